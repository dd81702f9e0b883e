"""The text of a request's prompt, the key ``cache_aware`` routes on."""

from __future__ import annotations

from typing import Any


def _as_text(value: Any) -> str:
    """A prompt field as text: strings as they are, token ids and lists joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        # A batch of strings, or token ids: either way a stable text of the same prefix.
        return " ".join(_as_text(item) for item in value)
    return "" if value is None else str(value)


def _message_text(message: Any) -> str:
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, list):  # parts: only the text ones say what the prefix is
        content = "".join(part.get("text", "") for part in content
                          if isinstance(part, dict) and isinstance(part.get("text"), str))
    return f"{message.get('role', '')}:{_as_text(content)}\n"


def prompt_text(route: str, body: Any) -> str:
    """The prompt of ``body`` sent to ``route``, or "" when it has none."""
    if not isinstance(body, dict):
        return ""
    if route == "/v1/chat/completions":
        messages = body.get("messages")
        return "".join(map(_message_text, messages)) if isinstance(messages, list) else ""
    if route == "/v1/completions":
        return _as_text(body.get("prompt"))
    if route == "/v1/embeddings":
        return _as_text(body.get("input"))
    if route == "/generate":
        text = body.get("text")
        return _as_text(text if text is not None else body.get("input_ids"))
    return ""
