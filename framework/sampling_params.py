"""Per-request sampling parameters, checked before a request enters the runtime."""

from __future__ import annotations

import msgspec

_TOP_K_ALL = -1


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How one request samples its tokens and when it stops.

    The field names follow SGLang's native ``sampling_params`` object, so that a
    ``/generate`` body written for SGLang works here unchanged. ``verify()``
    raises ``ValueError`` naming the offending field.
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

    @classmethod
    def from_dict(cls, params: dict | None) -> SamplingParams:
        """Build from a JSON-like dict; unknown keys and wrong types are ``ValueError``s."""
        params = dict(params or {})
        if isinstance(params.get("stop"), str):
            params["stop"] = [params["stop"]]
        try:
            return msgspec.convert(params, cls, strict=False)
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid sampling_params: {exc}") from None

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0 or self.top_k == 1

    def verify(self) -> None:
        """Raise ``ValueError`` with a message naming the field if any value is out of range."""
        checks: list[tuple[bool, str]] = [
            (self.max_new_tokens >= 0, f"max_new_tokens must be >= 0, got {self.max_new_tokens}"),
            (self.min_new_tokens >= 0, f"min_new_tokens must be >= 0, got {self.min_new_tokens}"),
            (
                self.min_new_tokens <= self.max_new_tokens,
                f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens "
                f"({self.max_new_tokens})",
            ),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (
                self.top_k == _TOP_K_ALL or self.top_k >= 1,
                f"top_k must be -1 (disabled) or >= 1, got {self.top_k}",
            ),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                -2.0 <= self.presence_penalty <= 2.0,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                0.0 < self.repetition_penalty <= 2.0,
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
            ),
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (
                self.stream_interval is None or self.stream_interval >= 1,
                f"stream_interval must be >= 1, got {self.stream_interval}",
            ),
            (
                all(isinstance(s, str) and s for s in self.stop),
                "stop must be a list of non-empty strings",
            ),
            (
                all(t >= 0 for t in self.stop_token_ids),
                "stop_token_ids must be non-negative token ids",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
