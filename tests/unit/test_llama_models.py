"""Llama-family models on ModelRunner against transformers, plus loading and TP slicing.

The key check drives ModelRunner and its pools (``runner.pools``) directly,
as the scheduler will: one EXTEND batch packing eight prompts of different lengths, then
DECODE steps for all eight, greedy. transformers' full-sequence logits over
the generated text are the reference: at every step the chosen token must be
transformers' argmax and its log-probability must agree within 1e-4.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from framework import registry as registry_module
from framework.config import ServerArgs
from framework.forward_batch import ForwardBatch, ForwardMode
from framework.layers.attention import AttentionBackendArgs, RadixAttention
from framework.layers.attention.torch_native import TorchNativeAttnBackend
from framework.layers.embedding import VocabParallelEmbedding
from framework.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from framework.layers.rotary import RopeConfig, RotaryEmbedding
from framework.model_executor import model_runner as model_runner_module
from framework.model_executor.model_config import resolve_dtype
from framework.model_executor.model_runner import EXTRA_REQ_SLOTS, ModelRunner
from framework.models import resolve_architecture, supported_architectures
from framework.registry import Registry
from tests.model_fixtures import (
    TINY_VOCAB_SIZE,
    make_tiny_checkpoint,
    make_tiny_tokenizer,
    single_threaded_torch,
    tiny_config,
)

NEW_TOKENS = 32
LOGPROB_ATOL = 1e-4
PROMPTS = [
    "",
    "Hello",
    "The quick brown fox",
    "Prefill processes the prompt in one pass, then decode",
    "def add(a, b):\n    return a + b",
    "Numbers like 0123456789 and 3.14159 appear in text, tables and code, again and again.",
    "She sells sea shells",
    "Attention lets every token look at the tokens before it; the cache keeps their keys "
    "and values so that decoding does not recompute them.",
]
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0}
MODEL_CASES: list[tuple[str, dict[str, Any]]] = [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE}),
    ("llama", {"rope_parameters": LINEAR_ROPE, "attention_bias": True, "mlp_bias": True}),
    ("mistral", {}),
    ("qwen2", {}),
    ("qwen2", {"tie_word_embeddings": True}),
    ("qwen3", {}),
]



@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with single_threaded_torch():
        yield

def prompt_ids() -> list[list[int]]:
    tokenizer = make_tiny_tokenizer()
    return [tokenizer(text).input_ids for text in PROMPTS]


def make_runner(path: Path, **overrides: Any) -> ModelRunner:
    args = {"model_path": str(path), "device": "cpu", "max_running_requests": 12,
            "max_total_tokens": 1024, **overrides}
    return ModelRunner(ServerArgs(**args), str(path))


@dataclass
class Request:
    """A request as the scheduler tracks it: its row and the tokens in the KV cache."""

    row: int
    cached: list[int] = field(default_factory=list)


class Driver:
    """Allocates slots and builds ForwardBatches the way the scheduler does."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.req_pool = runner.pools.req_to_token_pool
        self.allocator = runner.pools.allocator

    def start(self, count: int) -> list[Request]:
        rows = self.req_pool.alloc(count)
        assert rows is not None
        return [Request(row) for row in rows]

    def place(self, request: Request, tokens: Sequence[int]) -> torch.Tensor:
        """Allocate KV slots for ``tokens`` after the request's cached ones."""
        start = len(request.cached)
        slots = self.allocator.alloc(len(tokens))
        assert slots is not None
        self.req_pool.req_to_token[request.row, start : start + len(tokens)] = slots
        request.cached.extend(tokens)
        return slots

    def extend(self, requests: list[Request], chunks: list[list[int]]) -> torch.Tensor:
        """One EXTEND step: each request's chunk goes on top of what it has cached."""
        return self._run(self.extend_batch(requests, chunks))

    def extend_batch(self, requests: list[Request], chunks: list[list[int]],
                     **fields: Any) -> ForwardBatch:
        """The EXTEND step of ``extend``, with any other ``ForwardBatch`` fields, not run."""
        prefix_lens = [len(r.cached) for r in requests]
        slots = [self.place(r, chunk) for r, chunk in zip(requests, chunks, strict=True)]
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=len(requests),
            input_ids=torch.tensor([t for chunk in chunks for t in chunk]),
            positions=torch.cat(
                [torch.arange(p, p + len(c)) for p, c in zip(prefix_lens, chunks, strict=True)]
            ),
            req_pool_indices=torch.tensor([r.row for r in requests]),
            seq_lens=torch.tensor([len(r.cached) for r in requests]),
            out_cache_loc=torch.cat(slots),
            extend_prefix_lens=torch.tensor(prefix_lens),
            extend_seq_lens=torch.tensor([len(c) for c in chunks]),
            extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=[len(c) for c in chunks],
            **fields,
        )

    def decode(self, requests: list[Request], tokens: list[int]) -> torch.Tensor:
        """One DECODE step: one new token per request."""
        positions = [len(r.cached) for r in requests]
        slots = [self.place(r, [t]) for r, t in zip(requests, tokens, strict=True)]
        batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=len(requests),
            input_ids=torch.tensor(tokens),
            positions=torch.tensor(positions),
            req_pool_indices=torch.tensor([r.row for r in requests]),
            seq_lens=torch.tensor([len(r.cached) for r in requests]),
            out_cache_loc=torch.cat(slots),
            seq_lens_cpu=[len(r.cached) for r in requests],
            req_pool_indices_cpu=[r.row for r in requests],
        )
        return self._run(batch)

    def _run(self, batch: ForwardBatch) -> torch.Tensor:
        logits = self.runner.forward(batch).next_token_logits
        assert logits is not None
        assert logits.shape == (batch.batch_size, self.runner.model_config.vocab_size)
        assert logits.dtype == torch.float32
        return logits

    def finish(self, requests: list[Request]) -> None:
        for request in requests:
            self.allocator.free(self.req_pool.req_to_token[request.row, : len(request.cached)])
            self.req_pool.free(request.row)


def greedy(
    driver: Driver, requests: list[Request], first_logits: torch.Tensor, steps: int
) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and their log-probabilities, ``steps`` per request."""
    tokens: list[list[int]] = [[] for _ in requests]
    logprobs: list[list[float]] = [[] for _ in requests]
    logits = first_logits
    for step in range(steps):
        chosen = logits.argmax(dim=-1)
        chosen_logprobs = logits.log_softmax(dim=-1).gather(1, chosen[:, None])[:, 0]
        for i in range(len(requests)):
            tokens[i].append(int(chosen[i]))
            logprobs[i].append(float(chosen_logprobs[i]))
        if step + 1 < steps:
            logits = driver.decode(requests, chosen.tolist())
    return tokens, logprobs


def assert_matches_transformers(
    hf_model: Any, prompt: list[int], tokens: list[int], logprobs: list[float]
) -> None:
    """Every token is transformers' argmax given the same prefix; logprobs agree."""
    sequence = torch.tensor([prompt + tokens[:-1]])
    with torch.no_grad():
        reference = hf_model(sequence).logits[0, len(prompt) - 1 :].float().log_softmax(-1)
    assert reference.argmax(dim=-1).tolist() == tokens
    expected = reference.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(
        torch.tensor(logprobs), expected, atol=LOGPROB_ATOL, rtol=0.0
    )


def load_hf(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def assert_all_slots_free(runner: ModelRunner) -> None:
    assert runner.pools.allocator.available_size() == runner.max_total_num_tokens
    assert runner.pools.req_to_token_pool.available_size() == runner.pools.req_to_token_pool.size


@pytest.mark.parametrize(("arch", "overrides"), MODEL_CASES)
def test_batched_greedy_generation_matches_transformers(
    tmp_path: Path, arch: str, overrides: dict[str, Any]
) -> None:
    path = make_tiny_checkpoint(tmp_path, arch, **overrides)
    assert_batched_greedy_matches(path, make_runner(path), NEW_TOKENS)


def assert_batched_greedy_matches(path: Path, runner: ModelRunner, new_tokens: int,
                                  window: int | None = None) -> None:
    """One EXTEND of ``prompt_ids()`` (all of different lengths; with ``window``, most of
    them longer), then greedy DECODE steps: every token and logprob is transformers'."""
    driver = Driver(runner)
    prompts = prompt_ids()
    assert len({len(p) for p in prompts}) == len(prompts), "prompt lengths must all differ"
    if window is not None:
        assert sum(len(p) > window for p in prompts) >= 4, "most prompts must outgrow the window"
    requests = driver.start(len(prompts))
    tokens, logprobs = greedy(driver, requests, driver.extend(requests, prompts), new_tokens)
    hf_model = load_hf(path)
    for prompt, request_tokens, request_logprobs in zip(prompts, tokens, logprobs, strict=True):
        assert_matches_transformers(hf_model, prompt, request_tokens, request_logprobs)
    driver.finish(requests)
    assert_all_slots_free(runner)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefill_in_chunks_over_a_cached_prefix_matches_transformers(
    tmp_path: Path, arch: str
) -> None:
    path = make_tiny_checkpoint(tmp_path, arch)
    runner = make_runner(path)
    driver = Driver(runner)
    prompts = prompt_ids()
    chunked, whole = prompts[7], prompts[3]
    split = 9
    first, second = driver.start(2)
    driver.extend([first], [chunked[:split]])
    # The second EXTEND mixes a request with a cached prefix and a fresh one.
    logits = driver.extend([first, second], [chunked[split:], whole])
    tokens, logprobs = greedy(driver, [first, second], logits, 8)
    hf_model = load_hf(path)
    assert_matches_transformers(hf_model, chunked, tokens[0], logprobs[0])
    assert_matches_transformers(hf_model, whole, tokens[1], logprobs[1])
    driver.finish([first, second])
    assert_all_slots_free(runner)


def test_the_last_layer_answers_only_the_rows_that_make_logits(tmp_path: Path) -> None:
    """A prefill caches every token's keys and values, but only last tokens make logits.

    Earlier layers compute every row; the last one attends for, projects and runs
    its MLP on only the rows the head reads (as does the final norm), and the
    logits still match transformers.
    """
    path = make_tiny_checkpoint(tmp_path, "llama")
    runner = make_runner(path)
    layers = runner.model.model.layers
    seen: dict[str, list[int]] = {"attention": [], "o_proj": [], "mlp": []}

    def record(name: str) -> Any:
        return lambda _module, args, output: seen[name].append(
            (output if name == "attention" else args[0]).shape[0])

    hooks = [module.register_forward_hook(record(name)) for layer in layers
             for name, module in (("attention", layer.self_attn.attn),
                                  ("o_proj", layer.self_attn.o_proj), ("mlp", layer.mlp))]
    driver = Driver(runner)
    prompts = prompt_ids()[2:6]
    requests = driver.start(len(prompts))
    logits = driver.extend(requests, prompts)
    every, last = sum(map(len, prompts)), len(prompts)
    assert seen == {name: [every] * (len(layers) - 1) + [last] for name in seen}
    for rows in seen.values():
        rows.clear()
    tokens, logprobs = greedy(driver, requests, logits, 3)
    # Decode: every row is a last token.
    assert seen == {name: [last] * len(layers) * 2 for name in seen}
    for hook in hooks:
        hook.remove()
    hf_model = load_hf(path)
    for prompt, request_tokens, request_logprobs in zip(prompts, tokens, logprobs, strict=True):
        assert_matches_transformers(hf_model, prompt, request_tokens, request_logprobs)
    driver.finish(requests)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize(("arch", "overrides"), [
    ("llama", {}),
    ("qwen3", {"num_attention_heads": 4, "num_key_value_heads": 1}),
])
def test_random_steps_with_prompt_logprob_rows_match_transformers(
        tmp_path: Path, backend: str, arch: str, overrides: dict[str, Any]) -> None:
    """Every logits row of random EXTEND steps is transformers' at its position.

    Steps mix fresh prompts, chunks over cached tokens and one-token requests at the
    tail (a mixed step), and ask for prompt rows anywhere (out of order, repeated):
    the last layer then answers more than each request's last row, on both backends.
    """
    import random

    rng = random.Random(7)
    path = make_tiny_checkpoint(tmp_path, arch, **overrides)
    driver = Driver(make_runner(path, attention_backend=backend))
    requests = driver.start(5)
    # (request, position) of every logits row computed, with the row's log-probabilities.
    rows_seen: list[tuple[Request, int, torch.Tensor]] = []
    few_and_many = 0
    for step in range(10):
        cached = [r for r in requests if r.cached]
        tail = rng.sample(cached, rng.randint(0, len(cached)))
        head = [r for r in requests if r not in tail and rng.random() < 0.7] or \
            [r for r in requests if r not in tail][:1]
        order = head + tail
        chunks = [[rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(
            1 if r in tail else rng.choice([1, 2, 5, 9, 17]))] for r in order]
        positions = [(r, len(r.cached) + i) for r, chunk in zip(order, chunks, strict=True)
                     for i in range(len(chunk))]
        # Few prompt rows on even steps, most of them on odd ones (a prompt's logprobs).
        wanted = rng.randint(0, 3) if step % 2 == 0 else len(positions)
        prompt_rows = [rng.randrange(len(positions)) for _ in range(wanted)]
        batch = driver.extend_batch(
            order, chunks, decode_tail=len(tail),
            prompt_logprob_rows=torch.tensor(prompt_rows) if prompt_rows else None)
        output = driver.runner.forward(batch)
        logits = output.next_token_logits
        if prompt_rows:
            assert output.prompt_logits is not None
            logits = torch.cat([logits, output.prompt_logits])
        last_rows = (torch.tensor([len(c) for c in chunks]).cumsum(0) - 1).tolist()
        for row, row_logits in zip(last_rows + prompt_rows, logits, strict=True):
            rows_seen.append((*positions[row], row_logits.double().log_softmax(-1)))
        few_and_many += bool(prompt_rows)
    assert few_and_many >= 6
    hf_model = load_hf(path, torch.float64)
    for request in requests:
        with torch.no_grad():
            reference = hf_model(torch.tensor([request.cached])).logits[0].log_softmax(-1)
        for owner, position, logprobs in rows_seen:
            if owner is request:
                torch.testing.assert_close(logprobs, reference[position], atol=LOGPROB_ATOL,
                                           rtol=0.0)
    driver.finish(requests)
    assert_all_slots_free(driver.runner)


def test_decoder_served_as_embedding_model_pools_the_last_token(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "qwen3")
    runner = make_runner(path, is_embedding=True)
    driver = Driver(runner)
    prompts = prompt_ids()[1:5]
    requests = driver.start(len(prompts))
    lens = [len(p) for p in prompts]
    batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(prompts),
        input_ids=torch.tensor([t for p in prompts for t in p]),
        positions=torch.cat([torch.arange(n) for n in lens]),
        req_pool_indices=torch.tensor([r.row for r in requests]),
        seq_lens=torch.tensor(lens),
        out_cache_loc=torch.cat([driver.place(r, p) for r, p in zip(requests, prompts,
                                                                     strict=True)]),
        extend_prefix_lens=torch.zeros(len(prompts), dtype=torch.int64),
        extend_seq_lens=torch.tensor(lens),
    )
    output = runner.forward(batch)
    assert output.next_token_logits is None and output.embeddings is not None
    hf_model = load_hf(path)
    for prompt, embedding in zip(prompts, output.embeddings, strict=True):
        with torch.no_grad():
            hidden = hf_model.model(torch.tensor([prompt])).last_hidden_state[0, -1]
        torch.testing.assert_close(embedding, F.normalize(hidden, dim=-1), atol=1e-5, rtol=1e-5)


def test_bert_runs_through_model_runner_as_an_embedding_model(tmp_path: Path) -> None:
    from transformers import BertModel

    path = make_tiny_checkpoint(tmp_path, "bert")
    runner = make_runner(path)
    assert runner.model_config.is_embedding
    ids = [[1, 40, 41, 42, 2], [1, 50, 2]]
    batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=2,
        input_ids=torch.tensor(ids[0] + ids[1]),
        positions=torch.tensor([0, 1, 2, 3, 4, 0, 1, 2]),
        req_pool_indices=torch.tensor([0, 1]),
        seq_lens=torch.tensor([5, 3]),
        out_cache_loc=torch.arange(1, 9),
        extend_prefix_lens=torch.zeros(2, dtype=torch.int64),
        extend_seq_lens=torch.tensor([5, 3]),
    )
    output = runner.forward(batch)
    assert output.next_token_logits is None and output.embeddings is not None
    hf_model = BertModel.from_pretrained(path).eval()
    for request_ids, embedding in zip(ids, output.embeddings, strict=True):
        with torch.no_grad():
            states = hf_model(torch.tensor([request_ids])).last_hidden_state[0]
        expected = F.normalize(states.mean(dim=0), dim=-1)  # default: mean pooling, normalized
        torch.testing.assert_close(embedding, expected, atol=1e-5, rtol=1e-5)


def first_step_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    driver = Driver(runner)
    requests = driver.start(1)
    logits = driver.extend(requests, [prompt])
    driver.finish(requests)
    return logits[0]


def test_sharded_checkpoint_loads_the_same_weights(tmp_path: Path) -> None:
    single = make_tiny_checkpoint(tmp_path, "llama", seed=3)
    sharded = make_tiny_checkpoint(tmp_path, "llama", seed=3, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    prompt = prompt_ids()[2]
    torch.testing.assert_close(
        first_step_logits(make_runner(sharded), prompt),
        first_step_logits(make_runner(single), prompt),
        atol=0.0,
        rtol=0.0,
    )


def test_bfloat16_checkpoint_runs_in_bfloat16_under_auto_dtype(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "qwen2", dtype=torch.bfloat16)
    runner = make_runner(path)
    assert runner.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in runner.model.parameters())
    assert runner.pools.token_to_kv_pool.get_kv_buffer(0)[0].dtype == torch.bfloat16
    prompt = prompt_ids()[3]
    ours = first_step_logits(runner, prompt).log_softmax(-1)
    with torch.no_grad():
        reference = load_hf(path, torch.bfloat16)(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(ours, reference.float().log_softmax(-1), atol=0.1, rtol=0.0)


def test_auto_dtype_follows_the_config_but_avoids_float16_on_cpu() -> None:
    from transformers import LlamaConfig

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", LlamaConfig(dtype="bfloat16"), cpu) == torch.bfloat16
    assert resolve_dtype("auto", LlamaConfig(dtype="float16"), cpu) == torch.float32
    assert resolve_dtype("auto", LlamaConfig(dtype="float16"), cuda) == torch.float16
    assert resolve_dtype("auto", LlamaConfig(), cpu) == torch.float32
    assert resolve_dtype("float16", LlamaConfig(dtype="float32"), cpu) == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("float64", LlamaConfig(), cpu)


def test_dummy_weights_need_only_a_config_and_are_seeded(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama")
    for weights in path.glob("*.safetensors"):
        weights.unlink()
    prompt = prompt_ids()[2]
    first = first_step_logits(make_runner(path, load_format="dummy", random_seed=5), prompt)
    again = first_step_logits(make_runner(path, load_format="dummy", random_seed=5), prompt)
    other = first_step_logits(make_runner(path, load_format="dummy", random_seed=6), prompt)
    assert torch.isfinite(first).all()
    torch.testing.assert_close(first, again, atol=0.0, rtol=0.0)
    assert not torch.equal(first, other)


def test_pools_default_to_the_cpu_size_rule(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama")
    runner = make_runner(path, max_total_tokens=None, max_running_requests=3)
    context_len = runner.model_config.context_len
    assert runner.max_total_num_tokens == min(context_len * 3, 2**16)
    assert runner.pools.req_to_token_pool.req_to_token.shape[1] == context_len
    assert runner.pools.req_to_token_pool.size >= 3
    assert runner.pools.allocator.size == runner.pools.token_to_kv_pool.size
    assert runner.pools.allocator.size == runner.max_total_num_tokens
    assert runner.model_config.eos_token_ids == {2}


class RecordingBackend(TorchNativeAttnBackend):
    """The torch backend, recording what it is built with and how often it prepares a batch."""

    built: ClassVar[list[AttentionBackendArgs]] = []

    def __init__(self, args: AttentionBackendArgs) -> None:
        super().__init__(args)
        RecordingBackend.built.append(args)
        self.prepared = 0

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self.prepared += 1
        super().init_forward_metadata(forward_batch)


def test_attention_backend_is_built_once_with_the_pools_and_bounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama")
    prompt = prompt_ids()[2]
    # The recording backend is the torch one: bit for bit the same logits.
    reference = first_step_logits(make_runner(path, attention_backend="torch"), prompt)
    # A registry of its own, so that the test name does not outlive the test.
    registry: Registry[Any] = Registry("attention backend", "framework.attention_backends")
    registry.register("test-recording", RecordingBackend, source="tests")
    monkeypatch.setattr(model_runner_module, "ATTENTION_BACKENDS", registry)
    monkeypatch.setattr(registry_module, "ATTENTION_BACKENDS", registry)  # the flag's check
    monkeypatch.setattr(RecordingBackend, "built", [])

    runner = make_runner(path, attention_backend="test-recording", max_running_requests=5)
    assert len(RecordingBackend.built) == 1
    args = RecordingBackend.built[0]
    backend = runner.attn_backend
    assert isinstance(backend, RecordingBackend) and backend.args is args
    assert args.req_to_token_pool is runner.pools.req_to_token_pool
    assert args.token_to_kv_pool is runner.pools.token_to_kv_pool
    assert args.max_batch_size == runner.pools.req_to_token_pool.size == 5 + EXTRA_REQ_SLOTS
    assert args.context_len == runner.model_config.context_len
    assert (args.dtype, args.device) == (runner.dtype, runner.device)
    config = runner.model_config
    assert (args.num_heads, args.num_kv_heads, args.head_dim) == (
        config.num_heads_per_rank(1), config.num_kv_heads_per_rank(1), config.head_dim
    )
    layers = [m for m in runner.model.modules() if isinstance(m, RadixAttention)]
    assert len(layers) == config.num_layers
    assert all(layer.attn_backend is backend for layer in layers)

    ours = first_step_logits(runner, prompt)
    assert backend.prepared == 1, "init_forward_metadata runs once per step, not per layer"
    assert len(RecordingBackend.built) == 1, "the backend is built once, not per step"
    torch.testing.assert_close(ours, reference, atol=0.0, rtol=0.0)


def test_a_sliding_window_limits_attention_not_the_context(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "mistral", sliding_window=100)
    runner = make_runner(path)
    assert runner.model_config.context_len == 256  # the fixture's max_position_embeddings
    windows = {m.sliding_window for m in runner.model.modules() if isinstance(m, RadixAttention)}
    assert windows == {100}


def write_config(path: Path, **changes: Any) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_missing_or_malformed_model_directories_raise_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        make_runner(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no config\.json"):
        make_runner(tmp_path / "empty")
    no_weights = make_tiny_checkpoint(tmp_path, "llama", name="no-weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors files"):
        make_runner(no_weights)
    bad_index = make_tiny_checkpoint(tmp_path, "llama", name="bad-index", max_shard_size="40KB")
    (bad_index / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError, match="malformed"):
        make_runner(bad_index)
    bad_config = make_tiny_checkpoint(tmp_path, "llama", name="bad-config")
    (bad_config / "config.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read") as info:
        make_runner(bad_config)
    assert "\n" not in str(info.value)


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama")
    write_config(path, architectures=["FancyForCausalLM"])
    with pytest.raises(ValueError, match="FancyForCausalLM") as info:
        make_runner(path)
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM", "BertModel"):
        assert name in str(info.value)
        assert name in supported_architectures()
    assert resolve_architecture(["Foo", "Qwen2ForCausalLM"]) == "Qwen2ForCausalLM"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_is_bit_for_bit_transformers_rotate_half(dtype: torch.dtype) -> None:
    """Queries and keys given as column slices of one qkv tensor, as the model passes them."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    heads, kv_heads, head_dim, rows = 4, 2, 64, 37
    rope = RotaryEmbedding(head_dim, RopeConfig(theta=10000.0))
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    positions = torch.randint(0, 4096, (rows,), generator=generator)
    rotated_q, rotated_k = rope(positions, q, k)

    angles = positions.float()[:, None] * rope.inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    expected_q, expected_k = apply_rotary_pos_emb(
        q.reshape(rows, heads, head_dim).transpose(0, 1),
        k.reshape(rows, kv_heads, head_dim).transpose(0, 1),
        angles.cos().to(dtype), angles.sin().to(dtype), unsqueeze_dim=0)
    assert torch.equal(rotated_q, expected_q.transpose(0, 1).reshape(rows, -1))
    assert torch.equal(rotated_k, expected_k.transpose(0, 1).reshape(rows, -1))


def test_unsupported_rope_type_is_rejected() -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(rope_parameters={"rope_type": "yarn", "factor": 2.0,
                                          "rope_theta": 1e4})
    with pytest.raises(ValueError, match="yarn"):
        RopeConfig.from_hf_config(config)


def test_update_weights_from_disk_swaps_weights_or_keeps_the_old_ones(tmp_path: Path) -> None:
    original = make_tiny_checkpoint(tmp_path, "qwen2", seed=0)
    runner = make_runner(original)
    prompt = prompt_ids()[4]
    before = first_step_logits(runner, prompt)

    different_shape = make_tiny_checkpoint(tmp_path, "qwen2", intermediate_size=96)
    ok, message = runner.update_weights_from_disk(str(different_shape))
    assert not ok and "intermediate_size" in message

    incomplete = make_tiny_checkpoint(tmp_path, "qwen2", seed=1, name="incomplete")
    tensors = load_file(incomplete / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, incomplete / "model.safetensors", metadata={"format": "pt"})
    ok, message = runner.update_weights_from_disk(str(incomplete))
    assert not ok and "qkv_proj.bias[k]" in message, message

    ok, message = runner.update_weights_from_disk(str(tmp_path / "nowhere"))
    assert not ok and "does not exist" in message
    torch.testing.assert_close(first_step_logits(runner, prompt), before, atol=0.0, rtol=0.0)

    retrained = make_tiny_checkpoint(tmp_path, "qwen2", seed=1)
    ok, message = runner.update_weights_from_disk(str(retrained))
    assert ok, message
    with torch.no_grad():
        expected = load_hf(retrained)(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(first_step_logits(runner, prompt), expected, atol=1e-4, rtol=0.0)
    assert_all_slots_free(runner)


# --------------------------------------------------------------- tensor-parallel slicing


def test_qkv_weight_loader_gives_each_rank_its_heads() -> None:
    hidden, head_dim, heads, kv_heads = 8, 2, 4, 2
    q = torch.randn(heads * head_dim, hidden)
    k = torch.randn(kv_heads * head_dim, hidden)
    v = torch.randn(kv_heads * head_dim, hidden)
    for tp_size in (1, 2, 4):
        for rank in range(tp_size):
            layer = QKVParallelLinear(hidden, head_dim, heads, kv_heads, tp_rank=rank,
                                      tp_size=tp_size)
            for shard_id, tensor in (("q", q), ("k", k), ("v", v)):
                layer.weight_loader(layer.weight, tensor, shard_id)
            q_rows = heads * head_dim // tp_size
            kv_head = rank * kv_heads // tp_size  # replicated when tp_size > kv_heads
            kv_rows = max(1, kv_heads // tp_size) * head_dim
            expected = torch.cat([
                q[rank * q_rows : (rank + 1) * q_rows],
                k[kv_head * head_dim : kv_head * head_dim + kv_rows],
                v[kv_head * head_dim : kv_head * head_dim + kv_rows],
            ])
            assert torch.equal(layer.weight, expected), (tp_size, rank)


def test_column_and_row_parallel_parts_recombine_to_the_full_layer() -> None:
    x = torch.randn(3, 8)
    gate, up, down = torch.randn(6, 8), torch.randn(6, 8), torch.randn(8, 6)
    full = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    partial_sums = torch.zeros_like(full)
    for rank in range(2):
        gate_up = MergedColumnParallelLinear(8, [6, 6], tp_rank=rank, tp_size=2)
        gate_up.weight_loader(gate_up.weight, gate, 0)
        gate_up.weight_loader(gate_up.weight, up, 1)
        down_layer = RowParallelLinear(6, 8, tp_rank=rank, tp_size=2)
        down_layer.weight_loader(down_layer.weight, down)
        local_gate, local_up = gate_up(x).chunk(2, dim=-1)
        # The all-reduce of RowParallelLinear, done by hand.
        partial_sums += F.linear(F.silu(local_gate) * local_up, down_layer.weight)
    torch.testing.assert_close(partial_sums, full)
    column = ColumnParallelLinear(8, 6, bias=True, tp_rank=1, tp_size=2)
    bias = torch.randn(6)
    column.weight_loader(column.bias, bias)
    assert torch.equal(column.bias, bias[3:])
    with pytest.raises(ValueError, match="shape"):
        column.weight_loader(column.weight, torch.randn(6, 7))


def test_vocab_parallel_embedding_pads_the_last_rank() -> None:
    table = torch.randn(5, 4)
    parts = []
    for rank in range(2):
        embedding = VocabParallelEmbedding(5, 4, tp_rank=rank, tp_size=2)
        embedding.weight_loader(embedding.weight, table)
        parts.append(embedding.weight)
    assert torch.equal(torch.cat(parts)[:5], table)
    assert not parts[1][2:].any(), "padding rows must be zero"
    with pytest.raises(NotImplementedError):
        VocabParallelEmbedding(5, 4, tp_rank=0, tp_size=2)(torch.tensor([0]))


def test_the_model_forward_makes_no_host_sync(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``item``, ``tolist`` and the scalar conversions raising, a prefill and a decode run.

    On CUDA either call waits for the device; the forward must not need one.
    """
    runner = make_runner(make_tiny_checkpoint(tmp_path, "llama", seed=3))
    driver = Driver(runner)
    requests = driver.start(2)
    driver.extend(requests, [[5, 6, 7], [8, 9]])

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("a host sync in the model forward")

    for conversion in ("item", "tolist", "__int__", "__index__", "__bool__", "__float__"):
        monkeypatch.setattr(torch.Tensor, conversion, refuse)
    prefix_lens = [len(r.cached) for r in requests]
    chunks = [[10, 11, 12, 13], [14]]
    slots = [driver.place(r, chunk) for r, chunk in zip(requests, chunks, strict=True)]
    seq_lens = [len(r.cached) for r in requests]
    extend = ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=2,
        input_ids=torch.tensor([t for chunk in chunks for t in chunk]),
        positions=torch.tensor([3, 4, 5, 6, 2]),
        req_pool_indices=torch.tensor([r.row for r in requests]),
        seq_lens=torch.tensor(seq_lens), out_cache_loc=torch.cat(slots),
        extend_prefix_lens=torch.tensor(prefix_lens), extend_seq_lens=torch.tensor([4, 1]),
        seq_lens_cpu=seq_lens, extend_prefix_lens_cpu=prefix_lens, extend_seq_lens_cpu=[4, 1],
        req_pool_indices_cpu=[r.row for r in requests],
    )
    assert runner.forward(extend).next_token_logits is not None
    assert driver.decode(requests, [15, 16]) is not None


def test_layers_share_one_rotary_embedding_that_computes_a_step_s_angles_once() -> None:
    from framework.models.llama import LlamaForCausalLM, LlamaModel

    config = tiny_config("llama")
    model = LlamaModel(config, LlamaForCausalLM.attention_options(config), tp_rank=0, tp_size=1)
    ropes = {id(layer.self_attn.rotary_emb) for layer in model.layers}
    assert len(ropes) == 1 and config.num_hidden_layers > 1
    rope = model.layers[0].self_attn.rotary_emb
    positions = torch.tensor([0, 5, 9])
    cos, sin = rope.cos_sin(positions, torch.float32)
    again = rope.cos_sin(positions, torch.float32)
    assert again[0] is cos and again[1] is sin  # the next layer of the step
    positions += 1  # changed in place: new angles
    moved, _ = rope.cos_sin(positions, torch.float32)
    assert moved is not cos
    assert torch.equal(moved, rope.cos_sin(torch.tensor([1, 6, 10]), torch.float32)[0])
    assert not torch.equal(moved, cos)
    with torch.inference_mode():  # positions made there keep no version counter
        made_inside = torch.tensor([2, 3])
        first, _ = rope.cos_sin(made_inside, torch.float32)
        assert rope.cos_sin(made_inside, torch.float32)[0] is first
