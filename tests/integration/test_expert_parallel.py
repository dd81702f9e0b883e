"""``--ep-size 2``: the two tensor-parallel ranks split the experts and exchange the tokens.

At the layer level, two gloo processes run ``FusedMoE`` with ``ep_size=2`` over
the real ``GroupCoordinator`` and must give the single-rank layer's output for
token counts that do not split evenly (0, 1, 3, an odd count, all tokens routed
to the other rank's experts), each holding half of the expert bytes; with every
row sent to rank 0 (whose experts are half of them) the output changes. At the
model level (once the tiny Qwen3-MoE fixture exists) a two-rank harness driving
the ``ModelRunner`` with TP=2 and EP=2 gives one rank's greedy tokens, each rank
holding half of the experts, whole.
"""

from __future__ import annotations

import argparse
import itertools
import re
from pathlib import Path
from queue import Empty
from typing import Any

import pytest
import torch

from framework.comm.zmq import free_tcp_port
from framework.config import ServerArgs
from framework.distributed.config import ParallelConfig
from framework.layers.moe import FusedMoE, select_experts
from framework.layers.moe.expert_parallel import token_share
from framework.model_executor.model_runner import ModelRunner
from tests.integration.test_tensor_parallel import (
    HARNESS_TIMEOUT_S,
    _end_two_ranks,
    _greedy_tokens,
    _runner_args,
    rank_processes,
)
from tests.model_fixtures import make_tiny_checkpoint, tiny_config

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 4, 16, 8, 2
# Token counts: none, fewer than the ranks, odd ones, and one split evenly.
TOKEN_COUNTS = (0, 1, 3, 7, 16)
#: A batch whose every token chooses experts 2 and 3 (rank 1's): rank 0 receives no rows.
ONE_SIDED = "one-sided"


def expert_tensors(seed: int = 0) -> dict[tuple[int, str], torch.Tensor]:
    """Every expert's checkpoint tensors, as the hub format stores them."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {"gate": (INTERMEDIATE, HIDDEN), "up": (INTERMEDIATE, HIDDEN),
              "down": (HIDDEN, INTERMEDIATE)}
    return {(expert, part): torch.randn(shape, generator=generator) / 4
            for expert in range(EXPERTS) for part, shape in shapes.items()}


def loaded_layer(rank: int = 0, size: int = 1) -> FusedMoE:
    """A float32 layer holding rank ``rank``'s experts of ``size``, through its weight loader."""
    layer = FusedMoE(EXPERTS, HIDDEN, INTERMEDIATE, tp_rank=rank, tp_size=size,
                     ep_rank=rank, ep_size=size)
    for (expert, part), tensor in expert_tensors().items():
        param = layer.w2 if part == "down" else layer.w13
        param.weight_loader(param, tensor, (expert, part))
    return layer


def routed_batch(case: int | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x``, router weights and expert ids of a batch, the same in every process."""
    generator = torch.Generator().manual_seed(7)
    num_tokens = 5 if case == ONE_SIDED else int(case)
    x = torch.randn(num_tokens, HIDDEN, generator=generator)
    logits = torch.randn(num_tokens, EXPERTS, generator=generator)
    if case == ONE_SIDED:
        logits[:, 2:] += 10.0
    weights, ids = select_experts(logits, TOP_K, renormalize=False)
    return x, weights, ids


CASES: tuple[int | str, ...] = (*TOKEN_COUNTS, ONE_SIDED)


def _layer_rank(rank: int, port: int, results: Any) -> None:
    """One of two expert-parallel ranks: its layer's outputs for every case, then again with
    every row sent to rank 0; its bytes and whether its output is partial."""
    torch.set_num_threads(1)
    from framework.distributed.parallel_state import destroy_parallel, init_parallel
    from framework.layers.moe import expert_parallel

    config = ParallelConfig(tp_size=2, ep_size=2, dist_init_addr=f"127.0.0.1:{port}")
    context = init_parallel(config, rank, torch.device("cpu"))
    try:
        layer = loaded_layer(rank, 2)
        layer.tp_group = context.tp
        outputs = _outputs(layer)
        # Experts "numbered" so that the first rank seems to hold them all: every row goes
        # to rank 0, which runs only its own experts.
        expert_parallel.LocalExperts.count = property(lambda self: EXPERTS)  # type: ignore
        all_to_rank_0 = _outputs(layer)
        held = layer.w13.nbytes + layer.w2.nbytes
        results.put((rank, outputs, all_to_rank_0, held, layer.output_is_partial))
    finally:
        destroy_parallel()


def _outputs(layer: FusedMoE) -> dict[int | str, Any]:
    """The layer's output of every case, as arrays: a tensor would travel through the queue
    as a shared-memory handle of this process, which may be gone when the parent opens it."""
    with torch.no_grad():
        return {case: layer(*routed_batch(case)).numpy() for case in CASES}


def _tensors(outputs: dict[int | str, Any]) -> dict[int | str, torch.Tensor]:
    return {case: torch.from_numpy(out) for case, out in outputs.items()}


@pytest.fixture(scope="module")
def two_ranks() -> dict[int, dict[str, Any]]:
    """What each of two expert-parallel ranks gave, by rank."""
    ctx = rank_processes()
    results = ctx.Queue()
    port = free_tcp_port()
    ranks = [ctx.Process(target=_layer_rank, daemon=True, args=(rank, port, results))
             for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        gathered = [results.get(timeout=HARNESS_TIMEOUT_S) for _ in ranks]
    except Empty:
        pytest.fail("the two expert-parallel ranks gave no outputs")
    finally:
        for process in ranks:
            process.join(HARNESS_TIMEOUT_S)
            if process.is_alive():
                process.kill()
        results.close()
    return {rank: {"outputs": _tensors(outputs), "all_to_rank_0": _tensors(broken),
                   "held": held, "partial": partial}
            for rank, outputs, broken, held, partial in gathered}


@pytest.fixture(scope="module")
def single_rank() -> dict[int | str, torch.Tensor]:
    return _tensors(_outputs(loaded_layer()))


@pytest.mark.timeout(240)
def test_two_expert_parallel_ranks_give_the_single_rank_layer_s_output(
    two_ranks: dict[int, dict[str, Any]], single_rank: dict[int | str, torch.Tensor],
) -> None:
    whole = loaded_layer()
    for rank, got in two_ranks.items():
        for case in CASES:
            output = got["outputs"][case]
            assert output.shape == single_rank[case].shape, (rank, case)
            torch.testing.assert_close(output, single_rank[case], rtol=1e-5, atol=1e-6,
                                       msg=f"rank {rank}, case {case}")
        assert got["held"] * 2 == whole.w13.nbytes + whole.w2.nbytes
        assert got["partial"] is False  # complete on every rank: no all-reduce after it


@pytest.mark.timeout(240)
def test_rows_not_sent_to_the_ranks_holding_their_experts_change_the_output(
    two_ranks: dict[int, dict[str, Any]], single_rank: dict[int | str, torch.Tensor],
) -> None:
    """Every row sent to rank 0, which runs only its own experts: rank 1's are lost."""
    for got in two_ranks.values():
        broken = got["all_to_rank_0"]
        assert torch.equal(broken[0], single_rank[0])  # nothing to exchange
        for case in CASES[1:]:
            assert not torch.allclose(broken[case], single_rank[case], atol=1e-3), case


def test_the_tokens_split_into_contiguous_shares_of_every_token() -> None:
    for num_tokens in range(7):
        shares = [token_share(num_tokens, rank, 3) for rank in range(3)]
        assert shares[0][0] == 0 and shares[-1][1] == num_tokens
        assert all(a[1] == b[0] for a, b in itertools.pairwise(shares))
        sizes = [end - start for start, end in shares]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_which_split_needs_an_all_reduce_after_the_layer() -> None:
    assert FusedMoE(EXPERTS, HIDDEN, INTERMEDIATE).output_is_partial is False
    assert FusedMoE(EXPERTS, HIDDEN, INTERMEDIATE, tp_size=2).output_is_partial is True
    expert_parallel = FusedMoE(EXPERTS, HIDDEN, INTERMEDIATE, tp_rank=1, tp_size=2,
                               ep_rank=1, ep_size=2)
    assert expert_parallel.output_is_partial is False
    assert expert_parallel.w13.shape == (EXPERTS // 2, 2 * INTERMEDIATE, HIDDEN)
    with pytest.raises(NotImplementedError, match="bind_tp_group"):
        expert_parallel(*routed_batch(3))


def test_expert_ranks_must_be_the_tensor_parallel_ones() -> None:
    with pytest.raises(ValueError, match="ep_rank"):
        FusedMoE(EXPERTS, HIDDEN, INTERMEDIATE, tp_rank=0, tp_size=2, ep_rank=1, ep_size=2)
    with pytest.raises(ValueError, match="ep_size"):
        FusedMoE(EXPERTS, HIDDEN, INTERMEDIATE, tp_size=4, ep_size=2)


@pytest.mark.parametrize(("tp_size", "ep_size"), [(1, 2), (2, 4), (4, 2), (2, 0)])
def test_an_ep_size_other_than_1_or_the_tp_size_is_refused(tp_size: int, ep_size: int) -> None:
    message = f"--ep-size must be 1 or equal --tp-size ({tp_size}), got {ep_size}"
    with pytest.raises(ValueError, match=re.escape(message)):
        ServerArgs(tp_size=tp_size, ep_size=ep_size)
    with pytest.raises(ValueError, match="ep_size must be 1 or equal tp_size"):
        ParallelConfig(tp_size=tp_size, ep_size=ep_size).check()


def test_the_ep_size_flag_reaches_the_parallel_config() -> None:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(["--tp-size", "2", "--ep-size", "2"]))
    assert ParallelConfig.from_server_args(args).ep_size == 2
    assert ServerArgs().ep_size == 1


# --------------------------------------------------------------------------- the model


def _model_rank(rank: int, port: int, model_dir: str, results: Any) -> None:
    """One of two TP=2, EP=2 ranks: the shapes of its experts' ``w13``; rank 0 drives greedy
    steps and gives their tokens, rank 1 follows them."""
    torch.set_num_threads(1)
    from framework.distributed.parallel_state import destroy_parallel, init_parallel
    from framework.distributed.step_sync import Follower

    config = ParallelConfig(tp_size=2, ep_size=2, dist_init_addr=f"127.0.0.1:{port}")
    context = init_parallel(config, rank, torch.device("cpu"))
    try:
        args = _runner_args(model_dir, 2).replace(ep_size=2)
        try:
            runner = ModelRunner(args, model_dir, parallel=context)
        except Exception as exc:  # shown by the test at once, not as a timeout
            results.put((rank, None, repr(exc)))
            raise
        shapes = [tuple(module.w13.shape) for module in runner.model.modules()
                  if isinstance(module, FusedMoE)]
        if rank == 0:
            results.put((rank, shapes, _greedy_tokens(runner)))
        else:
            results.put((rank, shapes, None))
            Follower(context.control, runner, runner.pools.req_to_token_pool.req_to_token).run()
    finally:
        destroy_parallel()


@pytest.mark.timeout(240)
def test_tp_2_with_ep_2_gives_one_rank_s_tokens_each_holding_half_the_experts(
    tmp_path: Path,
) -> None:
    model_dir = str(make_tiny_checkpoint(tmp_path, "qwen3_moe", seed=5))
    expected = _greedy_tokens(ModelRunner(_runner_args(model_dir, 1), model_dir))
    ctx = rank_processes()
    results = ctx.Queue()
    port = free_tcp_port()
    ranks = [ctx.Process(target=_model_rank, daemon=True,
                         args=(rank, port, model_dir, results)) for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        by_rank = {rank: rest for rank, *rest in
                   (results.get(timeout=HARNESS_TIMEOUT_S) for _ in ranks)}
    except Empty:
        pytest.fail("the two-rank harness gave no tokens")
    finally:
        _end_two_ranks(ranks, results)
    config = tiny_config("qwen3_moe")
    whole_experts = (config.num_experts // 2, 2 * config.moe_intermediate_size,
                     config.hidden_size)
    for shapes, got in by_rank.values():  # half the experts, each one whole
        assert shapes is not None, got
        assert shapes == [whole_experts] * config.num_hidden_layers
    assert by_rank[0][1] == expected
