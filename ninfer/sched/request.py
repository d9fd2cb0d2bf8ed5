"""What a client asks the engine for, and the events it gets back.

The protocol layer turns wire requests into a `GenerationRequest` (token ids already rendered
and tokenized) and turns the event stream back into wire responses.
"""

from __future__ import annotations

import enum
from typing import Protocol

import attrs
import numpy as np

from ninfer.core.params import MAX_TOP_LOGPROBS, SamplingParams
from ninfer.core.usage import Timings, Usage


class TokenConstraint(Protocol):
    """A grammar that restricts which token may come next (structured output, tool calls).

    The engine calls `allowed_mask()` before sampling each token and `advance(token_id)` once
    per emitted token, in order. It never re-advances on replay after a pause.
    """

    def allowed_mask(self) -> np.ndarray | None:
        """bool[vocab] of tokens allowed next, or None when anything may follow."""

    def advance(self, token_id: int) -> None:
        """Consume one emitted token."""

    def is_finished(self) -> bool:
        """True once the grammar accepts and allows nothing more (the engine then stops)."""


def _max_tokens(instance, attribute, value):
    if value < 1:
        raise ValueError(f"max_tokens must be at least 1, got {value}")


def _cache_salt(instance, attribute, value):
    # The prefix cache hashes its UTF-8 bytes inside the step task: it must encode.
    if value is not None:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("cache_salt must be valid Unicode (it holds a lone surrogate)") from None


def _top_logprobs(instance, attribute, value):
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {value}")


@attrs.frozen(kw_only=True, eq=False)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int = attrs.field(validator=_max_tokens)
    sampling: SamplingParams = SamplingParams()
    seed: int | None = None  # None: the engine draws one at admission
    stop: tuple[str, ...] = ()  # stop strings: matched across token boundaries, never emitted
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's own end-of-turn ids
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = attrs.field(default=0, validator=_top_logprobs)
    constraint: TokenConstraint | None = None
    cache_salt: str | None = attrs.field(default=None, validator=_cache_salt)  # isolates tenants in the prefix cache
    cache_read_only: bool = False  # read the prefix cache, publish nothing
    request_id: str = ""
    # scoring: token ids whose log-probabilities each sampled position reports
    # (`TokenLogprob.scores`, in this order; needs `logprobs`)
    score_token_ids: tuple[int, ...] = ()
    want_hidden: bool = False  # embeddings: each sampled position reports its final hidden row (TokenDelta.hidden)

    def __attrs_post_init__(self):
        if not self.prompt_ids:
            raise ValueError("the prompt must hold at least one token")
        if self.score_token_ids and not self.logprobs:
            raise ValueError("score_token_ids are reported with the logprobs: set logprobs")


class FinishReason(enum.Enum):
    STOP = "stop"  # end-of-turn token, stop token id or stop string
    LENGTH = "length"  # max_tokens or the context limit
    CANCELLED = "cancelled"
    ERROR = "error"


@attrs.frozen
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first
    scores: tuple[float, ...] = ()  # logprobs of the request's score_token_ids at this position


@attrs.frozen
class Started:
    request_id: str
    prompt_tokens: int
    cached_tokens: int


@attrs.frozen
class TokenDelta:
    token_ids: tuple[int, ...]
    text: str  # newly completed text (never broken UTF-8, never part of a stop string)
    logprobs: tuple[TokenLogprob, ...] | None = None
    hidden: np.ndarray | None = attrs.field(default=None, eq=False)  # float32 [d_model]: want_hidden


@attrs.frozen
class Finished:
    reason: FinishReason
    usage: Usage
    timings: Timings
    stop_sequence: str | None = None  # the stop string or token text that ended it
    error: str | None = None  # message when reason is ERROR
    stop_token_id: int | None = None  # the stop / end-of-turn token that ended it (never emitted)


Event = Started | TokenDelta | Finished


class EngineError(Exception):
    """Base of the errors `submit` raises before a request starts."""


class Overloaded(EngineError):
    """The pending queue is full (HTTP 429 / Anthropic 529)."""


class QueueTimeout(EngineError):
    """The request waited past its pending deadline (HTTP 503)."""


class RequestTooLarge(EngineError):
    """Prompt + max_tokens can never fit the context (HTTP 400)."""


class EngineUnhealthy(EngineError):
    """The runner failed; the engine takes no more work (HTTP 503)."""


class ShuttingDown(EngineError):
    """The server is shutting down: no new work, and the queue is answered at once (HTTP 503)."""


class RequestFailed(EngineError):
    """This request's own work failed inside the engine before it started; the others go on
    (HTTP 500). The details are in the server's log, never in another client's answer."""


class InvalidRequest(EngineError, ValueError):
    """The request can never run as given, e.g. token ids outside the vocabulary (HTTP 400)."""
