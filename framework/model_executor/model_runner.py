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
CPU ``min(context_len * max_running_requests, 65536)`` tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from framework.layers.attention.base import AttentionBackend, AttentionBackendArgs
from framework.layers.attention.radix_attention import bind_attention_backend
from framework.mem_cache.memory_pool import (
    KVCachePools,
    decide_max_total_tokens,
    kv_cache_bytes_per_token,
)
from framework.model_executor.model_config import ModelConfig
from framework.model_executor.weight_loader import (
    check_load_format,
    dry_run_load,
    load_model,
    load_weights,
)
from framework.registry import ATTENTION_BACKENDS

if TYPE_CHECKING:
    from framework.config import ServerArgs
    from framework.forward_batch import ForwardBatch
    from framework.layers.sampler import SampleOutput, SamplingBatchInfo

logger = logging.getLogger(__name__)

# Request rows beyond max_running_requests: a request being prefilled in chunks
# holds its row while it is not in the running batch.
EXTRA_REQ_SLOTS = 4


@dataclass
class LogitsOutput:
    """What one forward step returns, one row per request."""

    next_token_logits: torch.Tensor | None  # [B, vocab] float32 at each request's last new token
    embeddings: torch.Tensor | None = None  # [B, hidden] float32, embedding models only


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
    """

    def __init__(self, server_args: ServerArgs, model_path: str, *, tp_rank: int = 0) -> None:
        if server_args.tp_size != 1:
            raise ValueError(
                f"tensor parallelism (tp_size={server_args.tp_size}) is not supported yet"
            )
        check_load_format(server_args.load_format)
        self.server_args = server_args
        self.tp_rank = tp_rank
        self.tp_size = server_args.tp_size
        self.device = resolve_device(server_args.device, tp_rank)
        self.model_config = ModelConfig.from_pretrained(
            model_path,
            dtype=server_args.dtype,
            device=self.device,
            context_length=server_args.context_length,
            is_embedding=server_args.is_embedding,
        )
        self.dtype = self.model_config.dtype
        self.model_path = model_path
        self.load_format = server_args.load_format
        self.model = load_model(
            self.model_config,
            self.device,
            self.load_format,
            seed=server_args.random_seed,
            tp_rank=tp_rank,
            tp_size=self.tp_size,
        )
        # Sized after the weights are loaded: on CUDA the KV cache takes a
        # fraction of the memory they leave free.
        self.max_total_num_tokens = self._decide_kv_cache_tokens()
        self.pools = self._build_pools()
        self.attn_backend = self._build_attention_backend(server_args.attention_backend)
        bound = bind_attention_backend(self.model, self.attn_backend)
        self._sampler: Any = None
        logger.info(
            "loaded %s (%s) on %s in %s; KV cache %d tokens; attention backend %s on %d layers",
            model_path, self.model_config.architecture, self.device, self.dtype,
            self.max_total_num_tokens, server_args.attention_backend, bound,
        )

    def _decide_kv_cache_tokens(self) -> int:
        config = self.model_config
        return decide_max_total_tokens(
            max_total_tokens=self.server_args.max_total_tokens,
            mem_fraction=self.server_args.mem_fraction,
            bytes_per_token=kv_cache_bytes_per_token(
                config.num_kv_heads_per_rank(self.tp_size),
                config.head_dim,
                config.num_layers,
                self.dtype,
            ),
            context_len=config.context_len,
            max_running_requests=self.server_args.max_running_requests,
            device=self.device,
        )

    def _build_pools(self) -> KVCachePools:
        config = self.model_config
        return KVCachePools.build(
            max_total_tokens=self.max_total_num_tokens,
            max_requests=self.server_args.max_running_requests + EXTRA_REQ_SLOTS,
            context_len=config.context_len,
            dtype=self.dtype,
            num_kv_heads=config.num_kv_heads_per_rank(self.tp_size),
            head_dim=config.head_dim,
            num_layers=config.num_layers,
            device=self.device,
        )

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
        return ATTENTION_BACKENDS.get(name)(args)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> LogitsOutput:
        """Run one step; the new tokens' keys and values land in the KV cache."""
        self.attn_backend.init_forward_metadata(batch)
        if not self.model_config.is_embedding:
            logits = self.model(batch.input_ids, batch.positions, batch)
            return LogitsOutput(next_token_logits=logits.float())
        if self.model_config.is_native_embedding:
            embeddings = self.model(batch.input_ids, batch.positions, batch)
        else:
            embeddings = self.model(batch.input_ids, batch.positions, batch, get_embedding=True)
        return LogitsOutput(next_token_logits=None, embeddings=embeddings.float())

    def sample(
        self,
        logits: torch.Tensor,
        sampling_info: SamplingBatchInfo,
        top_logprobs_nums: list[int] | None = None,
    ) -> SampleOutput:
        """Pick each request's next token (and its logprobs) with the ``Sampler``."""
        if self._sampler is None:
            # Imported here: the sampler is a separate layer that forward() never needs.
            from framework.layers.sampler import Sampler

            self._sampler = Sampler()
        return self._sampler(logits, sampling_info, top_logprobs_nums)

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
        """
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
            if load_format != "dummy":
                dry_run_load(new_config, model_path)
        except (ValueError, OSError) as exc:
            return False, f"cannot update weights from {model_path}: {exc}"
        try:
            load_weights(self.model, model_path, load_format, seed=self.server_args.random_seed)
        except Exception as exc:  # I/O or data errors after the old weights were partly overwritten
            return False, self._restore_after_failed_update(model_path, exc)
        self.model_path = model_path
        self.load_format = load_format
        return True, f"weights updated from {model_path}"

    def _check_same_shapes(self, new_config: ModelConfig) -> None:
        old, new = self.model_config.shape_signature(), new_config.shape_signature()
        differences = [f"{key}: {old[key]} -> {new[key]}" for key in old if old[key] != new[key]]
        if differences:
            raise ValueError("the new model differs from the running one (" + "; ".join(
                differences) + ")")

    def _restore_after_failed_update(self, model_path: str, error: Exception) -> str:
        message = f"loading weights from {model_path} failed: {error}"
        try:
            load_weights(
                self.model, self.model_path, self.load_format, seed=self.server_args.random_seed
            )
        except Exception as restore_error:  # report both; nothing better can be done here
            logger.error("restoring weights from %s failed: %s", self.model_path, restore_error)
            return f"{message}; restoring the previous weights also failed: {restore_error}"
        return f"{message}; the previous weights from {Path(self.model_path)} were restored"
