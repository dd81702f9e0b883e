"""The checks that refuse a request before anything is sent to the Scheduler.

Each raises ``RequestError`` (or ``OverloadedError``) with the message the API
user sees; the TokenizerManager runs them in order while preparing a request:
the values of its parts, what the model serves, room in the queue, then its
prompt once tokenized. The checks that need the served model take its
``ModelFacts``; None (not known yet) lets those values through to the Scheduler's
own checks.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from framework.config import ServerArgs
from framework.model_facts import ModelFacts
from framework.runtime.request_input import GenerateRequest, OverloadedError, RequestError
from framework.sampling_params import (
    REQUEST_RANGES,
    FieldError,
    check_token_ids,
    check_top_logprobs_num,
)


def check_values(reqs: Sequence[GenerateRequest], model: ModelFacts | None) -> None:
    """Refuse the first value out of range in ``reqs``: first their sampling parameters,
    verified once per object (the prompts of one OpenAI request share theirs), then each
    part's logprob options.

    ``n`` is checked on the part itself: its choices (``SamplingParams.for_choice``)
    differ from it only in ``n`` and ``seed`` and are not checked again.
    """
    vocab_size = None if model is None else model.vocab_size
    for params in {id(req.sampling_params): req.sampling_params for req in reqs}.values():
        try:
            params.verify(vocab_size)
        except FieldError as exc:
            raise RequestError(str(exc), param=exc.param) from None
    for req in reqs:
        check_logprob_options(req)


def check_lora(reqs: Sequence[GenerateRequest], adapters: Collection[str]) -> None:
    """Refuse a request naming a LoRA adapter that is not served (``param="lora_path"``)."""
    for req in reqs:
        if req.lora_path is not None and req.lora_path not in adapters:
            served = ", ".join(sorted(adapters)) or "none"
            raise RequestError(f"unknown LoRA adapter {req.lora_path!r} in lora_path "
                               f"(served: {served})", param="lora_path", code="model_not_found")


def check_logprob_options(req: GenerateRequest) -> None:
    """Refuse (``RequestError``) logprob options of ``req`` that are out of range."""
    try:
        check_top_logprobs_num(req.top_logprobs_num)
    except FieldError as exc:
        raise RequestError(str(exc), param=exc.param) from None
    if not isinstance(req.return_logprob, bool):
        raise RequestError(f"return_logprob must be true or false, got {req.return_logprob!r}")
    start = req.logprob_start_len
    # Only the bottom of its range: the top that matters, the prompt's length, is checked
    # once the prompt is tokenized.
    if type(start) is not int or start < REQUEST_RANGES["logprob_start_len"].low:
        raise RequestError(f"logprob_start_len must be -1 (no prompt logprobs) or a prompt "
                           f"position >= 0, got {start!r}")
    if start >= 0 and not req.return_logprob:
        raise RequestError("logprob_start_len needs return_logprob set to true")
    if not isinstance(req.return_text_in_logprobs, bool):
        raise RequestError(f"return_text_in_logprobs must be true or false, "
                           f"got {req.return_text_in_logprobs!r}")


def check_model_kind(model: ModelFacts | None, embedding: bool) -> None:
    """Refuse an embedding request to a generation model, or the reverse."""
    if model is None or model.is_embedding == embedding:
        return
    if model.is_embedding:
        raise RequestError("this model is an embedding model; it serves embeddings, "
                           "not text generation")
    raise RequestError("this model is a generation model; it does not serve embeddings")


def check_queue_room(server_args: ServerArgs, in_flight: int) -> None:
    """Refuse (``OverloadedError``) a new request when ``in_flight`` requests fill the queue.

    The queue is what is in flight beyond the running batches (``max_running_requests``
    per replica).
    """
    limit = server_args.max_queued_requests
    if limit is None:
        return
    running = server_args.max_running_requests * server_args.dp_size
    if in_flight >= running + limit:
        raise OverloadedError(
            f"the server is overloaded: {in_flight} requests are in flight "
            f"({running} running at most, {limit} queued); try again later")


def check_prompt_ids(ids: list[int], given: bool, model: ModelFacts | None) -> None:
    """Refuse an empty prompt, a prompt longer than the context, and ids outside the
    vocabulary where the caller ``given`` them."""
    vocab_size = None if model is None else model.vocab_size
    context_len = None if model is None else model.context_len
    if not ids:
        raise RequestError("the prompt is empty")
    if given:
        # The tokenizer's own ids need no check; the Scheduler checks them all again.
        try:
            check_token_ids(ids, vocab_size, "input_ids")
        except FieldError as exc:
            raise RequestError(str(exc), param=exc.param) from None
    if context_len is not None and len(ids) > context_len:
        raise RequestError(
            f"the prompt has {len(ids)} tokens, but the model's context length is "
            f"{context_len}", code="context_length_exceeded")


def check_prompt_room(req: GenerateRequest, ids: list[int], model: ModelFacts | None) -> None:
    """Refuse a generation whose prompt ``ids`` leave no room for a new token, or whose
    ``logprob_start_len`` lies beyond the prompt."""
    context_len = None if model is None else model.context_len
    if (context_len is not None and len(ids) == context_len
            and req.sampling_params.max_new_tokens != 0):
        # A prompt may fill the context only to be scored (max_new_tokens 0).
        raise RequestError(
            f"the prompt has {len(ids)} tokens, but the model's context length is "
            f"{context_len}: no room is left for a new token (max_new_tokens 0 "
            f"scores the prompt alone)",
            code="context_length_exceeded")
    if req.logprob_start_len >= len(ids):
        raise RequestError(f"logprob_start_len must be below the prompt's length "
                           f"{len(ids)}, got {req.logprob_start_len}")
