"""Turning a prompt into token ids: the tokenizer and the chat template.

Both calls can take long on a large input, so a large one runs in a worker
thread and the event loop stays free for every other request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from framework.runtime.request_input import RequestError

A = TypeVar("A")
T = TypeVar("T")

#: A chat as templates read it: OpenAI's messages as dicts.
Chat = list[dict[str, Any]]
#: OpenAI's tool definitions for the template, or None.
Tools = list[dict[str, Any]] | None
#: More variables for the template (``chat_template_kwargs``), or None.
TemplateKwargs = Mapping[str, Any] | None

# Inputs longer than this (in characters) are tokenized in a worker thread.
INLINE_TOKENIZE_CHARS = 2048


async def off_loop_if_long(call: Callable[[A], T], arg: A, size: int) -> T:
    """``call(arg)``, in a worker thread when ``size`` characters are too many for the loop."""
    if size > INLINE_TOKENIZE_CHARS:
        return await asyncio.to_thread(call, arg)
    return call(arg)


def chat_size(conversation: list[dict[str, Any]]) -> int:
    """The characters of a chat's contents, which its templating takes time in."""
    return sum(len(str(message.get("content") or "")) for message in conversation)


def chat_template_ids(tokenizer: Any, conversation: Chat, tools: Tools = None,
                      template_kwargs: TemplateKwargs = None) -> list[int]:
    """Token ids of ``conversation`` through the tokenizer's chat template, ending in the
    assistant's turn; ``tools`` (OpenAI's tool definitions) and ``template_kwargs`` go
    to the template. A missing template or one that fails is a ``RequestError``."""
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model's tokenizer has no chat template; start the "
                           "server with --chat-template FILE, or use /v1/completions")
    try:
        ids = tokenizer.apply_chat_template(conversation, tools=tools,
                                            add_generation_prompt=True, tokenize=True,
                                            **(template_kwargs or {}))
    except Exception as exc:  # templates raise their own errors for bad roles
        raise RequestError(f"cannot apply the chat template: {exc}") from None
    if isinstance(ids, Mapping):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
