"""How close one runner's distributions are to another's: the guard on a faster, inexact path.

`compare(runner_a, runner_b, token_ids)` feeds the same text to both, one token a step (the
decode path, where activation quantization acts), and compares the next-token distributions
at every position: top-1 agreement, mean KL(a || b) per token, and each one's perplexity of
the text. `greedy_agreement` lets both generate greedily from one prompt and reports how long
they agree. Any `Runner` works: the CUDA runner with `q8` against `f32`, either against the
numpy reference.

`token_logprobs` and `kl_rows` are the same figures over many logits rows at once (float64,
a block of rows at a time): what `ninfer score` reports for a corpus.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from ninfer.core.params import SamplingParams
from ninfer.core.runner import Runner, SampleSpec, StepRow

_GREEDY = SamplingParams(temperature=0.0)


@attrs.frozen
class Agreement:
    num_positions: int
    top1_agreement: float  # fraction of positions whose argmax is the same
    mean_kl: float  # mean over positions of KL(a || b), nats
    perplexity_a: float  # of the text's next tokens
    perplexity_b: float

    @property
    def perplexity_ratio(self) -> float:
        return self.perplexity_b / self.perplexity_a


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - logits.max()
    return z - np.log(np.exp(z).sum())


_BLOCK = 64  # logits rows converted to float64 at a time


def log_softmax_rows(logits: np.ndarray) -> np.ndarray:
    """float64 log_softmax of each row of [n, vocab] logits."""
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def token_logprobs(logits: np.ndarray, targets: Sequence[int]) -> np.ndarray:
    """float64 [n]: log-probability of targets[i] under row i of [n, vocab] logits."""
    logits = np.asarray(logits)
    targets = np.asarray(targets, np.int64)
    if logits.shape[0] != targets.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows for {targets.shape[0]} targets")
    out = np.empty(targets.shape[0], np.float64)
    for lo in range(0, targets.shape[0], _BLOCK):
        lp = log_softmax_rows(logits[lo : lo + _BLOCK])
        out[lo : lo + _BLOCK] = lp[np.arange(lp.shape[0]), targets[lo : lo + _BLOCK]]
    return out


def kl_rows(logits_a: np.ndarray, logits_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(KL(a || b) [n] in nats, argmax agreement [n] bool) of two [n, vocab] logits arrays,
    row by row: a is the reference distribution, as in `compare`."""
    if logits_a.shape != logits_b.shape:
        raise ValueError(f"logits of shape {logits_a.shape} and {logits_b.shape} cannot be compared")
    n = logits_a.shape[0]
    kl, same = np.empty(n, np.float64), np.empty(n, bool)
    for lo in range(0, n, _BLOCK):
        lp_a, lp_b = log_softmax_rows(logits_a[lo : lo + _BLOCK]), log_softmax_rows(logits_b[lo : lo + _BLOCK])
        kl[lo : lo + _BLOCK] = (np.exp(lp_a) * (lp_a - lp_b)).sum(axis=1)
        same[lo : lo + _BLOCK] = lp_a.argmax(axis=1) == lp_b.argmax(axis=1)
    return kl, same


def _pages(runner: Runner, num_tokens: int) -> np.ndarray:
    num = -(-num_tokens // runner.page_size)
    if num > runner.num_pages:
        raise ValueError(f"{num_tokens} tokens need {num} pages; the runner has {runner.num_pages}")
    return np.arange(num, dtype=np.int32)


def _step_logits(runner: Runner, token_id: int, pos: int, pages: np.ndarray) -> np.ndarray:
    spec = SampleSpec(params=_GREEDY, seed=0, token_index=pos, want_logits=True)
    row = StepRow(seq_id=0, token_ids=np.array([token_id], np.int32), start_pos=pos, page_table=pages, sample=spec)
    [sampled] = runner.step([row])
    return np.asarray(sampled.logits, np.float32)


def teacher_forced_logprobs(runner: Runner, token_ids: Sequence[int]) -> np.ndarray:
    """[len(token_ids) - 1, vocab] log-probabilities of the next token after each prefix."""
    pages = _pages(runner, len(token_ids))
    out = [_log_softmax(_step_logits(runner, t, i, pages)) for i, t in enumerate(token_ids[:-1])]
    return np.stack(out)


def compare(runner_a: Runner, runner_b: Runner, token_ids: Sequence[int]) -> Agreement:
    lp_a = teacher_forced_logprobs(runner_a, token_ids)
    lp_b = teacher_forced_logprobs(runner_b, token_ids)
    targets = np.asarray(token_ids[1:])
    rows = np.arange(len(targets))
    kl = (np.exp(lp_a) * (lp_a - lp_b)).sum(axis=1)
    return Agreement(
        num_positions=len(targets),
        top1_agreement=float(np.mean(lp_a.argmax(axis=1) == lp_b.argmax(axis=1))),
        mean_kl=float(kl.mean()),
        perplexity_a=float(np.exp(-lp_a[rows, targets].mean())),
        perplexity_b=float(np.exp(-lp_b[rows, targets].mean())),
    )


def greedy_tokens(runner: Runner, prompt_ids: Sequence[int], num_tokens: int) -> list[int]:
    pages = _pages(runner, len(prompt_ids) + num_tokens)
    spec = SampleSpec(params=_GREEDY, seed=0, token_index=0)
    [first] = runner.step([StepRow(seq_id=0, token_ids=np.asarray(prompt_ids, np.int32), start_pos=0,
                                   page_table=pages, sample=spec)])  # fmt: skip
    out = [int(first.token_id)]
    while len(out) < num_tokens:
        pos = len(prompt_ids) + len(out) - 1
        spec = SampleSpec(params=_GREEDY, seed=0, token_index=len(out))
        row = StepRow(seq_id=0, token_ids=np.array([out[-1]], np.int32), start_pos=pos, page_table=pages, sample=spec)
        [sampled] = runner.step([row])
        out.append(int(sampled.token_id))
    return out


def greedy_agreement(runner_a: Runner, runner_b: Runner, prompt_ids: Sequence[int], num_tokens: int) -> int:
    """How many greedy tokens the two runners generate alike before they first differ."""
    a = greedy_tokens(runner_a, prompt_ids, num_tokens)
    b = greedy_tokens(runner_b, prompt_ids, num_tokens)
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), num_tokens)
