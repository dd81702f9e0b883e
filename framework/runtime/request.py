"""One request as the Scheduler sees it: its tokens, its KV slots and how far it has got."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from framework.messages import FinishReason
from framework.sampling_params import SamplingParams


@dataclass
class Req:
    """A generation or embedding request inside the Scheduler.

    The tokens whose KV is computed are ``fill_ids[:kv_len]``; ``fill_ids`` is the
    prompt followed by the output so far, so a request that was retracted (its KV
    handed to the prefix cache under memory pressure) is simply admitted again: it
    matches what is still cached and recomputes the rest, keeping its output.

    Of the KV slots in ``req_to_token[req_pool_idx, :kv_len]``, the first
    ``cache_protected_len`` belong to the prefix cache (locked through
    ``last_node`` while the request holds them); the rest belong to the request.
    """

    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    is_embedding: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    stream_interval: int = 2

    output_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    kv_len: int = 0
    cache_protected_len: int = 0
    last_node: Any = None
    #: Prompt tokens found in the prefix cache when the request was first admitted.
    cached_tokens: int = 0
    admitted: bool = False
    #: Finds stop strings in the decoded output; made on the first check that needs it.
    stop_matcher: Any = None
    #: The penalties' view of the tokens, updated as tokens come (``PenaltyHistory``).
    penalty_history: Any = None
    finished_reason: FinishReason | None = None
    #: ``output_ids[:sent_len]`` have been sent to the Detokenizer already.
    sent_len: int = 0
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs_val: list[list[float]] = field(default_factory=list)
    output_top_logprobs_idx: list[list[int]] = field(default_factory=list)

    @property
    def fill_ids(self) -> list[int]:
        """Every token the model must have seen before sampling the next one."""
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        """Length of ``fill_ids`` without building the list."""
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def extend_remaining(self) -> int:
        """Tokens still to prefill before the next token can be sampled."""
        return self.seq_len - self.kv_len

    @property
    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finished_reason is not None

    def output_due(self) -> bool:
        """Whether this request has something the client should see now.

        A stream gets its first token at once (time to first token is what a user
        waits for), then every ``stream_interval`` tokens.
        """
        if self.finished:
            return True
        unsent = len(self.output_ids) - self.sent_len
        first = self.sent_len == 0 and unsent > 0
        return self.stream and (first or unsent >= self.stream_interval)
