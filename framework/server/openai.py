"""OpenAI-compatible request schemas (and SGLang's native ones), with their checks.

Requests are ``msgspec.Struct``s: decoding validates types, and unknown
fields are ignored as OpenAI ignores them. ``_SamplingFields.sampling_params`` maps
the OpenAI names onto ``SamplingParams``. A field that OpenAI's API (or SGLang's, on
``/generate``) lets a client send as ``null`` is typed ``X | None``: with a default
other than None, a ``null`` means that default (see ``_NullMeansDefault``).
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from typing import Any, ClassVar, Union

import msgspec

from framework.constrained.base import InvalidConstraintError
from framework.sampling_params import (
    SAMPLING_RANGES,
    FieldError,
    SamplingParams,
    check_token_ids,
    check_top_logprobs_num,
)
from framework.server.chat_tools import ToolCallMessage, ToolDef

# A string, a list of strings, token ids or lists of token ids; msgspec unions allow one list
# type, so the list's items are checked by ``split_prompts``.
Prompt = Union[str, list[Any]]  # noqa: UP007 - msgspec needs a runtime Union


class UnsupportedFieldError(ValueError):
    """A request set a field this server knows but does not implement (400 naming it)."""

    def __init__(self, field: str) -> None:
        super().__init__(f"`{field}` is not supported by this server")
        self.param = field


@functools.cache
def _null_defaults(cls: type[msgspec.Struct]) -> tuple[tuple[str, Any], ...]:
    """``(name, default)`` of each field of ``cls`` with a plain default other than None."""
    return tuple((f.name, f.default) for f in msgspec.structs.fields(cls)
                 if f.default is not None and f.default is not msgspec.NODEFAULT)


class _NullMeansDefault(msgspec.Struct, kw_only=True):
    """A request body in which an explicit ``null`` means "not given".

    OpenAI's API marks most request fields nullable, and clients that serialise
    ``None`` send ``null`` for what they leave unset. Such a field is typed ``X | None``
    so that ``null`` decodes; if its default is not None, ``__post_init__`` (which
    msgspec runs after decoding) puts that default in its place, so that every later
    reader sees the same value as for a field left out.
    """

    def __post_init__(self) -> None:
        for name, default in _null_defaults(type(self)):
            if getattr(self, name) is None:
                setattr(self, name, default)


class _RefusesUnsupported(_NullMeansDefault, kw_only=True):
    """A request with fields that are refused unless left at a value meaning "off".

    ``UNSUPPORTED`` maps each such field to the values that ask for nothing (its
    default, and its spelled-out equivalents such as ``best_of: 1``). Unknown fields
    stay ignored, as OpenAI ignores them; these are known, and silently ignoring
    them would answer something other than what was asked.
    """

    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {}

    def check_unsupported(self) -> None:
        """Raise ``UnsupportedFieldError`` for the first unsupported field that is set."""
        for name, off_values in self.UNSUPPORTED.items():
            if not _is_one_of(getattr(self, name), off_values):
                raise UnsupportedFieldError(name)


def _is_one_of(value: Any, candidates: tuple[Any, ...]) -> bool:
    """``value in candidates``, but of the same type: ``true`` is not ``1`` here."""
    return any(type(value) is type(c) and value == c for c in candidates)


# Fields of both OpenAI routes (OpenAI's, and SGLang's and vLLM's extensions) that this
# server takes another way: a LoRA adapter is named by ``model`` on these routes.
_UNSUPPORTED_SAMPLING: dict[str, tuple[Any, ...]] = {
    "lora_path": (None,),
}
# What ``response_format: {"type": "json_object"}`` asks for: any JSON object.
_ANY_JSON_OBJECT = '{"type": "object"}'


def response_format_schema(response_format: dict[str, Any] | None) -> str | None:
    """The JSON schema (as a string) that OpenAI's ``response_format`` asks for, or None.

    ``{"type": "text"}`` asks for nothing, ``{"type": "json_object"}`` for any JSON
    object, ``{"type": "json_schema", "json_schema": {"schema": {...}}}`` for that schema.
    """
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _ANY_JSON_OBJECT
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise InvalidConstraintError(
                "response_format", "a json_schema response_format needs "
                "json_schema.schema, a JSON schema object")
        return json.dumps(schema)
    raise InvalidConstraintError(
        "response_format", f"type must be text, json_object or json_schema, got {kind!r}")


class StreamOptions(_NullMeansDefault, kw_only=True):
    """``stream_options`` of a streaming request."""

    include_usage: bool | None = False


class _SamplingFields(_RefusesUnsupported, kw_only=True):
    """Sampling fields shared by completions and chat completions (OpenAI names + extras)."""

    model: str | None = None
    # OpenAI's nullable fields: a null means the default (see _NullMeansDefault).
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    seed: int | None = None
    user: str | None = None
    # Extensions that SGLang and vLLM accept as well.
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[int] | None = None
    no_stop_trim: bool = False
    # Known but not implemented (see UNSUPPORTED): typed Any, so that any value set gets
    # the same 400 naming the field.
    lora_path: Any = None
    logit_bias: dict[str, float] | None = None
    # Structured outputs: OpenAI's response_format, or SGLang's constraint fields.
    response_format: dict[str, Any] | None = None
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    ebnf: str | None = None

    def constraint_fields(self) -> dict[str, str]:
        """The ``SamplingParams`` constraint fields set by this request (at most one)."""
        fields = {name: getattr(self, name) for name in ("json_schema", "regex", "ebnf")
                  if getattr(self, name) is not None}
        if isinstance(fields.get("json_schema"), dict):
            fields["json_schema"] = json.dumps(fields["json_schema"])
        schema = response_format_schema(self.response_format)
        if schema is not None:
            if fields:
                raise InvalidConstraintError(
                    "response_format", f"give either response_format or {', '.join(fields)}, "
                    "not both")
            fields["json_schema"] = schema
        return fields

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a ``usage`` chunk (``stream_options.include_usage``)."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_stream_options(self) -> None:
        """Refuse ``stream_options`` on a request that does not stream, as OpenAI's API does."""
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options",
                             "stream_options is only allowed when stream is true")

    def sampling_params(self, max_tokens: int | None, default_max: int,
                        field: str = "max_tokens") -> SamplingParams:
        """The runtime's ``SamplingParams`` for this request.

        ``max_tokens`` is the value of the request's field ``field`` (None: not given, so
        ``default_max``); a value out of range is refused naming that field.
        """
        if max_tokens is not None:
            # Checked here to be named as the request spells it, in the message too.
            SAMPLING_RANGES["max_new_tokens"].check(field, max_tokens)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_new_tokens=default_max if max_tokens is None else max_tokens,
            min_new_tokens=self.min_tokens, stop=stop,
            stop_token_ids=list(self.stop_token_ids or []), temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty, ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens, no_stop_trim=self.no_stop_trim,
            seed=self.seed, n=self.n, logit_bias=self.logit_bias, **self.constraint_fields(),
        )

    @contextlib.contextmanager
    def naming_fields(self, max_tokens_field: str) -> Iterator[None]:
        """Name a refused ``SamplingParams`` field (an error's ``param``) as this request
        names it: ``max_tokens_field``, ``min_tokens``, ``response_format``."""
        names = {"max_new_tokens": max_tokens_field, "min_new_tokens": "min_tokens"}
        if self.response_format is not None:
            names["json_schema"] = "response_format"
        try:
            yield
        except ValueError as exc:
            param = getattr(exc, "param", None)
            if param in names:
                exc.param = names[param]  # type: ignore[attr-defined]
            raise


class CompletionRequest(_SamplingFields, kw_only=True):
    """``POST /v1/completions``."""

    prompt: Prompt
    # None: not given; the route then asks for 16 tokens, as OpenAI's API does.
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool | None = False
    best_of: Any = None
    suffix: Any = None

    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_UNSUPPORTED_SAMPLING, "best_of": (None, 1), "suffix": (None, ""),
    }

    def requested_max_tokens(self) -> tuple[str, int | None]:
        """The field that limits the completion's length, and its value (None: not given)."""
        return "max_tokens", self.max_tokens

    def top_logprobs_num(self) -> int | None:
        """How many top logprobs each token carries, or None when ``logprobs`` is off."""
        if self.logprobs is not None:
            check_top_logprobs_num(self.logprobs, "logprobs")
        return self.logprobs


# The roles of OpenAI's chat messages; the chat template renders each.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class ChatMessage(msgspec.Struct):
    """One chat message; content may be a string or a list of text parts.

    An assistant message may carry the ``tool_calls`` it made (then its content may be
    null), and a ``tool`` message the ``tool_call_id`` it answers.
    """

    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    # Known but not implemented: OpenAI's deprecated single function call.
    function_call: Any = None

    def for_template(self, index: int) -> dict[str, Any]:
        """``messages[index]`` as the chat template reads it (``text`` checks it)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text(index)}
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        for name in ("tool_call_id", "name"):
            if getattr(self, name) is not None:
                message[name] = getattr(self, name)
        return message

    def text(self, index: int) -> str:
        """The text of ``messages[index]`` (text parts joined).

        A role OpenAI's API does not know, a missing content (but for an assistant's
        tool calls), a part other than text (``image_url``, ``input_audio``, ...: this
        model reads text only), tool calls outside an assistant message and a
        ``function_call`` are refused, with ``param`` naming the field.
        """
        where = f"messages[{index}]"
        if self.role not in CHAT_ROLES:
            raise FieldError(f"{where}.role", f"{where}.role must be one of "
                             f"{', '.join(CHAT_ROLES)}, got {self.role!r}")
        if self.function_call not in (None, []):
            raise UnsupportedFieldError(f"{where}.function_call")
        if self.tool_calls and self.role != "assistant":
            raise FieldError(f"{where}.tool_calls", f"{where}.tool_calls is for assistant "
                             f"messages, not {self.role} ones")
        if self.content is None:
            if self.tool_calls:
                return ""
            raise FieldError(f"{where}.content", f"{where}.content is missing; a {self.role} "
                             "message needs content (a string or a list of text parts)")
        if isinstance(self.content, str):
            return self.content
        return "".join(_text_part(part, f"{where}.content[{i}]")
                       for i, part in enumerate(self.content))


def _text_part(part: dict[str, Any], where: str) -> str:
    """The text of the content part at ``where``; any other kind of part is refused."""
    kind = part.get("type")
    if kind != "text":
        raise FieldError(f"{where}.type", f"{where}.type is {kind!r}, but this model reads "
                         "text only: content parts must have type 'text'")
    text = part.get("text")
    if not isinstance(text, str):
        raise FieldError(f"{where}.text", f"{where}.text must be a string, got {text!r}")
    return text


def chat_conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """``messages`` as the chat template takes them: role, text and the tool fields, each
    message checked."""
    if not messages:
        raise FieldError("messages", "messages must not be empty")
    return [m.for_template(i) for i, m in enumerate(messages)]


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    # "none", "auto", "required" or {"type": "function", "function": {"name": ...}}.
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    # Keyword arguments for the chat template (as SGLang and vLLM take them), e.g.
    # {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None

    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_UNSUPPORTED_SAMPLING,
        # OpenAI's deprecated functions: an empty list and "none" ask for nothing.
        "functions": (None, []), "function_call": (None, "none"),
        "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    }

    def requested_max_tokens(self) -> tuple[str, int | None]:
        """The field that limits the completion's length, and its value (None: not given).

        ``max_completion_tokens`` (OpenAI's current name) wins over ``max_tokens``.
        """
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def top_logprobs_num(self) -> int | None:
        """How many top logprobs each token carries, or None when ``logprobs`` is off.

        As in OpenAI's API, ``top_logprobs`` needs ``logprobs: true``.
        """
        if self.top_logprobs is None:
            return 0 if self.logprobs else None
        if not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs set to true")
        check_top_logprobs_num(self.top_logprobs, "top_logprobs")
        return self.top_logprobs


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/embeddings``."""

    input: Prompt
    model: str | None = None
    encoding_format: str = "float"
    # Embeddings are not shortened: only the model's own size is accepted.
    dimensions: int | None = None
    user: str | None = None


class GenerateRequestBody(_RefusesUnsupported, kw_only=True):
    """``POST /generate``: SGLang's native request."""

    text: str | list[str] | None = None
    input_ids: list[Any] | None = None
    # Each of these is one value for every prompt, or a list of one per prompt.
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    # Nullable in SGLang's request: a null means the default (see _NullMeansDefault).
    return_logprob: bool | list[bool] | None = False
    top_logprobs_num: int | list[int] | None = 0
    logprob_start_len: int | list[int] | None = -1
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    #: The LoRA adapter of every prompt, or a list of one per prompt (None: the base model).
    lora_path: str | list[str | None] | None = None

    def per_prompt(self, field: str, prompts: int) -> list[Any]:
        """Field ``field`` for each of ``prompts`` prompts: a list gives one value per
        prompt (it must have that many), a single value is every prompt's."""
        value = getattr(self, field)
        if not isinstance(value, list):
            return [value] * prompts
        if len(value) != prompts:
            raise FieldError(field, f"{field} has {len(value)} entries for {prompts} "
                             f"prompt(s): give one per prompt, or one value for all")
        return value


class UpdateWeightsBody(msgspec.Struct, kw_only=True):
    """``POST /update_weights_from_disk``."""

    model_path: str
    load_format: str = "auto"
    abort_all_requests: bool = False


class LoadLoraAdapterBody(msgspec.Struct, kw_only=True):
    """``POST /load_lora_adapter``."""

    lora_name: str
    lora_path: str


class UnloadLoraAdapterBody(msgspec.Struct, kw_only=True):
    """``POST /unload_lora_adapter``."""

    lora_name: str


class TokenizeBody(msgspec.Struct, kw_only=True):
    """``POST /tokenize``: ``text`` (``prompt`` is accepted as its alias, as vLLM names it)."""

    text: str | None = None
    prompt: str | None = None

    def the_text(self) -> str:
        """The text to tokenize; exactly one of ``text`` and ``prompt`` must be given."""
        if (self.text is None) == (self.prompt is None):
            raise ValueError("give exactly one of text and prompt")
        return self.text if self.text is not None else self.prompt or ""


class DetokenizeBody(msgspec.Struct, kw_only=True):
    """``POST /detokenize``: token ids (checked against the vocabulary by the route)."""

    tokens: list[Any]


class AbortBody(msgspec.Struct, kw_only=True):
    """``POST /abort_request``."""

    rid: str = ""
    abort_all: bool = False


class ErrorDetail(msgspec.Struct):
    """The ``error`` object of an error answer, as OpenAI's API writes it."""

    message: str
    type: str
    param: str | None
    #: The HTTP status, or a name such as ``model_not_found``, ``invalid_api_key`` or
    #: ``context_length_exceeded``.
    code: int | str | None


class ErrorResponse(msgspec.Struct):
    """The body of every error answer (4xx and 5xx); the schema of /openapi.json's errors."""

    error: ErrorDetail


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def split_prompts(prompt: Prompt, field: str = "prompt",
                  vocab_size: int | None = None) -> list[tuple[str | None, list[int] | None]]:
    """A prompt field as a list of (text, input_ids) pairs, one per prompt.

    Token ids are checked against ``[0, vocab_size)`` here, before any request is sent,
    so that a bad id in a streaming request is a 400 rather than an error event.
    """
    if isinstance(prompt, str):
        return [(prompt, None)]
    if not prompt:
        raise FieldError(field, f"{field} is empty")
    if all(_is_token_id(p) for p in prompt):
        pairs: list[tuple[str | None, list[int] | None]] = [(None, list(prompt))]
    elif all(isinstance(p, str) for p in prompt):
        return [(p, None) for p in prompt]
    elif all(isinstance(p, list) and all(_is_token_id(t) for t in p) for p in prompt):
        pairs = [(None, list(p)) for p in prompt]
    else:
        raise FieldError(field, f"{field} must be a string, a list of strings, or token ids")
    for _, ids in pairs:
        check_token_ids(ids or [], vocab_size, field)
    return pairs
