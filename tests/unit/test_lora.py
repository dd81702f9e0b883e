"""LoRA adapters: PEFT's files loaded and checked, one packed batch serving several
adapters at once against transformers + peft, tensor-parallel shards, and the slot cache.

The parity check builds a tiny Llama with transformers, trains nothing but makes three
PEFT adapters with random (non-zero) matrices, and runs this project's model on one
packed prefill of four requests (no adapter and each adapter once); every token's
logits must match transformers with that adapter merged into the weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from framework.bench.lora_adapters import write_random_adapters
from framework.forward_batch import ForwardBatch, ForwardMode
from framework.layers.attention import AttentionBackendArgs
from framework.layers.attention.radix_attention import bind_attention_backend
from framework.layers.attention.torch_native import TorchNativeAttnBackend
from framework.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from framework.lora import NO_SLOT, LoraAdapter, LoraBatch, LoraModel, LoraSlots, apply_lora
from framework.lora.adapter import LoraWeights, ModelLoraSpec
from framework.lora.layers import LoraLinear, LoraState
from framework.lora.ops import torch_lora_delta
from framework.lora.serving import LoraServing
from framework.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from framework.models.llama import LlamaForCausalLM
from tests.model_fixtures import make_tiny_checkpoint, single_threaded_torch, tiny_config

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name -> (rank, alpha, targets, rsLoRA)
ADAPTERS: dict[str, tuple[int, int, list[str], bool]] = {
    "qv": (4, 8, ["q_proj", "v_proj"], False),
    "attn": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], True),
    "mlp": (16, 8, ["gate_proj", "up_proj", "down_proj"], False),
}
PROMPTS = [[1, 17, 45, 99, 3, 250, 7], [1, 300, 12], [1, 5, 6, 7, 8, 9, 10, 11, 40],
           [1, 77, 78, 123, 401]]
MAX_SLOTS, MAX_RANK = 4, 16


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with single_threaded_torch():
        yield


@dataclass
class Served:
    """This project's model with LoRA applied and the three adapters loaded."""

    model: LlamaForCausalLM
    lora: LoraModel
    slots: LoraSlots
    backend: TorchNativeAttnBackend
    reference: dict[str | None, list[torch.Tensor]]  # adapter -> each prompt's logits


def make_peft_adapters(base_dir: Path, root: Path) -> dict[str | None, list[torch.Tensor]]:
    """Save the ``ADAPTERS`` with peft; return transformers' logits of every prompt, for the
    base (``None``) and each adapter merged."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    def logits(model: Any) -> list[torch.Tensor]:
        with torch.no_grad():
            return [model(torch.tensor([p])).logits[0].float() for p in PROMPTS]

    reference = {None: logits(AutoModelForCausalLM.from_pretrained(base_dir).eval())}
    for seed, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                            use_rslora=rslora, init_lora_weights=False)
        peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), config)
        peft_model.save_pretrained(root / name)
        reference[name] = logits(peft_model.merge_and_unload().eval())
    return reference


def build_model(base_dir: Path) -> tuple[LlamaForCausalLM, TorchNativeAttnBackend]:
    config = tiny_config("llama")
    model = LlamaForCausalLM(config, torch.float32, torch.device("cpu"))
    model.load_weights(load_file(str(base_dir / "model.safetensors")).items())
    head_dim = config.hidden_size // config.num_attention_heads
    tokens = sum(len(p) for p in PROMPTS) + 1
    backend = TorchNativeAttnBackend(AttentionBackendArgs(
        num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        req_to_token_pool=ReqToTokenPool(len(PROMPTS), 64, torch.device("cpu")),
        token_to_kv_pool=MHATokenToKVPool(tokens, torch.float32, config.num_key_value_heads,
                                          head_dim, config.num_hidden_layers,
                                          torch.device("cpu")),
        max_batch_size=len(PROMPTS), context_len=64, dtype=torch.float32,
        device=torch.device("cpu")))
    bind_attention_backend(model, backend)
    return model, backend


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Served:
    root = tmp_path_factory.mktemp("lora")
    base_dir = make_tiny_checkpoint(root, "llama", seed=5)
    reference = make_peft_adapters(base_dir, root)
    model, backend = build_model(base_dir)
    lora = apply_lora(model, MAX_SLOTS, MAX_RANK, ALL_TARGETS)
    slots = LoraSlots(lora)
    for name in ADAPTERS:
        slots.load(LoraAdapter.load(root / name, name))
    return Served(model, lora, slots, backend, reference)


def prefill_every_token(served: Served, request_slots: list[int]) -> list[torch.Tensor]:
    """One packed prefill of ``PROMPTS``; each request's logits at every one of its tokens."""
    lens = [len(p) for p in PROMPTS]
    pool = served.backend.req_to_token_pool
    locs = torch.arange(1, sum(lens) + 1)  # KV slot 0 is the pool's padding slot
    for row, chunk in enumerate(locs.split(lens)):
        pool.req_to_token[row, :len(chunk)] = chunk
    batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=len(PROMPTS),
        input_ids=torch.tensor([t for p in PROMPTS for t in p]),
        positions=torch.cat([torch.arange(n) for n in lens]),
        req_pool_indices=torch.arange(len(PROMPTS)), seq_lens=torch.tensor(lens),
        out_cache_loc=locs, extend_prefix_lens=torch.zeros(len(lens), dtype=torch.int64),
        extend_seq_lens=torch.tensor(lens),
        prompt_logprob_rows=torch.arange(sum(lens)),  # logits of every packed row
    )
    served.lora.set_batch(LoraBatch.build(request_slots, lens,
                                          output_rows=batch.logits_rows()))
    served.backend.init_forward_metadata(batch)
    with torch.no_grad():
        logits = served.model(batch.input_ids, batch.positions, batch)
    served.lora.set_batch(None)
    return list(logits[len(PROMPTS):].split(lens))


def mixed_slots(served: Served) -> tuple[list[str | None], list[int]]:
    names: list[str | None] = [None, *ADAPTERS]
    return names, [NO_SLOT if n is None else served.slots.slot_of(n) for n in names]


def test_one_mixed_prefill_matches_peft_merged_adapters(served: Served) -> None:
    names, request_slots = mixed_slots(served)
    got = prefill_every_token(served, request_slots)
    for index, name in enumerate(names):
        expected = served.reference[name][index]
        torch.testing.assert_close(got[index], expected, rtol=0, atol=2e-4,
                                   msg=lambda m, n=name: f"adapter {n}: {m}")


def test_every_adapter_changes_some_greedy_tokens(served: Served) -> None:
    """An adapter that does nothing would leave transformers' base argmax everywhere."""
    names, _ = mixed_slots(served)
    for name in names[1:]:
        slot = served.slots.slot_of(name)
        got = prefill_every_token(served, [slot] * len(PROMPTS))
        changed = sum(int((g.argmax(-1) != base.argmax(-1)).sum())
                      for g, base in zip(got, served.reference[None], strict=True))
        assert changed > 0, f"adapter {name} changed no greedy token"


def test_rows_take_their_own_request_s_adapter(served: Served) -> None:
    """Every row on slot 0 (the first request's choice applied to all) changes the others."""
    names, request_slots = mixed_slots(served)
    right = prefill_every_token(served, request_slots)
    first = served.slots.slot_of(names[1])
    wrong = prefill_every_token(served, [first] * len(PROMPTS))
    for index, name in enumerate(names):
        same = torch.allclose(wrong[index], right[index], atol=1e-5)
        assert same == (name == names[1]), f"request {index} ({name})"


# ---------------------------------------------------------------- adapter files and checks

def write_adapter(directory: Path, *, rank: int = 4, config: dict[str, Any] | None = None,
                  modules: dict[str, tuple[int, int]] | None = None, layers: int = 2) -> Path:
    """A PEFT-layout adapter of random matrices: ``modules`` maps projection -> (in, out)."""
    directory.mkdir(parents=True)
    modules = modules or {"q_proj": (64, 64), "v_proj": (64, 32)}
    tensors = {}
    for layer in range(layers):
        for module, (in_features, out_features) in modules.items():
            block = "self_attn" if module[0] in "qkvo" else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features)
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    fields = {"r": rank, "lora_alpha": 2 * rank, "target_modules": list(modules),
              "bias": "none", **(config or {})}
    (directory / "adapter_config.json").write_text(json.dumps(fields))
    return directory


SPEC = ModelLoraSpec(num_layers=2, max_rank=8,
                     shapes={"q_proj": (64, 64), "v_proj": (64, 32), "o_proj": (64, 64)})


def test_a_fitting_adapter_loads_with_its_scaling(tmp_path: Path) -> None:
    adapter = LoraAdapter.load(write_adapter(tmp_path / "a", rank=4), "a")
    adapter.check(SPEC)
    assert (adapter.rank, adapter.scaling, adapter.modules) == (4, 2.0, {"q_proj", "v_proj"})
    rs = LoraAdapter.load(write_adapter(tmp_path / "rs", config={"use_rslora": True}), "rs")
    assert rs.scaling == 8 / 2  # alpha / sqrt(r)
    regex = write_adapter(tmp_path / "re", config={"target_modules": r".*\.(q|v)_proj"})
    assert LoraAdapter.load(regex, "re").modules == {"q_proj", "v_proj"}


@pytest.mark.parametrize(("kwargs", "spec", "message"), [
    ({"rank": 16}, SPEC, "'bad': rank 16 exceeds the maximum LoRA rank 8"),
    ({"modules": {"down_proj": (128, 64)}}, SPEC, "'bad': layer 0 down_proj: the model has "
                                                  "no LoRA target 'down_proj'"),
    ({"modules": {"v_proj": (64, 64)}}, SPEC, r"'bad': layer 0 v_proj: lora_A \(4, 64\) and "
                                              r"lora_B \(64, 4\) do not match"),
    ({"layers": 3}, SPEC, "'bad': layer 2 q_proj: the model has 2 layers"),
])
def test_adapters_that_do_not_fit_the_model_are_refused(
        tmp_path: Path, kwargs: dict[str, Any], spec: ModelLoraSpec, message: str) -> None:
    adapter = LoraAdapter.load(write_adapter(tmp_path / "bad", **kwargs), "bad")
    with pytest.raises(ValueError, match=message):
        adapter.check(spec)


@pytest.mark.parametrize(("config", "message"), [
    ({"rank_pattern": {"q_proj": 8}}, "'bad': rank_pattern is not supported"),
    ({"alpha_pattern": {"q_proj": 8}}, "'bad': alpha_pattern is not supported"),
    ({"modules_to_save": ["lm_head"]}, "'bad': modules_to_save is not supported"),
    ({"bias": "lora_only"}, "'bad': bias='lora_only' is not supported"),
    ({"target_modules": ["q_proj"]}, r"'bad': weights for \['v_proj'\] are not in"),
    ({"target_modules": r".*\.q_proj"}, r"'bad': weights for \['v_proj'\] are not in"),
])
def test_unsupported_adapter_configs_are_refused(tmp_path: Path, config: dict[str, Any],
                                                 message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LoraAdapter.load(write_adapter(tmp_path / "bad", config=config), "bad")


def test_apply_lora_describes_the_targets_it_wrapped(served: Served) -> None:
    spec = served.lora.spec
    assert spec.num_layers == 2 and spec.max_rank == MAX_RANK
    assert spec.shapes == {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32),
                           "o_proj": (64, 64), "gate_proj": (64, 128), "up_proj": (64, 128),
                           "down_proj": (128, 64)}
    model = LlamaForCausalLM(tiny_config("llama"), torch.float32, torch.device("cpu"))
    partial = apply_lora(model, 2, 8, ["v_proj"])
    assert set(partial.wrappers) == {(0, "qkv_proj"), (1, "qkv_proj")}
    assert isinstance(model.model.layers[1].self_attn.qkv_proj, LoraLinear)
    assert not isinstance(model.model.layers[1].self_attn.o_proj, LoraLinear)
    with pytest.raises(ValueError, match="unknown LoRA targets"):
        apply_lora(model, 2, 8, ["lm_head"])


# ---------------------------------------------------------------- tensor-parallel shards

class RecordingGroup:
    """A tensor-parallel group of one rank that keeps what it was asked to sum."""

    def __init__(self) -> None:
        self.reduced: list[torch.Tensor] = []

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.reduced.append(x.clone())
        return x


HIDDEN = 16
# kind -> (the Hugging Face projections it fuses, how to build its base at tp_rank/tp_size)
KINDS: dict[str, tuple[tuple[str, ...], Any]] = {
    # 4 query heads, 1 key/value head: replicated on both ranks
    "qkv": (("q_proj", "k_proj", "v_proj"),
            lambda r, n: QKVParallelLinear(HIDDEN, 4, 4, 1, bias=True, tp_rank=r, tp_size=n)),
    "gate_up": (("gate_proj", "up_proj"),
                lambda r, n: MergedColumnParallelLinear(HIDDEN, [12, 12], bias=True,
                                                        tp_rank=r, tp_size=n)),
    "o": (("o_proj",), lambda r, n: RowParallelLinear(HIDDEN, 10, bias=True, tp_rank=r,
                                                      tp_size=n)),
}


def tp_wrapper(kind: str, tp_rank: int, tp_size: int, batch: LoraBatch) -> LoraLinear:
    """The wrapped layer of ``kind`` at ``tp_rank``, full weights and one rank-4 adapter
    (slot 1, padded to rank 8) loaded from the same seed at every ``tp_size``."""
    modules, make = KINDS[kind]
    base: LinearBase = make(tp_rank, tp_size)
    wrapper = LoraLinear(base, LoraState(torch_lora_delta, batch), 0, modules, 2, 8)
    generator = torch.Generator().manual_seed(11)
    weights = {}
    for module in modules:
        shard = None if kind == "o" else {"q_proj": "q", "k_proj": "k", "v_proj": "v",
                                          "gate_proj": 0, "up_proj": 1}[module]
        in_features, out_features = wrapper.full_shape(module)
        for param, shape in ((base.weight, (out_features, in_features)),
                             (base.bias, (out_features,))):
            assert param is not None
            base.weight_loader(param, torch.randn(shape, generator=generator), shard)
        weights[(0, module)] = LoraWeights(torch.randn(4, in_features, generator=generator),
                                           torch.randn(out_features, 4, generator=generator))
    wrapper.load_slot(1, LoraAdapter("tp", rank=4, scaling=1.5, weights=weights))
    return wrapper


@pytest.mark.parametrize("kind", list(KINDS))
def test_two_rank_shards_recombine_to_the_single_rank_output(kind: str) -> None:
    batch = LoraBatch.build([1, NO_SLOT, 1], [2, 1, 2])
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(3))
    whole = tp_wrapper(kind, 0, 1, batch)
    expected = whole(x)
    assert not torch.allclose(expected[[0, 1, 3, 4]], whole.base(x)[[0, 1, 3, 4]], atol=1e-3)
    torch.testing.assert_close(expected[2], whole.base(x)[2])  # the row without an adapter
    ranks = [tp_wrapper(kind, rank, 2, batch) for rank in range(2)]
    if kind == "o":
        groups = [RecordingGroup(), RecordingGroup()]
        for rank, wrapper in enumerate(ranks):
            wrapper.base.tp_group = groups[rank]
            wrapper(x[:, rank * HIDDEN // 2:(rank + 1) * HIDDEN // 2])
        # What each rank sums over the group must already hold its share of the delta.
        combined = groups[0].reduced[0] + groups[1].reduced[0] + whole.base.bias
    else:
        # Each rank's output: its half of the query heads and the one key/value head
        # (q/k/v), or its halves of gate and up.
        local_sizes = [8, 4, 4] if kind == "qkv" else [6, 6]
        parts = [wrapper(x).split(local_sizes, dim=-1) for wrapper in ranks]
        if kind == "qkv":
            torch.testing.assert_close(parts[0][1:], parts[1][1:])  # key/value replicated
            combined = torch.cat([parts[0][0], parts[1][0], *parts[0][1:]], dim=-1)
        else:
            combined = torch.cat([parts[0][0], parts[1][0], parts[0][1], parts[1][1]], dim=-1)
    torch.testing.assert_close(combined, expected, rtol=1e-5, atol=1e-5)


def test_a_batch_of_other_rows_is_refused() -> None:
    wrapper = tp_wrapper("gate_up", 0, 1, LoraBatch.build([1], [3]))
    with pytest.raises(ValueError, match="the LoRA batch has 3 rows, layer 0 got 2"):
        wrapper(torch.zeros(2, HIDDEN))


# ---------------------------------------------------------------- slots

def tiny_adapter(name: str, value: float, rank: int = 2) -> LoraAdapter:
    weights = {(layer, "q_proj"): LoraWeights(torch.full((rank, 64), value),
                                              torch.full((64, rank), value))
               for layer in range(2)}
    return LoraAdapter(name, rank=rank, scaling=value, weights=weights)


@pytest.fixture
def slots() -> LoraSlots:
    model = LlamaForCausalLM(tiny_config("llama"), torch.float32, torch.device("cpu"))
    return LoraSlots(apply_lora(model, 3, 4, ["q_proj"]), max_loaded=2)


def slot_is_zero(slots: LoraSlots, slot: int) -> bool:
    return all(not (w.lora_a[slot].any() or w.lora_b[slot].any() or w.lora_scalings[slot])
               for w in slots.lora_model.layers)


def test_slots_load_each_adapter_into_every_layer_zero_padded(slots: LoraSlots) -> None:
    slot = slots.load(tiny_adapter("a", 3.0))
    assert slots.load(tiny_adapter("a", 3.0)) == slot  # loaded once
    for wrapper in slots.lora_model.layers:
        assert bool((wrapper.lora_a[slot, :2] == 3.0).all())
        assert not wrapper.lora_a[slot, 2:].any() and not wrapper.lora_b[slot, :, 2:].any()
        assert float(wrapper.lora_scalings[slot]) == 3.0


def test_the_least_recently_used_adapter_is_evicted(slots: LoraSlots) -> None:
    first, second = slots.load(tiny_adapter("a", 1.0)), slots.load(tiny_adapter("b", 2.0))
    slots.load(tiny_adapter("a", 1.0))  # used again: "b" is now the least recent
    assert slots.load(tiny_adapter("c", 3.0)) == second
    assert slots.loaded == ["a", "c"]
    slots.acquire("c")
    slots.release("c")
    assert slots.load(tiny_adapter("d", 4.0)) == first  # "a" was used before "c"
    assert slots.loaded == ["c", "d"]


def test_pinned_adapters_are_never_evicted(slots: LoraSlots) -> None:
    slots.load(tiny_adapter("a", 1.0))
    slots.load(tiny_adapter("b", 2.0))
    slots.acquire("a")  # the least recently used, but in use
    slots.acquire("b")
    slots.release("b")
    slots.load(tiny_adapter("c", 3.0))
    assert slots.loaded == ["a", "c"]
    slots.acquire("c")
    with pytest.raises(RuntimeError, match="cannot load LoRA adapter 'd': all 2 loaded "
                                           "adapters are pinned"):
        slots.load(tiny_adapter("d", 4.0))
    with pytest.raises(ValueError, match="'a' is in use by 1 requests"):
        slots.unload("a")
    slots.release("a")
    slots.load(tiny_adapter("d", 4.0))
    assert slots.loaded == ["c", "d"]


def test_unload_zeroes_the_slot(slots: LoraSlots) -> None:
    slot = slots.load(tiny_adapter("a", 1.0))
    other = slots.load(tiny_adapter("b", 2.0))
    slots.unload("a")
    assert slot_is_zero(slots, slot) and not slot_is_zero(slots, other)
    assert slots.loaded == ["b"]
    with pytest.raises(KeyError, match="'a' is not loaded"):
        slots.slot_of("a")


def test_an_adapter_that_does_not_fit_is_not_loaded(slots: LoraSlots) -> None:
    with pytest.raises(ValueError, match="'big': rank 8 exceeds the maximum LoRA rank 4"):
        slots.load(tiny_adapter("big", 1.0, rank=8))
    assert slots.loaded == []


def _decode_step(names: list[str | None], in_use: list[str] | None) -> ForwardBatch:
    n = len(names)
    return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=n,
                        input_ids=torch.zeros(n, dtype=torch.int64),
                        positions=torch.zeros(n, dtype=torch.int64),
                        req_pool_indices=torch.arange(n), seq_lens=torch.ones(n, dtype=torch.int64),
                        out_cache_loc=torch.arange(1, n + 1), lora_names=names,
                        lora_in_use=in_use)


def test_adapters_in_use_are_never_evicted_to_load_another(tmp_path: Path) -> None:
    """Two slots: while requests of adapter 0 hold KV between their steps (a step of
    adapter 1 ran), loading a third adapter is refused rather than evicting adapter 0;
    once they end, the least recently used goes."""
    config = tiny_config("llama")
    config.save_pretrained(tmp_path / "model")
    dirs = write_random_adapters(tmp_path / "model", tmp_path / "adapters", count=3, rank=4,
                                 targets=("q_proj",))
    lora_model = apply_lora(LlamaForCausalLM(config, torch.float32, torch.device("cpu")), 2,
                            4, ["q_proj"])
    serving = LoraServing(lora_model, LoraSlots(lora_model, 2), {})
    serving.load("lora0", str(dirs["lora0"]))
    serving.load("lora1", str(dirs["lora1"]))
    serving.set_batch(_decode_step(["lora1", None], ["lora0", "lora1"]))
    with pytest.raises(RuntimeError, match="cannot load LoRA adapter 'lora2'"):
        serving.load("lora2", str(dirs["lora2"]))
    assert serving.slots.loaded == ["lora0", "lora1"]
    serving.set_batch(_decode_step(["lora1"], ["lora1"]))  # adapter 0's requests ended
    serving.load("lora2", str(dirs["lora2"]))
    assert serving.slots.loaded == ["lora1", "lora2"]
