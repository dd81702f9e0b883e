"""Structured outputs in the Scheduler and sampler, on the fake model worker.

The fake model's logits are one-hot; under a grammar's mask a sampled row draws among
the allowed tokens, so every output exercises the grammar. Outputs are checked with
``jsonschema``, ``re`` and ``lark`` (tests/structured_cases.py), never by the backend.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from framework.config import ServerArgs
from framework.constrained import Constraint, InvalidConstraintError, check_constraint
from framework.constrained.cache import GrammarCache
from framework.constrained.compile_pool import CompilePool
from framework.constrained.json_schema import (
    ANNOTATIONS,
    FORMATS,
    SUPPORTED,
    TYPE_KEYWORDS,
    TYPES,
    SchemaKeywordError,
    check_schema,
)
from framework.constrained.xgrammar_backend import XGrammarBackend
from framework.layers.sampler import apply_token_bitmask
from framework.messages import AbortReq
from framework.registry import GRAMMAR_BACKENDS
from framework.sampling_params import SamplingParams
from framework.server.openai import CompletionRequest, response_format_schema
from tests.fake_worker import FakeModelWorker, SchedulerHarness, reference_output
from tests.model_fixtures import make_tiny_tokenizer
from tests.structured_cases import (
    EBNF,
    REGEXES,
    SCHEMAS,
    UNSUPPORTED_KEYWORDS,
    check_json,
    check_regex,
    constraint_cases,
    lark_parser,
)

TOKENIZER = make_tiny_tokenizer()
PROMPTS = [[1, 40 + i, 50 + 2 * i, 60] for i in range(8)]


def text_of(ids: list[int]) -> str:
    return TOKENIZER.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------- sampler and params


def test_apply_token_bitmask_disallows_exactly_the_cleared_bits() -> None:
    generator = torch.Generator().manual_seed(0)
    vocab = 100  # four words cover 128 ids; a padded vocabulary is wider than the mask
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), generator=generator,
                            dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1  # a row without a grammar allows everything
    logits = torch.randn(3, vocab + 30, generator=generator)
    out = apply_token_bitmask(logits, bitmask)
    for row in range(3):
        for token in range(vocab + 30):
            word = int(bitmask[row, token // 32]) if token < 128 else 0
            allowed = token < 128 and (word >> (token % 32)) & 1
            expected = logits[row, token] if allowed else float("-inf")
            assert out[row, token] == expected, (row, token)


def test_at_most_one_constraint_and_no_min_new_tokens() -> None:
    with pytest.raises(ValueError, match="at most one of json_schema, regex, ebnf"):
        SamplingParams(regex="a", ebnf='root ::= "a"').verify()
    with pytest.raises(ValueError, match="regex must be a non-empty string"):
        SamplingParams(regex="").verify()
    with pytest.raises(ValueError, match="min_new_tokens cannot be combined with json_schema"):
        SamplingParams(json_schema="{}", min_new_tokens=2, max_new_tokens=4).verify()
    params = SamplingParams.from_dict({"json_schema": {"type": "integer"}})
    assert params.constraint() == ("json_schema", '{"type": "integer"}')
    assert SamplingParams().constraint() is None


def test_response_format_maps_onto_json_schema() -> None:
    assert response_format_schema(None) is None
    assert response_format_schema({"type": "text"}) is None
    assert response_format_schema({"type": "json_object"}) == '{"type": "object"}'
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    got = response_format_schema({"type": "json_schema",
                                  "json_schema": {"name": "x", "schema": schema}})
    assert json.loads(got or "") == schema
    with pytest.raises(InvalidConstraintError, match=r"json_schema\.schema") as info:
        response_format_schema({"type": "json_schema", "json_schema": {"name": "x"}})
    assert info.value.param == "response_format"
    with pytest.raises(InvalidConstraintError, match="type must be"):
        response_format_schema({"type": "yaml"})
    both = CompletionRequest(prompt="x", regex="a", response_format={"type": "json_object"})
    with pytest.raises(InvalidConstraintError, match="not both"):
        both.sampling_params(4, 16)


@pytest.mark.parametrize(("field", "value", "problem"), [
    ("json_schema", '{"type": "foo"}', "'type' at /type must be one of null"),
    ("json_schema", '{"type": "integer", "minimum": 5, "maximum": 3}', "minimum greater"),
    ("json_schema", "not json", "Failed to parse JSON"),
    ("regex", "a(b", "parenthesis is not closed"),
    ("ebnf", "root ::= foo", 'Rule "foo" is not defined'),
])
def test_invalid_constraints_are_refused_naming_the_problem(field: str, value: str,
                                                             problem: str) -> None:
    with pytest.raises(InvalidConstraintError, match=f"invalid {field}: .*{problem}") as info:
        check_constraint(SamplingParams(**{field: value}), "xgrammar")
    assert info.value.param == field
    assert "/project" not in str(info.value)  # no native log prefix
    with pytest.raises(InvalidConstraintError, match="--grammar-backend none"):
        check_constraint(SamplingParams(regex="a"), "none")
    check_constraint(SamplingParams(), "none")  # unconstrained requests always pass


@pytest.mark.parametrize(("schema", "keyword", "pointer"), UNSUPPORTED_KEYWORDS,
                         ids=[f"{k}@{p}" for _, k, p in UNSUPPORTED_KEYWORDS])
def test_keywords_that_are_not_enforced_are_refused_naming_keyword_and_pointer(
        schema: dict[str, Any], keyword: str, pointer: str) -> None:
    with pytest.raises(SchemaKeywordError) as info:
        check_constraint(SamplingParams(json_schema=json.dumps(schema)), "xgrammar")
    assert (info.value.keyword, info.value.pointer) == (keyword, pointer)
    assert info.value.param == "json_schema"
    assert info.value.code == "unsupported_schema_keyword"
    assert str(info.value).startswith(f"invalid json_schema: '{keyword}' at {pointer} ")


def test_a_regex_constraint_the_grammar_cannot_follow_is_refused() -> None:
    for pattern, problem in [("(?=x)hej", "lookahead '(?=' at position 0"),
                             ("(a)b\\1", "backreference '\\1' at position 4"),
                             ("\\bword", "word boundary '\\b' at position 0"),
                             ("(?i)yes", "inline flag")]:
        with pytest.raises(InvalidConstraintError, match=re.escape(problem)) as info:
            check_constraint(SamplingParams(regex=pattern), "xgrammar")
        assert info.value.param == "regex"
    # Inside a class these are plain characters; a non-capturing group is fine.
    check_constraint(SamplingParams(regex="[(?=\\b]x(?:y|z)"), "xgrammar")


def test_annotations_are_accepted_anywhere() -> None:
    notes = {"title": "T", "description": "d", "default": 1, "examples": [1],
             "$comment": "c", "deprecated": False, "readOnly": True, "writeOnly": False}
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **notes,
              "type": "object", "properties": {"a": {"type": "integer", **notes},
                                               "b": {"anyOf": [{"type": "null"}], **notes}}}
    check_constraint(SamplingParams(json_schema=json.dumps(schema)), "xgrammar")


@pytest.mark.parametrize(("schema", "normalized"), [
    ({"type": "object", "minProperties": 2},  # JSON Schema's objects are open
     {"type": "object", "minProperties": 2, "additionalProperties": True}),
    ({"type": "object", "properties": {"a": {"type": "null"}}, "required": ["b"]},
     {"type": "object", "properties": {"a": {"type": "null"}, "b": True}, "required": ["b"]}),
    ({"type": "object", "required": ["b"], "additionalProperties": {"type": "integer"}},
     {"type": "object", "required": ["b"], "additionalProperties": {"type": "integer"},
      "properties": {"b": {"type": "integer"}}}),
    ({"type": "array", "minItems": 2}, {"type": "array", "minItems": 2, "items": True}),
    ({"type": "integer", "minimum": 1}, {"type": "integer", "minimum": 1}),
])
def test_valid_schemas_that_can_be_enforced_compile(schema: dict[str, Any],
                                                    normalized: dict[str, Any]) -> None:
    assert json.loads(check_schema(json.dumps(schema))) == normalized
    XGrammarBackend.validate(Constraint("json_schema", json.dumps(schema)))


_SCHEMA_WORDS = st.sampled_from([*TYPE_KEYWORDS, "type", "enum", "const", "anyOf", "oneOf",
                                  "allOf", "$ref", "$defs", "not", "title", "a"])
_SCHEMA_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=True),
    st.sampled_from(["object", "array", "string", "integer", "number", "#", "#/$defs/a"]))


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(_SCHEMA_WORDS, st.recursive(_SCHEMA_SCALARS, lambda c: st.one_of(
    st.lists(c, max_size=3), st.dictionaries(_SCHEMA_WORDS, c, max_size=3)), max_leaves=10),
    max_size=4))
def test_any_schema_is_accepted_or_refused_with_a_400(schema: dict[str, Any]) -> None:
    # The keyword check on its own: the backend would wrap its crash in a vague 400.
    with contextlib.suppress(InvalidConstraintError):
        check_schema(json.dumps(schema))
    with contextlib.suppress(InvalidConstraintError):
        check_constraint(SamplingParams(json_schema=json.dumps(schema)), "xgrammar")


def test_the_documented_keyword_list_is_the_enforced_one() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "structured_outputs.md").read_text()
    section = doc.split("## JSON schema keywords", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`([$A-Za-z]+)`", section))
    assert set(SUPPORTED) | ANNOTATIONS | set(FORMATS) | set(TYPES) <= documented


def test_json_strings_exclude_control_characters() -> None:
    backend = XGrammarBackend(TOKENIZER, 512, [2])
    compiled = backend.compile(Constraint("json_schema", json.dumps(
        {"type": "string", "maxLength": 4})))
    matcher = backend.new_matcher(compiled)
    control = TOKENIZER.convert_tokens_to_ids(TOKENIZER.convert_ids_to_tokens(
        TOKENIZER.encode("\x18", add_special_tokens=False)))
    assert matcher.accept_token(TOKENIZER.encode('"', add_special_tokens=False)[0])
    assert not matcher.accept_token(control[0])


# ---------------------------------------------------------------- the Scheduler


@pytest.fixture
def harness() -> Any:
    made: list[SchedulerHarness] = []

    def make(**kwargs: Any) -> SchedulerHarness:
        h = SchedulerHarness(**kwargs)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def constrained(field: str, value: str, seed: int, **extra: Any) -> dict[str, Any]:
    return {field: value, "temperature": 1.0, "seed": seed, "max_new_tokens": 120, **extra}


def test_every_constraint_kind_gives_valid_outputs(harness: Any) -> None:
    h = harness()
    cases = constraint_cases()
    for n, (field, value, _) in enumerate(cases):
        for seed in range(3):
            h.submit(f"{n}-{seed}", PROMPTS[seed], **constrained(field, value, seed))
    outcomes = h.run()
    stopped = 0
    for n, (_, _, check) in enumerate(cases):
        for seed in range(3):
            outcome = outcomes[f"{n}-{seed}"]
            if outcome.finished_reason.type == "stop":
                stopped += 1
                check(text_of(outcome.output_ids))
    assert stopped >= 0.9 * len(cases) * 3
    h.assert_idle_invariant()


def test_mixed_batch_leaves_unconstrained_requests_unchanged(harness: Any) -> None:
    h = harness()
    for i, prompt in enumerate(PROMPTS[:4]):
        h.submit(f"free-{i}", prompt, max_new_tokens=12, temperature=0.0)
        h.submit(f"json-{i}", PROMPTS[4 + i], **constrained(
            "json_schema", json.dumps(SCHEMAS[1]), i, return_logprob=True))
    outcomes = h.run()
    for i, prompt in enumerate(PROMPTS[:4]):
        assert outcomes[f"free-{i}"].output_ids == reference_output(prompt, 12)
        json_out = outcomes[f"json-{i}"]
        assert json_out.finished_reason.type == "stop"
        check_json(text_of(json_out.output_ids), SCHEMAS[1])
        # Logprobs come from the raw logits: one per token, finite.
        assert len(json_out.logprobs) == len(json_out.output_ids)
        assert all(lp == lp and lp > float("-inf") for lp in json_out.logprobs)
    h.assert_idle_invariant()


def test_abort_in_the_middle_drops_the_matcher(harness: Any) -> None:
    h = harness()
    h.submit("a", PROMPTS[0], **constrained("regex", r"[a-z]{60,80}", 0))
    h.submit("b", PROMPTS[1], **constrained("regex", REGEXES[0], 1))
    # Its grammar compiles on the pool's threads: steps until it is a few tokens in.
    step_until(h, lambda: any(r.rid == "a" and len(r.output_ids) >= 3
                              for r in h.scheduler.running),
               "the constrained request ran a few steps")
    running = {r.rid: r for r in h.scheduler.running}
    assert running["a"].grammar is not None
    h.send(AbortReq(rid="a"))
    outcomes = h.run()
    assert outcomes["a"].finished_reason.type == "abort"
    assert running["a"].grammar is None
    check_regex(text_of(outcomes["b"].output_ids), REGEXES[0])
    h.assert_idle_invariant()


def test_retraction_keeps_the_matcher_state(harness: Any) -> None:
    # Eight requests of ~30 tokens each in a pool of 120 slots: some must be retracted.
    h = harness(worker=FakeModelWorker(max_total_tokens=120, max_requests=8))
    schema = SCHEMAS[2]
    for i, prompt in enumerate(PROMPTS):
        h.submit(f"r{i}", prompt, **constrained("json_schema", json.dumps(schema), i,
                                                max_new_tokens=60))
    outcomes = h.run()
    assert h.scheduler.stats.retracted_requests > 0
    for outcome in outcomes.values():
        if outcome.finished_reason.type == "stop":
            check_json(text_of(outcome.output_ids), schema)
        else:  # the grammar's prefix so far is kept: the text is a prefix of a document
            assert outcome.finished_reason.type == "length"
    assert sum(o.finished_reason.type == "stop" for o in outcomes.values()) >= 6
    h.assert_idle_invariant()


def test_radix_cache_hits_and_chunked_prefill(harness: Any) -> None:
    h = harness(chunked_prefill_size=8)
    long_prompt = [1, *range(100, 140)]
    parser = lark_parser()
    h.submit("first", long_prompt, **constrained("ebnf", EBNF, 0))
    first = h.run()["first"]
    parser.parse(text_of(first.output_ids))
    # The same prompt again, and one continuing the first output: both reuse its KV.
    h.submit("again", long_prompt, **constrained("ebnf", EBNF, 1))
    h.submit("continued", long_prompt + first.output_ids[:-1],
             **constrained("regex", REGEXES[1], 2))
    outcomes = h.run()
    assert outcomes["again"].cached_tokens > 0 and outcomes["continued"].cached_tokens > 0
    parser.parse(text_of(outcomes["again"].output_ids))
    check_regex(text_of(outcomes["continued"].output_ids), REGEXES[1])
    h.assert_idle_invariant()


def test_a_grammar_that_fails_in_the_scheduler_ends_only_its_request(harness: Any) -> None:
    h = harness()  # the edge would refuse these; the Scheduler still must not fail on them
    h.submit("bad", PROMPTS[0], regex="a(b")
    h.submit("good", PROMPTS[1], max_new_tokens=4, temperature=0.0)
    outcomes = h.run()
    assert outcomes["bad"].finished_reason.type == "abort"
    assert "invalid regex" in outcomes["bad"].finished_reason.message
    assert outcomes["good"].output_ids == reference_output(PROMPTS[1], 4)
    h.assert_idle_invariant()


class GatedBackend(XGrammarBackend):
    """xgrammar, but each compile waits for ``gate`` and is counted."""

    gate = threading.Event()
    compiles: list[Constraint] = []

    def compile(self, constraint: Constraint) -> Any:
        assert GatedBackend.gate.wait(30), "the test never opened the gate"
        GatedBackend.compiles.append(constraint)
        return super().compile(constraint)


def test_compiling_waits_off_the_loop_and_is_cached(harness: Any) -> None:
    GRAMMAR_BACKENDS.register("gated-test", GatedBackend)
    GatedBackend.gate.clear()
    GatedBackend.compiles.clear()
    h = harness(grammar_backend="gated-test")
    for i in range(3):  # n = 3 of one request: three requests, one constraint
        h.submit(f"json-{i}", PROMPTS[i], **constrained("json_schema", json.dumps(SCHEMAS[0]),
                                                        i))
    h.submit("free", PROMPTS[3], max_new_tokens=6, temperature=0.0)
    for _ in range(20):
        h.step()
    # The unconstrained request ran to its end while the grammar was still compiling.
    assert h.outcomes["free"].output_ids == reference_output(PROMPTS[3], 6)
    assert all(h.outcomes[f"json-{i}"].output_ids == [] for i in range(3))
    GatedBackend.gate.set()
    outcomes = h.run()
    for i in range(3):
        assert outcomes[f"json-{i}"].finished_reason.type == "stop"
        check_json(text_of(outcomes[f"json-{i}"].output_ids), SCHEMAS[0])
    assert GatedBackend.compiles == [Constraint("json_schema", json.dumps(SCHEMAS[0]))]
    h.assert_idle_invariant()


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_with_aborts_retraction_and_chunking(harness: Any, seed: int) -> None:
    """Random arrivals, aborts, small pools and chunks; constrained and free requests mixed."""
    rng = random.Random(seed)
    h = harness(worker=FakeModelWorker(max_total_tokens=rng.choice([90, 150, 400]),
                                       max_requests=6),
                chunked_prefill_size=rng.choice([4, 16, 2048]))
    cases = constraint_cases()
    shared = [rng.randrange(3, 500) for _ in range(12)]
    plan = []
    for i in range(14):
        prompt = [1, *shared[:rng.choice([0, 12])], *(rng.randrange(3, 500) for _ in range(4))]
        case = rng.choice(cases) if rng.random() < 0.6 else None
        params = (constrained(case[0], case[1], i, max_new_tokens=60) if case else
                  {"max_new_tokens": rng.randint(1, 10), "temperature": 0.0})
        plan.append((f"r{i}", prompt, case, params, rng.randint(0, 10),
                     rng.choice([None, None, rng.randint(1, 15)])))
    aborted = set()
    for step in range(5_000):
        for rid, prompt, _, params, arrive, abort_at in plan:
            if step == arrive:
                h.submit(rid, prompt, **params)
            if abort_at is not None and step == arrive + abort_at:
                h.send(AbortReq(rid=rid))
                aborted.add(rid)
        h.step()
        if step > 30 and all(o.finished_reason is not None for o in h.outcomes.values()):
            break
    checked: list[str] = []
    for rid, prompt, case, params, _, _ in plan:
        outcome = h.outcomes[rid]
        if outcome.finished_reason.type == "abort":
            assert rid in aborted, outcome.finished_reason
        elif case is not None and outcome.finished_reason.type == "stop":
            case[2](text_of(outcome.output_ids))
            checked.append(rid)
        elif case is None:
            assert outcome.output_ids == reference_output(prompt, params["max_new_tokens"])
    assert checked  # some constrained output ran to its end and was checked
    h.assert_idle_invariant()


def test_a_backend_is_imported_only_once_a_tokenizer_still_loading_is_there(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Scheduler loads its tokenizer on a thread, which imports transformers; so may a
    backend's module, and two threads importing transformers at once can break it."""
    import concurrent.futures as cf

    from framework.constrained.manager import GrammarManager

    tokenizer: cf.Future[Any] = cf.Future()
    seen: list[bool] = []
    real_get = GRAMMAR_BACKENDS.get

    def get(name: str) -> Any:
        seen.append(tokenizer.done())
        return real_get(name)

    monkeypatch.setattr(GRAMMAR_BACKENDS, "get", get)
    manager = GrammarManager("xgrammar", tokenizer, TOKENIZER.vocab_size, [2])
    try:
        with pytest.raises(cf.TimeoutError):  # waits for the tokenizer, backend not imported
            manager.compiled(Constraint("regex", "(yes|no)"), timeout=0.2)
        assert seen == []
        tokenizer.set_result(TOKENIZER)
        assert manager.compiled(Constraint("regex", "(yes|no)"), timeout=60) is not None
        assert seen == [True]
    finally:
        manager.close()


# ---------------------------------------------------------------- bounded, cancellable compiles

# Stands for a constraint whose compile takes minutes (a 20,000-entry enum did).
SLOW = json.dumps({"enum": [f"item-{i}" for i in range(20)]})
SLOW_CONSTRAINT = Constraint("json_schema", SLOW)
# A generous liveness limit on waits; nothing here asserts how long anything took.
LIVENESS_S = 30.0


class StallingBackend(XGrammarBackend):
    """xgrammar, but the compile of ``SLOW`` runs until ``release`` is set."""

    release = threading.Event()
    stalled: list[Constraint] = []  # compiles of SLOW under way
    compiled: list[Constraint] = []

    def compile(self, constraint: Constraint) -> Any:
        if constraint == SLOW_CONSTRAINT:
            StallingBackend.stalled.append(constraint)
            try:
                # Longer than any wait of a test: on its own it never ends in time.
                StallingBackend.release.wait(2 * LIVENESS_S)
            finally:
                StallingBackend.stalled.remove(constraint)
        compiled = super().compile(constraint)
        StallingBackend.compiled.append(constraint)
        return compiled


@pytest.fixture
def stalling(harness: Any) -> Any:
    """A harness whose backend stalls on ``SLOW``; the stall is released at the end."""
    GRAMMAR_BACKENDS.register("stalling-test", StallingBackend)
    StallingBackend.release.clear()
    StallingBackend.compiled.clear()
    yield lambda **kwargs: harness(grammar_backend="stalling-test", **kwargs)
    StallingBackend.release.set()
    # The released compiles leave ``stalled`` before the next test reads it: on a busy
    # machine a thread woken here can still be in it when the next test starts.
    deadline = time.monotonic() + LIVENESS_S
    while StallingBackend.stalled and time.monotonic() < deadline:
        time.sleep(0.01)


def step_until(h: SchedulerHarness, done: Any, what: str) -> None:
    """Step ``h`` until ``done()``, within the liveness limit."""
    deadline = time.monotonic() + LIVENESS_S
    while not done():
        assert time.monotonic() < deadline, f"never happened: {what}"
        h.step()


def test_a_trivial_regex_is_served_while_a_compile_its_client_left_still_runs(
        stalling: Any) -> None:
    h = stalling()
    h.submit("slow", PROMPTS[0], json_schema=SLOW, max_new_tokens=8)
    step_until(h, lambda: StallingBackend.stalled, "the slow compile started")
    h.send(AbortReq(rid="slow"))  # its client left
    h.submit("yes-no", PROMPTS[1], regex="(yes|no)", max_new_tokens=8)
    step_until(h, lambda: h.outcomes["yes-no"].finished_reason is not None,
               "the (yes|no) request finished while the slow compile ran")
    assert h.outcomes["slow"].finished_reason.type == "abort"
    assert h.outcomes["yes-no"].finished_reason.type == "stop"
    check_regex(text_of(h.outcomes["yes-no"].output_ids), "(yes|no)")
    # Asserted from the compile's state: it was still running all along.
    assert StallingBackend.stalled == [SLOW_CONSTRAINT]
    assert h.scheduler.grammars.pool.counts() == {"queued": 0, "live": 0, "stray": 1}
    h.assert_idle_invariant()


def test_an_abort_mid_compile_leaves_nothing_behind(stalling: Any) -> None:
    h = stalling()
    grammars = h.scheduler.grammars
    for rid in ("a", "b"):  # two requests of one constraint: one compile
        h.submit(rid, PROMPTS[0], json_schema=SLOW, max_new_tokens=8)
    step_until(h, lambda: StallingBackend.stalled, "the slow compile started")
    job = grammars.jobs[SLOW_CONSTRAINT]
    h.send(AbortReq(rid="a"))
    h.step()
    assert grammars.jobs == {SLOW_CONSTRAINT: job}  # "b" still waits for it
    assert grammars.waiters == {SLOW_CONSTRAINT: {"b"}}
    h.send(AbortReq(rid="b"))
    h.step()
    assert h.outcomes["a"].finished_reason.type == h.outcomes["b"].finished_reason.type == "abort"
    # Nobody waits: the job is gone from the manager and its thread no longer counts.
    assert grammars.jobs == {} and grammars.waiters == {} and not grammars.compiling()
    assert grammars.pool.counts() == {"queued": 0, "live": 0, "stray": 1}
    StallingBackend.release.set()
    assert job.future.result(timeout=LIVENESS_S) is not None  # the compile ends ...
    step_until(h, lambda: grammars.pool.counts()["stray"] == 0, "the stray thread ended")
    for _ in range(3):
        h.step()
    assert SLOW_CONSTRAINT not in grammars.cache  # ... and its result is dropped
    assert grammars.cache.bytes == 0 and grammars.jobs == {} and grammars.waiters == {}
    h.assert_idle_invariant()


def test_a_compile_past_its_budget_ends_its_requests_with_an_error(stalling: Any) -> None:
    h = stalling(grammar_compile_timeout=0.05)
    for rid in ("a", "b"):
        h.submit(rid, PROMPTS[0], json_schema=SLOW, max_new_tokens=8)
    h.submit("free", PROMPTS[1], max_new_tokens=4, temperature=0.0)
    step_until(h, lambda: all(o.finished_reason is not None for o in h.outcomes.values()),
               "every request finished")
    for rid in ("a", "b"):
        reason = h.outcomes[rid].finished_reason
        assert reason.type == "abort"
        assert ("the json_schema constraint did not compile within 0.05 s "
                "(--grammar-compile-timeout)") in reason.message
    assert h.outcomes["free"].output_ids == reference_output(PROMPTS[1], 4)
    grammars = h.scheduler.grammars
    assert grammars.jobs == {} and grammars.waiters == {}
    assert grammars.pool.counts()["stray"] == 1 and StallingBackend.stalled
    h.assert_idle_invariant()


def test_the_compile_pool_never_starts_a_compile_abandoned_in_its_queue() -> None:
    gate = threading.Event()
    started: list[str] = []

    def compile_fn(job: Any) -> str:
        started.append(job.constraint.value)
        job.start_clock()
        assert gate.wait(LIVENESS_S)
        return job.constraint.value

    pool = CompilePool(compile_fn, workers=1, max_stray=2)
    first = pool.submit(Constraint("regex", "first"))
    queued = pool.submit(Constraint("regex", "queued"))
    deadline = time.monotonic() + LIVENESS_S
    while not first.running():
        assert time.monotonic() < deadline
        time.sleep(0.001)
    pool.abandon(queued)
    assert queued.future.cancelled()
    pool.abandon(first)  # its thread goes on, uncounted: the next job starts at once
    third = pool.submit(Constraint("regex", "third"))
    while not third.running():
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert pool.counts() == {"queued": 0, "live": 1, "stray": 1}
    # At the cap of stray threads, a new job waits for one of them to end.
    pool.abandon(third)
    fourth = pool.submit(Constraint("regex", "fourth"))
    assert pool.counts() == {"queued": 1, "live": 0, "stray": 2}
    gate.set()
    assert fourth.future.result(timeout=LIVENESS_S) == "fourth"
    assert started == ["first", "third", "fourth"]


def test_the_grammar_cache_is_bounded_by_bytes() -> None:
    cache = GrammarCache(max_bytes=100)
    a, b, c, big = (Constraint("regex", v) for v in "abcz")
    cache.put(a, "A", 40)
    cache.put(b, "B", 40)
    assert cache.get(a) == "A"  # now the most recently used
    cache.put(c, "C", 40)  # 120 > 100: the least recently used (b) goes
    assert (a in cache, b in cache, c in cache, cache.bytes) == (True, False, True, 80)
    cache.put(big, "Z", 101)  # larger than the whole cache: not kept, nothing dropped
    assert big not in cache and len(cache) == 2
    nothing = GrammarCache(max_bytes=0)
    nothing.put(a, "A", 1)
    assert len(nothing) == 0


def test_compiled_grammars_are_counted_by_their_bytes(harness: Any) -> None:
    h = harness(grammar_cache_mb=0)  # keeps none: every request is still served
    for i, regex in enumerate(REGEXES[:2]):
        h.submit(f"r{i}", PROMPTS[i], **constrained("regex", regex, i))
    outcomes = h.run()
    for i, regex in enumerate(REGEXES[:2]):
        check_regex(text_of(outcomes[f"r{i}"].output_ids), regex)
    grammars = h.scheduler.grammars
    assert len(grammars.cache) == 0 and grammars.jobs == {}
    backend = grammars.backend()
    compiled = backend.compile(Constraint("regex", REGEXES[0]))
    assert backend.size_bytes(compiled) == compiled.memory_size_bytes > 0
    # xgrammar keeps no cache of its own beside the bounded one.
    assert backend.compiler.get_cache_size_bytes() == 0
    h.assert_idle_invariant()


@pytest.mark.parametrize(("field", "value", "limit"), [
    ("json_schema", json.dumps({"enum": [f"v{i}" for i in range(50_000)]}),
     "50000 entries in all; the limit is 1000 (enum entries)"),
    ("json_schema", json.dumps({"type": "object", "properties": {
        "a": {"enum": list(range(600))}, "b": {"type": "array", "items": {
            "enum": list(range(401))}}}}), "1001 entries in all; the limit is 1000"),
    ("regex", "(" + "|".join(f"w{i}" for i in range(1000)) + ")",
     "characters; the limit is 2048 (pattern length)"),
    ("json_schema", json.dumps({"type": "object", "properties": {"p": {
        "type": "string", "pattern": "a" * 3000}}}),
     "a pattern (at /properties/p/pattern) has 3000 characters; the limit is 2048"),
    ("json_schema", "[" * 65 + "]" * 65, "nested deeper than the limit of 64"),
    ("json_schema", "[" * 100_000 + "]" * 100_000, "nested deeper than the limit of 64"),
], ids=["enum", "enums-together", "regex", "pattern", "depth", "depth-past-the-parser"])
def test_constraints_past_a_size_limit_are_refused_at_the_edge(field: str, value: str,
                                                               limit: str) -> None:
    with pytest.raises(InvalidConstraintError, match=re.escape(limit)) as info:
        check_constraint(SamplingParams(**{field: value}), "xgrammar")
    assert (info.value.param, info.value.code) == (field, "constraint_too_large")


def test_constraints_at_the_size_limits_pass() -> None:
    enum = {"type": "string", "enum": [f"v{i}" for i in range(1000)]}
    check_constraint(SamplingParams(json_schema=json.dumps(enum)), "xgrammar")
    check_constraint(SamplingParams(regex="a" * 2048), "xgrammar")


def test_compile_budget_and_cache_size_are_checked_at_start_up() -> None:
    with pytest.raises(ValueError, match="--grammar-compile-timeout must be a number of "
                                         "seconds above 0, got 0"):
        ServerArgs(grammar_compile_timeout=0)
    with pytest.raises(ValueError, match="--grammar-compile-timeout"):
        ServerArgs(grammar_compile_timeout=float("inf"))
    with pytest.raises(ValueError, match="--grammar-cache-mb must be at least 0, got -1"):
        ServerArgs(grammar_cache_mb=-1)
