"""One request as the Scheduler sees it: its tokens, its KV slots and how far it has got."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from framework.messages import FinishReason, decode_context
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

    ``kv_len`` counts a step's tokens as soon as the step is handed to the model
    worker. With overlap scheduling a request may be in a step whose result is not
    applied yet (``in_flight``), and the tokens such steps sample for it
    (``unapplied``) count in ``seq_len`` before they are known: the next step names
    the last of them by ``future_token``.
    """

    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    is_embedding: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    #: First prompt position whose logprob is returned (-1: the prompt's are not).
    logprob_start_len: int = -1
    stream_interval: int = 2
    #: The TokenizerManager's number for the request, which names it in every output
    #: (``BatchTokenIDOutput.handles``); -1 for embeddings, whose output names the rid.
    handle: int = -1
    #: The LoRA adapter the request runs with (None: the base model).
    lora_name: str | None = None
    #: The prefix cache's key space of that adapter (0: the base model's).
    lora_key: int = 0

    output_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    kv_len: int = 0
    cache_protected_len: int = 0
    last_node: Any = None
    #: Prompt tokens found in the prefix cache when the request was first admitted.
    cached_tokens: int = 0
    admitted: bool = False
    #: When the Scheduler took the request in (``time.monotonic()``), and how long it
    #: then waited for its first admission.
    queued_at: float = 0.0
    queue_seconds: float = 0.0
    #: Speculative decoding: steps that verified drafts for the request, and the drafts
    #: they accepted.
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0
    #: Finds stop strings in the decoded output; made on the first check that needs it.
    stop_matcher: Any = None
    #: The penalties' view of the tokens, updated as tokens come (``PenaltyHistory``).
    penalty_history: Any = None
    #: The structured-output matcher (``GrammarMatcher``), given when its grammar is
    #: compiled; kept through retraction, dropped when the request ends.
    grammar: Any = None
    finished_reason: FinishReason | None = None
    #: Steps holding the request that were handed to the worker and not applied yet;
    #: a request that ends meanwhile keeps its slots until the last of them is applied.
    in_flight: int = 0
    #: Tokens those steps sample for it, and the placeholder id of the last one.
    unapplied: int = 0
    future_token: int = 0
    #: ``output_ids[:sent_len]`` have been sent to the Detokenizer already.
    sent_len: int = 0
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs_val: list[list[float]] = field(default_factory=list)
    output_top_logprobs_idx: list[list[int]] = field(default_factory=list)
    #: Logprobs of the prompt's tokens computed so far, from ``prompt_logprob_first``.
    input_logprobs: list[float] = field(default_factory=list)
    input_top_logprobs_val: list[list[float]] = field(default_factory=list)
    input_top_logprobs_idx: list[list[int]] = field(default_factory=list)

    @property
    def fill_ids(self) -> list[int]:
        """Every token the model must have seen before sampling the next one."""
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        """Length of ``fill_ids`` without building the list, with the tokens sampled for
        the request by steps not applied yet."""
        return len(self.origin_input_ids) + len(self.output_ids) + self.unapplied

    def last_token(self) -> int:
        """The token the next decode step feeds: the last output token, or the placeholder
        of one a step in flight samples."""
        return self.future_token if self.unapplied else self.output_ids[-1]

    def ends_by_length(self, context_len: int) -> bool:
        """Whether the tokens counted so far end the request by length (so no step should
        make it another one)."""
        return (len(self.output_ids) + self.unapplied >= self.sampling_params.max_new_tokens
                or self.seq_len >= context_len)

    @functools.cached_property
    def steady_sampling(self) -> bool:
        """Whether the sampler sees this request the same way at every step.

        Not so with a penalty (it reads the tokens so far), a ``min_new_tokens``
        ban (lifted after that many tokens), a structured-output grammar (its
        mask follows the output) or a seed on a sampled request (its random
        stream is read at the step's position). Read after the Scheduler has
        settled the request's parameters.
        """
        params = self.sampling_params
        return (not params.has_penalties and params.min_new_tokens == 0
                and params.constraint() is None and (params.is_greedy or params.seed is None))

    def context_ids(self) -> list[int]:
        """The prompt ids the output is decoded after (``decode_context``)."""
        return decode_context(self.origin_input_ids)

    @property
    def extend_remaining(self) -> int:
        """Tokens still to prefill before the next token can be sampled."""
        return self.seq_len - self.kv_len

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether the prompt's own logprobs are returned."""
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def prompt_logprob_first(self) -> int:
        """The first prompt position with a logprob (position 0 has nothing before it)."""
        return max(self.logprob_start_len, 1)

    def prompt_logprobs_todo(self) -> range:
        """Prompt positions whose logprobs are still to compute (empty when not asked)."""
        if not self.wants_prompt_logprobs:
            return range(0)
        return range(self.prompt_logprob_first + len(self.input_logprobs),
                     len(self.origin_input_ids))

    def prefix_limit(self) -> int:
        """The most leading tokens that may come from the prefix cache.

        All but the last (its logits give the next token); and a prompt position
        whose logprob is still to compute needs the logits of the position before
        it, so that one must be computed, not reused.
        """
        todo = self.prompt_logprobs_todo()
        return min(self.seq_len - 1, todo.start - 1) if todo else self.seq_len - 1

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
