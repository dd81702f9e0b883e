"""Per-request sampling parameters, checked before a request enters the runtime.

Every limit a request's values must respect lives here, so that each edge (the HTTP
routes, the Engine, the TokenizerManager) refuses the same values with the same words.
The numeric ranges are declared once, as ``Range``s in ``SAMPLING_RANGES`` and
``REQUEST_RANGES``: ``SamplingParams.verify`` walks them, their error messages are built
from them, and ``/openapi.json`` states them (``framework.server.openapi_schema``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

_TOP_K_ALL = -1

# Temperatures below this sample the argmax, as in SGLang and vLLM: dividing float32 logits
# by a smaller temperature may overflow to inf, and the softmax of inf is NaN.
GREEDY_TEMPERATURE = 1e-5
# Any larger temperature already spreads the probability almost evenly; the cap keeps the
# value far from where float32 would round it to inf.
MAX_TEMPERATURE = 100.0
# Top log-probabilities per token that a request may ask for (vLLM's default max_logprobs).
MAX_TOP_LOGPROBS = 20
# Choices of one OpenAI request; each is a full request in the Scheduler.
MAX_N = 128
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
MAX_PENALTY = 2.0  # frequency and presence penalties lie in [-MAX_PENALTY, MAX_PENALTY]
MAX_REPETITION_PENALTY = 2.0  # the repetition penalty lies in (0, MAX_REPETITION_PENALTY]
# Seeds travel as msgpack integers and seed torch generators; both take this range.
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
# Other integer fields must fit a signed 64-bit integer (msgpack, torch tensors).
INT64_MAX = 2**63 - 1
# The structured-output constraints (SGLang's names); a request may set one of them.
CONSTRAINT_FIELDS = ("json_schema", "regex", "ebnf")


class FieldError(ValueError):
    """A field whose value is refused (the API answers 400); ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _is_int(value: object) -> bool:
    """True for an ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def _show(bound: float) -> str:
    """A range's end as messages write it: an int in full, a float at its shortest (2.0: 2)."""
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


@dataclass(frozen=True)
class Range:
    """The values one numeric field accepts.

    The ends are ``low`` and ``high``, each included unless ``low_open`` / ``high_open``;
    an ``integer`` field takes ints (never bools), any other field a finite number.
    ``special`` values lie outside the range and mean something of their own (top_k's
    -1: no top-k), each with the words that say what. ``note`` follows the range in
    messages (temperature's greedy threshold); ``spelled`` writes the ends as expressions,
    shown before their values (seed's ``2**64 - 1``).
    """

    low: float
    high: float
    integer: bool = False
    low_open: bool = False
    high_open: bool = False
    special: tuple[tuple[int, str], ...] = ()
    note: str = ""
    spelled: tuple[str, str] | None = None

    def contains(self, value: float) -> bool:
        """Whether ``value`` (of the right type) is a special value or lies in the range."""
        if any(value == special for special, _ in self.special):
            return True
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def interval(self) -> str:
        """The range as messages write it: ``[0, 1]``, ``(0, 1]``."""
        shape = ("(" if self.low_open else "[") + "{}, {}" + (")" if self.high_open else "]")
        shown = shape.format(_show(self.low), _show(self.high))
        return shown if self.spelled is None else f"{shape.format(*self.spelled)} = {shown}"

    def describe(self) -> str:
        """What a value must be: ``in [0, 1]``, ``-1 (disabled) or in [1, 9...]``, and the
        note in parentheses."""
        text = " or ".join([*(f"{value} ({meaning})" for value, meaning in self.special),
                            f"in {self.interval()}"])
        return f"{text} ({self.note})" if self.note else text

    def check_type(self, field: str, value: object) -> None:
        """Raise ``FieldError`` unless ``value`` is an int (``integer``) or a finite number."""
        if self.integer:
            if not _is_int(value):
                raise FieldError(field, f"{field} must be an integer, got {value!r}")
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise FieldError(field, f"{field} must be a number, got {value!r}")
        # NaN compares false to every bound, so it is refused here, by name.
        if not math.isfinite(value):
            raise FieldError(field, f"{field} must be a finite number, got {value!r}")

    def check(self, field: str, value: float) -> None:
        """Raise ``FieldError`` naming ``field`` and the range unless ``value`` (whose type
        ``check_type`` accepted) is in it."""
        if not self.contains(value):
            raise FieldError(field, f"{field} must be {self.describe()}, got {value}")


#: The range of each numeric field of ``SamplingParams``, in the order ``verify`` checks them.
SAMPLING_RANGES: dict[str, Range] = {
    "temperature": Range(0.0, MAX_TEMPERATURE,
                         note=f"below {GREEDY_TEMPERATURE:g} it means greedy"),
    "top_p": Range(0.0, 1.0, low_open=True),
    "min_p": Range(0.0, 1.0),
    "frequency_penalty": Range(-MAX_PENALTY, MAX_PENALTY),
    "presence_penalty": Range(-MAX_PENALTY, MAX_PENALTY),
    "repetition_penalty": Range(0.0, MAX_REPETITION_PENALTY, low_open=True),
    "max_new_tokens": Range(0, INT64_MAX, integer=True),
    # Its top is also max_new_tokens (``SamplingParams.verify``).
    "min_new_tokens": Range(0, INT64_MAX, integer=True),
    "top_k": Range(1, INT64_MAX, integer=True, special=((_TOP_K_ALL, "disabled"),)),
    "n": Range(1, MAX_N, integer=True),
    "stream_interval": Range(1, INT64_MAX, integer=True),
    "seed": Range(SEED_MIN, SEED_MAX, integer=True, spelled=("-2**63", "2**64 - 1")),
}

#: The range of each numeric field of a generation request beside its sampling parameters.
REQUEST_RANGES: dict[str, Range] = {
    "top_logprobs_num": Range(0, MAX_TOP_LOGPROBS, integer=True),
    # -1: none of the prompt's logprobs. The top that matters is the prompt's length,
    # checked once the prompt is tokenized.
    "logprob_start_len": Range(-1, INT64_MAX, integer=True),
}


def check_top_logprobs_num(value: object, field: str = "top_logprobs_num") -> None:
    """Raise ``ValueError`` naming ``field`` unless ``value`` is an int in the range of
    ``REQUEST_RANGES["top_logprobs_num"]``."""
    allowed = REQUEST_RANGES["top_logprobs_num"]
    if not _is_int(value) or not allowed.contains(value):  # type: ignore[arg-type]
        raise FieldError(field, f"{field} must be an integer {allowed.describe()}, "
                         f"got {value!r}")


def check_token_ids(token_ids: Sequence[object], vocab_size: int | None, field: str) -> None:
    """Raise ``ValueError`` naming ``field`` unless every id is an int in ``[0, vocab_size)``.

    Without a known vocabulary the bound is the signed 64-bit range, which is what the
    Scheduler's tensors hold.
    """
    upper = vocab_size if vocab_size is not None else INT64_MAX + 1
    for position, token in enumerate(token_ids):
        if not _is_int(token) or not 0 <= token < upper:  # type: ignore[operator]
            raise FieldError(
                field, f"{field} must hold integer token ids in [0, {upper}), got {token!r} at "
                f"position {position}"
            )


def wrap_seed(seed: int) -> int:
    """``seed`` moved into [SEED_MIN, SEED_MAX] by a multiple of 2**64.

    The sampler reads a seed modulo 2**64, so the wrapped seed names the same random stream;
    this keeps ``seed + choice`` of an ``n > 1`` request in the range every codec carries.
    """
    if SEED_MIN <= seed <= SEED_MAX:
        return seed
    return (seed - SEED_MIN) % 2**64 + SEED_MIN


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How one request samples its tokens and when it stops.

    The field names follow SGLang's native ``sampling_params`` object, so that a
    ``/generate`` body written for SGLang works here unchanged. ``verify()``
    raises ``ValueError`` naming the offending field and its allowed range.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = _TOP_K_ALL
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    n: int = 1
    stream_interval: int | None = None
    #: Token id (as a string, as OpenAI's JSON keys are) -> value added to its logit.
    logit_bias: dict[str, float] | None = None
    #: Structured outputs (at most one): the output follows a JSON schema (as a JSON string),
    #: fully matches a regular expression, or is a sentence of an EBNF grammar (rule root).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @classmethod
    def from_dict(cls, params: dict | None) -> SamplingParams:
        """Build from a JSON-like dict; unknown keys and wrong types are ``ValueError``s.

        A field given as None (JSON's ``null``) takes its default, as if left out; an
        unknown key is refused whatever its value.
        """
        params = {key: value for key, value in (params or {}).items()
                  if value is not None or key not in cls.__struct_fields__}
        if isinstance(params.get("stop"), str):
            params["stop"] = [params["stop"]]
        if isinstance(params.get("json_schema"), dict):
            params["json_schema"] = json.dumps(params["json_schema"])
        try:
            return msgspec.convert(params, cls, strict=False)
        except msgspec.ValidationError as exc:
            raise FieldError("sampling_params", f"invalid sampling_params: {exc}") from None

    @property
    def has_penalties(self) -> bool:
        """True when a repetition, frequency or presence penalty is switched on."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax (a temperature below 1e-5, or top_k == 1)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def constraint(self) -> tuple[str, str] | None:
        """``(field name, text)`` of the structured-output constraint, or None."""
        for name in CONSTRAINT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice ``index`` of an ``n > 1`` request: n=1, seed + index."""
        seed = None if self.seed is None else wrap_seed(self.seed + index)
        return msgspec.structs.replace(self, n=1, seed=seed)

    def verify(self, vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` naming the field and its range if any value is out of range.

        ``vocab_size``, when known, bounds ``stop_token_ids``.
        """
        for integer in (False, True):  # the floats first, then the integers
            self._verify_ranges(integer)
        if not isinstance(self.stop, list) or not all(
            isinstance(s, str) and s for s in self.stop
        ):
            raise FieldError("stop", "stop must be a list of non-empty strings")
        check_token_ids(self.stop_token_ids, vocab_size, "stop_token_ids")
        self._verify_logit_bias(vocab_size)
        self._verify_constraint()

    def _verify_constraint(self) -> None:
        """At most one constraint, a non-empty string; whether it compiles is checked later."""
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise FieldError(given[1], f"give at most one of {', '.join(CONSTRAINT_FIELDS)}; "
                             f"got {' and '.join(given)}")
        if not given:
            return
        name = given[0]
        if not isinstance(getattr(self, name), str) or not getattr(self, name):
            raise FieldError(name, f"{name} must be a non-empty string")
        if self.min_new_tokens:
            # The grammar decides where the output ends; a ban on ending could leave no token.
            raise FieldError("min_new_tokens", f"min_new_tokens cannot be combined with {name}")

    def _verify_logit_bias(self, vocab_size: int | None) -> None:
        if not self.logit_bias:
            return
        for key, value in self.logit_bias.items():
            if not key.strip().isdigit():
                raise FieldError("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
            check_token_ids([int(key)], vocab_size, "logit_bias")
            if not (isinstance(value, (int, float)) and math.isfinite(value)
                    and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
                raise FieldError("logit_bias", f"logit_bias values must be in "
                                 f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value!r} "
                                 f"for token {key}")

    def logit_bias_by_id(self) -> dict[int, float]:
        """``logit_bias`` with integer token ids (empty when unset)."""
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}

    def _verify_ranges(self, integer: bool) -> None:
        """The fields of ``SAMPLING_RANGES`` of one kind (integers or not): every type,
        then every range, in the table's order.

        A field whose default is None is left unset by None: only a value has a range.
        """
        values = {name: getattr(self, name) for name, allowed in SAMPLING_RANGES.items()
                  if allowed.integer is integer}
        values = {name: value for name, value in values.items()
                  if value is not None or name not in _UNSET_BY_NONE}
        for name, value in values.items():
            SAMPLING_RANGES[name].check_type(name, value)
        for name, value in values.items():
            SAMPLING_RANGES[name].check(name, value)
            if name == "min_new_tokens":
                # Not a range: its top is max_new_tokens, whose own range comes before.
                self._verify_min_new_tokens()

    def _verify_min_new_tokens(self) -> None:
        if self.min_new_tokens > self.max_new_tokens:
            raise FieldError("min_new_tokens", f"min_new_tokens ({self.min_new_tokens}) must "
                             f"be <= max_new_tokens ({self.max_new_tokens})")


# The fields that None leaves unset (None is their default).
_UNSET_BY_NONE = frozenset(field.name for field in msgspec.structs.fields(SamplingParams)
                           if field.default is None)
