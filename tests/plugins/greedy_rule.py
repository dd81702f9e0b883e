"""DESIGN's rule for comparing greedy outputs across attention backends and devices."""

from __future__ import annotations

from typing import Any

NEAR_TIE = 1e-3
LOGPROB_TOLERANCE = 1e-4


def assert_same_greedy(got: dict[str, Any], ref: dict[str, Any]) -> None:
    """Equal tokens until the reference's first near-tie, logprobs close before it.

    Both are Engine results asked with ``return_logprob=True, top_logprobs_num=2``.
    """
    for step, (ref_id, top) in enumerate(zip(ref["output_ids"],
                                             ref["meta_info"]["output_top_logprobs"])):
        if top[0][0] - top[1][0] < NEAR_TIE:
            return  # a near-tie: the rest may legitimately differ
        assert got["output_ids"][step] == ref_id, f"token {step} differs"
        got_lp = got["meta_info"]["output_token_logprobs"][step][0]
        ref_lp = ref["meta_info"]["output_token_logprobs"][step][0]
        assert abs(got_lp - ref_lp) < LOGPROB_TOLERANCE, f"logprob {step}"
    assert len(got["output_ids"]) == len(ref["output_ids"])
