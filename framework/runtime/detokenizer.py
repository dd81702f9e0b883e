"""The Detokenizer: token ids from the Scheduler in, new text for the TokenizerManager out.

Each running request has an ``IncrementalDecoder`` (see
``framework.runtime.incremental_decoder``): text is decoded incrementally,
never ends in the middle of a character, and never shows a part of a stop
string that the Scheduler may still find. The Scheduler matches stop strings
on the same text, decoded with the same function (``make_decode_fn``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from framework.comm.transport import Receiver, Sender, Transport
from framework.config import PortArgs, ServerArgs
from framework.messages import (
    BatchStrOutput,
    BatchTokenIDOutput,
    FinishReason,
    Message,
    RequestConstants,
)
from framework.registry import create_codec
from framework.runtime.hf_tokenizer import load_tokenizer
from framework.runtime.incremental_decoder import DecodeFn, IncrementalDecoder, make_decode_fn

logger = logging.getLogger(__name__)


class Detokenizer:
    """Turns ``BatchTokenIDOutput`` into ``BatchStrOutput``, one ``IncrementalDecoder`` per request.

    Requests are known by their handle (``BatchTokenIDOutput.handles``), never
    their rid. A request's state (its decoder, its ``RequestConstants`` and the count
    of ids it has produced) is made on its first output, the one message that
    carries its constants, and dropped with its last (the one with a finish
    reason). Subclasses can override ``decode`` (the tokenizer call),
    ``new_decoder``, ``decode_step`` (one request's step) or ``handle_message``
    (what to do with each received message).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.decoders: dict[int, IncrementalDecoder] = {}
        # Each running request's constants, sent with its first output only (by handle).
        self.constants: dict[int, RequestConstants] = {}
        # Each running request's ids so far (by handle): the Scheduler sends every id once,
        # in order, so counting them here spares a per-request count in every step.
        self.completion_tokens: dict[int, int] = {}
        # One decode function per (skip_special_tokens, spaces_between_special_tokens).
        self._decode_fns: dict[tuple[bool, bool], DecodeFn] = {}
        self.receiver: Receiver | None = None
        self.sender: Sender | None = None
        self._stopped = threading.Event()
        self._serving: tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]] | None = None

    @classmethod
    def from_server_args(
        cls, server_args: ServerArgs, port_args: PortArgs, transport: Transport,
        tokenizer_class: str | None = None,
    ) -> Detokenizer:
        """A Detokenizer with the server's tokenizer, bound to its channels.

        ``tokenizer_class`` (``"module:Name"``) is the class to load, when
        another process already had AutoTokenizer pick it.
        """
        detokenizer = cls(load_tokenizer(server_args.resolved_tokenizer_path(),
                                         tokenizer_class=tokenizer_class))
        detokenizer.receiver = transport.receiver(
            port_args.detokenizer_input, create_codec(server_args.codec)
        )
        detokenizer.sender = transport.sender(
            port_args.tokenizer_input, create_codec(server_args.codec)
        )
        return detokenizer

    async def serve(self) -> None:
        """``run`` on the bound channels until ``stop()``."""
        if self.receiver is None or self.sender is None:
            raise RuntimeError("serve() needs the channels that from_server_args() binds")
        task = asyncio.ensure_future(self.run(self.receiver, self.sender))
        self._serving = (asyncio.get_running_loop(), task)
        if self._stopped.is_set():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def stop(self) -> None:
        """End ``serve()`` (callable from any thread or a signal handler)."""
        self._stopped.set()
        if self._serving is not None:
            loop, task = self._serving
            loop.call_soon_threadsafe(task.cancel)

    def close(self) -> None:
        """Close the bound channels."""
        for end in (self.receiver, self.sender):
            if end is not None:
                end.close()

    def num_live_states(self) -> int:
        """How many requests have decode state (running requests that produced output)."""
        return len(self.decoders)

    def decode(
        self,
        ids: Sequence[int],
        *,
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
    ) -> str:
        """Decode ids with the tokenizer and a request's settings.

        This is the function ``make_decode_fn`` builds, the one the Scheduler
        matches stop strings with; a subclass that decodes otherwise must give
        the Scheduler the same function, or stop strings may be cut elsewhere.
        """
        settings = (skip_special_tokens, spaces_between_special_tokens)
        decode = self._decode_fns.get(settings)
        if decode is None:
            decode = self._decode_fns[settings] = make_decode_fn(
                self.tokenizer,
                skip_special_tokens=skip_special_tokens,
                spaces_between_special_tokens=spaces_between_special_tokens,
            )
        return decode(ids)

    def new_decoder(
        self,
        *,
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
        context_ids: Sequence[int] = (),
        stop_strs: Sequence[str] = (),
    ) -> IncrementalDecoder:
        """A fresh per-request state decoding with the request's settings."""
        decode = functools.partial(
            self.decode,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
        )
        return IncrementalDecoder(decode, context_ids, stop_strs)

    def decode_step(
        self,
        handle: int,
        new_ids: Sequence[int],
        finished_reason: FinishReason | None,
        *,
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
        no_stop_trim: bool,
        context_ids: Sequence[int] = (),
        stop_strs: Sequence[str] = (),
    ) -> str:
        """One request's step: its new text since its last output.

        A finished request has its remaining text flushed, the stop string or
        stop token trimmed (unless ``no_stop_trim``), and its state dropped.
        """
        decoder = self.decoders.get(handle)
        if decoder is None:
            decoder = self.new_decoder(
                skip_special_tokens=skip_special_tokens,
                spaces_between_special_tokens=spaces_between_special_tokens,
                context_ids=context_ids,
                stop_strs=() if no_stop_trim else stop_strs,
            )
            self.decoders[handle] = decoder
        if finished_reason is None:
            return decoder.step(new_ids)
        del self.decoders[handle]
        stop_token, stop_str = _stop_to_trim(finished_reason, no_stop_trim)
        return decoder.finish(new_ids, stop_token=stop_token, stop_str=stop_str)

    def handle_batch(self, batch: BatchTokenIDOutput) -> BatchStrOutput:
        """The new text of every request in ``batch``, in the same order.

        The reply carries the batch's ``created_at`` and when this call began and
        ended (``BatchStrOutput``'s stamps), for the TokenizerManager's timings.
        """
        received = time.monotonic()
        _check_layout(batch)
        ids = batch.id_lists()
        reasons = batch.finished_reason_list()
        handles: list[int] = batch.handles.tolist()  # Python ints: dict keys and the reply's
        for i, constants in zip(batch.new_indices, batch.new_constants):
            self.constants[handles[i]] = constants
        kept = [self.constants.get(h) or self._missing_constants(h) for h in handles]
        counts = self.completion_tokens
        completion_tokens = [counts.get(h, 0) + len(new) for h, new in zip(handles, ids)]
        counts.update(zip(handles, completion_tokens))
        output_strs = [
            self.decode_step(
                handle,
                ids[i],
                reasons[i],
                skip_special_tokens=constants.skip_special_tokens,
                spaces_between_special_tokens=constants.spaces_between_special_tokens,
                no_stop_trim=constants.no_stop_trim,
                context_ids=constants.context_ids,
                stop_strs=constants.stop_strs,
            )
            for i, (handle, constants) in enumerate(zip(handles, kept))
        ]
        for i in batch.finished_indices:
            del self.constants[handles[i]]
            del counts[handles[i]]
        out = BatchStrOutput(
            handles=handles,
            finished_reasons=reasons,
            output_strs=output_strs,
            output_ids=ids,
            prompt_tokens=[c.prompt_tokens for c in kept],
            completion_tokens=completion_tokens,
            cached_tokens=[c.cached_tokens for c in kept],
            queue_seconds=[c.queue_seconds for c in kept],
            spec_verify_cts=batch.spec_verify_cts,
            spec_accepted_tokens=batch.spec_accepted_tokens,
            prompt_logprob_indices=batch.prompt_logprob_indices,
            prompt_logprobs=batch.prompt_logprobs,
            token_ids_created_at=batch.created_at,
            detokenizer_received_at=received,
        )
        if batch.output_token_logprobs is not None:
            _copy_logprobs(batch, ids, out)
        out.detokenizer_sent_at = time.monotonic()
        return out

    def _missing_constants(self, handle: int) -> RequestConstants:
        """The constants for a request whose first output never arrived: the defaults."""
        # Only a first output whose frame did not decode leads here: decoding with the
        # defaults serves the request rather than losing it.
        logger.warning("detokenizer got output for request %d before its first output", handle)
        constants = self.constants[handle] = RequestConstants()
        return constants

    def handle_message(self, msg: Message) -> Message | None:
        """The reply to one received message, or ``None`` when there is nothing to send."""
        if isinstance(msg, BatchTokenIDOutput):
            return self.handle_batch(msg)
        logger.warning("detokenizer ignores a %s message", type(msg).__name__)
        return None

    async def run(self, receiver: Receiver, sender: Sender) -> None:
        """Serve forever: receive from the Scheduler, send text to the TokenizerManager.

        A frame that does not decode, or a message that cannot be handled, is logged
        and skipped; a closed channel (``TransportError``) or cancellation ends the loop.
        """
        while True:
            msg = await receiver.recv_valid()
            try:
                reply = self.handle_message(msg)
            except Exception:  # a malformed message is dropped; the loop serves everyone
                logger.exception("detokenizer dropped a malformed %s", type(msg).__name__)
                continue
            if reply is not None:
                await sender.send(reply)


def _stop_to_trim(reason: FinishReason, no_stop_trim: bool) -> tuple[int | None, str | None]:
    """The stop token and stop string to keep out of a finished request's text."""
    if no_stop_trim or reason.type != "stop":
        return None, None
    if isinstance(reason.matched, str):
        return None, reason.matched
    if isinstance(reason.matched, int):
        return reason.matched, None
    return None, None


def _copy_logprobs(batch: BatchTokenIDOutput, ids: list[list[int]], out: BatchStrOutput) -> None:
    """Per-request logprob lists, empty for the requests that did not ask for them."""
    for i in range(len(batch.handles)):
        values = batch.logprobs_of(i)
        top_val, top_idx = batch.top_logprobs_of(i)
        out.output_token_logprobs_val.append(values)
        out.output_token_logprobs_idx.append(ids[i] if values else [])
        out.output_top_logprobs_val.append(top_val)
        out.output_top_logprobs_idx.append(top_idx)


def _check_layout(batch: BatchTokenIDOutput) -> None:
    """Refuse a batch whose arrays and sparse lists do not line up with ``handles``."""
    if batch.handles.ndim != 1:
        raise ValueError("BatchTokenIDOutput.handles must be one-dimensional")
    size = len(batch.handles)
    num_ids = len(batch.output_ids)
    problems = []
    offsets = batch.output_offsets
    if offsets is None:
        if (num_ids % size if size else num_ids) != 0:
            problems.append("output_offsets is None (as many ids for each request), but the "
                            "ids do not divide among the requests")
    elif offsets.ndim != 1 or len(offsets) != size + 1 or offsets[0] != 0 or offsets[-1] != num_ids:
        problems.append(f"output_offsets must run from 0 to {num_ids} in {size + 1} entries")
    elif size and bool((offsets[1:] < offsets[:-1]).any()):
        problems.append("output_offsets must not decrease")
    for indices, values in (("finished_indices", "finished_reasons"),
                            ("new_indices", "new_constants"),
                            ("prompt_logprob_indices", "prompt_logprobs")):
        index_list = getattr(batch, indices)
        if len(index_list) != len(getattr(batch, values)):
            problems.append(f"{indices} and {values} differ in length")
        if any(not 0 <= i < size for i in index_list):
            problems.append(f"{indices} has an index out of range")
    logprobs = batch.output_token_logprobs
    if logprobs is not None and len(logprobs) != num_ids:
        problems.append(f"output_token_logprobs has {len(logprobs)} entries for {num_ids} ids")
    if logprobs is not None and any(
        len(top) != num_ids for top in (batch.output_top_logprobs_val,
                                        batch.output_top_logprobs_idx)):
        problems.append(f"output_top_logprobs_val and _idx need {num_ids} entries each")
    if problems:
        raise ValueError(f"BatchTokenIDOutput of {size} requests and {num_ids} ids: "
                         + "; ".join(problems))
