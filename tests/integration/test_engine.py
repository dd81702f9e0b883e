"""The offline Engine: the real Scheduler, Detokenizer and TokenizerManager in one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from framework import Engine
from framework.sampling_params import SamplingParams
from tests.model_fixtures import (
    make_tiny_checkpoint,
    minilm_checkpoint,
    reference_sentence_embeddings,
    transformers_greedy,
)

PROMPTS = [
    "hello",
    "the quick brown fox jumps over the lazy dog",
    "a",
    "one two three four five six seven eight nine ten eleven twelve",
    "serving systems batch requests of different lengths together",
    "def add(a, b):",
    "x y",
    "the cache holds keys and values for every layer of the model, page by page",
]
NEW_TOKENS = 32
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
# For the tests of what the Scheduler and the model compute rather than of the launch: the
# components as threads of this process, which start in a fraction of a second instead of
# seconds of imports. The module's shared Engine, the launch tests and every server test
# run them as processes.
IN_THREADS = {"launch_mode": "thread"}


@pytest.mark.parametrize("overlap", ["off", "on"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_batched_greedy_matches_transformers(arch: str, overlap: str, tmp_path: Path) -> None:
    model_dir = make_tiny_checkpoint(tmp_path, arch, seed=3)
    with Engine(model_path=str(model_dir), chunked_prefill_size=64, overlap_schedule=overlap,
                **IN_THREADS) as engine:
        outputs = engine.generate(PROMPTS, GREEDY, return_logprob=True,
                                  return_text_in_logprobs=True)
        assert engine.get_server_info()["kv_cache_idle_and_free"] is True
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    for prompt, out in zip(PROMPTS, outputs):
        ref_ids, ref_logprobs = transformers_greedy(model.eval(), tokenizer.encode(prompt),
                                                    NEW_TOKENS)
        assert out["output_ids"] == ref_ids, prompt
        entries = out["meta_info"]["output_token_logprobs"]
        assert np.allclose([lp for lp, _, _ in entries], ref_logprobs, atol=1e-4, rtol=0)
        # Each entry names its token and carries the token's text, decoded alone.
        assert [(tid, text) for _, tid, text in entries] == [
            (tid, tokenizer.decode([tid])) for tid in ref_ids], prompt
        assert out["meta_info"]["completion_tokens"] == NEW_TOKENS
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": NEW_TOKENS}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=5)


@pytest.fixture(scope="module")
def engine(llama_dir: Path) -> Any:
    with Engine(model_path=str(llama_dir)) as eng:
        yield eng


@pytest.fixture(scope="module")
def reference(engine: Engine) -> list[dict[str, Any]]:
    return engine.generate(PROMPTS, GREEDY)


def test_prompts_are_prefilled_together_then_decoded_together(llama_dir: Path) -> None:
    with Engine(model_path=str(llama_dir), **IN_THREADS) as eng:
        eng.generate(PROMPTS, GREEDY)
        info = eng.get_server_info()
    # A prefill step takes every prompt that has arrived (the first step may see only some),
    # then the batch decodes one token per request per step: about NEW_TOKENS decode steps in
    # all, not one per request and token.
    assert 1 <= info["extend_steps"] <= len(PROMPTS)
    assert NEW_TOKENS - 1 <= info["decode_steps"] <= NEW_TOKENS - 1 + info["extend_steps"]


def test_single_prompt_returns_a_dict(engine: Engine, reference: list) -> None:
    out = engine.generate(PROMPTS[1], GREEDY)
    assert isinstance(out, dict)
    assert out["output_ids"] == reference[1]["output_ids"]
    assert out["text"] == reference[1]["text"]
    assert out["meta_info"]["prompt_tokens"] == reference[1]["meta_info"]["prompt_tokens"]


def test_input_ids_are_accepted(engine: Engine, reference: list) -> None:
    ids = engine.tokenizer_manager.tokenizer.encode(PROMPTS[3])
    out = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert out["output_ids"] == reference[3]["output_ids"]


@pytest.mark.parametrize("chunk", [3, 7])
def test_chunked_prefill_gives_the_same_tokens(llama_dir: Path, reference: list,
                                               chunk: int) -> None:
    with Engine(model_path=str(llama_dir), chunked_prefill_size=chunk, **IN_THREADS) as eng:
        outputs = eng.generate(PROMPTS, GREEDY)
        assert eng.get_server_info()["kv_cache_idle_and_free"] is True
    assert [o["output_ids"] for o in outputs] == [r["output_ids"] for r in reference]


def test_retraction_under_memory_pressure_gives_the_same_tokens(llama_dir: Path,
                                                                reference: list) -> None:
    # Too little KV cache for all eight requests at full length: some are retracted
    # and prefilled again later.
    with Engine(model_path=str(llama_dir), max_total_tokens=160, **IN_THREADS) as eng:
        outputs = eng.generate(PROMPTS, GREEDY)
        info = eng.get_server_info()
    assert [o["output_ids"] for o in outputs] == [r["output_ids"] for r in reference]
    assert info["kv_cache_idle_and_free"] is True


def test_requests_join_and_leave_the_running_batch(engine: Engine, reference: list) -> None:
    lengths = [1, 5, 32, 9, 17, 2, 32, 12]
    params = [{**GREEDY, "max_new_tokens": n} for n in lengths]
    outputs = engine.generate(PROMPTS, params)
    for out, ref, n in zip(outputs, reference, lengths):
        assert out["output_ids"] == ref["output_ids"][:n]
        assert out["meta_info"]["completion_tokens"] == n
    assert engine.get_server_info()["kv_cache_idle_and_free"] is True


def test_same_seed_same_tokens_also_inside_a_batch(engine: Engine) -> None:
    sampled = {"temperature": 1.0, "max_new_tokens": 24, "seed": 1234, "ignore_eos": True}
    alone = engine.generate(PROMPTS[4], sampled)
    batch = engine.generate(PROMPTS, [sampled if i == 4 else {**sampled, "seed": i}
                                      for i in range(len(PROMPTS))])
    assert batch[4]["output_ids"] == alone["output_ids"]
    other_seed = engine.generate(PROMPTS[4], {**sampled, "seed": 99})
    assert other_seed["output_ids"] != alone["output_ids"]


def test_per_request_params_in_one_batch_are_each_honoured(engine: Engine,
                                                           reference: list) -> None:
    prompt = PROMPTS[1]
    greedy_ref = reference[1]["output_ids"][:16]
    params = [
        {"top_k": 1, "temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True, "seed": s}
        for s in range(4)
    ] + [
        {"temperature": 5.0, "max_new_tokens": 16, "ignore_eos": True, "seed": s}
        for s in range(4)
    ]
    outputs = engine.generate([prompt] * 8, params)
    for out in outputs[:4]:  # top_k=1 is greedy whatever the seed
        assert out["output_ids"] == greedy_ref
    hot = {tuple(o["output_ids"]) for o in outputs[4:]}
    assert len(hot) == 4  # high temperature with different seeds: all different
    assert tuple(greedy_ref) not in hot


def test_stop_strings_and_stop_token_ids(engine: Engine, reference: list) -> None:
    ref = reference[3]
    text, ids = ref["text"], ref["output_ids"]
    stop_id = ids[5]
    out = engine.generate(PROMPTS[3], {**GREEDY, "stop_token_ids": [stop_id]})
    first = ids.index(stop_id)
    assert out["output_ids"] == ids[:first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    stop = text[len(text) // 2: len(text) // 2 + 2]
    if stop.strip():
        out = engine.generate(PROMPTS[3], {**GREEDY, "stop": [stop]})
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert out["text"] == text[:text.index(stop)]


def test_eos_ends_generation_unless_ignored(reference: list, tmp_path: Path) -> None:
    # The same weights (same seed and shapes) with the EOS id set to a token that greedy
    # decoding produces: generation must stop right there, unless ignore_eos.
    ids = reference[1]["output_ids"]
    eos = ids[4]
    model_dir = make_tiny_checkpoint(tmp_path, "llama", seed=5, eos_token_id=eos)
    with Engine(model_path=str(model_dir), **IN_THREADS) as eng:
        stopped = eng.generate(PROMPTS[1], {**GREEDY, "ignore_eos": False})
        ignored = eng.generate(PROMPTS[1], GREEDY)
        held = eng.generate(PROMPTS[1], {**GREEDY, "ignore_eos": False,
                                         "min_new_tokens": ids.index(eos) + 2})
    assert stopped["output_ids"] == ids[:ids.index(eos) + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert ignored["output_ids"] == ids
    assert eos not in held["output_ids"][:ids.index(eos) + 2]


def test_max_new_tokens_zero_and_min_new_tokens(engine: Engine) -> None:
    out = engine.generate(PROMPTS[2], {"max_new_tokens": 0})
    assert out["output_ids"] == []
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    out = engine.generate(PROMPTS[2], {"temperature": 0, "max_new_tokens": 6,
                                       "min_new_tokens": 6})
    assert out["meta_info"]["completion_tokens"] == 6


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_new_tokens": -2}, "max_new_tokens"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
    ],
)
def test_bad_sampling_params_raise_value_error_naming_the_field(
    engine: Engine, params: dict, field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        engine.generate(PROMPTS[0], params)


def test_bad_prompts_are_value_errors(engine: Engine) -> None:
    with pytest.raises(ValueError, match="context length"):
        engine.generate(input_ids=[5] * 5000, sampling_params=GREEDY)
    with pytest.raises(ValueError, match="exactly one"):
        engine.generate()
    # Checked at the edge, against the vocabulary the Scheduler reported at start-up.
    with pytest.raises(ValueError, match=r"input_ids must hold integer token ids in \[0, 512\)"):
        engine.generate(input_ids=[100000], sampling_params=GREEDY)
    assert engine.get_server_info()["kv_cache_idle_and_free"] is True


def test_generation_model_refuses_embeddings(engine: Engine) -> None:
    before = engine.get_server_info()
    with pytest.raises(ValueError, match="generation model; it does not serve embeddings"):
        engine.encode("hello")
    with pytest.raises(ValueError, match="generation model"):
        engine.encode(["hello", "world"])
    # Refused before anything is sent: the Scheduler never saw them.
    assert engine.get_server_info()["extend_steps"] == before["extend_steps"]


def test_embedding_model_refuses_generation() -> None:
    with Engine(model_path=str(minilm_checkpoint()), **IN_THREADS) as engine:
        for stream in (False, True):
            with pytest.raises(ValueError, match="embedding model"):
                engine.generate("hello", {"max_new_tokens": 2}, stream=stream)
        assert engine.get_server_info()["extend_steps"] == 0


SAMPLED = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True}


def test_n_fans_out_into_seeded_choices_prompt_major(engine: Engine) -> None:
    outs = engine.generate(PROMPTS[:2], {**SAMPLED, "n": 2, "seed": 7})
    assert isinstance(outs, list) and len(outs) == 4
    # Choice c of prompt p is at p * n + c and samples with seed + c, as /generate does.
    for p in range(2):
        for c in range(2):
            alone = engine.generate(PROMPTS[p], {**SAMPLED, "seed": 7 + c})
            assert outs[p * 2 + c]["output_ids"] == alone["output_ids"]
    # One prompt with n > 1 is a list too.
    single = engine.generate(PROMPTS[0], {**SAMPLED, "n": 2, "seed": 7})
    assert [o["output_ids"] for o in single] == [o["output_ids"] for o in outs[:2]]


def test_n_streams_every_choice_with_its_index(engine: Engine) -> None:
    full = engine.generate(PROMPTS[0], {**SAMPLED, "n": 3, "seed": 11})
    chunks = list(engine.generate(PROMPTS[0], {**SAMPLED, "n": 3, "seed": 11}, stream=True))
    for index in range(3):
        mine = [c for c in chunks if c["index"] == index]
        assert [i for c in mine for i in c["output_ids"]] == full[index]["output_ids"]
        assert mine[-1]["meta_info"]["finish_reason"] is not None


def test_sampling_params_must_be_dicts_or_sampling_params(engine: Engine) -> None:
    with pytest.raises(ValueError, match="sampling_params must be a dict, a SamplingParams"):
        engine.generate(PROMPTS[0], "notadict")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="each sampling_params entry must be a dict"):
        engine.generate(PROMPTS[:2], [GREEDY, "x"])  # type: ignore[list-item]
    # A SamplingParams is taken as the dict of the same values.
    as_object = engine.generate(PROMPTS[1], SamplingParams(**GREEDY))
    assert as_object["output_ids"] == engine.generate(PROMPTS[1], GREEDY)["output_ids"]


def test_minilm_embeddings_match_transformers() -> None:
    model_dir = minilm_checkpoint()
    texts = ["A man is eating food.", "hello", "The quick brown fox jumps over the lazy dog.",
             "Embeddings map sentences to vectors of the same length for any input size."]
    with Engine(model_path=str(model_dir), **IN_THREADS) as engine:
        got = engine.encode(texts)
        single = engine.encode(texts[1])
        assert engine.get_server_info()["kv_cache_idle_and_free"] is True
    ref = reference_sentence_embeddings(model_dir, texts)
    for vec, want in zip(got, ref):
        assert vec.shape == want.shape
        cosine = float(np.dot(vec, want) / np.linalg.norm(vec) / np.linalg.norm(want))
        assert cosine > 0.9999
    assert np.allclose(single, got[1], atol=1e-5)


def test_non_integer_input_ids_are_refused_before_the_scheduler(engine: Engine) -> None:
    with pytest.raises(ValueError, match="integer token ids"):
        engine.generate(input_ids=["input_ids", "attention_mask"], sampling_params=GREEDY)
    assert engine.generate(PROMPTS[0], {"max_new_tokens": 2})["meta_info"]["completion_tokens"]


def test_one_bad_prompt_in_a_list_sends_none_of_them(engine: Engine) -> None:
    before = engine.get_server_info()
    with pytest.raises(ValueError, match="context length"):
        engine.generate(input_ids=[[5, 6, 7], [5] * 5000, [8, 9]],
                        sampling_params={**GREEDY, "max_new_tokens": 200})
    after = engine.get_server_info()
    assert after["kv_cache_idle_and_free"] is True
    # Every prompt is checked before any is sent: the good ones never ran.
    assert after["extend_steps"] == before["extend_steps"]
    assert after["decode_steps"] == before["decode_steps"]
