"""The Detokenizer: token ids from the Scheduler in, new text for the TokenizerManager out.

Decoding is incremental, as in vLLM and SGLang. Each running request keeps
its output ids and two offsets: ``read_offset`` ends the ids whose text has
been accounted for, and ``prefix_offset`` starts a window of context before
them. A step decodes the window ``ids[prefix_offset:]`` and subtracts the
decoding of ``ids[prefix_offset:read_offset]``: decoding tokens one by one
would lose SentencePiece's leading-space handling and split byte-level
characters, while decoding the whole output every step would cost O(n²).

Text must never end in the middle of a character. A multi-byte character
spread over several tokens (byte-level BPE, SentencePiece byte fallback)
decodes to U+FFFD until its last byte arrives, so a trailing run of U+FFFD is
held back until the character completes, or until the request finishes, when
everything left is flushed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from framework.comm.transport import Receiver, Sender, Transport
from framework.config import PortArgs, ServerArgs
from framework.messages import BatchStrOutput, BatchTokenIDOutput, FinishReason, Message
from framework.registry import create_codec
from framework.runtime.hf_tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

#: What a decoder yields for bytes that do not (yet) form a whole character.
REPLACEMENT_CHAR = "\ufffd"

DecodeFn = Callable[[Sequence[int]], str]


class IncrementalDecoder:
    """The text state of one request: its output ids, the two offsets, what was emitted.

    ``decode`` turns a list of ids into text with the request's settings
    (special tokens skipped or not) already bound.
    """

    def __init__(self, decode: DecodeFn, context_ids: Sequence[int] = (),
                 stop_strs: Sequence[str] = ()) -> None:
        self.decode = decode
        # Context ids (the end of the prompt) sit before the output in the window but are
        # never part of the text: the first output token then keeps its leading space.
        self.ids: list[int] = list(context_ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop_strs = [s for s in stop_strs if s]
        #: The text of ``ids[:read_offset]``.
        self.text = ""
        #: How many characters have been emitted; may run ahead of ``text`` by a printable tail.
        self.sent_len = 0

    def step(self, new_ids: Sequence[int]) -> str:
        """Add ids of a running request; return the new text that is safe to show."""
        self.ids.extend(new_ids)
        tail = self._unread_text(len(self.ids))
        if tail and not tail.endswith(REPLACEMENT_CHAR):
            self.text += tail
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return self._emit(self._hold_stop_prefix(self.text))
        # The offsets stay put: the window is decoded again once the character's
        # remaining bytes arrive. What precedes the incomplete character is final.
        return self._emit(self._hold_stop_prefix(self.text + tail.rstrip(REPLACEMENT_CHAR)))

    def finish(
        self,
        new_ids: Sequence[int],
        *,
        stop_token: int | None = None,
        stop_str: str | None = None,
    ) -> str:
        """Add the last ids of a finished request; return all the text not yet emitted.

        ``stop_token`` is left out of the text when it is the last new id;
        ``stop_str`` cuts the whole text right before its first occurrence.
        """
        self.ids.extend(new_ids)
        end = len(self.ids)
        if stop_token is not None and len(new_ids) > 0 and new_ids[-1] == stop_token:
            end -= 1
        full_text = self.text + self._unread_text(end)
        if stop_str:
            cut = full_text.find(stop_str)
            if cut != -1:
                full_text = full_text[:cut]
        return self._emit(full_text)

    def _hold_stop_prefix(self, text: str) -> str:
        """``text`` without a tail that could be the start of a stop string.

        The Scheduler ends a request on the token that completes a stop string
        and ``finish`` cuts it; until then a partial match must not be shown,
        since emitted text is never taken back.
        """
        hold = 0
        for stop in self.stop_strs:
            for k in range(min(len(stop) - 1, len(text) - self.sent_len), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
        return text[: len(text) - hold] if hold else text

    def _unread_text(self, end: int) -> str:
        """The text of ``ids[read_offset:end]``, decoded in the context of the window."""
        if end <= self.read_offset:
            return ""
        prefix_text = self.decode(self.ids[self.prefix_offset : self.read_offset])
        window_text = self.decode(self.ids[self.prefix_offset : end])
        return window_text[len(prefix_text) :]

    def _emit(self, visible_text: str) -> str:
        """The part of ``visible_text`` not emitted yet (emitted text is never taken back)."""
        new_text = visible_text[self.sent_len :]
        self.sent_len += len(new_text)
        return new_text


class Detokenizer:
    """Turns ``BatchTokenIDOutput`` into ``BatchStrOutput``, one ``IncrementalDecoder`` per rid.

    A request's state is made on its first output and dropped with its last
    (the one with a finish reason). Subclasses can override ``decode`` (the
    tokenizer call), ``new_decoder``, ``decode_step`` (one request's step) or
    ``handle_message`` (what to do with each received message).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.decoders: dict[str, IncrementalDecoder] = {}
        self._decode_takes_spaces_flag = _accepts_keyword(
            tokenizer, "spaces_between_special_tokens"
        )
        self.receiver: Receiver | None = None
        self.sender: Sender | None = None
        self._stopped = threading.Event()
        self._serving: tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]] | None = None

    @classmethod
    def from_server_args(
        cls, server_args: ServerArgs, port_args: PortArgs, transport: Transport
    ) -> Detokenizer:
        """A Detokenizer with the server's tokenizer, bound to its channels."""
        detokenizer = cls(load_tokenizer(server_args.resolved_tokenizer_path()))
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
        """Decode ids with the tokenizer, passing the spacing flag only where decode takes it."""
        if self._decode_takes_spaces_flag:
            return self.tokenizer.decode(
                list(ids),
                skip_special_tokens=skip_special_tokens,
                spaces_between_special_tokens=spaces_between_special_tokens,
            )
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

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
        rid: str,
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
        decoder = self.decoders.get(rid)
        if decoder is None:
            decoder = self.new_decoder(
                skip_special_tokens=skip_special_tokens,
                spaces_between_special_tokens=spaces_between_special_tokens,
                context_ids=context_ids,
                stop_strs=() if no_stop_trim else stop_strs,
            )
            self.decoders[rid] = decoder
        if finished_reason is None:
            return decoder.step(new_ids)
        del self.decoders[rid]
        stop_token, stop_str = _stop_to_trim(finished_reason, no_stop_trim)
        return decoder.finish(new_ids, stop_token=stop_token, stop_str=stop_str)

    def handle_batch(self, batch: BatchTokenIDOutput) -> BatchStrOutput:
        """The new text of every request in ``batch``, in the same order."""
        _check_parallel_lists(batch)
        output_strs = [
            self.decode_step(
                rid,
                batch.output_ids[i],
                batch.finished_reasons[i],
                skip_special_tokens=batch.skip_special_tokens[i],
                spaces_between_special_tokens=batch.spaces_between_special_tokens[i],
                no_stop_trim=batch.no_stop_trim[i],
                context_ids=batch.context_ids[i] if batch.context_ids else (),
                stop_strs=batch.stop_strs[i] if batch.stop_strs else (),
            )
            for i, rid in enumerate(batch.rids)
        ]
        return BatchStrOutput(
            rids=batch.rids,
            finished_reasons=batch.finished_reasons,
            output_strs=output_strs,
            output_ids=batch.output_ids,
            prompt_tokens=batch.prompt_tokens,
            completion_tokens=batch.completion_tokens,
            cached_tokens=batch.cached_tokens,
            output_token_logprobs_val=batch.output_token_logprobs_val,
            output_token_logprobs_idx=batch.output_token_logprobs_idx,
            output_top_logprobs_val=batch.output_top_logprobs_val,
            output_top_logprobs_idx=batch.output_top_logprobs_idx,
        )

    def handle_message(self, msg: Message) -> Message | None:
        """The reply to one received message, or ``None`` when there is nothing to send."""
        if isinstance(msg, BatchTokenIDOutput):
            return self.handle_batch(msg)
        logger.warning("detokenizer ignores a %s message", type(msg).__name__)
        return None

    async def run(self, receiver: Receiver, sender: Sender) -> None:
        """Serve forever: receive from the Scheduler, send text to the TokenizerManager.

        A frame that does not decode is logged and skipped; a closed channel
        (``TransportError``) or cancellation ends the loop.
        """
        while True:
            reply = self.handle_message(await receiver.recv_valid())
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


def _check_parallel_lists(batch: BatchTokenIDOutput) -> None:
    """Refuse a batch whose per-request lists do not line up with ``rids``."""
    size = len(batch.rids)
    optional = [name for name in ("stop_strs", "context_ids") if getattr(batch, name)]
    for name in (
        "finished_reasons",
        "output_ids",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        *optional,
    ):
        if len(getattr(batch, name)) != size:
            raise ValueError(
                f"BatchTokenIDOutput.{name} has {len(getattr(batch, name))} entries for {size} rids"
            )


def _accepts_keyword(tokenizer: Any, name: str) -> bool:
    """Whether the tokenizer's decode (or the ``_decode`` it delegates to) names ``name``."""
    for method_name in ("decode", "_decode"):
        method = getattr(tokenizer, method_name, None)
        if method is None:
            continue
        try:
            parameters = inspect.signature(method).parameters
        except (TypeError, ValueError):  # builtins without a signature
            continue
        if name in parameters:
            return True
    return False
