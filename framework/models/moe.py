"""Mixture-of-Experts decoders: what Qwen2-MoE, Qwen3-MoE and Mixtral share.

An MoE decoder is a Llama-shaped decoder whose MLP is, in its sparse layers, a
sparse MoE block: a replicated router (``gate``, ``[E, H]``) picks each token's
top-k experts (``select_experts``), and the experts (``FusedMoE``) add their
outputs weighted by the router's probabilities. The families differ in a few
settings (``MoeSpec``) and in their attention:

* Qwen2-MoE (``framework.models.qwen_moe``): q/k/v bias (as Qwen2); a shared
  expert, an MLP every token goes through, scaled by
  ``sigmoid(shared_expert_gate(x))``; ``norm_topk_prob`` renormalizes the chosen
  weights.
* Qwen3-MoE (``framework.models.qwen_moe``): per-head q/k RMSNorm (as Qwen3); no shared expert.
* Mixtral (``framework.models.mixtral``): Mistral's attention; always renormalizes.

Qwen's layer ``i`` is sparse iff ``i not in mlp_only_layers``, ``num_experts > 0``
and ``(i + 1) % decoder_sparse_step == 0``; the others have a dense MLP of
``intermediate_size``.

Tensor parallelism splits each expert's intermediate rows (and the shared
expert's, as a dense MLP's): a rank computes a partial sum of the block's
output, the experts' and the shared expert's partials added first and summed
over the tensor-parallel group in one all-reduce. Expert parallelism
(``ep_rank``, ``ep_size``, the ranks of the tensor-parallel group) gives each
rank whole experts, its share of them; the experts' output is then complete on
every rank (``FusedMoE`` exchanges the tokens), and only the shared expert's
partial sum is all-reduced. Pipeline stages are Llama's.

Checkpoints hold the experts per expert (``mlp.experts.{e}.gate_proj/up_proj/
down_proj``, Mixtral's ``w1``/``w3``/``w2``) or stacked, as transformers holds
them in memory (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj
[E, H, I]``); both load, each rank reading only the rows it holds. Every expert
a rank holds must get its gate, up and down projections.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from framework.layers.activation import GatedActivation
from framework.layers.linear import (
    CheckpointWeight,
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    TensorParallelGroup,
    bound_tp_group,
)
from framework.layers.moe import FusedMoE, select_experts
from framework.layers.moe.experts import DOWN, GATE, UP, expert_weight_name
from framework.layers.norm import RMSNorm
from framework.layers.rotary import RotaryEmbedding
from framework.models.llama import (
    AttentionOptions,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    sliding_window_of,
)


@dataclass(frozen=True)
class MoeSpec:
    """A family's sparse MoE block, read from its config."""

    num_experts: int
    top_k: int
    #: Each expert's intermediate size.
    intermediate_size: int
    #: Whether each token's chosen weights are scaled to sum to one.
    renormalize: bool
    #: The shared expert's intermediate size; None: no shared expert.
    shared_intermediate_size: int | None = None


class PartialSumLinear(RowParallelLinear):
    """A row-parallel projection that returns this rank's partial product, unsummed.

    For a layer whose output joins other partial sums before one all-reduce over
    the ranks (the shared expert's output with the experts'). Without bias: a
    bias added on every rank would be counted once per rank.
    """

    def __init__(self, input_size: int, output_size: int, *, tp_rank: int, tp_size: int) -> None:
        super().__init__(input_size, output_size, bias=False, tp_rank=tp_rank, tp_size=tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's ``x W_rank^T``, ``[n, output_size]`` (its weight quantized or float)."""
        return self.partial(x)


class SharedExpertMLP(nn.Module):
    """Qwen2-MoE's shared expert: a gated MLP whose output is this rank's partial sum."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, *,
                 tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], tp_rank=tp_rank,
            tp_size=tp_size)
        self.down_proj = PartialSumLinear(intermediate_size, hidden_size, tp_rank=tp_rank,
                                          tp_size=tp_size)
        self.act_fn = GatedActivation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, hidden] -> [n, hidden]``, not yet summed over the ranks."""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Router, experts and (optionally) the shared expert of one sparse layer."""

    def __init__(self, config: Any, spec: MoeSpec, *, tp_rank: int, tp_size: int,
                 ep_rank: int, ep_size: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.spec = spec
        # The router is replicated (a column-parallel layer over one rank): every rank
        # routes every token itself, so no collective is needed to agree on the choice.
        self.gate = ColumnParallelLinear(hidden, spec.num_experts)
        self.experts = FusedMoE(spec.num_experts, hidden, spec.intermediate_size,
                                activation=config.hidden_act, tp_rank=tp_rank, tp_size=tp_size,
                                ep_rank=ep_rank, ep_size=ep_size)
        self.shared_expert: SharedExpertMLP | None = None
        self.shared_expert_gate: ColumnParallelLinear | None = None
        if spec.shared_intermediate_size is not None:
            self.shared_expert = SharedExpertMLP(hidden, spec.shared_intermediate_size,
                                                 config.hidden_act, tp_rank=tp_rank,
                                                 tp_size=tp_size)
            self.shared_expert_gate = ColumnParallelLinear(hidden, 1)  # replicated, [1, H]
        self.tp_size = tp_size
        #: The group the partial sums are summed over (``bind_tp_group``).
        self.tp_group: TensorParallelGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, hidden] -> [n, hidden]``: the block's output, summed over the ranks."""
        weights, ids = select_experts(self.gate(x), self.spec.top_k, self.spec.renormalize)
        routed = self.experts(x, weights, ids)
        shared = self._shared(x)
        if self.experts.output_is_partial:
            # Both are partial sums over the same ranks: one all-reduce adds them all.
            return self._sum(routed if shared is None else routed + shared)
        return routed if shared is None else routed + self._sum(shared)

    def _shared(self, x: torch.Tensor) -> torch.Tensor | None:
        """The gated shared expert's output, this rank's partial sum (None without one).

        The gate is a per-token scalar, so scaling each rank's part scales their sum.
        """
        if self.shared_expert is None or self.shared_expert_gate is None:
            return None
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def _sum(self, partial: torch.Tensor) -> torch.Tensor:
        return bound_tp_group(self).all_reduce(partial) if self.tp_size > 1 else partial


class MoeDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block around a given attention and MLP (dense or sparse)."""

    def __init__(self, config: Any, attention: LlamaAttention, mlp: nn.Module) -> None:
        nn.Module.__init__(self)
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class MoeModel(LlamaModel):
    """Llama's stack with each layer's MLP from ``make_mlp``: a sparse MoE block or a
    dense MLP (made once, where Llama's layers would make a dense one first)."""

    def __init__(self, config: Any, options: AttentionOptions,
                 make_mlp: Callable[[int], nn.Module], *, tp_rank: int, tp_size: int,
                 pp_rank: int = 0, pp_size: int = 1) -> None:
        self._make_mlp = make_mlp  # read by make_layer, which LlamaModel.__init__ calls
        super().__init__(config, options, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank,
                         pp_size=pp_size)

    def make_layer(self, config: Any, layer_id: int, options: AttentionOptions, *,
                   tp_rank: int, tp_size: int, rotary_emb: RotaryEmbedding) -> nn.Module:
        """Llama's attention with this layer's MLP."""
        attention = LlamaAttention(
            config, layer_id - self.start_layer, options, tp_rank=tp_rank, tp_size=tp_size,
            rotary_emb=rotary_emb, sliding_window=sliding_window_of(config, layer_id))
        return MoeDecoderLayer(config, attention, self._make_mlp(layer_id))


class ExpertMatrix:
    """One expert's matrix of a stacked ``[E, rows, cols]`` checkpoint tensor: its rows
    ``start .. start + rows - 1``, read only as far as a loader narrows it.

    A ``CheckpointWeight`` itself, so that a stacked tensor loads as the per-expert
    tensors do, each rank reading only its experts and its rows of them.
    """

    def __init__(self, stacked: CheckpointWeight, expert: int, start: int, rows: int) -> None:
        self._stacked = stacked
        self._expert = expert
        self._start = start
        self._rows = rows

    @property
    def shape(self) -> torch.Size:
        """``(rows, cols)``."""
        return torch.Size((self._rows, self._stacked.shape[2]))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """``length`` rows (``dim`` 0) or columns (``dim`` 1) from ``start``."""
        first = self._start
        if dim == 0:
            return self._stacked[self._expert, first + start:first + start + length]
        return self._stacked[self._expert, first:first + self._rows, start:start + length]

    def __getitem__(self, index: Any) -> torch.Tensor:
        """The matrix's entries at ``index`` (``[...]``: all of them)."""
        return self._stacked[self._expert, self._start:self._start + self._rows][index]


def per_expert_weights(
    weights: Iterable[tuple[str, CheckpointWeight]],
) -> Iterator[tuple[str, CheckpointWeight]]:
    """The checkpoint's weights with each stacked expert tensor replaced by its experts'
    matrices, under the per-expert names (``experts.{e}.gate_proj.weight``, ...)."""
    for name, weight in weights:
        prefix, _, tensor = name.rpartition(".")
        if not prefix.endswith(".experts") or tensor not in ("gate_up_proj", "down_proj"):
            yield name, weight
            continue
        if len(weight.shape) != 3:
            raise ValueError(f"checkpoint weight {name!r} has shape {tuple(weight.shape)}, "
                             "expected [experts, rows, columns]")
        experts, rows = weight.shape[0], weight.shape[1]
        for expert in range(experts):
            if tensor == "down_proj":
                yield f"{prefix}.{expert}.down_proj.weight", ExpertMatrix(weight, expert, 0, rows)
                continue
            half = rows // 2  # gate rows, then up rows
            yield f"{prefix}.{expert}.gate_proj.weight", ExpertMatrix(weight, expert, 0, half)
            yield f"{prefix}.{expert}.up_proj.weight", ExpertMatrix(weight, expert, half, half)


class MoeForCausalLM(LlamaForCausalLM):
    """An MoE decoder with its language-model head; families set ``moe_spec``,
    ``is_sparse_layer`` and ``attention_options``."""

    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        device: torch.device,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        ep_rank: int = 0,
        ep_size: int = 1,
    ) -> None:
        # Read by build_model, which the base class's __init__ calls.
        self.ep_rank = ep_rank
        self.ep_size = ep_size
        super().__init__(config, dtype, device, tp_rank=tp_rank, tp_size=tp_size,
                         pp_rank=pp_rank, pp_size=pp_size)

    @classmethod
    def moe_spec(cls, config: Any) -> MoeSpec:
        """The family's sparse block settings (Qwen's fields by default)."""
        return MoeSpec(num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                       intermediate_size=config.moe_intermediate_size,
                       renormalize=bool(config.norm_topk_prob))

    @classmethod
    def is_sparse_layer(cls, config: Any, layer_id: int) -> bool:
        """Qwen's rule: not in ``mlp_only_layers``, and every ``decoder_sparse_step``-th."""
        return (layer_id not in (getattr(config, "mlp_only_layers", None) or ())
                and config.num_experts > 0
                and (layer_id + 1) % config.decoder_sparse_step == 0)

    def build_model(self, config: Any, *, tp_rank: int, tp_size: int, pp_rank: int,
                    pp_size: int) -> MoeModel:
        """The decoder stack of this rank: sparse MoE blocks or dense MLPs, layer by layer."""
        spec = self.moe_spec(config)

        def make_mlp(layer_id: int) -> nn.Module:
            if self.is_sparse_layer(config, layer_id):
                return SparseMoeBlock(config, spec, tp_rank=tp_rank, tp_size=tp_size,
                                      ep_rank=self.ep_rank, ep_size=self.ep_size)
            return LlamaMLP(config, tp_rank=tp_rank, tp_size=tp_size)

        return MoeModel(config, self.attention_options(config), make_mlp, tp_rank=tp_rank,
                        tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size)

    def load_weights(self, weights: Iterable[tuple[str, CheckpointWeight]]) -> None:
        """Copy Hugging Face-named weights into the model (``LlamaForCausalLM.load_weights``),
        the experts from per-expert or stacked tensors.

        Raises:
            ValueError: as Llama's, and when an expert this rank holds lacks its gate,
                up or down projection, or a checkpoint names an expert the model lacks.
        """
        super().load_weights(per_expert_weights(weights))

    def _stacked_target(self, name: str) -> tuple[str, Any]:  # type: ignore[override]
        """A per-expert tensor's ``FusedMoE`` parameter and ``(expert, part)`` shard id;
        any other tensor as Llama stacks it."""
        target = expert_weight_name(name)
        if target is None:
            return LlamaForCausalLM._stacked_target(name)
        experts = self.moe_spec(self.config).num_experts
        if target.expert >= experts:
            raise ValueError(f"checkpoint weight {name!r} names expert {target.expert}, but "
                             f"the model has {experts} experts")
        param = "w2" if target.part == DOWN else "w13"  # FusedMoE's stacked parameters
        return f"{target.prefix}.{param}", (target.expert, target.part)

    def _expected_loads(  # type: ignore[override]
        self, params: dict[str, nn.Parameter]
    ) -> set[tuple[str, Any]]:
        """Llama's, with each expert this rank holds in place of the stacked expert weights
        (experts of other expert-parallel ranks are not expected)."""
        expected = LlamaForCausalLM._expected_loads(params)
        for prefix, module in self.named_modules():
            if not isinstance(module, FusedMoE):
                continue
            w13, w2 = f"{prefix}.w13", f"{prefix}.w2"
            expected -= {(w13, None), (w2, None)}
            for expert in range(module.first_expert, module.first_expert + module.num_local):
                expected |= {(w13, (expert, GATE)), (w13, (expert, UP)), (w2, (expert, DOWN))}
        return expected
