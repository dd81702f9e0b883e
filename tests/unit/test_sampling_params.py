"""SamplingParams and the edge checks: parsing, range checks that name the field and range."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from framework.config import PortArgs, ServerArgs
from framework.model_facts import ModelFacts
from framework.registry import create_transport
from framework.runtime.tokenizer_manager import GenerateRequest, RequestError, TokenizerManager
from framework.sampling_params import (
    INT64_MAX,
    MAX_N,
    MAX_TOP_LOGPROBS,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
    check_token_ids,
    check_top_logprobs_num,
    wrap_seed,
)

NAN = float("nan")
INF = float("inf")


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"min_new_tokens": 5, "max_new_tokens": 2}, "min_new_tokens"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"n": 0}, "n"),
        ({"stream_interval": 0}, "stream_interval"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ],
)
def test_out_of_range_values_name_the_field(params: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict(params).verify()


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"top_k": -2}, r"top_k must be -1 \(disabled\) or in \[1, "),
        ({"top_k": 2**63}, r"top_k must be -1 \(disabled\) or in \[1, "),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
        ({"temperature": -1.0}, r"temperature must be in \[0, 100\]"),
        ({"temperature": 1e6}, r"temperature must be in \[0, 100\]"),
        ({"n": MAX_N + 1}, rf"n must be in \[1, {MAX_N}\]"),
        ({"n": -1}, rf"n must be in \[1, {MAX_N}\]"),
        ({"seed": SEED_MAX + 1}, r"seed must be in \[-2\*\*63, 2\*\*64 - 1\]"),
        ({"seed": SEED_MIN - 1}, r"seed must be in \[-2\*\*63, 2\*\*64 - 1\]"),
        ({"max_new_tokens": -(2**70)}, rf"max_new_tokens must be in \[0, {INT64_MAX}\]"),
        ({"max_new_tokens": 2**64}, rf"max_new_tokens must be in \[0, {INT64_MAX}\]"),
        ({"stream_interval": 2**64}, r"stream_interval must be in \[1, "),
    ],
)
def test_messages_give_the_allowed_range(params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict(params).verify()


@pytest.mark.parametrize(
    "field",
    ["temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
     "repetition_penalty"],
)
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_nan_and_infinite_floats_are_refused(field: str, value: float) -> None:
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=f"{field} must be a finite number"):
        params.verify()


def test_seed_range_ends_are_accepted() -> None:
    # The msgpack codec and torch.Generator.manual_seed both take exactly this range.
    SamplingParams(seed=SEED_MIN).verify()
    SamplingParams(seed=SEED_MAX).verify()
    assert (SEED_MIN, SEED_MAX) == (-(2**63), 2**64 - 1)


def test_choice_seeds_stay_in_range_and_name_the_same_stream() -> None:
    params = SamplingParams(seed=SEED_MAX, n=3)
    seeds = [params.for_choice(i).seed for i in range(3)]
    assert seeds[0] == SEED_MAX
    for choice, seed in enumerate(seeds):
        assert seed is not None and SEED_MIN <= seed <= SEED_MAX
        # The sampler reads seeds modulo 2**64.
        assert seed % 2**64 == (SEED_MAX + choice) % 2**64
        assert params.for_choice(choice).n == 1
    assert SamplingParams(seed=7).for_choice(2).seed == 9
    assert SamplingParams().for_choice(1).seed is None
    below = wrap_seed(SEED_MIN - 1)
    assert SEED_MIN <= below <= SEED_MAX and below % 2**64 == (SEED_MIN - 1) % 2**64


@pytest.mark.parametrize("temperature", [0.0, 1e-30, 5e-324, 9.9e-6])
def test_tiny_temperatures_are_greedy(temperature: float) -> None:
    params = SamplingParams(temperature=temperature)
    params.verify()
    assert params.is_greedy


def test_tiny_temperature_samples_the_argmax() -> None:
    import torch

    from framework.layers.sampler import Sampler, SamplingBatchInfo

    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9], [1.0, -2.0, 0.0, 4.0]])
    params = [SamplingParams(temperature=1e-30, seed=1), SamplingParams(temperature=1e-30)]
    info = SamplingBatchInfo.from_requests(params, [[], []], [[0], [0]], set(), 4,
                                           torch.device("cpu"))
    out = Sampler()(logits, info)
    assert out.next_token_ids.tolist() == [1, 3]
    assert torch.isfinite(out.logprobs).all()


def test_temperatures_at_the_threshold_and_cap_sample() -> None:
    assert not SamplingParams(temperature=1e-5).is_greedy
    SamplingParams(temperature=100.0).verify()


def test_stop_token_ids_are_bounded_by_the_vocabulary() -> None:
    SamplingParams(stop_token_ids=[0, 9]).verify(vocab_size=10)
    in_vocab = r"stop_token_ids must hold integer token ids in \[0, 10\)"
    with pytest.raises(ValueError, match=in_vocab):
        SamplingParams(stop_token_ids=[10]).verify(vocab_size=10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[2**63]).verify()


@pytest.mark.parametrize("value", [-1, MAX_TOP_LOGPROBS + 1, 1.5, True, None])
def test_top_logprobs_num_range(value: object) -> None:
    in_range = rf"logprobs must be an integer in \[0, {MAX_TOP_LOGPROBS}\]"
    with pytest.raises(ValueError, match=in_range):
        check_top_logprobs_num(value, "logprobs")


def test_top_logprobs_num_range_ends_are_accepted() -> None:
    check_top_logprobs_num(0)
    check_top_logprobs_num(MAX_TOP_LOGPROBS)


@pytest.mark.parametrize("ids", [[0, 10], [-1], [1, True], [1, "2"]])
def test_token_ids_outside_the_vocabulary_name_the_field(ids: list) -> None:
    with pytest.raises(ValueError, match=r"input_ids must hold integer token ids in \[0, 10\)"):
        check_token_ids(ids, 10, "input_ids")


def test_defaults_verify() -> None:
    SamplingParams().verify()
    SamplingParams().verify(vocab_size=1)


def test_from_dict_accepts_a_single_stop_string() -> None:
    params = SamplingParams.from_dict({"stop": "\n", "temperature": 0})
    assert params.stop == ["\n"]
    assert params.is_greedy


@pytest.mark.parametrize(
    "params",
    [{"temperature": "hot"}, {"max_new_tokens": 1.5}, {"no_such_field": 1}, {"stop": [1]}],
)
def test_wrong_types_and_unknown_fields_are_value_errors(params: dict) -> None:
    with pytest.raises(ValueError, match="sampling_params"):
        SamplingParams.from_dict(params)


def test_wrong_types_built_in_python_are_value_errors() -> None:
    with pytest.raises(ValueError, match="temperature must be a number"):
        SamplingParams(temperature="hot").verify()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="top_k must be an integer"):
        SamplingParams(top_k=2.5).verify()  # type: ignore[arg-type]


# --------------------------------------------------------------------------- TokenizerManager


@pytest.fixture
def manager() -> Iterator[TokenizerManager]:
    """A TokenizerManager with no Scheduler behind it: only requests it refuses may be sent."""
    transport = create_transport("inproc")
    port_args = PortArgs.create(transport)
    tm = TokenizerManager(ServerArgs(model_path="unused", transport="inproc"), port_args,
                          transport, tokenizer=None, model=ModelFacts(context_len=64, vocab_size=10,
                                           is_embedding=False, hidden_size=32))
    yield tm
    asyncio.run(tm.close())
    port_args.cleanup()


async def _first(tm: TokenizerManager, req: GenerateRequest) -> None:
    async for _ in tm.generate(req):
        return


@pytest.mark.parametrize(
    ("req", "message"),
    [
        (GenerateRequest(input_ids=[1, 10]), r"input_ids must hold .* in \[0, 10\), got 10"),
        (GenerateRequest(input_ids=[-1]), r"input_ids must hold .* in \[0, 10\), got -1"),
        (GenerateRequest(input_ids=[1], sampling_params=SamplingParams(stop_token_ids=[12])),
         r"stop_token_ids must hold .* in \[0, 10\)"),
        (GenerateRequest(input_ids=[1], return_logprob=True, top_logprobs_num=-1),
         r"top_logprobs_num must be an integer in \[0, 20\]"),
        (GenerateRequest(input_ids=[1], return_logprob=True, top_logprobs_num=21),
         r"top_logprobs_num must be an integer in \[0, 20\]"),
        (GenerateRequest(input_ids=[1], sampling_params=SamplingParams(temperature=NAN)),
         "temperature must be a finite number"),
        (GenerateRequest(input_ids=[1], sampling_params=SamplingParams(seed=2**64)),
         "seed must be in"),
    ],
)
def test_tokenizer_manager_refuses_before_sending(manager: TokenizerManager,
                                                  req: GenerateRequest, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        asyncio.run(_first(manager, req))
    assert not manager.rid_to_state
