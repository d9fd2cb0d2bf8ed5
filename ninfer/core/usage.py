"""What a finished request reports: token counts and timings (engine events and API answers alike)."""

from __future__ import annotations

import attrs


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


@attrs.frozen
class Timings:
    queue_s: float  # admission to first scheduled step
    ttft_s: float  # admission to first token
    total_s: float  # admission to finish
