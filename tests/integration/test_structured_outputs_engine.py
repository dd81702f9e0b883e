"""Structured outputs through the Engine on a tiny random-weight model.

The model's free output is noise, so whatever parses is the grammar's doing. Every
output that finishes with ``stop`` must pass an independent check (``jsonschema``,
``re``, ``lark``), and nine in ten must stop within ``max_new_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from framework import Engine
from tests.model_fixtures import make_tiny_checkpoint
from tests.structured_cases import SCHEMAS, check_json, constraint_cases, supported_schemas

PROMPTS = ["Give me JSON:", "hello", "the quick brown fox", "numbers 1 2 3"]
TEMPERATURES = [0.0, 0.7, 1.0, 1.5]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", seed=3)
    with Engine(model_path=str(model_dir), launch_mode="thread", transport="inproc",
                chunked_prefill_size=64) as engine:
        yield engine


def params(field: str, value: str, seed: int, **extra: Any) -> dict[str, Any]:
    return {field: value, "seed": seed, "temperature": TEMPERATURES[seed % 4],
            "max_new_tokens": 160, **extra}


def test_outputs_follow_every_constraint_streaming_or_not(engine: Engine) -> None:
    cases = constraint_cases()
    sampling = [params(field, value, seed) for field, value, _ in cases for seed in range(4)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(sampling))]
    outputs = engine.generate(prompts, sampling)
    streamed: dict[int, list[dict[str, Any]]] = {}
    for chunk in engine.generate(prompts, sampling, stream=True):
        streamed.setdefault(chunk["index"], []).append(chunk)
    stopped = 0
    for i, out in enumerate(outputs):
        check = cases[i // 4][2]
        stream_text = "".join(c["text"] for c in streamed[i])
        # A seeded request gives the same tokens whether streamed or not.
        assert stream_text == out["text"]
        assert streamed[i][-1]["meta_info"]["finish_reason"] == out["meta_info"]["finish_reason"]
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            stopped += 1
            check(out["text"])
    assert stopped >= 0.9 * len(outputs), f"{stopped} of {len(outputs)} stopped"
    assert engine.get_server_info()["kv_cache_idle_and_free"] is True


def test_unconstrained_greedy_tokens_are_unchanged_by_constrained_neighbours(
        engine: Engine) -> None:
    free = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    alone = engine.generate(PROMPTS, free)
    schema = json.dumps(SCHEMAS[0])
    mixed = engine.generate(PROMPTS * 2, [free] * len(PROMPTS) + [
        params("json_schema", schema, seed) for seed in range(len(PROMPTS))])
    for before, after in zip(alone, mixed[:len(PROMPTS)]):
        assert before["output_ids"] == after["output_ids"]
    for out in mixed[len(PROMPTS):]:
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            check_json(out["text"], SCHEMAS[0])


def test_logprobs_and_leaving_a_stream_early(engine: Engine) -> None:
    schema = json.dumps(SCHEMAS[1])
    out = engine.generate(PROMPTS[0], params("json_schema", schema, 1),
                          return_logprob=True, top_logprobs_num=2)
    check_json(out["text"], SCHEMAS[1])
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])
    stream = engine.generate(PROMPTS[1], params("json_schema", schema, 2), stream=True)
    next(iter(stream))
    stream.close()  # aborts the request; its matcher and KV are dropped
    info = engine.get_server_info()
    assert info["kv_cache_idle_and_free"] is True


def test_outputs_of_generated_schemas_that_stop_satisfy_them(engine: Engine) -> None:
    """Schemas drawn from the supported set, batched: each output that finishes with
    ``stop`` must validate under ``jsonschema``. Random weights could run every request to
    ``length`` and check nothing, so at least 30 must have stopped."""
    stopped: list[int] = []

    @settings(max_examples=8, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.lists(supported_schemas(), min_size=8, max_size=8))
    def outputs_satisfy(schemas: list[dict[str, Any]]) -> None:
        sampling = [params("json_schema", json.dumps(s), seed, max_new_tokens=200)
                    for seed, s in enumerate(schemas)]
        outputs = engine.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(schemas))],
                                  sampling)
        for schema, out in zip(schemas, outputs):
            if out["meta_info"]["finish_reason"]["type"] == "stop":
                check_json(out["text"], schema)
                stopped.append(1)

    outputs_satisfy()
    assert len(stopped) >= 30, f"only {len(stopped)} outputs finished with stop"


def test_min_properties_with_open_additional_properties_is_accepted(engine: Engine) -> None:
    schema = {"type": "object", "minProperties": 2, "maxProperties": 2,
              "additionalProperties": {"type": "boolean"}}
    outputs = engine.generate(PROMPTS, [params("json_schema", json.dumps(schema), seed,
                                               max_new_tokens=200) for seed in range(4)])
    for out in outputs:
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            check_json(out["text"], schema)
    # The issue's own example compiles too.
    engine.generate("x", {"json_schema": {"type": "object", "minProperties": 2},
                          "max_new_tokens": 1})


@pytest.mark.parametrize(("field", "value", "problem"), [
    ("json_schema", '{"type": "object", "properties": 3}', "json_schema"),
    ("regex", "[z-a]", "regex"),
    ("ebnf", 'root ::= "a" |', "ebnf"),
])
def test_invalid_constraints_raise_before_anything_runs(engine: Engine, field: str, value: str,
                                                        problem: str) -> None:
    with pytest.raises(ValueError, match=f"invalid {problem}"):
        engine.generate("x", {field: value})
    with pytest.raises(ValueError, match="at most one"):
        engine.generate("x", {"regex": "a", "json_schema": "{}"})


def test_grammar_backend_none_refuses_constraints(tmp_path: Path) -> None:
    model_dir = make_tiny_checkpoint(tmp_path, "llama", seed=3)
    with Engine(model_path=str(model_dir), launch_mode="thread", transport="inproc",
                grammar_backend="none") as engine:
        with pytest.raises(ValueError, match="--grammar-backend none"):
            engine.generate("x", {"regex": "a"})
        assert engine.generate("x", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2
