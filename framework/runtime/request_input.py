"""What a caller hands the TokenizerManager, and the errors that refuse it.

A ``GenerateRequest`` is a generation request as the API (or the Engine) hands
it over; a ``PreparedRequest`` is one that passed every check, with its
prompt's token ids. ``RequestError`` (HTTP 400) and ``OverloadedError``
(HTTP 503) are how a request is refused before anything is sent.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from framework.messages import TokenizedGenerateReqInput, decode_context
from framework.sampling_params import SamplingParams


class RequestError(ValueError):
    """A request the runtime cannot serve (bad input); the API answers 400 with its message.

    ``param`` names the refused field where there is one; ``code`` is OpenAI's error code
    (``context_length_exceeded``) where one applies.
    """

    def __init__(self, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class OverloadedError(RuntimeError):
    """The runtime holds as many requests as ``--max-queued-requests`` allows (HTTP 503).

    ``retry_after`` is a hint, in seconds, of when to try again.
    """

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class GenerateRequest:
    """A generation request as the API (or the Engine) hands it over."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    #: With ``return_logprob``: the first prompt position whose logprob is returned
    #: (-1: none of the prompt's).
    logprob_start_len: int = -1
    #: With ``return_logprob``: each logprob entry's third element is its token's text
    #: (otherwise ``None``), as SGLang's ``[logprob, token_id, text]`` triples.
    return_text_in_logprobs: bool = False
    rid: str | None = None
    #: The LoRA adapter to run with (None: the base model).
    lora_path: str | None = None


def new_request_id() -> str:
    """A fresh request id (rid), for a request whose caller gave none: the one place
    request ids are made."""
    return uuid.uuid4().hex


@dataclass
class PreparedRequest:
    """A ``GenerateRequest`` that passed every check, with its prompt's token ids.

    ``TokenizerManager.prepare`` makes one; a caller that fans one API request out
    into several prepares them all before sending any, so that one bad part
    refuses the whole request while nothing is running yet. ``rid`` is the caller's
    (``req.rid``) or a fresh one, fixed here so that logs name the request before
    it is sent.
    """

    req: GenerateRequest
    input_ids: list[int]
    rid: str = ""

    def __post_init__(self) -> None:
        self.rid = self.rid or self.req.rid or new_request_id()

    @property
    def decode_context(self) -> list[int]:
        """The prompt ids the output is decoded after (``messages.decode_context``)."""
        return decode_context(self.input_ids)

    def message(self, handle: int) -> TokenizedGenerateReqInput:
        """The request as the Scheduler takes it, under its ``rid`` and ``handle``."""
        req = self.req
        return TokenizedGenerateReqInput(
            rid=self.rid, handle=handle, input_text=req.text or "",
            input_ids=self.input_ids,
            sampling_params=req.sampling_params, stream=req.stream,
            return_logprob=req.return_logprob, top_logprobs_num=req.top_logprobs_num,
            logprob_start_len=req.logprob_start_len, lora_name=req.lora_path,
        )
