"""Teacher forcing through the grammar seam: a `TokenConstraint` that allows one given token
at each step.

With greedy sampling the engine then emits exactly those tokens, and each one's reported
logprob is its raw log-probability under the model (the runner reads logprobs before any
mask): the log-likelihood of a given continuation, computed by the same batched decode steps
as generation (text-form scoring, `ninfer/server/scoring.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class ForcedTokens:
    """Allows `token_ids[i]` as the i-th emitted token, then finishes."""

    def __init__(self, token_ids: Sequence[int], vocab_size: int):
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("forcing needs at least one token")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"forced token ids must be in [0, {vocab_size})")
        self._ids = ids
        self._vocab_size = vocab_size
        self._next = 0

    def allowed_mask(self) -> np.ndarray:
        mask = np.zeros(self._vocab_size, dtype=bool)
        mask[self._ids[min(self._next, len(self._ids) - 1)]] = True
        return mask

    def advance(self, token_id: int) -> None:
        if self._next >= len(self._ids) or int(token_id) != self._ids[self._next]:
            raise ValueError(f"forced token {self._next} is not {token_id}")
        self._next += 1

    def is_finished(self) -> bool:
        return self._next >= len(self._ids)
