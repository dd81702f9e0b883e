"""What the TokenizerManager answers: ``RequestOutput`` (text, ids and SGLang's
``meta_info``) and ``EmbeddingOutput``.

Each is built from a request's state as of one ``Chunk``, so a streaming
caller that reads late still sees each output as it arrived. Logprobs are
SGLang's ``[logprob, token_id, text]`` triples; ``text`` is filled (through a
``token_text`` function) only for a request that asked for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from framework.messages import PromptLogprobs
from framework.runtime.request_input import RequestError
from framework.runtime.request_state import Chunk, ReqState


def no_text(token_id: int) -> None:
    """The text of a logprob entry that did not ask for texts."""
    return None


def logprob_entries(pairs: Iterable[tuple[float | None, int]],
                    text_of: Callable[[int], str | None] = no_text) -> list[list[Any]]:
    """SGLang's ``[logprob, token_id, text]`` triples (``text`` None unless asked for)."""
    return [[value, tid, text_of(tid)] for value, tid in pairs]


def prompt_logprob_meta(prompt: PromptLogprobs,
                        text_of: Callable[[int], str | None] = no_text) -> dict[str, list[Any]]:
    """SGLang's ``input_token_logprobs`` (a ``[logprob, id, text]`` triple per prompt position
    from the start asked for; no logprob at position 0) and ``input_top_logprobs`` (None there)."""
    tops: list[Any] = [
        None if value is None else logprob_entries(zip(vals, ids), text_of)
        for value, vals, ids in zip(prompt.values, prompt.top_values, prompt.top_ids)]
    return {
        "input_token_logprobs": logprob_entries(zip(prompt.values, prompt.token_ids), text_of),
        "input_top_logprobs": tops,
    }


def request_meta_info(rid: str, state: ReqState, chunk: Chunk | None,
              token_text: Callable[[int], str]) -> dict[str, Any]:
    """SGLang's ``meta_info`` object for a request, as of ``chunk``."""
    reason = chunk.finished_reason if chunk else state.finished_reason
    meta: dict[str, Any] = {
        "id": rid,
        "prompt_tokens": state.prompt_tokens,
        "completion_tokens": chunk.completion_tokens if chunk else 0,
        "cached_tokens": chunk.cached_tokens if chunk else 0,
        "finish_reason": reason.to_json() if reason else None,
    }
    if chunk and chunk.spec_verify_ct:
        meta["spec_verify_ct"] = chunk.spec_verify_ct
        meta["spec_accepted_tokens"] = chunk.spec_accepted_tokens
    text_of = token_text if state.text_in_logprobs else no_text
    if state.prompt_logprobs is not None:
        meta.update(prompt_logprob_meta(state.prompt_logprobs, text_of))
    if chunk and chunk.logprobs_len:
        end = chunk.logprobs_len
        meta["output_token_logprobs"] = logprob_entries(state.logprobs[:end], text_of)
        meta["output_top_logprobs"] = [
            logprob_entries(row, text_of) for row in state.top_logprobs[:end]]
    return meta


@dataclass(slots=True)
class RequestOutput:
    """One output of a generate request, as of one chunk.

    ``text`` and ``output_ids``: all of the output so far; ``delta``: the text new
    since the previous output; ``meta_info``: SGLang's (``request_meta_info``).
    """

    text: str
    delta: str
    output_ids: list[int]
    meta_info: dict[str, Any]

    @classmethod
    def of(cls, state: ReqState, chunk: Chunk, meta: dict[str, Any]) -> RequestOutput:
        """The output of ``state`` as of ``chunk``, with ``meta`` its ``meta_info``."""
        return cls(state.text[:chunk.text_len], chunk.delta, state.output_ids[:chunk.ids_len],
                   meta)

    @property
    def finished(self) -> bool:
        """Whether this is the request's last output."""
        return self.meta_info["finish_reason"] is not None

    def to_dict(self) -> dict[str, Any]:
        """SGLang's output object: ``text``, ``output_ids`` and ``meta_info``."""
        return {"text": self.text, "output_ids": self.output_ids, "meta_info": self.meta_info}


@dataclass(slots=True)
class EmbeddingOutput:
    """An embedding request's answer: its embedding and its ``meta_info``."""

    embedding: Any  # a float32 vector
    meta_info: dict[str, Any]

    @classmethod
    def of(cls, state: ReqState, meta: dict[str, Any]) -> EmbeddingOutput:
        """The answer of ``state``, with ``meta`` its ``meta_info``.

        A request the Scheduler aborted (it cannot run it) has no embedding to
        return: it is a ``RequestError`` with the Scheduler's reason.
        """
        reason = state.finished_reason
        if reason is not None and reason.type == "abort":
            raise RequestError(f"the embedding request was aborted: {reason.message}")
        return cls(state.embedding, meta)
