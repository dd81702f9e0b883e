"""DESIGN's rule for comparing greedy outputs across attention backends and devices."""

from __future__ import annotations

from pathlib import Path
from typing import Any

NEAR_TIE = 1e-3
LOGPROB_TOLERANCE = 1e-4
#: The same rule for float16 models, whose kernels round each product to 11 bits: a
#: near-tie below this gap, logprobs within this of each other.
FLOAT16_NEAR_TIE = 1e-2
FLOAT16_LOGPROB_TOLERANCE = 1e-2


def assert_same_greedy(got: dict[str, Any], ref: dict[str, Any], near_tie: float = NEAR_TIE,
                       logprob_tolerance: float = LOGPROB_TOLERANCE) -> None:
    """Equal tokens until the reference's first near-tie, logprobs close before it.

    Both are Engine results asked with ``return_logprob=True, top_logprobs_num=2``;
    float16 models pass ``FLOAT16_NEAR_TIE`` and ``FLOAT16_LOGPROB_TOLERANCE``.
    """
    for step, (ref_id, top) in enumerate(zip(ref["output_ids"],
                                             ref["meta_info"]["output_top_logprobs"])):
        if top[0][0] - top[1][0] < near_tie:
            return  # a near-tie: the rest may legitimately differ
        assert got["output_ids"][step] == ref_id, f"token {step} differs"
        got_lp = got["meta_info"]["output_token_logprobs"][step][0]
        ref_lp = ref["meta_info"]["output_token_logprobs"][step][0]
        assert abs(got_lp - ref_lp) < logprob_tolerance, f"logprob {step}"
    assert len(got["output_ids"]) == len(ref["output_ids"])


def two_greedy_rounds(model_dir: Path, prompts: list[str], greedy: dict[str, Any],
                      **engine_args: Any) -> list[dict[str, Any]]:
    """Greedy outputs of two rounds through an Engine: the prompts, then the prompts grown
    by their outputs (a cached prefix); the KV pool must be idle after, and a prefix reused.
    """
    from framework import Engine

    with Engine(model_path=str(model_dir), launch_mode="thread", chunked_prefill_size=16,
                **engine_args) as engine:
        first = engine.generate(prompts, greedy, return_logprob=True, top_logprobs_num=2)
        grown = [p + " " + out["text"] for p, out in zip(prompts, first)]
        second = engine.generate(grown, greedy, return_logprob=True, top_logprobs_num=2)
        assert engine.get_server_info()["kv_cache_idle_and_free"] is True
    assert any(out["meta_info"]["cached_tokens"] for out in second), "no prefix was reused"
    return first + second
