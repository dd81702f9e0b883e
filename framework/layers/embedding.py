"""Token embeddings and the output projection, split over ranks along the vocabulary."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from framework.layers.deferred import materialized
from framework.layers.linear import CheckpointWeight, TensorParallelGroup, bound_tp_group
from framework.layers.linear_kernel import linear


class VocabParallelEmbedding(nn.Module):
    """An embedding table whose rows (the vocabulary) are split evenly over ranks.

    The vocabulary is padded up to a multiple of ``tp_size``; padding rows are
    zero. Each rank holds rows ``[tp_rank * rows_per_rank, (tp_rank + 1) *
    rows_per_rank)`` of the padded table. With ``tp_size`` above 1, lookups are
    summed and logits gathered over the group bound by ``bind_tp_group``.
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, *, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.rows_per_rank = -(-num_embeddings // tp_size)
        self.vocab_start = tp_rank * self.rows_per_rank
        self.weight = nn.Parameter(
            torch.empty(self.rows_per_rank, embedding_dim), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.tp_group: TensorParallelGroup | None = None
        #: The table packed for the linear backend when this is the model's output head
        #: (``pack_linear_weights``); None: ``compute_logits`` takes ``weight`` as it is.
        self.packed_weight: torch.Tensor | None = None
        #: The native CPU kernels when bound (``bind_cpu_layer_ops``): the logits of a few
        #: rows come from their ``linear_rows``.
        self.cpu_ops: Any = None
        #: With ``--quantize-embeddings`` or ``--quantize-lm-head`` the table held in int8
        #: instead (framework/layers/quantization/linear_method.py): ``quant_weight`` as the
        #: quantized-linear kernel ``quant_kernel`` prepared it, for logits; ``quant_rows``
        #: as quantized (int8 ``qweight`` and a ``scale`` a row), for lookups.
        self.quant_weight: Any = None
        self.quant_kernel: Any = None
        self.quant_rows: Any = None

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointWeight, shard_id: object = None
    ) -> None:
        """Copy this rank's rows of the full ``[num_embeddings, dim]`` table; zero the padding."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} takes no shard id, got {shard_id!r}")
        expected = (self.num_embeddings, self.embedding_dim)
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(
                f"{type(self).__name__}: checkpoint tensor has shape "
                f"{tuple(loaded_weight.shape)}, expected {expected}"
            )
        real_rows = max(0, min(self.rows_per_rank, self.num_embeddings - self.vocab_start))
        data = materialized(param)
        data.narrow(0, 0, real_rows).copy_(loaded_weight.narrow(0, self.vocab_start, real_rows))
        data[real_rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embed token ids; each rank looks up its own rows, the rest are summed in."""
        if self.tp_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.rows_per_rank)
        out = self._lookup(local.clamp(0, self.rows_per_rank - 1))
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return bound_tp_group(self).all_reduce(out)

    def _lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's table rows ``rows``, in the weight dtype (int8 rows times scales)."""
        if self.quant_rows is None:
            return F.embedding(rows, self.weight)
        codes, scale = self.quant_rows.tensors["qweight"], self.quant_rows.tensors["scale"]
        return (codes[rows].float() * scale[rows].float().unsqueeze(-1)).to(self.weight.dtype)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Use the table as an output projection: logits ``[n, num_embeddings]``.

        This is how a model with tied embeddings projects onto the vocabulary.
        The result is in the weight dtype.
        """
        logits = self._project(hidden_states)
        if self.tp_size > 1:
            logits = bound_tp_group(self).all_gather(logits, dim=-1)
        return logits[:, : self.num_embeddings]

    def _project(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """This rank's logits: ``hidden_states`` times its rows of the table."""
        if self.quant_weight is not None:
            return self.quant_kernel.apply(self.quant_weight, hidden_states)
        return linear(hidden_states, self.weight, None, self.packed_weight, self.cpu_ops)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, tp_rank={self.tp_rank}, "
            f"tp_size={self.tp_size}"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection ``hidden -> vocabulary logits``, split like the embedding
    (held in int8 with ``--quantize-lm-head``)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """An output head is not an embedding lookup; use ``compute_logits``."""
        raise RuntimeError("ParallelLMHead is applied with compute_logits(hidden_states)")
