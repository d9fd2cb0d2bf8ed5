"""One request's scheduling state: its tokens, its KV pages, and where it is in its life.

Plain data, no IO: the planner reads it, the trio driver updates it between steps.

Every step feeds a sequence's next uncomputed tokens `token_ids[num_cached : num_cached + n]`
and samples only when that reaches the end of the known tokens. Prefill, decode and replay
after a dropped pause are therefore one rule: a decode is a chunk of one token, a replay is
a prefill over prompt + already emitted tokens that samples the next, not-yet-emitted token.
"""

from __future__ import annotations

import enum

import numpy as np

from ninfer.cache.pages import pages_for_tokens
from ninfer.core.runner import PageSnapshot, StateSnapshot
from ninfer.sched.request import GenerationRequest


class Phase(enum.Enum):
    WAITING = "waiting"  # in the bounded FIFO, no lane yet
    RUNNING = "running"  # holds a lane; its KV (if any) is resident in pages
    PAUSED = "paused"  # holds a lane; its KV was snapshotted to host or dropped
    FINISHED = "finished"


class Sequence:
    """Mutable state of one admitted or waiting request."""

    def __init__(self, seq_id: int, request: GenerationRequest, *, seed: int, submitted_s: float):
        self.seq_id = seq_id  # also the arrival order: ids increase with submission
        self.request = request
        self.seed = seed
        self.submitted_s = submitted_s
        self.deadline_s = float("inf")
        self.phase = Phase.WAITING
        self.token_ids: list[int] = list(request.prompt_ids)
        self.num_prompt = len(request.prompt_ids)
        self.prompt_array = np.asarray(request.prompt_ids, dtype=np.int32)
        self.num_cached = 0  # positions whose K/V are written in `pages`
        self.num_computed_max = 0  # the most positions ever computed (replay accounting)
        self.num_cached_prompt = 0  # prompt tokens served by the prefix cache
        self.is_prefix_looked_up = False  # attached (and claimed) this step: an admission candidate
        self.prefix_wait = None  # set by the prefix cache while another sequence computes its next pages
        self.num_waiters = 0  # queued requests waiting for the prefix pages this one computes
        self.pages: list[int] = []
        self.snapshot: PageSnapshot | None = None  # set while paused by snapshot
        self.state_snapshot: StateSnapshot | None = None  # its recurrent state then (hybrid models)
        # Hybrid models and the prefix cache: the recurrent state a prefix-cache hit starts from
        # (the checkpoint after its num_cached tokens; the step task restores it on admission),
        # and the prompt position where the cache wants a checkpoint of this sequence's state
        # (prefill rows end there; 0: none wanted).
        self.start_state: StateSnapshot | None = None
        self.checkpoint_at = 0
        self.num_snapshot_pages = 0  # pages the snapshot fills again on resume
        self.num_pauses = 0
        self.is_cancel_requested = False
        self.first_scheduled_s: float | None = None
        self.token_times_s: list[float] = []

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id}, {self.phase.value}, tokens={len(self.token_ids)}, "
            f"cached={self.num_cached}, pages={len(self.pages)})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def num_pending(self) -> int:
        """Known tokens whose K/V are not computed yet (1 while decoding)."""
        return len(self.token_ids) - self.num_cached

    def pages_needed(self, num_new_tokens: int, page_size: int) -> int:
        """New pages a step feeding `num_new_tokens` more tokens would need."""
        total = pages_for_tokens(self.num_cached + num_new_tokens, page_size)
        return max(0, total - len(self.pages))
