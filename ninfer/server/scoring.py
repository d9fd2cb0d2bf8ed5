"""Scoring through the engine: a `ScoreCall` (ninfer.protocols.scoring) in, one
`QuestionScore` or `QuestionError` per question out.

Every question is rendered as the shared prefix (`messages`) plus one user turn, through the
chat template with the generation prompt, and its candidates are tokenized on their own (the
text the assistant's answer starts with). Then each question becomes engine requests that join
the same scheduler as generation (admission, lanes, the queue's limits and deadline, metrics,
cancellation):

- token form (every candidate one token): one request, `max_tokens` 1, whose sampled position
  reports the raw log-probabilities of the candidate ids (`GenerationRequest.score_token_ids`,
  read from the logits row by the runner);
- text form: one request per candidate, teacher-forced (`ForcedTokens`: greedy, one allowed
  token per step), whose emitted logprobs are the candidate tokens' raw log-probabilities.

The prefix the requests share (their longest common token prefix) is computed once: with the
prefix cache on and two or more requests, one request of just that prefix runs first and
publishes it; the questions then run `cache_read_only`, reading it without publishing their
own branches, and each reports the prompt tokens it was served from the cache. At most one
request per lane is in flight per call, so one call never overflows the queue by itself.

A caller that tokenizes its own questions (`score(call, prepared=...)`, /v1/systemone) may
branch a question off another's prompt (`PreparedQuestion.branch_len`: its prompt is that
prompt plus a few tokens, e.g. a two-token label's first token fed before reading the
second). With the prefix cache on, the requests whose prompt others branch off (the heads)
run first and publish their prompt; the branches then read it and compute only their own
tokens.
Cancelling the caller (a client that disconnects) cancels every request of the call: queued
ones leave the queue, running ones free their pages within one step.

Embeddings (`embed`) run the same way: one prefill-only request per input, whose sampled
position reports its final hidden row (`GenerationRequest.want_hidden`: last-token pooling).
"""

from __future__ import annotations

import logging
import re

import attrs
import numpy as np
import trio

from ninfer.core.params import SamplingParams
from ninfer.protocols.calls import InvalidRequest
from ninfer.protocols.errors import ApiError, ErrorKind
from ninfer.protocols.scoring import (
    MAX_SCORE_ROWS, CandidateScore, QuestionError, QuestionScore, ScoreCall, ScoredToken, ScoreOutcome,
)  # fmt: skip
from ninfer.sched.forced import ForcedTokens
from ninfer.sched.request import EngineError, EngineUnhealthy, FinishReason, GenerationRequest, ShuttingDown
from ninfer.sched.stream import Completion
from ninfer.server.http_io import error_from_exception
from ninfer.server.service import current_route

log = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0.0)


@attrs.frozen
class _Question:
    """A question after templating and tokenizing: its prompt and each candidate's ids.

    `branch_len`: where set, `prompt_ids[:branch_len]` is another question's whole prompt,
    which this one branches off (see the module's docstring)."""

    prompt_ids: tuple[int, ...]
    candidate_ids: tuple[tuple[int, ...], ...]
    branch_len: int | None = None

    @property
    def is_token_form(self) -> bool:
        firsts = [ids[0] for ids in self.candidate_ids if len(ids) == 1]
        return len(firsts) == len(self.candidate_ids) and len(set(firsts)) == len(firsts)


@attrs.frozen
class _Row:
    """One engine request of a question: the whole token form, or one text-form candidate."""

    question: int
    candidate: int | None
    request: GenerationRequest


PreparedQuestion = _Question  # for callers that tokenize their own questions (`Scorer.score(prepared=...)`)


class Scorer:
    """Runs score calls on a GenerationService's engine and model."""

    def __init__(self, service):
        self.service = service
        self.engine = service.engine
        self.model = service.model

    async def score(self, call: ScoreCall, *, prepared: list[_Question | QuestionError] | None = None,
                    max_rows: int | None = MAX_SCORE_ROWS) -> ScoreOutcome:  # fmt: skip
        """Score every question (raises InvalidRequest for a call that cannot run as sent, the
        engine's errors when it cannot take work; a question's own failure goes in its slot).

        `prepared`: the questions already templated and tokenized (one per question of the
        call), instead of `_prepare`'s rendering of `call.messages` plus each question;
        `max_rows`: the most engine requests the call may need (None: the caller bounds it)."""
        if prepared is None:
            num_chars = sum(len(q.content) for q in call.questions) + sum(
                len(m.get("content") or "") if isinstance(m.get("content"), str) else 0 for m in call.messages
            )
            prepared = await self.service.in_worker(num_chars, self._prepare, call)
        results: list[QuestionScore | QuestionError | None] = [None] * len(call.questions)
        rows: list[_Row] = []
        for i, item in enumerate(prepared):
            if isinstance(item, QuestionError):
                results[i] = item
            else:
                rows += self._rows(call, i, item, results)
        if max_rows is not None and len(rows) > max_rows:
            raise InvalidRequest(
                f"This call needs {len(rows)} scoring requests (one per token-form question, one per candidate of a "
                f"text-form question); the limit is {max_rows}.", "questions",
            )  # fmt: skip
        shared = _common_prefix([row.request.prompt_ids for row in rows])
        heads, branched = self._branches(rows, prepared)
        prompt_tokens = (shared if rows else 0) + sum(
            len(row.request.prompt_ids) - branched.get(k, shared)
            + (row.request.max_tokens if row.candidate is not None else 0)
            for k, row in enumerate(rows)
        )
        if rows:
            if not any(len(rows[k].request.prompt_ids) <= shared for k in heads):  # else a head publishes it
                await self._publish_prefix(call, rows, shared)
            if heads:  # they publish their prompts first; the branches read them
                first = await self._run([attrs.evolve(rows[k].request, cache_read_only=False) for k in heads])
                first_ones = set(heads)
                rest = [k for k in range(len(rows)) if k not in first_ones]
                later = await self._run([rows[k].request for k in rest])
                completions: list = [None] * len(rows)
                for k, done in [*zip(heads, first, strict=True), *zip(rest, later, strict=True)]:
                    completions[k] = done
            else:
                completions = await self._run([row.request for row in rows])
            by_question: dict[int, list] = {}
            for row, done in zip(rows, completions, strict=True):
                by_question.setdefault(row.question, []).append((row, done))
            for i, mine in by_question.items():
                results[i] = self._question_result(call, i, prepared[i], mine)
        return ScoreOutcome(tuple(results), prompt_tokens)

    async def embed(self, inputs: list, request_id: str = "") -> tuple[list[np.ndarray], int]:
        """(one L2-normalized float32 vector per input, prompt tokens): last-token pooling of the
        final hidden rows (the final norm's output at the last prompt position: the LM head's
        input). Texts are tokenized as /v1/completions does (with the model's special tokens);
        token-id inputs are used as sent. Any input that cannot run fails the call."""
        num_chars = sum(len(x) for x in inputs if isinstance(x, str))
        prompts = await self.service.in_worker(num_chars, self._embedding_prompts, inputs)
        rows = [GenerationRequest(prompt_ids=ids, max_tokens=1, sampling=_GREEDY, seed=0, ignore_eos=True,
                                  want_hidden=True, cache_read_only=True, request_id=f"{request_id}/{i}")
                for i, ids in enumerate(prompts)]  # fmt: skip
        vectors = []
        for i, done in enumerate(await self._run(rows)):
            if isinstance(done, QuestionError):
                raise done.api_error(f"input.{i}" if len(inputs) > 1 else "input")
            _raise_if_cancelled(done)
            if done.finished.reason is FinishReason.ERROR or done.hidden is None:
                log.error("embedding request %s/%d failed: %s", request_id, i, done.finished.error)
                raise ApiError(ErrorKind.INTERNAL, "The model failed while embedding an input.")
            hidden = np.asarray(done.hidden, np.float64)
            vectors.append((hidden / max(np.linalg.norm(hidden), 1e-30)).astype(np.float32))
        return vectors, sum(len(ids) for ids in prompts)

    def _embedding_prompts(self, inputs: list) -> list[tuple[int, ...]]:
        """(in a worker thread) Each input's token ids, checked against the vocabulary and the context."""
        vocab, limit = self.model.spec.vocab_size, self.service.max_context
        out = []
        for i, item in enumerate(inputs):
            param = f"input.{i}" if len(inputs) > 1 else "input"
            if isinstance(item, str):
                ids = tuple(int(t) for t in self.model.tokenizer.encode(item, add_special_tokens=True))
            else:
                ids = tuple(item)
                if any(isinstance(t, bool) or not 0 <= t < vocab for t in ids):
                    raise InvalidRequest(f"Token ids must be in [0, {vocab}).", param)
            if not ids:
                raise InvalidRequest("This input tokenizes to nothing.", param)
            if len(ids) >= limit:
                raise InvalidRequest(f"This model's maximum context length is {limit} tokens, but this input has "
                                     f"{len(ids)} (at most {limit - 1} can be embedded).", param,
                                     code="context_length_exceeded")  # fmt: skip
            out.append(ids)
        return out

    def _branches(self, rows: list[_Row], prepared: list) -> tuple[list[int], dict[int, int]]:
        """(the rows others branch off, which run first and publish: with the prefix cache on;
        {branching row: the length of the prompt it branches off})."""
        branch_of: dict[int, tuple[int, ...]] = {}
        for k, row in enumerate(rows):
            cut = prepared[row.question].branch_len
            if cut is not None and cut < len(row.request.prompt_ids):
                branch_of[k] = row.request.prompt_ids[:cut]
        if not branch_of:
            return [], {}
        bases = set(branch_of.values())
        heads = [k for k, row in enumerate(rows) if k not in branch_of and row.request.prompt_ids in bases]
        found = {rows[k].request.prompt_ids for k in heads}
        branched = {k: len(base) for k, base in branch_of.items() if base in found}
        return (heads if self.engine.config.prefix_cache else []), branched

    # ---- preparing -------------------------------------------------------------------

    def _prepare(self, call: ScoreCall) -> list[_Question | QuestionError]:
        """(in a worker thread) Render and tokenize every question and candidate."""
        from ninfer.models.chat_template import ChatTemplate, ChatTemplateError

        template = self.model.chat_template or ChatTemplate.chatml()
        tokenizer = self.model.tokenizer
        vocab = self.model.spec.vocab_size
        by_text: dict[str, tuple[int, ...]] = {}
        out: list[_Question | QuestionError] = []
        for q in call.questions:
            messages = [*call.messages, {"role": "user", "content": q.content}]
            try:
                text = template.render(messages, tools=None, add_generation_prompt=True, **call.template_kwargs)
            except ChatTemplateError as e:
                raise InvalidRequest(f"The chat template rejected the messages: {e}", "messages") from None
            prompt = tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))
            for c in q.candidates:
                if c not in by_text:
                    by_text[c] = tuple(int(t) for t in tokenizer.encode(c, add_special_tokens=False))
            candidates = tuple(by_text[c] for c in q.candidates)
            bad = next((c for c, ids in zip(q.candidates, candidates) if not ids or max(ids) >= vocab), None)
            if bad is not None:
                out.append(QuestionError(ErrorKind.INVALID_REQUEST, f"The candidate {bad!r} does not tokenize to "
                                         "tokens of this model's vocabulary.", "invalid_value"))  # fmt: skip
            elif not prompt:
                empty = "The question renders to an empty prompt."
                out.append(QuestionError(ErrorKind.INVALID_REQUEST, empty, "invalid_value"))
            else:
                out.append(_Question(prompt, candidates))
        return out

    def _rows(self, call: ScoreCall, i: int, q: _Question, results: list) -> list[_Row]:
        """The question's engine requests; a question that cannot fit the context gets its error."""
        longest = 1 if q.is_token_form else max(len(ids) for ids in q.candidate_ids)
        limit = self.service.max_context
        if len(q.prompt_ids) + longest > limit:
            results[i] = QuestionError(
                ErrorKind.INVALID_REQUEST,
                f"This question needs {len(q.prompt_ids) + longest} tokens ({len(q.prompt_ids)} in the prompt, "
                f"{longest} for the longest candidate) but the model's context holds {limit}.",
                "context_length_exceeded",
            )  # fmt: skip
            return []
        common = dict(prompt_ids=q.prompt_ids, sampling=_GREEDY, seed=0, logprobs=True, top_logprobs=call.top_logprobs,
                      ignore_eos=True, cache_read_only=True)  # fmt: skip
        if q.is_token_form:
            scored = tuple(ids[0] for ids in q.candidate_ids)
            request = GenerationRequest(max_tokens=1, score_token_ids=scored, request_id=f"{call.request_id}/{i}",
                                        **common)  # fmt: skip
            return [_Row(i, None, request)]
        vocab = self.model.spec.vocab_size
        return [
            _Row(i, j, GenerationRequest(max_tokens=len(ids), constraint=ForcedTokens(ids, vocab),
                                         request_id=f"{call.request_id}/{i}.{j}", **common))
            for j, ids in enumerate(q.candidate_ids)
        ]  # fmt: skip

    # ---- running ---------------------------------------------------------------------

    async def _publish_prefix(self, call: ScoreCall, rows: list[_Row], shared: int) -> None:
        """Compute the shared prefix once and publish it to the prefix cache, before the rows
        (which only read it) run. Worth a request only where at least a page is shared."""
        engine = self.engine
        if not engine.config.prefix_cache or len(rows) < 2 or shared < engine.config.page_size:
            return
        prefix = rows[0].request.prompt_ids[:shared]
        request = GenerationRequest(prompt_ids=prefix, max_tokens=1, sampling=_GREEDY, seed=0, ignore_eos=True,
                                    request_id=f"{call.request_id}/prefix")  # fmt: skip
        async with self.service.gate.entered(), engine.submit(request) as stream:  # held while quiesced
            done = await stream.collect()
        _raise_if_cancelled(done)

    async def _run(self, requests: list[GenerationRequest]) -> list[Completion | QuestionError]:
        """Every request through the engine, at most one per lane in flight."""
        out: list[Completion | QuestionError | None] = [None] * len(requests)
        window = trio.Semaphore(max(1, self.engine.config.max_concurrency))

        route, live = current_route.get(), self.service.live

        async def run_one(k: int, request: GenerationRequest) -> None:
            try:
                with live.prefill_only(request.request_id, route, len(request.prompt_ids)):  # the dashboard's table
                    async with self.engine.submit(request) as stream:
                        out[k] = await stream.collect()
            except (EngineUnhealthy, ShuttingDown):
                raise  # nothing more can be answered: the call fails (503)
            except EngineError as e:
                api = error_from_exception(e)
                out[k] = QuestionError(api.kind, api.message, api.code)
            finally:
                window.release()

        try:
            async with self.service.gate.entered(), trio.open_nursery() as nursery:  # held while quiesced
                for k, request in enumerate(requests):
                    await window.acquire()
                    nursery.start_soon(run_one, k, request)
        except BaseExceptionGroup as group:  # the engine's refusal, as itself (the route maps it)
            raise _first_leaf(group) from None
        return out

    # ---- results ---------------------------------------------------------------------

    def _question_result(self, call: ScoreCall, i: int, q: _Question, mine: list) -> QuestionScore | QuestionError:
        """A question's scores from its rows' completions (`mine`: (row, completion or error), in order)."""
        for _, done in mine:
            if isinstance(done, QuestionError):
                return done
            _raise_if_cancelled(done)
            if done.finished.reason is FinishReason.ERROR:
                log.error("score request %s/%d failed: %s", call.request_id, i, done.finished.error)
                return QuestionError(ErrorKind.INTERNAL, "The model failed while scoring this question.", None)
        question = call.questions[i]
        cached = min(done.started.cached_tokens for _, done in mine)
        if q.is_token_form:
            ((_, done),) = mine
            (entry,) = done.logprobs
            candidates = tuple(
                CandidateScore(text=text, logprob=lp, tokens=(ScoredToken(ids[0], self._text(ids[0]), lp),))
                for text, ids, lp in zip(question.candidates, q.candidate_ids, entry.scores, strict=True)
            )  # fmt: skip
            top = self._top(entry.top) if call.top_logprobs else None
            return QuestionScore(form="token", candidates=candidates, prompt_tokens=len(q.prompt_ids),
                                 cached_tokens=cached, top=top)  # fmt: skip
        candidates = []
        for (row, done), text, ids in zip(mine, question.candidates, q.candidate_ids, strict=True):
            entries = done.logprobs or ()
            if tuple(e.token_id for e in entries) != ids:
                log.error("score request %s/%d.%d emitted %s, not the forced %s", call.request_id, i, row.candidate,
                          [e.token_id for e in entries], ids)  # fmt: skip
                return QuestionError(ErrorKind.INTERNAL, "The model failed while scoring this question.", None)
            tokens = tuple(ScoredToken(e.token_id, self._text(e.token_id), e.logprob, self._top(e.top))
                           for e in entries)  # fmt: skip
            candidates.append(CandidateScore(text=text, logprob=sum(t.logprob for t in tokens), tokens=tokens))
        return QuestionScore(form="text", candidates=tuple(candidates), prompt_tokens=len(q.prompt_ids),
                             cached_tokens=cached)  # fmt: skip

    def _text(self, token_id: int) -> str:
        return self.service.token_text(token_id)

    def _top(self, top) -> tuple[tuple[int, str, float], ...]:
        return tuple((int(t), self._text(t), float(lp)) for t, lp in top)


def thinking_off_kwargs(template) -> dict[str, bool]:
    """The chat template kwargs that turn a reasoning model's thinking off, where its template
    reads them (Qwen3's and SmolLM3's `enable_thinking`); {} for other templates."""
    return {"enable_thinking": False} if re.search(r"\benable_thinking\b", template.source) else {}


def _raise_if_cancelled(done: Completion) -> None:
    """A request the engine cancelled (a shutdown) ends the call with 503."""
    if done.finished.reason is FinishReason.CANCELLED:
        raise ApiError(ErrorKind.UNAVAILABLE, "The server is shutting down; the scoring was cancelled.",
                       code="shutting_down")  # fmt: skip


def _first_leaf(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def _common_prefix(prompts: list[tuple[int, ...]]) -> int:
    """Length of the longest token prefix every prompt shares (0 without prompts)."""
    if not prompts:
        return 0
    first = prompts[0]
    n = min(len(p) for p in prompts)
    for p in prompts[1:]:
        if p[:n] != first[:n]:  # bisect on slices: compared in C, not token by token
            lo, hi = 0, n  # p[:lo] == first[:lo], p[:hi] != first[:hi]
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if p[:mid] == first[:mid]:
                    lo = mid
                else:
                    hi = mid
            n = lo
    return n
