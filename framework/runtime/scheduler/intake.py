"""Intake: messages from the TokenizerManager become queued requests, or aborts.

The edge (HTTP or Engine) checks every user value first; ``validate`` is the last
line, for what only the Scheduler knows (the KV pool's size) or what a client of
the raw channel could send.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from framework.lora.names import parse_lora_paths
from framework.messages import (
    AbortReq,
    FinishReason,
    Message,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from framework.runtime.request import Req
from framework.sampling_params import SamplingParams

if TYPE_CHECKING:
    from framework.config import ServerArgs
    from framework.constrained.manager import GrammarManager
    from framework.runtime.scheduler.queues import RequestQueues

logger = logging.getLogger("framework.scheduler")

_EMBEDDING_PARAMS = SamplingParams(max_new_tokens=0)


class Intake:
    """Turns incoming messages into queued requests, or aborts."""

    def __init__(self, *, server_args: ServerArgs, queues: RequestQueues,
                 grammars: GrammarManager, context_len: int, kv_slots: int, vocab_size: int,
                 is_embedding: bool) -> None:
        self.server_args = server_args
        self.queues = queues
        self.grammars = grammars
        self.context_len = context_len
        self.kv_slots = kv_slots
        self.vocab_size = vocab_size
        self.is_embedding = is_embedding
        #: Each LoRA adapter's prefix-cache key space (``Req.lora_key``), by name; never
        #: reused, so that an adapter reloaded under a name gets a fresh one.
        self.lora_keys: dict[str, int] = {}
        self._lora_keys_made = 0
        #: The LoRA adapters served (``--lora-paths``, then those loaded and unloaded over
        #: RPC): a request naming another one, unloaded on its way here, is refused.
        self.lora_names: set[str] = set(parse_lora_paths(server_args.lora_paths))

    def handle(self, msg: Message) -> None:
        """Queue a new request or apply an abort."""
        if isinstance(msg, TokenizedGenerateReqInput):
            self.add_generate_request(msg)
        elif isinstance(msg, TokenizedEmbeddingReqInput):
            self.add(Req(rid=msg.rid, origin_input_ids=list(msg.input_ids),
                         sampling_params=_EMBEDDING_PARAMS, is_embedding=True))
        elif isinstance(msg, AbortReq):
            self.queues.abort(msg)
        else:
            logger.warning("scheduler ignored an unexpected %s", type(msg).__name__)

    def add_generate_request(self, msg: TokenizedGenerateReqInput) -> None:
        """Turn a tokenized request into a ``Req`` and queue it (or reject it at once)."""
        params = msg.sampling_params
        req = Req(
            rid=msg.rid, handle=msg.handle, origin_input_ids=list(msg.input_ids),
            sampling_params=params, stream=msg.stream, return_logprob=msg.return_logprob,
            top_logprobs_num=msg.top_logprobs_num, logprob_start_len=msg.logprob_start_len,
            stream_interval=params.stream_interval or self.server_args.stream_interval,
            lora_name=msg.lora_name,
            lora_key=self.lora_key(msg.lora_name),
        )
        self.add(req)  # checked with the max_new_tokens asked for
        if req.finished_reason is not None:
            return
        room = self.capacity - len(req.origin_input_ids)
        if params.max_new_tokens > room:
            # As the OpenAI API does, generation stops at the context length (or at what the
            # KV cache can hold for a request alone).
            params.max_new_tokens = room
            params.min_new_tokens = min(params.min_new_tokens, params.max_new_tokens)
        self.grammars.prefetch(req)  # compiles while the request waits

    def lora_key(self, name: str | None) -> int:
        """The prefix-cache key space of adapter ``name`` (0: the base model)."""
        if name is None:
            return 0
        if name not in self.lora_keys:
            self._lora_keys_made += 1
            self.lora_keys[name] = self._lora_keys_made
        return self.lora_keys[name]

    def retire_lora(self, name: str) -> None:
        """Forget adapter ``name`` and its key space (it was unloaded)."""
        self.lora_names.discard(name)
        self.lora_keys.pop(name, None)

    @property
    def capacity(self) -> int:
        """The most tokens one request can hold: the context length or the whole KV pool."""
        return min(self.context_len, self.kv_slots)

    def add(self, req: Req) -> None:
        """Queue ``req`` unless it can never run; then finish it with the reason."""
        problem = self.validate(req)
        if problem is not None:
            req.finished_reason = FinishReason("abort", message=problem)
            self.queues.outputs.send([req])
            return
        req.queued_at = time.monotonic()
        self.queues.waiting.append(req)

    def validate(self, req: Req) -> str | None:
        """Why ``req`` cannot run, or None (the edge checks first; this is the last line)."""
        n = len(req.origin_input_ids)
        if req.is_embedding != self.is_embedding:
            served = "embeddings" if self.is_embedding else "text generation"
            return f"this model serves {served} only"
        if n == 0:
            return "the prompt is empty"
        if n > self.context_len:
            return f"the input has {n} tokens, more than the context length {self.context_len}"
        # Embeddings and prompts only scored (max_new_tokens 0) generate nothing after it.
        generates = not req.is_embedding and req.sampling_params.max_new_tokens != 0
        if n == self.context_len and generates:
            return (f"the prompt has {n} tokens, but the model's context length is "
                    f"{self.context_len}: no room is left for a new token")
        if n + 1 > self.kv_slots:
            # Admission keeps a slot for the token after any prompt (``PrefillAdder``).
            return (f"the prompt has {n} tokens, but the KV cache holds only "
                    f"{self.kv_slots} (the prompt and one new token must fit)")
        if any(t < 0 or t >= self.vocab_size for t in req.origin_input_ids):
            return f"token ids must be in [0, {self.vocab_size})"
        if req.lora_name is not None and req.lora_name not in self.lora_names:
            return f"LoRA adapter {req.lora_name!r} is not loaded"
        if req.logprob_start_len >= n:
            return f"logprob_start_len must be below the prompt's length {n}"
        return None
