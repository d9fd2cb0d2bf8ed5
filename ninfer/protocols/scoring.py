"""Scoring APIs: `POST /v1/score` (closed-set questions over one shared prefix) and
`POST /v1/rerank` (Jina's shape), as wire schemas, protocol-neutral calls and response bodies.

Pure: parsing, validation, the rerank prompt, and the arithmetic of the answers (candidate
distributions, entropy, margin, relevance). The server runs a `ScoreCall` through the engine
(`ninfer/server/scoring.py`) and hands back one `QuestionScore` or `QuestionError` per question.

A question's candidates are scored as the beginning of the assistant's answer:

- token form (every candidate is one token): one prefill row; each candidate's raw
  log-probability at the first answer position, `probability` renormalized over the
  candidates, and `outside_mass` = the raw probability of every other token;
- text form (some candidate is several tokens): each candidate is teacher-forced as the
  answer; its `logprob` is the sum of its tokens' raw log-probabilities (the per-token list
  alongside) and `probability` the softmax of those sums over the candidates.

`entropy` (nats) and `margin` (best minus second-best probability) are of that renormalized
distribution. Rerank asks each document a 4-option question (exact, substitute, complement,
irrelevant: Amazon's ESCI labels) and weighs the four probabilities into `relevance_score`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any, Literal

import attrs

from ninfer.core.params import MAX_TOP_LOGPROBS
from ninfer.protocols.calls import InvalidRequest
from ninfer.protocols.errors import ApiError, ErrorKind
from ninfer.protocols.openai import Content, JsonSchemaFormat, Message, ResponseFormatIn, TextFormat, _make_converter
from ninfer.protocols.openai_calls import _text_of, template_messages
from ninfer.protocols.strict import JsonObject, WireFormatError, between, structure

MAX_QUESTIONS = 256
MAX_CANDIDATES = 256  # per question
MAX_SCORE_ROWS = 4096  # engine requests one call may need: a token-form question is one, a text-form one per candidate
DEFAULT_RERANK_MAX_DOCUMENTS = 256
# chat_template_kwargs may not override what the server passes the template itself
RESERVED_TEMPLATE_KWARGS = frozenset(
    ("messages", "tools", "add_generation_prompt", "continue_final_message", "bos_token", "eos_token", "documents")
)


# ---- wire requests ---------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ScoreQuestionIn:
    id: str
    content: Content
    candidates: list[str] | None = None
    response_format: ResponseFormatIn | None = None


@attrs.frozen(kw_only=True)
class ScoreRequest:
    model: str
    messages: list[Message]
    questions: list[ScoreQuestionIn]
    candidates: list[str] | None = None  # for questions that send none
    top_logprobs: int | None = attrs.field(default=None, validator=between(0, MAX_TOP_LOGPROBS))
    chat_template_kwargs: JsonObject | None = None


@attrs.frozen(kw_only=True)
class RerankDocumentIn:
    text: str


@attrs.frozen(kw_only=True)
class RerankRequest:
    query: str
    documents: list[str | RerankDocumentIn]
    model: str | None = None
    top_n: int | None = None  # clamped to 1 .. len(documents)
    return_documents: bool | None = None  # default true


_CONVERTER = _make_converter()  # OpenAI's messages and content parts, and a document's two shapes


def _document(value, _type):
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return _CONVERTER.structure(value, RerankDocumentIn)
    raise WireFormatError("expected a string or an object with a text field")


_CONVERTER.register_structure_hook(str | RerankDocumentIn, _document)


# ---- calls -----------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ScoreQuestion:
    id: str
    content: str  # one user turn appended to the shared prefix
    candidates: tuple[str, ...]  # non-empty, distinct, none empty


@attrs.frozen(kw_only=True)
class ScoreCall:
    """Closed-set questions over one shared prefix (`messages`, chat-template dicts)."""

    messages: tuple[dict[str, Any], ...]
    questions: tuple[ScoreQuestion, ...]
    top_logprobs: int = 0
    template_kwargs: dict[str, Any] = attrs.field(factory=dict)
    request_id: str = ""


def parse_score_request(body: Any) -> ScoreRequest:
    """Structure a JSON body; raises WireFormatError naming the first bad field."""
    return structure(_CONVERTER, body, ScoreRequest)


def score_call(req: ScoreRequest, request_id: str = "") -> ScoreCall:
    """The call for a parsed /v1/score request (raises InvalidRequest naming the field)."""
    if not 1 <= len(req.questions) <= MAX_QUESTIONS:
        raise InvalidRequest(f"questions must hold 1 to {MAX_QUESTIONS} questions, got {len(req.questions)}.",
                             "questions")  # fmt: skip
    default = _candidates(req.candidates, "candidates") if req.candidates is not None else None
    questions, seen = [], {}
    for i, q in enumerate(req.questions):
        if q.id in seen:
            raise InvalidRequest(f"Question ids must be unique: {q.id!r} is also question {seen[q.id]}.",
                                 f"questions.{i}.id")  # fmt: skip
        seen[q.id] = i
        candidates = _question_candidates(q, default, f"questions.{i}")
        content = _text_of(q.content, f"questions.{i}.content")
        questions.append(ScoreQuestion(id=q.id, content=content, candidates=candidates))
    return ScoreCall(
        messages=template_messages(req.messages), questions=tuple(questions), top_logprobs=req.top_logprobs or 0,
        template_kwargs=_template_kwargs(req.chat_template_kwargs), request_id=request_id,
    )  # fmt: skip


def _question_candidates(q: ScoreQuestionIn, default: tuple[str, ...] | None, param: str) -> tuple[str, ...]:
    enum = _enum_candidates(q.response_format, f"{param}.response_format")
    if enum is not None and q.candidates is not None:
        raise InvalidRequest("Send candidates or a response_format enum, not both.", f"{param}.response_format")
    if q.candidates is not None:
        return _candidates(q.candidates, f"{param}.candidates")
    if enum is not None:
        return enum
    if default is None:
        raise InvalidRequest("This question has no candidates: send candidates on it, a response_format with an "
                             "enum, or top-level candidates for every question.", f"{param}.candidates")  # fmt: skip
    return default


def _candidates(values: Sequence[str], param: str) -> tuple[str, ...]:
    if not 1 <= len(values) <= MAX_CANDIDATES:
        raise InvalidRequest(f"candidates must hold 1 to {MAX_CANDIDATES} strings, got {len(values)}.", param)
    seen: dict[str, int] = {}
    for j, text in enumerate(values):
        if not text:
            raise InvalidRequest("Candidates must not be empty.", f"{param}.{j}")
        if text in seen:
            raise InvalidRequest(f"Candidates must be distinct: {text!r} is also candidate {seen[text]}.",
                                 f"{param}.{j}")  # fmt: skip
        seen[text] = j
    return tuple(values)


def _enum_candidates(fmt: ResponseFormatIn | None, param: str) -> tuple[str, ...] | None:
    """A json_schema response format whose schema is an `enum` gives the candidates: each
    value's compact JSON text (`"Paris"` with its quotes, `3`, `true`)."""
    if fmt is None or isinstance(fmt, TextFormat):
        return None
    if not isinstance(fmt, JsonSchemaFormat):
        raise InvalidRequest("A scored question's response_format must be text, or a json_schema whose schema is an "
                             "enum (its values are the candidates).", param, code="unsupported_value")  # fmt: skip
    schema = fmt.json_schema.schema or {}
    values = schema.get("enum")
    if not isinstance(values, list) or not values or set(schema) - {"enum", "type", "title", "description"}:
        raise InvalidRequest("A scored question's json_schema must be {\"enum\": [...]} (optionally with a type): "
                             "its values are the candidates.", f"{param}.json_schema.schema",
                             code="unsupported_schema")  # fmt: skip
    texts = [json.dumps(v, ensure_ascii=False, separators=(",", ":")) for v in values]
    return _candidates(texts, f"{param}.json_schema.schema.enum")


def _template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    kwargs = dict(kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets them.",
                             "chat_template_kwargs")  # fmt: skip
    return kwargs


# ---- results ---------------------------------------------------------------------------------


@attrs.frozen
class ScoredToken:
    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()  # (token_id, token, logprob), best first


@attrs.frozen(kw_only=True)
class CandidateScore:
    text: str
    logprob: float  # the candidate's raw log-probability: the sum over its tokens
    tokens: tuple[ScoredToken, ...]


@attrs.frozen(kw_only=True)
class QuestionScore:
    form: Literal["token", "text"]
    candidates: tuple[CandidateScore, ...]  # in the question's order
    prompt_tokens: int
    cached_tokens: int
    top: tuple[tuple[int, str, float], ...] | None = None  # token form, top_logprobs > 0: the first position's

    @property
    def probabilities(self) -> list[float]:
        return renormalized([c.logprob for c in self.candidates])

    @property
    def outside_mass(self) -> float | None:
        if self.form != "token":
            return None
        return max(0.0, 1.0 - math.fsum(math.exp(c.logprob) for c in self.candidates))


@attrs.frozen
class QuestionError:
    kind: ErrorKind
    message: str
    code: str | None = None

    def api_error(self, param: str | None = None) -> ApiError:
        return ApiError(self.kind, self.message, param, self.code)


@attrs.frozen
class ScoreOutcome:
    results: tuple[QuestionScore | QuestionError, ...]
    prompt_tokens: int  # the shared prefix once, plus each row's own tokens (see docs/serving.md)


def renormalized(logprobs: Sequence[float]) -> list[float]:
    """softmax over the candidates' log-probabilities (float64, sums to 1)."""
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    total = math.fsum(weights)
    return [w / total for w in weights]


def entropy(probabilities: Sequence[float]) -> float:
    """Shannon entropy in nats."""
    return max(0.0, -math.fsum(p * math.log(p) for p in probabilities if p > 0))


def margin(probabilities: Sequence[float]) -> float:
    """Best minus second-best probability (1 with a single candidate)."""
    ranked = sorted(probabilities, reverse=True)
    return ranked[0] - (ranked[1] if len(ranked) > 1 else 0.0)


def best_index(probabilities: Sequence[float]) -> int:
    """The most probable candidate; ties go to the lower index."""
    return min(range(len(probabilities)), key=lambda i: (-probabilities[i], i))


# ---- /v1/score response ----------------------------------------------------------------------


def _top_json(top) -> list[dict[str, Any]]:
    return [{"token": text, "token_id": tid, "logprob": lp} for tid, text, lp in top]


def _token_json(t: ScoredToken, with_top: bool) -> dict[str, Any]:
    out = {"token": t.token, "token_id": t.token_id, "logprob": t.logprob}
    if with_top:
        out["top_logprobs"] = _top_json(t.top)
    return out


def question_json(index: int, question: ScoreQuestion, result: QuestionScore | QuestionError,
                  top_logprobs: int) -> dict[str, Any]:  # fmt: skip
    """One entry of `results`: the scores, or `error` in the question's own slot."""
    if isinstance(result, QuestionError):
        return {"index": index, "id": question.id, "error": result.api_error().openai()[1]["error"]}
    probs = result.probabilities
    best = best_index(probs)
    text_top = bool(top_logprobs) and result.form == "text"
    out = {
        "index": index,
        "id": question.id,
        "form": result.form,
        "candidates": [
            {"text": c.text, "probability": p, "logprob": c.logprob,
             "tokens": [_token_json(t, text_top) for t in c.tokens]}
            for c, p in zip(result.candidates, probs, strict=True)
        ],  # fmt: skip
        "best": result.candidates[best].text,
        "outside_mass": result.outside_mass,
        "entropy": entropy(probs),
        "margin": margin(probs),
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "error": None,
    }
    if top_logprobs and result.top is not None:
        out["top_logprobs"] = _top_json(result.top)
    return out


def score_response(call: ScoreCall, outcome: ScoreOutcome, *, id: str, created: int, model: str) -> dict[str, Any]:
    pairs = enumerate(zip(call.questions, outcome.results, strict=True))
    results = [question_json(i, q, r, call.top_logprobs) for i, (q, r) in pairs]
    usage = {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": 0, "total_tokens": outcome.prompt_tokens}
    return {"id": id, "object": "score", "created": created, "model": model, "results": results, "usage": usage}


# ---- /v1/rerank ------------------------------------------------------------------------------

RERANK_LABELS = ("A", "B", "C", "D")  # exact, substitute, complement, irrelevant
DEFAULT_RERANK_WEIGHTS = (1.0, 0.6, 0.25, 0.0)
RERANK_SYSTEM = """\
You judge how well a document matches a search query. Choose exactly one of these options:
A) Exact: the document is relevant to the query and satisfies everything it asks for.
B) Substitute: the document is somewhat relevant: it misses some aspect of the query, but could stand in for \
what was asked.
C) Complement: the document does not answer the query, but is useful together with something that does.
D) Irrelevant: the document has nothing to do with the query.
Answer with the letter only."""
RERANK_QUESTION = "Query: {query}\n\nDocument:\n{document}\n\nWhich option fits? Answer A, B, C or D."


def parse_rerank_request(body: Any, max_documents: int) -> RerankRequest:
    req = structure(_CONVERTER, body, RerankRequest)
    if not 1 <= len(req.documents) <= max_documents:
        raise InvalidRequest(f"documents must hold 1 to {max_documents} documents, got {len(req.documents)}.",
                             "documents")  # fmt: skip
    return req


def document_texts(req: RerankRequest) -> list[str]:
    return [d if isinstance(d, str) else d.text for d in req.documents]


def rerank_call(req: RerankRequest, request_id: str = "") -> ScoreCall:
    """Each document as one 4-option question; the query comes before it, so the system prompt
    and the query are the prefix every document shares."""
    questions = tuple(
        ScoreQuestion(id=str(i), content=RERANK_QUESTION.format(query=req.query, document=text),
                      candidates=RERANK_LABELS)
        for i, text in enumerate(document_texts(req))
    )  # fmt: skip
    system = {"role": "system", "content": RERANK_SYSTEM}
    return ScoreCall(messages=(system,), questions=questions, request_id=request_id)


def relevance(result: QuestionScore, weights: Sequence[float]) -> float:
    """The weighted sum of the four options' renormalized probabilities."""
    return math.fsum(w * p for w, p in zip(weights, result.probabilities, strict=True))


def rerank_response(req: RerankRequest, outcome: ScoreOutcome, weights: Sequence[float], *, model: str,
                    id: str) -> dict[str, Any]:  # fmt: skip
    """Jina's shape: results sorted by relevance_score, descending (ties: the lower index first),
    the first `top_n` of them. Every result must be a QuestionScore (the route fails the call
    on a document's error)."""
    texts = document_texts(req)
    scores = [relevance(r, weights) for r in outcome.results]
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    top_n = len(scores) if req.top_n is None else min(max(req.top_n, 1), len(scores))
    results = []
    for i in order[:top_n]:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if req.return_documents is not False:
            item["document"] = {"text": texts[i]}
        results.append(item)
    usage = {"total_tokens": outcome.prompt_tokens, "prompt_tokens": outcome.prompt_tokens}
    return {"id": id, "object": "list", "model": model, "results": results, "usage": usage}
