"""A draft model's decode forward as one native call.

A draft model drafts ``K`` tokens a step, one forward each, and on a CPU a small model's
forward is mostly the cost of running its module tree: module calls, attribute reads,
the attention backend's checks, a ``ForwardBatch`` to build, and some fifty operator
calls from Python. The default model's two-layer draft spent about 570 us a forward
through its modules on a 2-core Xeon, of which the kernels took about 100-200; that made
each of its tokens cost half a decode step of the served model, and drafting did not pay.

``DraftDecodePlan`` reads a Llama model's weights, norms and KV buffers once and runs a
draft forward of a few tokens a request (a decode step, or the tokens a request owes the
draft and its last one) as one call of the native ``llama_decode``
(``csrc/decode_forward.cpp``), which makes the calls the modules make (the native norms,
``linear_rows``, rotary, ``write_kv``, ``paged_attention`` and SiLU), in the same order with
the same arguments, from C++: its logits are the modules' bit for bit, in well under half
their time (one row on a 2-core AMD EPYC: 140 us, where the modules take about 360 and the
same calls made from Python took 250). Its weights are the modules' tensors, so a load in
place reaches it too.

It applies where the modules' decode forward is exactly that sequence: a
``LlamaForCausalLM`` (not a subclass) on a CPU with the native kernels bound, on one rank,
without LoRA, quantized weights or KV cache, biases, q/k norms, a sliding window or a
soft cap, with SiLU; and to a forward whose products all run in ``linear_rows``
(``fits``: float32 products of more than four rows go to oneDNN or torch in the modules).
``build`` returns None for any other model, which then drafts through its modules, as
does a forward that does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from framework.layers.linear_kernel import native_rows_fit
from framework.model_executor.model_runner import ModelRunner
from framework.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's tensors and sizes, as its modules hold them."""

    #: input norm, qkv, o, post-attention norm, gate_up and down weights (``llama_decode``'s
    #: order).
    weights: tuple[torch.Tensor, ...]
    kv: tuple[torch.Tensor, torch.Tensor]
    eps: tuple[float, float]
    #: q features, kv features, head_dim, query heads.
    sizes: tuple[int, int, int, int]
    scaling: float


class DraftDecodePlan:
    """Decode steps of a plain Llama model on a CPU without its module tree."""

    def __init__(self, runner: ModelRunner, layers: list[_Layer]) -> None:
        model = runner.model
        assert isinstance(model, LlamaForCausalLM) and model.lm_head is not None
        self._ops: Any = runner.layer_ops
        self._weights = [weight for layer in layers for weight in layer.weights]
        self._kv = [buffer for layer in layers for buffer in layer.kv]
        self._eps = [eps for layer in layers for eps in layer.eps]
        self._sizes, self._scaling = list(layers[0].sizes), layers[0].scaling
        self._embedding = model.model.embed_tokens.weight
        # Every position's angles, computed once as the rotary module computes a step's
        # (the same values: each is one product and its cosine or sine).
        self._cos, self._sin = model.model.layers[0].self_attn.rotary_emb.cos_sin(
            torch.arange(runner.model_config.context_len, device=runner.device),
            self._embedding.dtype)
        final = model.model.norm
        self._final_norm, self._final_eps = final.weight, final.eps
        self._head = model.lm_head.weight
        self._vocab = model.lm_head.num_embeddings
        self._req_to_token = runner.pools.req_to_token_pool.req_to_token
        self._device = runner.device

    @classmethod
    def build(cls, runner: ModelRunner) -> DraftDecodePlan | None:
        """The plan of ``runner``'s model, or None where its forward is not the plan's."""
        model = runner.model
        if (type(model) is not LlamaForCausalLM or runner.layer_ops is None
                or runner.device.type != "cpu" or runner.tp_size != 1 or runner.pp_size != 1
                or runner.lora is not None or runner.pools.token_to_kv_pool.quantized
                or model.lm_head is None or model.lm_head.quant_weight is not None
                or model.model.embed_tokens is None
                or model.model.embed_tokens.quant_rows is not None):
            return None
        layers = [_plain_layer(layer, runner) for layer in model.model.layers]
        plain = [layer for layer in layers if layer is not None]
        if len(plain) < len(layers) or not plain or any(
                (layer.sizes, layer.scaling) != (plain[0].sizes, plain[0].scaling)
                for layer in plain):
            return None
        return cls(runner, plain)

    def fits(self, count: int) -> bool:
        """Whether a forward feeding ``count`` tokens runs every product in the native
        ``linear_rows`` kernel, as the modules would (``native_rows_fit``); one that does
        not goes through the modules."""
        return native_rows_fit(count, self._head)

    def greedy(self, rows: list[int], starts: list[int], tokens: list[list[int]]) -> list[int]:
        """Each request's greedy next token after ``tokens`` (``logits``' arguments)."""
        return self._ops.argmax_rows(self.logits(rows, starts, tokens)).tolist()

    @torch.no_grad()
    def logits(self, rows: list[int], starts: list[int], tokens: list[list[int]]
               ) -> torch.Tensor:
        """Float32 logits ``[len(rows), vocab]`` at each request's last token after feeding
        ``tokens[i]`` at positions ``starts[i]...`` of its request row ``rows[i]`` (whose
        slots there it holds), their keys and values written into the draft's KV cache;
        a forward that ``fits``.

        Every fed token attends as a decode token of its own (as the ``cpu`` attention
        backend runs a step of a few new tokens a request), after all of them are written.
        """
        count = len(rows)
        index = torch.tensor([*rows, *starts, *(len(fed) for fed in tokens),
                              *(token for fed in tokens for token in fed)],
                             dtype=torch.int64, device=self._device)
        logits = self._ops.llama_decode(
            index[3 * count:], index[:count], index[count:2 * count],
            index[2 * count:3 * count], self._req_to_token, self._embedding, self._cos,
            self._sin, self._weights, self._kv, self._eps, self._sizes, self._scaling,
            self._final_norm, self._final_eps, self._head)
        return logits[:, :self._vocab].float()


def _plain_layer(layer: Any, runner: ModelRunner) -> _Layer | None:
    """``layer``'s tensors when its forward is the plan's sequence, else None."""
    attention, mlp = layer.self_attn, layer.mlp
    linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
    radix = attention.attn
    if (any(m.bias is not None or m.quant_weight is not None or m.cpu_ops is None
            for m in linears)
            or attention.q_norm is not None or attention.k_norm is not None
            or radix.sliding_window or radix.logit_cap
            or mlp.act_fn.hidden_act != "silu" or mlp.act_fn.cpu_ops is None
            or layer.input_layernorm.cpu_ops is None
            or layer.post_attention_layernorm.cpu_ops is None
            or attention.rotary_emb.cpu_ops is None):
        return None
    return _Layer(
        weights=(layer.input_layernorm.weight, attention.qkv_proj.weight, attention.o_proj.weight,
                 layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight,
                 mlp.down_proj.weight),
        kv=runner.pools.token_to_kv_pool.get_kv_buffer(radix.layer_id),
        eps=(layer.input_layernorm.eps, layer.post_attention_layernorm.eps),
        sizes=(attention.q_size, attention.kv_size, attention.head_dim, radix.num_heads),
        scaling=radix.scaling)
