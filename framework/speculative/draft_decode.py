"""A draft model's decode forward as a fixed list of native kernel calls.

A draft model drafts ``K`` tokens a step, one forward each, and on a CPU a small model's
forward is mostly the cost of running its module tree: module calls, attribute reads,
the attention backend's checks, a ``ForwardBatch`` to build. The default model's
two-layer draft spent about 570 us a forward through its modules, of which the kernels
took about 200; that made each of its tokens cost half a decode step of the served
model, and drafting did not pay.

``DraftDecodePlan`` reads a Llama model's weights, norms and KV buffers once and runs a
draft forward of a few tokens a request (a decode step, or the tokens a request owes the
draft and its last one) as the calls its modules make, in the same order with the same
arguments (``linear`` for the products, the native norms, rotary, SiLU,
``write_kv`` and ``paged_attention``), so its logits are the modules' bit for bit, in about
half the time (305 against 570 us, one row). Its weights are the modules' tensors, so a
load in place reaches it too.

It applies where the modules' decode forward is exactly that sequence: a
``LlamaForCausalLM`` (not a subclass) on a CPU with the native kernels bound, on one rank,
without LoRA, quantized weights or KV cache, biases, q/k norms, a sliding window or a
soft cap, with SiLU. ``build`` returns None for any other model, which then drafts
through its modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from framework.layers.linear_kernel import linear
from framework.model_executor.model_runner import ModelRunner
from framework.models.llama import LlamaForCausalLM


def token_places(rows: list[int], starts: list[int], tokens: list[list[int]]
                 ) -> tuple[list[int], list[int]]:
    """Each fed token's request row and position: ``tokens[i]`` at ``starts[i]...`` of row
    ``rows[i]``."""
    token_rows = [row for row, fed in zip(rows, tokens, strict=True) for _ in fed]
    positions = [start + j for start, fed in zip(starts, tokens, strict=True)
                 for j in range(len(fed))]
    return token_rows, positions


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's tensors and sizes, as its modules hold them."""

    input_norm: torch.Tensor
    input_eps: float
    qkv: tuple[torch.Tensor, torch.Tensor | None]  # weight, packed weight
    q_size: int
    kv_size: int
    head_dim: int
    num_heads: int
    scaling: float
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    o: tuple[torch.Tensor, torch.Tensor | None]
    post_norm: torch.Tensor
    post_eps: float
    gate_up: tuple[torch.Tensor, torch.Tensor | None]
    down: tuple[torch.Tensor, torch.Tensor | None]


class DraftDecodePlan:
    """Decode steps of a plain Llama model on a CPU without its module tree."""

    def __init__(self, runner: ModelRunner, layers: list[_Layer]) -> None:
        model = runner.model
        assert isinstance(model, LlamaForCausalLM) and model.lm_head is not None
        self._ops: Any = runner.layer_ops
        self._layers = layers
        self._embedding = model.model.embed_tokens.weight
        # Every position's angles, computed once as the rotary module computes a step's
        # (the same values: each is one product and its cosine or sine).
        self._cos, self._sin = model.model.layers[0].self_attn.rotary_emb.cos_sin(
            torch.arange(runner.model_config.context_len, device=runner.device),
            self._embedding.dtype)
        final = model.model.norm
        self._final_norm, self._final_eps = final.weight, final.eps
        head = model.lm_head
        self._head = (head.weight, head.packed_weight)
        self._vocab = head.num_embeddings
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
        if any(layer is None for layer in layers):
            return None
        return cls(runner, [layer for layer in layers if layer is not None])

    def greedy(self, rows: list[int], starts: list[int], tokens: list[list[int]]) -> list[int]:
        """Each request's greedy next token after ``tokens`` (``logits``' arguments)."""
        return self.logits(rows, starts, tokens).argmax(dim=-1).tolist()

    @torch.no_grad()
    def logits(self, rows: list[int], starts: list[int], tokens: list[list[int]]
               ) -> torch.Tensor:
        """Float32 logits ``[len(rows), vocab]`` at each request's last token after feeding
        ``tokens[i]`` at positions ``starts[i]...`` of its request row ``rows[i]`` (whose
        slots there it holds), their keys and values written into the draft's KV cache.

        Every fed token attends as a decode token of its own (as the ``cpu`` attention
        backend runs a step of a few new tokens a request), after all of them are written.
        """
        ops, device = self._ops, self._device
        token_rows, positions = token_places(rows, starts, tokens)
        index = torch.tensor([token_rows, positions, [t for fed in tokens for t in fed]],
                             dtype=torch.int64, device=device)
        row_ids, position_ids = index[0], index[1]
        out_cache_loc = self._req_to_token[row_ids, position_ids]
        seq_lens = position_ids + 1
        ones = torch.ones_like(seq_lens)
        hidden = F.embedding(index[2], self._embedding)
        cos, sin = self._cos[position_ids], self._sin[position_ids]
        count = len(positions)
        # Only each request's last token makes logits: the last layer computes the rest of
        # its block for those rows alone, as the modules do (``output_rows``).
        ends = None if count == len(rows) else torch.tensor(
            [len(fed) for fed in tokens], device=device).cumsum(0) - 1
        residual: torch.Tensor | None = None
        for number, layer in enumerate(self._layers, start=1):
            if residual is None:
                residual = hidden
                normed = ops.rms_norm(hidden, layer.input_norm, layer.input_eps)
            else:
                normed, residual = ops.add_rms_norm(hidden, residual, layer.input_norm,
                                                    layer.input_eps)
            qkv = linear(normed, layer.qkv[0], None, layer.qkv[1], ops)
            q, k, v = qkv.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
            q = ops.rotary(q, cos, sin, layer.head_dim)
            k = ops.rotary(k, cos, sin, layer.head_dim)
            ops.write_kv(layer.k_buffer, layer.v_buffer, out_cache_loc, k.reshape(count, -1),
                         v.reshape(count, -1))
            attending, seen, at = row_ids, seq_lens, count
            if ends is not None and number == len(self._layers):
                q, residual = q.index_select(0, ends), residual.index_select(0, ends)
                attending, seen, at = row_ids[ends], seq_lens[ends], len(rows)
            queries = q.reshape(at, layer.num_heads, layer.head_dim).contiguous()
            attended = ops.paged_attention(queries, layer.k_buffer, layer.v_buffer,
                                           self._req_to_token, attending, seen, ones[:at],
                                           layer.scaling, 0, 0.0, None, None)
            hidden = linear(attended.view(at, -1), layer.o[0], None, layer.o[1], ops)
            normed, residual = ops.add_rms_norm(hidden, residual, layer.post_norm,
                                                layer.post_eps)
            gate_up = linear(normed, layer.gate_up[0], None, layer.gate_up[1], ops)
            hidden = linear(ops.silu_and_mul(gate_up), layer.down[0], None, layer.down[1], ops)
        assert residual is not None  # build refuses a model without layers
        normed, _ = ops.add_rms_norm(hidden, residual, self._final_norm, self._final_eps)
        logits = linear(normed, self._head[0], None, self._head[1], ops)
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
    k_buffer, v_buffer = runner.pools.token_to_kv_pool.get_kv_buffer(radix.layer_id)
    return _Layer(
        input_norm=layer.input_layernorm.weight, input_eps=layer.input_layernorm.eps,
        qkv=(attention.qkv_proj.weight, attention.qkv_proj.packed_weight),
        q_size=attention.q_size, kv_size=attention.kv_size, head_dim=attention.head_dim,
        num_heads=radix.num_heads, scaling=radix.scaling, k_buffer=k_buffer, v_buffer=v_buffer,
        o=(attention.o_proj.weight, attention.o_proj.packed_weight),
        post_norm=layer.post_attention_layernorm.weight,
        post_eps=layer.post_attention_layernorm.eps,
        gate_up=(mlp.gate_up_proj.weight, mlp.gate_up_proj.packed_weight),
        down=(mlp.down_proj.weight, mlp.down_proj.packed_weight))
