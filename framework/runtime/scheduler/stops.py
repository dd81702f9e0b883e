"""When a request ends: its grammar completes, an EOS or stop token, a stop string in its
text, or its length limit."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from framework.messages import FinishReason
from framework.runtime.incremental_decoder import StopStringMatcher, make_decode_fn
from framework.runtime.request import Req


class StopChecker:
    """Says why a request's last token ends it (``Scheduler.check_finished``'s default)."""

    def __init__(self, *, eos_token_ids: set[int], context_len: int,
                 tokenizer: Future[Any]) -> None:
        self.eos_token_ids = eos_token_ids
        self.context_len = context_len
        self.tokenizer = tokenizer  # only stop strings need it: it may still be loading

    def reason(self, req: Req) -> FinishReason | None:
        """Why the last token ends the request, or None."""
        params = req.sampling_params
        last = req.output_ids[-1]
        if req.grammar is not None and req.grammar.is_terminated():
            return FinishReason("stop", matched=last)  # the output is complete
        if (not params.ignore_eos and last in self.eos_token_ids) or (
            last in params.stop_token_ids
        ):
            return FinishReason("stop", matched=last)
        if params.stop and (matched := self.match_stop_string(req)) is not None:
            return FinishReason("stop", matched=matched)
        if len(req.output_ids) >= params.max_new_tokens or req.seq_len >= self.context_len:
            # The limit reached: max_new_tokens, or fewer where the context ends.
            return FinishReason("length", length=len(req.output_ids))
        return None

    def match_stop_string(self, req: Req) -> str | None:
        """The stop string the client's text now contains, if any (decoded incrementally)."""
        if req.stop_matcher is None:
            params = req.sampling_params
            decode = make_decode_fn(
                self.tokenizer.result(), skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens)
            req.stop_matcher = StopStringMatcher(decode, params.stop, req.context_ids())
        return req.stop_matcher.append(req.output_ids[req.stop_matcher.num_output_ids:])
