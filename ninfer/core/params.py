"""Per-request sampling knobs and the limits the edges check requests against."""

from __future__ import annotations

import attrs

MAX_TOP_LOGPROBS = 20  # alternatives one sampled token may report

# Temperatures below this sample greedily: logits divided by a float32 this small (or one that
# rounds to 0 or a subnormal) overflow to inf / NaN, and the draw finds no candidate.
MIN_TEMPERATURE = 1e-5


def in_range(lo, hi):
    """An attrs validator: lo <= value <= hi."""

    def check(instance, attribute, value):
        if not lo <= value <= hi:
            raise ValueError(f"{attribute.name} must be between {lo} and {hi}, got {value}")

    return check


def _greedy_below_min(value):
    if isinstance(value, (int, float)) and 0.0 < value < MIN_TEMPERATURE:
        return 0.0
    return value


@attrs.frozen(kw_only=True)
class SamplingParams:
    """Per-request sampling knobs. temperature == 0 means greedy (so does any below MIN_TEMPERATURE)."""

    temperature: float = attrs.field(default=1.0, converter=_greedy_below_min, validator=in_range(0.0, 100.0))
    top_k: int = attrs.field(default=0, validator=in_range(0, 1 << 30))  # 0 = off
    top_p: float = attrs.field(default=1.0, validator=in_range(0.0, 1.0))
    min_p: float = attrs.field(default=0.0, validator=in_range(0.0, 1.0))
    presence_penalty: float = attrs.field(default=0.0, validator=in_range(-2.0, 2.0))
    frequency_penalty: float = attrs.field(default=0.0, validator=in_range(-2.0, 2.0))
    repetition_penalty: float = attrs.field(default=1.0, validator=in_range(0.01, 10.0))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
