"""Request ids are made in one place: a prepared request keeps its caller's rid or gets a
fresh one there, and that rid is the one the Scheduler's message carries."""

from __future__ import annotations

from framework.runtime.request_input import GenerateRequest, PreparedRequest
from framework.sampling_params import SamplingParams


def _request(rid: str | None = None) -> GenerateRequest:
    return GenerateRequest(input_ids=[3, 4], sampling_params=SamplingParams(), rid=rid)


def test_a_request_without_an_id_gets_a_fresh_one_per_part() -> None:
    req = _request()
    parts = [PreparedRequest(req, [3, 4]) for _ in range(3)]
    assert len({part.rid for part in parts}) == 3 and all(part.rid for part in parts)
    assert req.rid is None  # the caller's request is left as it came
    assert [part.message(handle=i).rid for i, part in enumerate(parts)] == [
        part.rid for part in parts]


def test_a_callers_id_is_kept() -> None:
    part = PreparedRequest(_request("mine"), [3, 4])
    assert part.rid == "mine" and part.message(handle=7).rid == "mine"
