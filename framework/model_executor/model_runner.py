"""``ModelRunner``: one model on one device, with its KV cache and attention backend.

The scheduler owns the batching: it allocates request and KV slots from
``runner.pools`` (a ``KVCachePools``), builds a ``ForwardBatch`` and calls
``forward`` and then ``sample``. ``ModelRunner`` loads the model, sizes and
builds the pools once, builds the attention backend once over them and binds
it to the model's attention layers, and runs steps.

Pool sizing: ``ReqToTokenPool`` has ``max_running_requests +
EXTRA_REQ_SLOTS`` rows of ``context_len`` tokens. The KV cache holds
``--max-total-tokens`` tokens when given; otherwise, on CUDA,
``--mem-fraction`` of the device memory free after loading the weights, and on
CPU ``min(context_len * max_running_requests, 65536)`` tokens or fewer: at most
``--mem-fraction`` of the host memory available then, shared by the machine's
scheduler ranks. Parallel ranks all take the smallest size any of them found.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from framework.distributed.config import stage_layers
from framework.distributed.micro_batch import (
    MicroBatchPlanner,
    merge_logits,
    split_micro_batches,
)
from framework.distributed.step_sync import (
    RankStepFailed,
    announce_forward,
    announce_weight_update,
    describe_failures,
    gather_failures,
)
from framework.layers.attention.base import AttentionBackend, AttentionBackendArgs
from framework.layers.attention.native_build import KERNEL_DTYPES, load_cpu_kernels
from framework.layers.attention.radix_attention import bind_attention_backend
from framework.layers.embedding import VocabParallelEmbedding
from framework.layers.linear import LinearBase, bind_attribute, bind_tp_group
from framework.layers.linear_kernel import (
    PackableLinear,
    pack_linear_weights,
    resolve_linear_backend,
)
from framework.layers.moe.experts import FusedMoE, pack_expert_weights
from framework.layers.quantization.checkpoint import (
    attach_checkpoint_weights,
    checkpoint_quantization,
    describe_quantization,
)
from framework.layers.quantization.linear_method import (
    OnlineQuantization,
    float_weights_for_reload,
    quantize_embeddings,
    quantize_linear_layers,
    quantize_lm_head,
    quantized_bytes,
    resolve_quant_backend,
)
from framework.layers.sampler import Sampler, StepSample, sample_step
from framework.lora.serving import LoraServing
from framework.mem_cache.kv_scales import CheckpointKVScales
from framework.mem_cache.memory_pool import (
    KVCachePools,
    decide_max_total_tokens,
    kv_cache_bytes_per_token,
)
from framework.model_executor.model_config import ModelConfig
from framework.model_executor.weight_loader import (
    check_load_format,
    check_same_layout,
    dry_run_load,
    load_model,
    load_weights,
)
from framework.registry import ATTENTION_BACKENDS, MOE_BACKENDS

if TYPE_CHECKING:
    from framework.config import ServerArgs
    from framework.distributed.parallel_state import ParallelContext
    from framework.forward_batch import ForwardBatch
    from framework.layers.sampler import SampleOutput, SamplingBatchInfo, SamplingRequest

logger = logging.getLogger(__name__)

# Request rows beyond max_running_requests: a request being prefilled in chunks
# holds its row while it is not in the running batch.
EXTRA_REQ_SLOTS = 4


@dataclass
class LogitsOutput:
    """What one forward step returns, one row per request."""

    next_token_logits: torch.Tensor | None  # [B, vocab] float32 at each request's last new token
    embeddings: torch.Tensor | None = None  # [B, hidden] float32, embedding models only
    # [m, vocab] float32 at the batch's ``prompt_logprob_rows``, when it has any.
    prompt_logits: torch.Tensor | None = None
    # With pipeline parallelism, what the last stage sampled (then no logits come back).
    sample: StepSample | None = None


def resolve_attention_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` → ``cpu`` (the native CPU attention kernel) for float32 or bfloat16 on a CPU,
    else ``torch``."""
    if name != "auto":
        return name
    return "cpu" if device.type == "cpu" and dtype in KERNEL_DTYPES else "torch"


def matmul_modules(model: torch.nn.Module) -> list[PackableLinear]:
    """The modules whose weight multiplies inputs: every linear layer, and the output head.

    The head may be the embedding table (tied); a table used only for lookups is left out.
    """
    modules: list[PackableLinear] = [m for m in model.modules() if isinstance(m, LinearBase)]
    head = getattr(model, "lm_head", None)
    if isinstance(head, VocabParallelEmbedding):
        modules.append(head)
    return modules


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """Bytes of ``model``'s parameters, and of every weight it holds: the parameters plus
    the packed copies the linear backend keeps beside them (``pack_linear_weights``)."""
    # A quantized layer's float parameter is empty; its quantized tensors count instead.
    params = sum(p.numel() * p.element_size() for p in model.parameters()) \
        + quantized_bytes(model)
    packed = {id(m.packed_weight): m.packed_weight for m in matmul_modules(model)
              if m.packed_weight is not None}  # a tied head and embedding share one
    for experts in model.modules():
        if isinstance(experts, FusedMoE) and experts.packed is not None:
            packed.update((id(w), w) for ws in experts.packed for w in ws)
    return params, params + sum(w.numel() * w.element_size() for w in packed.values())


def bind_cpu_layer_ops(model: torch.nn.Module, device: torch.device,
                       dtype: torch.dtype) -> Any | None:
    """For float32 or bfloat16 on a CPU, give the norms, activations, rotary embeddings and
    the products of a few rows (decode steps) the native kernels; returns them
    (``load_cpu_kernels``).

    Elsewhere, or when the kernels cannot be built (no compiler), nothing is bound,
    the layers keep their torch operators, and this returns None.
    """
    if device.type != "cpu" or dtype not in KERNEL_DTYPES:
        return None
    ops = load_cpu_kernels()
    if ops is not None:
        bind_attribute(model, "cpu_ops", ops)
    return ops


def resolve_device(device: str, tp_rank: int = 0) -> torch.device:
    """``auto`` → CUDA when available, else CPU; CUDA ranks take GPUs in order."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for, but CUDA is not available")
        return torch.device("cuda", tp_rank % torch.cuda.device_count())
    if device == "cpu":
        return torch.device("cpu")
    raise ValueError(f"device must be auto, cpu or cuda; got {device!r}")


class ModelRunner:
    """Loads a model, builds its KV cache pools and attention backend, and runs steps.

    ``pools`` (a ``KVCachePools``) and ``max_total_num_tokens`` are what the
    scheduler allocates from; ``attn_backend`` is bound to the model's
    attention layers and reaches the same pools.

    With tensor or pipeline parallelism, ``parallel`` is this rank's place
    among the ranks: the model and the KV cache hold only its share (its
    slice of each layer, its stage's layers), and the runner of global rank 0
    announces each step and weight update to the others before running it
    (``framework.distributed.step_sync``). With pipeline parallelism, only
    that runner's ``forward`` returns the logits, sent back by the last stage.
    """

    def __init__(self, server_args: ServerArgs, model_path: str, *, tp_rank: int = 0,
                 parallel: ParallelContext | None = None,
                 shared_slots: KVCachePools | None = None, kv_bytes_beside: int = 0) -> None:
        """``shared_slots``: another runner's pools whose request rows and KV slots this one
        uses, with K/V buffers of its own (a draft model's); ``kv_bytes_beside``: bytes per
        KV slot that such a runner will add, counted when this one sizes its pool."""
        if (server_args.tp_size != 1 or server_args.pp_size != 1) and parallel is None:
            raise ValueError(f"tp_size={server_args.tp_size}, pp_size={server_args.pp_size} "
                             "needs the ranks' process groups (start the server or the "
                             "Engine, which makes them)")
        check_load_format(server_args.load_format)
        self.server_args = server_args
        self.parallel = parallel
        self.tp_rank = tp_rank if parallel is None else parallel.tp_rank
        self.tp_size = server_args.tp_size
        # Expert parallelism: the tensor-parallel ranks split the MoE layers' experts.
        self.ep_size = server_args.ep_size
        self.ep_rank = self.tp_rank if self.ep_size > 1 else 0
        self.device = resolve_device(server_args.device, self.tp_rank) if parallel is None \
            else parallel.device
        self.model_config = ModelConfig.from_pretrained(
            model_path,
            dtype=server_args.dtype,
            device=self.device,
            context_length=server_args.context_length,
            is_embedding=server_args.is_embedding,
        )
        self.pp_rank = 0 if parallel is None else parallel.pp_rank
        self.pp_size = server_args.pp_size
        if self.pp_size > 1 and self.model_config.is_embedding:
            raise ValueError("pp_size above 1 is not supported for embedding models")
        self.start_layer, self.end_layer = stage_layers(
            self.model_config.num_layers, self.pp_rank, self.pp_size)
        self.dtype = self.model_config.dtype
        #: The attention backend's registered name (``auto`` resolved).
        self.attention_backend = resolve_attention_backend(server_args.attention_backend,
                                                           self.device, self.dtype)
        #: How linear layers multiply (``auto`` resolved): ``onednn`` or ``torch``.
        self.linear_backend = resolve_linear_backend(server_args.linear_backend, self.device,
                                                     self.dtype)
        self.model_path = model_path
        self.load_format = server_args.load_format
        #: A pre-quantized checkpoint's quantization (``quantization_config``), or None.
        self.checkpoint_quantization = checkpoint_quantization(model_path,
                                                               server_args.quantization)
        #: The checkpoint's static KV cache scales (an FP8 KV cache starts from them).
        self.kv_scales = CheckpointKVScales()
        self.model = load_model(
            self.model_config,
            self.device,
            self.load_format,
            seed=server_args.random_seed,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
            ep_rank=self.ep_rank,
            ep_size=self.ep_size,
            quantization=self.checkpoint_quantization,
            online=self._online_quantization(),
            kv_scales=self.kv_scales,
        )
        if parallel is not None:
            bind_tp_group(self.model, parallel.tp)
        bind_attribute(self.model, "moe_kernel", MOE_BACKENDS.get(server_args.moe_backend))
        #: The LoRA adapters served (``--lora-paths``), or None without LoRA.
        self.lora = self._build_lora()
        self._quantize_linear_layers()
        self._pack_linear_weights()
        # The native CPU kernels the layers (and the greedy sampler) run, or None.
        self._cpu_ops = bind_cpu_layer_ops(self.model, self.device, self.dtype)
        # Sized after the weights are loaded: the KV cache takes (at most, on a CPU) a
        # fraction of the memory they leave free.
        self.max_total_num_tokens = self._decide_kv_cache_tokens(kv_bytes_beside) \
            if shared_slots is None else shared_slots.allocator.size
        self.pools = self._build_pools(shared_slots)
        self._start_kv_scales()
        self.attn_backend = self._build_attention_backend(self.attention_backend)
        bound = bind_attention_backend(self.model, self.attn_backend)
        self._sampler: Sampler | None = None
        #: Pipeline micro-batches this rank has run (two per step of two or more requests).
        self.micro_batches = 0
        # Rank 0 plans each pipeline step's micro-batches; the plan travels with the step.
        self._micro_batch_planner = MicroBatchPlanner() \
            if self.pp_size > 1 and parallel is not None and parallel.is_driver else None
        #: Each rank's pid and bytes of parameters, of all its weights (packed copies
        #: included) and of KV cache, in global rank order.
        self.rank_info: list[dict[str, int]] = self._gather_rank_info()
        logger.info(
            "loaded %s (%s) on %s in %s; KV cache %d tokens; attention backend %s on %d layers; "
            "linear backend %s", model_path, self.model_config.architecture, self.device,
            self.dtype, self.max_total_num_tokens, self.attention_backend, bound,
            self.linear_backend,
        )

    def _build_lora(self) -> LoraServing | None:
        args = self.server_args
        if not args.lora_paths and args.max_loaded_loras is None:
            return None
        if self.pp_size > 1:
            raise ValueError("LoRA adapters are not supported with pp_size above 1")
        return LoraServing.build(self.model, args.lora_paths, max_loaded=args.max_loaded_loras,
                                 max_rank=args.max_lora_rank, backend=args.lora_backend,
                                 device=self.device)

    def _base_layers(self) -> contextlib.AbstractContextManager[None]:
        """The LoRA wrappers' base layers in place meanwhile (their weights' own names)."""
        return self.lora.lora_model.unwrapped() if self.lora is not None \
            else contextlib.nullcontext()

    @property
    def native_layer_ops(self) -> bool:
        """Whether norms, activations and rotary embeddings run the native CPU kernels."""
        return self._cpu_ops is not None

    @property
    def layer_ops(self) -> Any:
        """The native CPU kernels bound to the layers (``load_cpu_kernels``), or None."""
        return self._cpu_ops

    def _online_quantization(self) -> OnlineQuantization | None:
        """``--quantization int8|fp8`` of a float checkpoint, quantized as it loads."""
        args = self.server_args
        if args.quantization is None or self.checkpoint_quantization is not None:
            return None
        return OnlineQuantization(args.quantization, resolve_quant_backend(
            args.quantized_linear_backend, self.device))

    def _quantize_linear_layers(self) -> None:
        """Stack a pre-quantized checkpoint's layers for their kernel, or with
        ``--quantization int8|fp8`` of a float checkpoint quantize the loaded linear layers;
        with ``--quantize-embeddings`` and ``--quantize-lm-head`` the embedding table and the
        LM head too (a no-op otherwise)."""
        args = self.server_args
        if (args.quantization is None and self.checkpoint_quantization is None
                and not args.quantize_lm_head and not args.quantize_embeddings):
            return
        backend = resolve_quant_backend(args.quantized_linear_backend, self.device)
        if self.checkpoint_quantization is not None:
            attach_checkpoint_weights(self.model, backend)
        elif args.quantization is not None:
            quantize_linear_layers(self.model, args.quantization, backend)
        if args.quantize_embeddings:
            quantize_embeddings(self.model, backend)
        last_stage = self.pp_rank == self.pp_size - 1
        if args.quantize_lm_head and not quantize_lm_head(self.model, backend) and last_stage:
            logger.warning("--quantize-lm-head: the LM head is the embedding table (tied "
                           "embeddings); --quantize-embeddings quantizes it")

    def _pack_linear_weights(self) -> None:
        """With the onednn linear backend, pack the weights just loaded (a no-op otherwise)."""
        if self.linear_backend == "onednn":
            # A quantized layer multiplies through its quantized kernel instead.
            pack_linear_weights([m for m in matmul_modules(self.model)
                                 if getattr(m, "quant_weight", None) is None])
            pack_expert_weights([m for m in self.model.modules() if isinstance(m, FusedMoE)])

    def _decide_kv_cache_tokens(self, kv_bytes_beside: int) -> int:
        config = self.model_config
        shape = (config.num_kv_heads_per_rank(self.tp_size), config.head_dim,
                 self.end_layer - self.start_layer)  # this stage's layers
        per_token = kv_cache_bytes_per_token(*shape, self.dtype, self.server_args.kv_cache_dtype)
        # Room for what the attention backend keeps beyond the pool (its kept copies, in
        # the model's dtype).
        backend = ATTENTION_BACKENDS.get(self.attention_backend)
        extra = getattr(backend, "extra_kv_copies", 0.0) * kv_cache_bytes_per_token(
            *shape, self.dtype)
        # Every scheduler rank of this machine (each data-parallel replica's ranks too)
        # sizes its pool from the same host memory.
        local_ranks = (self.server_args.dp_size if self.parallel is None
                       else self.parallel.config.ranks_per_node)
        tokens = decide_max_total_tokens(
            max_total_tokens=self.server_args.max_total_tokens,
            mem_fraction=self.server_args.mem_fraction,
            bytes_per_token=int(per_token + extra) + kv_bytes_beside,
            context_len=config.context_len,
            max_running_requests=self.server_args.max_running_requests,
            device=self.device,
            ranks_sharing_memory=local_ranks,
        )
        if self.parallel is None:
            return tokens
        # Rank 0 hands out the KV slots of every rank: all pools must be the same size,
        # though each rank measured its own free memory.
        return min(self.parallel.control.all_gather_object(tokens))

    def _build_pools(self, shared_slots: KVCachePools | None) -> KVCachePools:
        config = self.model_config
        if shared_slots is not None:
            return shared_slots.beside(
                dtype=self.dtype, num_kv_heads=config.num_kv_heads_per_rank(self.tp_size),
                head_dim=config.head_dim, num_layers=self.end_layer - self.start_layer,
                kv_cache_dtype=self.server_args.kv_cache_dtype)
        return KVCachePools.build(
            max_total_tokens=self.max_total_num_tokens,
            max_requests=self.server_args.max_running_requests + EXTRA_REQ_SLOTS,
            context_len=config.context_len,
            dtype=self.dtype,
            num_kv_heads=config.num_kv_heads_per_rank(self.tp_size),
            head_dim=config.head_dim,
            num_layers=self.end_layer - self.start_layer,
            device=self.device,
            kv_cache_dtype=self.server_args.kv_cache_dtype,
        )

    def _start_kv_scales(self) -> None:
        """An FP8 KV cache's static scales from the checkpoint's, for this stage's layers
        and this rank's heads; other KV cache dtypes leave them unused."""
        scales = self.kv_scales
        if not (scales.keys or scales.values):
            return
        kv_cache_dtype = self.server_args.kv_cache_dtype
        if kv_cache_dtype != "fp8_e4m3":
            logger.info("the checkpoint's KV cache scales are unused with --kv-cache-dtype %s",
                        kv_cache_dtype)
            return
        pool = self.pools.token_to_kv_pool
        for local, layer in enumerate(range(self.start_layer, self.end_layer)):
            k, v = scales.rank_scales(layer, self.model_config.num_kv_heads, self.tp_rank,
                                      self.tp_size)
            pool.set_static_scales(local, k, v)

    def _build_attention_backend(self, name: str) -> AttentionBackend:
        config = self.model_config
        args = AttentionBackendArgs(
            num_heads=config.num_heads_per_rank(self.tp_size),
            num_kv_heads=config.num_kv_heads_per_rank(self.tp_size),
            head_dim=config.head_dim,
            req_to_token_pool=self.pools.req_to_token_pool,
            token_to_kv_pool=self.pools.token_to_kv_pool,
            # Every request of a batch holds a request slot, so no batch can
            # be larger than the request pool.
            max_batch_size=self.pools.req_to_token_pool.size,
            context_len=config.context_len,
            dtype=self.dtype,
            device=self.device,
        )
        backend = ATTENTION_BACKENDS.get(name)
        if args.token_to_kv_pool.quantized and not getattr(backend, "reads_quantized_kv", False):
            raise ValueError(f"the {name} attention backend does not read a quantized KV cache "
                             f"(--kv-cache-dtype {self.server_args.kv_cache_dtype}); use one "
                             "that does (torch, cpu, triton)")
        return backend(args)

    def _gather_rank_info(self) -> list[dict[str, int]]:
        pool = self.pools.token_to_kv_pool
        params, weights = weight_bytes(self.model)
        mine = {
            "pid": os.getpid(),
            "param_bytes": params,
            "weight_bytes": weights,
            "kv_cache_bytes": pool.nbytes,
        }
        if self.parallel is None:
            return [mine]
        return self.parallel.control.all_gather_object(mine)

    def ranks_info(self) -> dict[str, int]:
        """Each rank's pid, parameter, weight and KV cache bytes, as flat ``/get_server_info``
        fields."""
        info: dict[str, int] = {}
        for rank, fields in enumerate(self.rank_info):
            for key, value in fields.items():
                info[f"{key}_rank_{rank}"] = value
        return info

    def _announces(self) -> bool:
        """Whether this runner drives other ranks (it is its replica's rank 0 of several)."""
        return (self.parallel is not None and self.parallel.is_driver
                and self.parallel.config.is_parallel)

    @property
    def samples_at_last_stage(self) -> bool:
        """Whether steps are sampled on the last pipeline stage (``forward``'s ``sampling``)."""
        return self.pp_size > 1

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, sampling: SamplingRequest | None = None
                ) -> LogitsOutput:
        """Run one step; the new tokens' keys and values land in the KV cache.

        With pipeline parallelism and ``sampling``, the last stage samples and
        only its ``StepSample`` comes back (``LogitsOutput.sample``), not the logits;
        why it could not sample, if so, is raised here (a ``RuntimeError``).

        Raises:
            RankStepFailed: on a rank of several, the step failed here, and the
                ranks are out of step for good (``step_sync``).
        """
        if self.parallel is None or not self.parallel.config.is_parallel:
            output = self._forward(batch, sampling)
        else:
            try:
                output = self._forward(batch, sampling)
            except Exception as exc:
                logger.exception("rank %d: a model step failed", self.parallel.replica_rank)
                raise RankStepFailed(self.parallel.replica_rank, exc) from exc
        if output.sample is not None:
            output.sample.checked()  # every rank is done with the step: it can be contained
        return output

    def _forward(self, batch: ForwardBatch, sampling: SamplingRequest | None) -> LogitsOutput:
        if self._micro_batch_planner is not None:
            batch = self._micro_batch_planner.plan(batch)
        if self._announces():
            assert self.parallel is not None
            if self.lora is not None:
                batch = self.lora.describe(batch)
            announce_forward(self.parallel.control, batch,
                             self.pools.req_to_token_pool.req_to_token, sampling)
        if self.lora is not None:
            self.lora.set_batch(batch)
        if not self.model_config.is_embedding:
            logits = self._logits(batch, sampling)
            if logits is None:  # a pipeline stage that does not hold the result
                return LogitsOutput(next_token_logits=None)
            if isinstance(logits, StepSample):
                return LogitsOutput(next_token_logits=None, sample=logits)
            if batch.prompt_logprob_rows is None:
                return LogitsOutput(next_token_logits=logits)
            return LogitsOutput(next_token_logits=logits[:batch.batch_size],
                                prompt_logits=logits[batch.batch_size:])
        self.attn_backend.init_forward_metadata(batch)
        if self.model_config.is_native_embedding:
            embeddings = self.model(batch.input_ids, batch.positions, batch)
        else:
            embeddings = self.model(batch.input_ids, batch.positions, batch, get_embedding=True)
        return LogitsOutput(next_token_logits=None, embeddings=embeddings.float())

    def _logits(self, batch: ForwardBatch, sampling: SamplingRequest | None
                ) -> torch.Tensor | StepSample | None:
        if self.pp_size == 1:
            self.attn_backend.init_forward_metadata(batch)
            return self.model(batch.input_ids, batch.positions, batch).float()
        return self._pipeline_logits(batch, sampling)

    def _pipeline_logits(self, batch: ForwardBatch, sampling: SamplingRequest | None
                         ) -> torch.Tensor | StepSample | None:
        """This stage's part of the step; on the first stage, the sample or the logits.

        The step's requests go through the stages as micro-batches (as rank 0
        planned them, ``split_micro_batches``), so that while a stage computes
        one, the stage before it computes the next. Each stage receives the previous
        one's hidden states and residual and sends its own to the next; the
        last stage keeps each micro-batch's logits until it has received them
        all; then, along tensor rank 0 (the driver's), it samples the step as
        ``sampling`` says and sends the ``StepSample`` back to the first stage
        (without ``sampling``: the logits, and the first stage samples). Sending
        sooner could deadlock: the first stage may still be sending it the next
        micro-batch.
        """
        assert self.parallel is not None
        pp = self.parallel.pp
        returns_logits = self.parallel.tp_rank == 0
        parts = split_micro_batches(batch)
        kept: list[torch.Tensor] = []
        for part in parts:
            out = self._stage_forward(part.batch)
            if isinstance(out, tuple):
                for tensor in out:
                    pp.send(tensor, dst=pp.rank + 1)
            else:
                kept.append(out)
        self.micro_batches += len(parts)
        if pp.is_last:
            if returns_logits and sampling is not None:
                rows = sum(len(part.logits_rows) for part in parts)
                whole = merge_logits(list(zip(parts, kept, strict=True)), rows)
                size = batch.batch_size
                try:
                    sample = sample_step(self.sample, whole[:size], whole[size:], sampling)
                except Exception as exc:  # rank 0 waits for an answer: it gets the reason
                    logger.exception("sampling a step on the last pipeline stage failed")
                    sample = StepSample(error=repr(exc))
                pp.send_object(sample, dst=0, device=self.device)
            elif returns_logits:
                for logits in kept:
                    pp.send(logits.float(), dst=0)
            return None
        if not (pp.is_first and returns_logits):
            return None
        if sampling is not None:
            sample: StepSample = pp.recv_object(src=pp.size - 1, device=self.device)
            return sample
        vocab = self.model_config.vocab_size
        received = [(part, pp.recv((len(part.logits_rows), vocab), torch.float32, self.device,
                                   src=pp.size - 1)) for part in parts]
        return merge_logits(received, sum(len(part.logits_rows) for part in parts))

    def _stage_forward(self, batch: ForwardBatch) -> Any:
        """This stage's layers on ``batch``: ``(hidden, residual)``, or logits on the last."""
        assert self.parallel is not None
        pp = self.parallel.pp
        self.attn_backend.init_forward_metadata(batch)
        intermediate = None
        if not pp.is_first:
            shape = (batch.num_tokens, self.model_config.hidden_size)
            intermediate = (pp.recv(shape, self.dtype, self.device, src=pp.rank - 1),
                            pp.recv(shape, self.dtype, self.device, src=pp.rank - 1))
        return self.model(batch.input_ids, batch.positions, batch, intermediate=intermediate)

    def sample(
        self,
        logits: torch.Tensor,
        sampling_info: SamplingBatchInfo,
        top_logprobs_nums: list[int] | None = None,
        return_logprob: bool = True,
    ) -> SampleOutput:
        """Pick each request's next token (and its logprobs, when asked) with the ``Sampler``."""
        return self.sampler(logits, sampling_info, top_logprobs_nums, return_logprob)

    @property
    def sampler(self) -> Sampler:
        """The runner's ``Sampler`` (its greedy rows through the native ``argmax_rows`` where
        the CPU kernels are bound), made at first use."""
        if self._sampler is None:
            ops = self._cpu_ops
            self._sampler = Sampler(argmax_rows=None if ops is None else ops.argmax_rows)
        return self._sampler

    def update_weights_from_disk(
        self, model_path: str, load_format: str = "auto"
    ) -> tuple[bool, str]:
        """Replace the weights with those of another checkpoint of the same shapes.

        The new checkpoint is checked first (config shapes, then every tensor's
        name and shape, without reading data); only then are the weights
        overwritten in place. If reading fails halfway, the previous weights
        are loaded again from where they came from. Settings outside the
        weights (RoPE, norms' epsilon, ...) stay those of the running model.
        Returns ``(success, message)``; on failure the old weights keep serving.

        With several ranks it is all or nothing: the ranks share the outcome of
        the check and of the load (``step_sync.gather_failures``); if any rank
        fails either, none keeps new weights (those that loaded them load their
        previous ones again), and every rank returns the same answer, naming
        the ranks that failed.
        """
        if self._announces():
            assert self.parallel is not None
            announce_weight_update(self.parallel.control, model_path, load_format)
        failed = self._failures_on_ranks(self._check_update(model_path, load_format))
        if failed:
            return False, f"cannot update weights from {model_path}: {self._describe(failed)}"
        failed = self._failures_on_ranks(self._load_update(model_path, load_format))
        if failed:
            return False, self._restore_after_failed_update(model_path, failed)
        self._pack_linear_weights()
        self.model_path = model_path
        self.load_format = load_format
        return True, f"weights updated from {model_path}"

    def _failures_on_ranks(self, error: str | None) -> dict[int, str]:
        """Every rank's error in this phase of a weight update (this rank's alone on one)."""
        control = None if self.parallel is None else self.parallel.control
        return gather_failures(control, error)

    @property
    def _ranks(self) -> int:
        """How many ranks serve the model (this one alone: 1)."""
        return 1 if self.parallel is None else self.parallel.config.world_size

    def _describe(self, failures: dict[int, str]) -> str:
        return describe_failures(failures, self._ranks)

    def _check_update(self, model_path: str, load_format: str) -> str | None:
        """Why the checkpoint at ``model_path`` cannot replace the weights (None: it can)."""
        try:
            check_load_format(load_format)
            new_config = ModelConfig.from_pretrained(
                model_path,
                dtype=self.server_args.dtype,
                device=self.device,
                context_length=self.server_args.context_length,
                is_embedding=self.server_args.is_embedding,
            )
            self._check_same_shapes(new_config)
            if load_format == "dummy":
                if self.checkpoint_quantization is not None:
                    raise ValueError("random (dummy) weights load in float and cannot "
                                     "replace a pre-quantized checkpoint's")
            else:
                self._check_same_quantization(model_path)
                if self.checkpoint_quantization is None:
                    dry_run_load(new_config, model_path)
                else:  # the meta model cannot unpack quantized layers: compare the layouts
                    check_same_layout(model_path, self.model_path)
        # Any error, not only the expected ones: with several ranks, one that raised here
        # would leave the others waiting for its outcome.
        except Exception as exc:
            return str(exc)
        return None

    def _load_update(self, model_path: str, load_format: str) -> str | None:
        """Load this rank's share of the new weights; why it failed (None: it did not)."""
        try:
            self._reload_weights(model_path, load_format)
        except Exception as exc:  # I/O or data errors after the old weights were partly overwritten
            return str(exc)
        return None

    def _reload_weights(self, model_path: str, load_format: str) -> None:
        """Load a checkpoint over the running weights; quantized layers take float weights
        of their shapes for it (``float_weights_for_reload``) and are quantized anew: online
        (``--quantization int8|fp8``), or stacked from the new pre-quantized checkpoint's
        parts, which ``_check_update`` found quantized as the running one."""
        with self._base_layers():
            float_weights_for_reload(self.model)
            load_weights(self.model, model_path, load_format, seed=self.server_args.random_seed,
                         quantization=self.checkpoint_quantization,
                         online=self._online_quantization())
            self._quantize_linear_layers()

    def _check_same_quantization(self, model_path: str) -> None:
        """Raise ``ValueError`` unless the checkpoint at ``model_path`` is quantized as the
        running one was (float for a float or online-quantized model)."""
        new = checkpoint_quantization(model_path, self.server_args.quantization)
        if new != self.checkpoint_quantization:
            raise ValueError(f"the new checkpoint is {describe_quantization(new)}, the running "
                             f"one {describe_quantization(self.checkpoint_quantization)}; start "
                             "the server on the new one")

    def _check_same_shapes(self, new_config: ModelConfig) -> None:
        old, new = self.model_config.shape_signature(), new_config.shape_signature()
        differences = [f"{key}: {old[key]} -> {new[key]}" for key in old if old[key] != new[key]]
        if differences:
            raise ValueError("the new model differs from the running one (" + "; ".join(
                differences) + ")")

    def _restore_after_failed_update(self, model_path: str, failed: dict[int, str]) -> str:
        """Load the previous weights again on every rank; the answer, saying what each holds.

        Every rank does, those whose load succeeded too: no rank may serve new weights
        while another serves the old ones.
        """
        message = f"loading weights from {model_path} failed: {self._describe(failed)}"
        try:
            self._reload_weights(self.model_path, self.load_format)
            error = None
        except Exception as exc:  # reported below; nothing better can be done here
            logger.error("restoring weights from %s failed: %s", self.model_path, exc)
            error = str(exc)
        else:
            self._pack_linear_weights()
        unrestored = self._failures_on_ranks(error)
        if unrestored:
            return (f"{message}; restoring the previous weights also failed: "
                    f"{self._describe(unrestored)}")
        if self._ranks == 1:
            return f"{message}; the previous weights from {Path(self.model_path)} were restored"
        return f"{message}; every rank keeps the previous weights from {Path(self.model_path)}"
