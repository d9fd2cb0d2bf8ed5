"""The reference sampler: one logits row and a `SampleSpec` in, one `SampledToken` out.

Every backend implements exactly these semantics (the CUDA sampler is tested against this
module), so the steps are written out plainly, in the order they apply:

1. Read-out: `logprobs = log_softmax(logits)` of the raw row. The sampled token's logprob,
   the top-k read-out (k <= 20; ties broken by lower id) and the log-probabilities of
   `spec.score_ids` (scoring) come from here.
2. Repetition penalty (Hugging Face style) over the unique ids of prompt + output: a positive
   logit is divided by the penalty, a negative one multiplied.
3. Presence / frequency penalties (OpenAI style) over the output ids:
   `logit -= presence * (count > 0) + frequency * count`.
4. Grammar mask: tokens outside `spec.allowed` get -inf. No allowed token -> `NoAllowedToken`.
5. Greedy (temperature 0): argmax, the lowest id on ties. Done.
6. Otherwise `z = logit / temperature` and weights `w = exp(z - max z)` (float32). Candidates
   are ordered by (z desc, id asc); each filter keeps a prefix of that order:
   - top_k (0 = off): the first k;
   - top_p (1 = off): the shortest prefix of the top-k set whose cumulative weight reaches
     `top_p * (total weight of the top-k set)`;
   - min_p (0 = off): the prefix before the first token with `w < min_p * w_max` (w_max = 1).
   The kept set is the shortest of those prefixes.
7. Draw: `u = uniform(seed, token_index)`; with `c` the float32 running sum of the kept weights
   in that order, the token is the first one with `c[i] > u * c[-1]`.

Zero-weight tokens (masked, or exp underflow) can never be drawn by step 7, so they are
dropped before sorting; that changes no result and keeps the sort short.

Padded vocabularies: where the model's head has more rows than the tokenizer has ids
(`num_ids`, from `ModelSpec.tokenizer_vocab_size`), every step runs on the first `num_ids`
logits only: the padding ids are never sampled, never in the top-k read-out, and the
log-probabilities are normalised over real tokens (a scored padding id reads -inf). The
`logits` returned with `want_logits` stay the raw, full row.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ninfer.core.runner import SampledToken, SampleSpec

_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


class NoAllowedToken(ValueError):
    """The grammar mask allows no token at all, so nothing can be sampled."""


def uniform(seed: int, index: int) -> float:
    """A uniform float in [0, 1): the `index`-th output of splitmix64 seeded with `seed`.

    Exact formula, in wrapping uint64 arithmetic (seed and index taken modulo 2**64):

        x = seed + (index + 1) * 0x9E3779B97F4A7C15
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB
        x =  x ^ (x >> 31)
        u = (x >> 40) / 2**24          # top 24 bits, exact in float32

    It is a pure function of (seed, index), so a seeded request draws the same numbers in any
    batch and after pause / replay.
    """
    x = (seed + (index + 1) * _GOLDEN_GAMMA) & _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    x ^= x >> 31
    return (x >> 40) / float(1 << 24)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float32 log_softmax of one row: `x - max - log(sum(exp(x - max)))`."""
    x = np.asarray(logits, dtype=np.float32)
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum(dtype=np.float32))


def top_ids(values: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest values, best first, ties broken by lower id (int32 [k])."""
    k = min(k, values.shape[0])
    if k <= 0:
        return np.zeros(0, dtype=np.int32)
    kth = np.partition(values, values.shape[0] - k)[values.shape[0] - k]
    candidates = np.flatnonzero(values >= kth)  # ascending ids, so a stable sort keeps ties
    order = np.argsort(-values[candidates], kind="stable")[:k]
    return candidates[order].astype(np.int32)


def apply_penalties(logits: np.ndarray, spec: SampleSpec) -> np.ndarray:
    """Steps 2-3: a penalised float32 copy of the logits (the input is left untouched)."""
    out = np.array(logits, dtype=np.float32, copy=True)
    params = spec.params
    output_ids = _ids(spec.output_ids)
    if params.repetition_penalty != 1.0:
        seen = np.unique(np.concatenate([_ids(spec.prompt_ids), output_ids]))
        vals = out[seen]
        out[seen] = np.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output_ids.size:
        ids, counts = np.unique(output_ids, return_counts=True)
        out[ids] -= params.presence_penalty + params.frequency_penalty * counts.astype(np.float32)
    return out


def apply_mask(logits: np.ndarray, allowed: np.ndarray | None) -> np.ndarray:
    """Step 4, in place: disallowed tokens get -inf."""
    if allowed is None:
        return logits
    allowed = np.asarray(allowed, dtype=bool)
    if allowed.shape != logits.shape:
        raise ValueError(f"allowed mask has shape {allowed.shape}, logits have {logits.shape}")
    if not allowed.any():
        raise NoAllowedToken("the grammar allows no next token, so nothing can be sampled")
    logits[~allowed] = -np.inf
    return logits


def kept_candidates(logits: np.ndarray, spec: SampleSpec) -> tuple[np.ndarray, np.ndarray]:
    """Step 6: (ids, weights) of the kept tokens in draw order (z desc, id asc)."""
    params = spec.params
    z = logits / np.float32(params.temperature)
    weights = np.exp(z - z.max())
    if params.top_p >= 1.0 and params.min_p > 0:
        # Without top_p nothing below the min_p floor matters: skip sorting it.
        ids = np.flatnonzero(weights >= np.float32(params.min_p))
    else:
        ids = np.flatnonzero(weights > 0)
    if 0 < params.top_k < ids.size:
        ids = ids[top_ids(z[ids], params.top_k)]  # ids ascending, so ties keep the lower id
    else:
        ids = ids[np.argsort(-z[ids], kind="stable")]
    w = weights[ids]
    num_kept = ids.size
    if params.top_p < 1.0:
        cum = np.cumsum(w, dtype=np.float32)
        target = np.float32(params.top_p) * cum[-1]
        num_kept = min(num_kept, int(np.searchsorted(cum, target, side="left")) + 1)
    if params.min_p > 0:
        below = w < np.float32(params.min_p)
        if below.any():
            num_kept = min(num_kept, int(np.argmax(below)))
    return ids[:num_kept], w[:num_kept]


def draw(weights: np.ndarray, u: float) -> int:
    """Step 7: index of the first running weight sum above `u * total`."""
    cum = np.cumsum(weights, dtype=np.float32)
    index = int(np.searchsorted(cum, np.float32(u) * cum[-1], side="right"))
    return min(index, weights.shape[0] - 1)


def sample(logits: np.ndarray, spec: SampleSpec, *, num_ids: int | None = None) -> SampledToken:
    """Sample one token from a float32 [vocab] logits row (steps 1-7 of the module doc);
    only ids below `num_ids` (the tokenizer's, when the head is padded past it) take part."""
    raw = np.asarray(logits, dtype=np.float32)
    real = raw if num_ids is None or num_ids >= raw.shape[0] else raw[:num_ids]
    logprobs = log_softmax(real)
    allowed = spec.allowed
    if allowed is not None and allowed.shape[0] > real.shape[0]:
        allowed = allowed[: real.shape[0]]  # a grammar's mask over the whole head
    scores = apply_mask(apply_penalties(real, spec), allowed)
    if spec.params.is_greedy:
        token_id = int(np.argmax(scores))
    else:
        ids, weights = kept_candidates(scores, spec)
        token_id = int(ids[draw(weights, uniform(spec.seed, spec.token_index))])
    top = top_ids(logprobs, spec.num_top_logprobs) if spec.num_top_logprobs else None
    return SampledToken(
        token_id=token_id,
        logprob=float(logprobs[token_id]),
        top_ids=top,
        top_logprobs=None if top is None else logprobs[top].astype(np.float32),
        logits=raw.copy() if spec.want_logits else None,
        score_logprobs=score_logprobs(logprobs, spec.score_ids, vocab_size=raw.shape[0]),
    )


def score_logprobs(logprobs: np.ndarray, score_ids: np.ndarray | None, *,
                   vocab_size: int | None = None) -> np.ndarray | None:  # fmt: skip
    """float32 log-probabilities of `score_ids` (None when there are none) from a log_softmax row;
    ids past the row but inside `vocab_size` (a padded head's padding) read -inf."""
    if score_ids is None:
        return None
    ids = np.asarray(score_ids, dtype=np.int64).reshape(-1)
    limit = max(vocab_size or 0, logprobs.shape[0])
    if ids.size and (ids.min() < 0 or ids.max() >= limit):
        raise ValueError(f"score ids must be in [0, {limit})")
    padded = np.concatenate([logprobs, np.full(limit - logprobs.shape[0], -np.inf, np.float32)])
    return padded[ids].astype(np.float32)


def sample_rows(logits: np.ndarray, specs: Sequence[SampleSpec], *, num_ids: int | None = None) -> list[SampledToken]:
    """Sample each row of float32 [n, vocab] logits with its own spec."""
    if logits.shape[0] != len(specs):
        raise ValueError(f"{logits.shape[0]} logits rows for {len(specs)} sample specs")
    return [sample(row, spec, num_ids=num_ids) for row, spec in zip(logits, specs, strict=True)]


def _ids(ids: np.ndarray | None) -> np.ndarray:
    if ids is None:
        return np.zeros(0, dtype=np.int64)
    return np.asarray(ids, dtype=np.int64).reshape(-1)
