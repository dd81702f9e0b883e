"""Tensor and pipeline parallelism over ``torch.distributed`` (NCCL on CUDA, gloo on CPU).

``config`` says how the model is split (``ParallelConfig``, free of torch);
``parallel_state`` makes the process groups and wraps the collectives
(``ParallelContext``, ``GroupCoordinator``); ``step_sync`` keeps the ranks
other than 0 on the steps rank 0's Scheduler chooses. Groups are passed
explicitly, never kept in module state.
"""
