"""Per-request sampling parameters, checked before a request enters the runtime.

Every limit a request's values must respect lives here, so that each edge (the HTTP
routes, the Engine, the TokenizerManager) refuses the same values with the same words.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

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


def check_top_logprobs_num(value: object, field: str = "top_logprobs_num") -> None:
    """Raise ``ValueError`` naming ``field`` unless ``value`` is an int in [0, MAX_TOP_LOGPROBS]."""
    if not _is_int(value) or not 0 <= value <= MAX_TOP_LOGPROBS:  # type: ignore[operator]
        raise FieldError(
            field, f"{field} must be an integer in [0, {MAX_TOP_LOGPROBS}], got {value!r}"
        )


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
        self._verify_floats()
        self._verify_ints()
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

    def _verify_floats(self) -> None:
        """Finite values first (NaN compares false to every bound), then each range."""
        floats = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        for name, value in floats.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise FieldError(name, f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise FieldError(name, f"{name} must be a finite number, got {value!r}")
        checks: list[tuple[bool, str, str]] = [
            (
                0.0 <= self.temperature <= MAX_TEMPERATURE,
                "temperature",
                f"temperature must be in [0, {MAX_TEMPERATURE:g}] (below {GREEDY_TEMPERATURE:g}"
                f" it means greedy), got {self.temperature}",
            ),
            (0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (
                -MAX_PENALTY <= self.frequency_penalty <= MAX_PENALTY,
                "frequency_penalty",
                f"frequency_penalty must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got "
                f"{self.frequency_penalty}",
            ),
            (
                -MAX_PENALTY <= self.presence_penalty <= MAX_PENALTY,
                "presence_penalty",
                f"presence_penalty must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got "
                f"{self.presence_penalty}",
            ),
            (
                0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
                "repetition_penalty",
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got "
                f"{self.repetition_penalty}",
            ),
        ]
        _raise_first(checks)

    def _verify_ints(self) -> None:
        """Integer fields: each within its range, all within what msgpack and torch carry."""
        ints = {
            "max_new_tokens": self.max_new_tokens,
            "min_new_tokens": self.min_new_tokens,
            "top_k": self.top_k,
            "n": self.n,
        }
        if self.stream_interval is not None:
            ints["stream_interval"] = self.stream_interval
        if self.seed is not None:
            ints["seed"] = self.seed
        for name, value in ints.items():
            if not _is_int(value):
                raise FieldError(name, f"{name} must be an integer, got {value!r}")
        checks: list[tuple[bool, str, str]] = [
            (
                0 <= self.max_new_tokens <= INT64_MAX,
                "max_new_tokens",
                f"max_new_tokens must be in [0, {INT64_MAX}], got {self.max_new_tokens}",
            ),
            (
                0 <= self.min_new_tokens <= INT64_MAX,
                "min_new_tokens",
                f"min_new_tokens must be in [0, {INT64_MAX}], got {self.min_new_tokens}",
            ),
            (
                self.min_new_tokens <= self.max_new_tokens,
                "min_new_tokens",
                f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens "
                f"({self.max_new_tokens})",
            ),
            (
                self.top_k == _TOP_K_ALL or 1 <= self.top_k <= INT64_MAX,
                "top_k",
                f"top_k must be -1 (disabled) or in [1, {INT64_MAX}], got {self.top_k}",
            ),
            (1 <= self.n <= MAX_N, "n", f"n must be in [1, {MAX_N}], got {self.n}"),
            (
                self.stream_interval is None or 1 <= self.stream_interval <= INT64_MAX,
                "stream_interval",
                f"stream_interval must be in [1, {INT64_MAX}], got {self.stream_interval}",
            ),
            (
                self.seed is None or SEED_MIN <= self.seed <= SEED_MAX,
                "seed",
                f"seed must be in [-2**63, 2**64 - 1] = [{SEED_MIN}, {SEED_MAX}], "
                f"got {self.seed}",
            ),
        ]
        _raise_first(checks)


def _raise_first(checks: list[tuple[bool, str, str]]) -> None:
    """Raise ``FieldError`` naming the field and with the message of the first check that
    failed."""
    for ok, field, message in checks:
        if not ok:
            raise FieldError(field, message)
