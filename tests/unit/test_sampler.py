"""Sampler: every parameter honoured, seeds reproducible across batches, logprobs exact."""

from __future__ import annotations

import math
from collections import Counter

import msgspec
import pytest
import torch

from framework.layers.sampler import SampleOutput, Sampler, SamplingBatchInfo
from framework.sampling_params import SamplingParams

CPU = torch.device("cpu")

# A known distribution, deliberately not in id order so that sorting bugs show.
KNOWN_PROBS = [0.06, 0.35, 0.1, 0.25, 0.04, 0.2]


def make_info(
    params: list[SamplingParams],
    output_ids: list[list[int]] | None = None,
    prompt_ids: list[list[int]] | None = None,
    eos_token_ids: set[int] | None = None,
    vocab_size: int = 6,
    default_seed: int = 0,
) -> SamplingBatchInfo:
    """Batch info with empty histories unless given."""
    return SamplingBatchInfo.from_requests(
        params,
        output_ids if output_ids is not None else [[] for _ in params],
        prompt_ids if prompt_ids is not None else [[] for _ in params],
        eos_token_ids or set(),
        vocab_size,
        CPU,
        default_seed=default_seed,
    )


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    sampler: Sampler | None = None,
    **info_kwargs: object,
) -> list[int]:
    """Tokens drawn for ``logits`` (one row per request)."""
    info = make_info(params, vocab_size=logits.shape[-1], **info_kwargs)
    return (sampler or Sampler())(logits, info).next_token_ids.tolist()


def reference_filtered(probs: list[float], top_k: int, top_p: float, min_p: float) -> list[float]:
    """Float64 reference of top-k, then top-p over what top-k kept, then min-p; renormalised."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept = order[:top_k] if top_k > 0 else order
    if top_p < 1.0:
        total = sum(probs[i] for i in kept)
        nucleus, mass = [], 0.0
        for i in kept:
            if mass / total >= top_p:
                break
            nucleus.append(i)
            mass += probs[i]
        kept = nucleus
    largest = max(probs[i] for i in kept)
    kept = [i for i in kept if probs[i] >= min_p * largest]
    total = sum(probs[i] for i in kept)
    return [probs[i] / total if i in kept else 0.0 for i in range(len(probs))]


def reference_penalized(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_ids: list[list[int]],
    prompt_ids: list[list[int]],
) -> torch.Tensor:
    """Float64 reference of repetition, then frequency and presence penalties, token by token."""
    result = logits.double().clone()
    for row, request in enumerate(params):
        for token in set(prompt_ids[row]) | set(output_ids[row]):
            value = result[row, token].item()
            penalty = request.repetition_penalty
            result[row, token] = value / penalty if value > 0 else value * penalty
        for token, count in Counter(output_ids[row]).items():
            result[row, token] -= request.frequency_penalty * count + request.presence_penalty
    return result


# --- greedy, temperature and the filters -------------------------------------------------


def test_greedy_rows_take_argmax_while_temperature_rows_vary() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16).repeat(3, 1)
    params = [SamplingParams(top_k=1), SamplingParams(temperature=0.0), SamplingParams()]
    sampler = Sampler()
    draws = [sample(logits, params, sampler) for _ in range(60)]
    argmax = int(logits[0].argmax())
    assert all(tokens[0] == argmax and tokens[1] == argmax for tokens in draws)
    assert len({tokens[2] for tokens in draws}) >= 5


def test_all_greedy_batch_draws_no_noise() -> None:
    class NoNoiseSampler(Sampler):
        def exponential_noise(self, info: SamplingBatchInfo, device: torch.device) -> torch.Tensor:
            raise AssertionError("an all-greedy batch must not draw noise")

    torch.manual_seed(1)
    logits = torch.randn(4, 32)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1, temperature=0.7)] * 2
    assert sample(logits, params, NoNoiseSampler()) == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=2.0),
        SamplingParams(top_k=2),
        SamplingParams(top_p=0.55),
        SamplingParams(min_p=0.3),
        # top-p measured on what top-k kept: 0.35 / 0.6 > 0.5, so only the top token stays.
        SamplingParams(top_k=2, top_p=0.5),
        SamplingParams(temperature=0.8, top_k=4, top_p=0.9, min_p=0.2),
    ],
    ids=["t1", "t0.5", "t2", "top_k", "top_p", "min_p", "top_k+top_p", "all"],
)
def test_empirical_frequencies_match_the_filtered_softmax(params: SamplingParams) -> None:
    draws = 4000
    logits = torch.tensor(KNOWN_PROBS).log() + 3.0  # a shift must not matter
    tokens = sample(logits.repeat(draws, 1), [params] * draws)

    tempered = torch.softmax(logits.double() / params.temperature, dim=-1).tolist()
    expected = reference_filtered(tempered, params.top_k, params.top_p, params.min_p)
    counts = Counter(tokens)
    for token, probability in enumerate(expected):
        frequency = counts[token] / draws
        if probability == 0.0:
            assert frequency == 0.0, f"token {token} should be filtered out"
        else:
            # ~4 standard deviations of a binomial frequency at this sample size.
            tolerance = 4 * math.sqrt(probability * (1 - probability) / draws) + 1e-3
            assert abs(frequency - probability) < tolerance, (token, frequency, probability)


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    torch.manual_seed(2)
    logits = torch.randn(40).repeat(300, 1)
    tokens = sample(logits, [SamplingParams(top_p=0.01, temperature=1.5)] * 300)
    assert set(tokens) == {int(logits[0].argmax())}


def test_min_p_drops_tokens_under_the_threshold() -> None:
    probs = torch.tensor([0.5, 0.26, 0.24])  # min_p 0.5 -> threshold 0.25: token 2 never drawn
    tokens = sample(probs.log().repeat(2000, 1), [SamplingParams(min_p=0.5)] * 2000)
    counts = Counter(tokens)
    assert counts[2] == 0 and counts[0] > 0 and counts[1] > 0


# --- penalties and min_new_tokens ---------------------------------------------------------


def test_penalties_match_a_float64_reference() -> None:
    generator = torch.Generator().manual_seed(3)
    vocab = 12
    logits = torch.randn(5, vocab, generator=generator) * 3
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.7),
        SamplingParams(temperature=0.0, frequency_penalty=0.9),
        SamplingParams(temperature=0.0, presence_penalty=-1.3),
        SamplingParams(
            temperature=0.0, repetition_penalty=0.6, frequency_penalty=-0.4, presence_penalty=1.1
        ),
        SamplingParams(temperature=0.0),
    ]
    prompt_ids = [torch.randint(vocab, (6,), generator=generator).tolist() for _ in params]
    output_ids = [torch.randint(vocab, (9,), generator=generator).tolist() for _ in params]
    info = make_info(params, output_ids, prompt_ids, vocab_size=vocab)

    expected = reference_penalized(logits, params, output_ids, prompt_ids)
    processed = Sampler().process_logits(logits, info)
    torch.testing.assert_close(processed.double(), expected, rtol=0, atol=1e-5)
    tokens = Sampler()(logits, info).next_token_ids
    assert tokens.tolist() == expected.argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    ("row_logits", "params", "prompt", "output"),
    [
        # repetition: positive logit divided (2 / 1.2 < 1.9), prompt tokens count
        ([2.0, 1.9, -1.0], SamplingParams(repetition_penalty=1.2), [0], []),
        # repetition: negative logit multiplied (-0.5 * 1.2 < -0.55); dividing would not flip
        ([-0.5, -0.55, -3.0], SamplingParams(repetition_penalty=1.2), [], [0]),
        # frequency scales with the count: 2 - 3 * 0.05 < 1.9
        ([2.0, 1.9, -1.0], SamplingParams(frequency_penalty=0.05), [], [0, 0, 0]),
        # presence is paid once: 2 - 0.15 < 1.9 after a single occurrence
        ([2.0, 1.9, -1.0], SamplingParams(presence_penalty=0.15), [], [0]),
    ],
    ids=["rep-positive", "rep-negative", "frequency", "presence"],
)
def test_penalty_flips_the_argmax_as_the_reference_says(
    row_logits: list[float], params: SamplingParams, prompt: list[int], output: list[int]
) -> None:
    logits = torch.tensor([row_logits])
    greedy = [msgspec.structs.replace(params, temperature=0.0)]
    expected = reference_penalized(logits, greedy, [output], [prompt]).argmax(dim=-1).tolist()
    assert expected != logits.argmax(dim=-1).tolist(), "the case must flip the argmax"
    assert sample(logits, greedy, output_ids=[output], prompt_ids=[prompt]) == expected


def test_penalties_that_do_not_apply_leave_the_argmax() -> None:
    logits = torch.tensor([[2.0, 1.9, -1.0], [2.0, 1.9, -1.0]])
    params = [
        # frequency and presence look at the output only, never at the prompt
        SamplingParams(temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0),
        # frequency once: 2 - 0.05 > 1.9
        SamplingParams(temperature=0.0, frequency_penalty=0.05),
    ]
    tokens = sample(logits, params, output_ids=[[], [0]], prompt_ids=[[0, 0], []])
    assert tokens == [0, 0]


def test_min_new_tokens_bans_stop_tokens_then_lifts_the_ban() -> None:
    eos, stop = 3, 5
    logits = torch.tensor([0.0, 1.0, 2.0, 9.0, 0.5, 8.0]).repeat(5, 1)
    greedy = {"temperature": 0.0, "min_new_tokens": 2, "stop_token_ids": [stop]}
    params = [
        SamplingParams(**greedy),
        SamplingParams(**greedy),
        SamplingParams(**greedy),
        SamplingParams(**greedy, ignore_eos=True),  # EOS does not end it, so EOS is allowed
        SamplingParams(temperature=0.0, stop_token_ids=[stop]),  # no min_new_tokens
    ]
    output_ids = [[], [1], [1, 1], [], []]
    tokens = sample(logits, params, output_ids=output_ids, eos_token_ids={eos})
    assert tokens == [2, 2, eos, eos, eos]

    sampled = [SamplingParams(min_new_tokens=1, stop_token_ids=[stop])] * 500
    tokens = sample(logits[:1].repeat(500, 1), sampled, eos_token_ids={eos})
    assert eos not in tokens and stop not in tokens
    assert len(set(tokens)) > 1


# --- seeds ---------------------------------------------------------------------------------


SEEDED = [
    SamplingParams(seed=11),
    SamplingParams(seed=12, temperature=0.7, top_k=20),
    SamplingParams(seed=13, top_p=0.8, min_p=0.05),
    SamplingParams(seed=14, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2),
    SamplingParams(seed=15, temperature=1.5, min_new_tokens=3),
]


def test_seeded_rows_draw_the_same_alone_and_in_a_mixed_batch() -> None:
    generator = torch.Generator().manual_seed(4)
    vocab = 50
    others = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(seed=99, top_k=3)]
    for step in range(4):
        output_ids = [torch.randint(vocab, (step,), generator=generator).tolist() for _ in SEEDED]
        prompt_ids = [torch.randint(vocab, (5,), generator=generator).tolist() for _ in SEEDED]
        logits = torch.randn(len(SEEDED), vocab, generator=generator)
        alone = [
            sample(
                logits[i : i + 1],
                [request],
                output_ids=[output_ids[i]],
                prompt_ids=[prompt_ids[i]],
                eos_token_ids={0},
            )[0]
            for i, request in enumerate(SEEDED)
        ]
        # Interleave with other requests, in reverse order, with another sampler state.
        batch = [p for request in reversed(SEEDED) for p in (request, *others)]
        rows = [i for i in reversed(range(len(SEEDED))) for _ in range(1 + len(others))]
        busy_sampler = Sampler()
        busy_sampler(torch.randn(2, vocab), make_info([SamplingParams()] * 2, vocab_size=vocab))
        tokens = sample(
            logits[rows],
            batch,
            busy_sampler,
            output_ids=[output_ids[i] for i in rows],
            prompt_ids=[prompt_ids[i] for i in rows],
            eos_token_ids={0},
            default_seed=7,
        )
        in_batch = tokens[:: 1 + len(others)][::-1]
        assert in_batch == alone, f"step {step}"


def test_different_seeds_and_steps_draw_differently() -> None:
    vocab = 1000
    uniform = torch.zeros(1, vocab)
    by_seed = [sample(uniform, [SamplingParams(seed=seed)])[0] for seed in range(20)]
    assert len(set(by_seed)) >= 15
    by_step = [
        sample(uniform, [SamplingParams(seed=5)], output_ids=[[1] * step])[0] for step in range(20)
    ]
    assert len(set(by_step)) >= 15
    # and the same (seed, step) is the same token on a fresh sampler
    assert sample(uniform, [SamplingParams(seed=5)], output_ids=[[1] * 3])[0] == by_step[3]


def test_unseeded_rows_follow_the_default_seed_and_advance_per_call() -> None:
    logits = torch.zeros(8, 1000)
    params = [SamplingParams()] * 8
    first, second = Sampler(), Sampler()
    run_a = [sample(logits, params, first, default_seed=1) for _ in range(3)]
    run_b = [sample(logits, params, second, default_seed=1) for _ in range(3)]
    assert run_a == run_b
    assert run_a[0] != run_a[1] != run_a[2]
    assert sample(logits, params, Sampler(), default_seed=2) != run_a[0]


# --- logprobs ------------------------------------------------------------------------------


def test_logprobs_are_of_the_raw_logits() -> None:
    generator = torch.Generator().manual_seed(5)
    vocab = 30
    logits = torch.randn(4, vocab, generator=generator) * 4
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.3, repetition_penalty=1.8),
        SamplingParams(top_k=3, frequency_penalty=1.5, seed=1),
        SamplingParams(min_p=0.2, temperature=2.0),
    ]
    output_ids = [[1, 2], [int(logits[1].argmax())] * 2, [3, 3, 3], []]
    nums = [0, 1, 5, vocab + 10]
    info = make_info(params, output_ids, [[0]] * 4, vocab_size=vocab)
    out: SampleOutput = Sampler()(logits, info, nums)

    reference = torch.log_softmax(logits.double(), dim=-1)
    assert out.logprobs.dtype == torch.float32
    chosen = reference.gather(1, out.next_token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(out.logprobs.double(), chosen, rtol=0, atol=1e-5)
    for row, n in enumerate(nums):
        values, ids = reference[row].topk(min(n, vocab))
        assert out.top_logprobs_idx[row] == ids.tolist()
        torch.testing.assert_close(
            torch.tensor(out.top_logprobs_val[row], dtype=torch.float64),
            values,
            rtol=0,
            atol=1e-5,
        )


def test_input_logits_are_not_modified() -> None:
    logits = torch.randn(2, 10)
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=2.0, min_new_tokens=1, presence_penalty=1.0)] * 2
    info = make_info(params, [[1], []], [[2], [3]], {0}, vocab_size=10)
    Sampler()(logits, info, [2, 2])
    assert torch.equal(logits, before)


# --- errors --------------------------------------------------------------------------------


def test_bad_inputs_raise_value_errors() -> None:
    params = [SamplingParams(), SamplingParams()]
    info = make_info(params, vocab_size=6)
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(torch.zeros(3, 6), info)
    with pytest.raises(ValueError, match="top_logprobs_nums"):
        Sampler()(torch.zeros(2, 6), info, [1, -1])
    with pytest.raises(ValueError, match="one entry per row"):
        make_info(params, output_ids=[[]])
    with pytest.raises(ValueError, match="outside"):
        make_info([SamplingParams(repetition_penalty=1.1)], prompt_ids=[[6]], vocab_size=6)


def test_penalty_histories_kept_across_steps_equal_ones_built_from_the_lists() -> None:
    from framework.layers.sampler import PenaltyHistory

    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5),
              SamplingParams(),
              SamplingParams(presence_penalty=-1.0)]
    prompts = [[0, 1, 1], [2], [3, 4]]
    outputs = [[5, 5, 2, 0], [1, 1], [4, 4, 4]]
    histories = [PenaltyHistory(p, prompt, 6, CPU) if p.has_penalties else None
                 for p, prompt in zip(params, prompts)]
    for step in range(1, 5):  # one token at a time, as the Scheduler adds them
        for history, output in zip(histories, outputs):
            if history is not None:
                history.add_outputs(output[history.num_outputs:step])
    kept = SamplingBatchInfo.from_requests(params, outputs, prompts, set(), 6, CPU,
                                           histories=histories)
    rebuilt = make_info(params, outputs, prompts)
    for name in ("repetition_mask", "output_counts", "repetition_penalties",
                 "frequency_penalties", "presence_penalties"):
        assert torch.equal(getattr(kept, name), getattr(rebuilt, name)), name
    assert kept.output_counts[0, 5] == 2 and kept.output_counts[2, 4] == 3
    assert kept.repetition_mask[0].tolist() == [True, True, True, False, False, True]
    assert not kept.repetition_mask[1].any() and not kept.output_counts[1].any()


def test_logit_bias_moves_the_choice_and_leaves_the_reported_logprobs_raw() -> None:
    logits = torch.log(torch.tensor([KNOWN_PROBS, KNOWN_PROBS]))
    params = [SamplingParams(temperature=0.0, logit_bias={"4": 100.0, "1": -100.0}),
              SamplingParams(temperature=0.0)]
    out = Sampler()(logits, make_info(params))
    assert out.next_token_ids.tolist() == [4, 1]  # row 1 keeps the argmax
    assert out.logprobs[0].item() == pytest.approx(math.log(KNOWN_PROBS[4]), abs=1e-6)


@pytest.mark.parametrize(("bias", "message"), [
    ({"x": 1.0}, "logit_bias keys must be token ids"),
    ({"6": 1.0}, r"logit_bias must hold integer token ids in \[0, 6\)"),
    ({"2": 101.0}, r"logit_bias values must be in \[-100, 100\]"),
    ({"2": float("nan")}, "logit_bias values"),
])
def test_bad_logit_bias_is_refused_naming_the_field(bias: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias).verify(vocab_size=6)


def test_greedy_ties_take_the_first_largest_token() -> None:
    """As ``argmax`` and transformers do: of equal largest logits, the lowest id wins."""
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 2.0, 5.0, 5.0]])
    info = make_info([SamplingParams(temperature=0.0)] * 2, [[], []], [[0], [0]], vocab_size=4)
    assert Sampler()(logits, info).next_token_ids.tolist() == [1, 0]


def test_without_return_logprob_the_tokens_stay_and_no_logprobs_are_computed() -> None:
    generator = torch.Generator().manual_seed(9)
    logits = torch.randn(3, 20, generator=generator)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=3),
              SamplingParams(top_k=4, seed=4)]
    info = make_info(params, [[], [1], [2, 2]], [[0]] * 3, vocab_size=20)
    with_logprobs = Sampler()(logits, info, [2, 0, 1])
    without = Sampler()(logits, info, [2, 0, 1], return_logprob=False)
    assert without.next_token_ids.tolist() == with_logprobs.next_token_ids.tolist()
    assert without.logprobs is None
    assert without.top_logprobs_val == without.top_logprobs_idx == [[], [], []]
