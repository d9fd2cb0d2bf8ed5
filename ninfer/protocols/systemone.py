"""TypeSafe "System One" decisions: `POST /v1/systemone` (and `/systemone`), as a request
schema with FastAPI-style errors, the prompts, and the arithmetic of the answers.

Pure: parsing and validation (every schema violation at once, as FastAPI / pydantic list them),
the prompt of each question (a system message that carries the state, one user turn per
question), the labels a question is answered with, and the answer's probabilities and
confidence from the labels' raw log-probabilities. The server runs the reads
(`ninfer/server/routes_systemone.py`, through `ninfer/server/scoring.py`'s `Scorer`).

Question kinds and their labels (each label is read at the answer's first position):

- `noul`: `Yes` / `No`; the answer is P(Yes).
- `choice`: 1..255 options. Up to 62 options, one label each, in the order A-Z, a-z, 0-9.
  From 63 options on, two-token labels: a letter A-Z, then a digit 0-9 (option i is
  `LETTERS[i // 10] + DIGITS[i % 10]`: A0 .. Z4 for 255), read conditionally:
  P(label) = P(letter) x P(digit | letter), the digit read at the second position after that
  letter was fed.
- `score`: 1..10 levels, labels the digits 0 .. N-1; the answer is the expected score.

Probabilities are softmax(logprob / T) over the labels a read can give (T from the model
name's `-t<T>` suffix; without one, or with T = 0, T = 1: the raw log-probabilities exactly
renormalized). A two-token label multiplies the letter's distribution (over the letters in
use) by the digit's (over that letter's digits in use). The `averaged` readout asks each
question in three framings and averages the three distributions.
"""

from __future__ import annotations

import json
import math
import re
import string
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs

from ninfer.protocols.errors import ApiError, ErrorKind

ROUTES = ("/v1/systemone", "/systemone")
MAX_QUESTIONS = 8192
MAX_OPTIONS = 255
MAX_LEVELS = 10
KINDS = ("noul", "choice", "score")
READOUTS = ("single", "averaged")
NUM_FRAMINGS = 3  # the averaged readout's framings
MAX_READS = NUM_FRAMINGS * MAX_QUESTIONS  # engine requests one call may need (a two-token choice: 1 + its letters)
SINGLE_LABELS = tuple(string.ascii_uppercase + string.ascii_lowercase + string.digits)  # 62
LETTERS = tuple(string.ascii_uppercase)
DIGITS = tuple(string.digits)
YES, NO = "Yes", "No"
_TEMPERATURE_SUFFIX = re.compile(r"-t(\d+(?:\.\d+)?)$")
_TOP_FIELDS = frozenset(("model", "state", "questions", "policy"))
_POLICY_FIELDS = frozenset(("readout",))
_QUESTION_FIELDS = {"noul": frozenset(("type", "question")), "choice": frozenset(("type", "question", "options")),
                    "score": frozenset(("type", "question", "levels"))}  # fmt: skip

SYSTEM_PROMPT = """\
You are an evaluation assistant. Read the state below, then answer each question about it with \
exactly one of the labels the question allows: the label alone, with no explanation.

State:
{state}"""


def is_systemone_path(path: str) -> bool:
    """Whether a request path belongs to this API (its errors take FastAPI's shape)."""
    return any(path == route or path.startswith(route + "/") for route in ROUTES)


# ---- errors ----------------------------------------------------------------------------------


class ValidationFailed(Exception):
    """A body that breaks the schema: 422 with every violation, `{"detail": [...]}`."""

    def __init__(self, errors: list[dict[str, Any]]):
        super().__init__(f"{len(errors)} validation error(s)")
        self.errors = errors

    def body(self) -> dict[str, Any]:
        return {"detail": self.errors}


def violation(loc: Sequence[str | int], msg: str, type_: str) -> dict[str, Any]:
    """One FastAPI / pydantic validation error (`loc` starts with "body")."""
    return {"loc": ["body", *loc], "msg": msg, "type": type_}


MISSING_KEY_CODE = "missing_api_key"  # an AUTHENTICATION ApiError with this code is a 403 here


def detail_error(error: ApiError) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, body, headers) of an ApiError in FastAPI's shape, `{"detail": message}`: the
    OpenAI status of its kind, except a missing API key (403, as FastAPI's security schemes
    answer); 401 carries `WWW-Authenticate: Bearer`, 405 `Allow: POST`."""
    status, _ = error.openai()
    headers = {}
    if error.kind is ErrorKind.AUTHENTICATION:
        if error.code == MISSING_KEY_CODE:
            status = 403
        else:
            headers["WWW-Authenticate"] = "Bearer"
    elif error.kind is ErrorKind.METHOD_NOT_ALLOWED:
        headers["Allow"] = "POST"
    return status, {"detail": error.message}, headers


# ---- the request -----------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Question:
    key: str
    kind: Literal["noul", "choice", "score"]
    text: str
    options: tuple[str, ...] = ()  # a choice's
    levels: int = 0  # a score's

    @property
    def labels(self) -> tuple[str, ...]:
        """The answer labels, in the options' (or levels') order."""
        if self.kind == "noul":
            return (YES, NO)
        if self.kind == "score":
            return DIGITS[: self.levels]
        return choice_labels(len(self.options))

    @property
    def two_token(self) -> bool:
        return self.kind == "choice" and len(self.options) > len(SINGLE_LABELS)

    @property
    def outcomes(self) -> tuple[str, ...]:
        """The keys of the answer's `probabilities`: Yes / No, the options, or the digits."""
        return self.options if self.kind == "choice" else self.labels


@attrs.frozen(kw_only=True)
class SystemOneRequest:
    model: str
    temperature: float | None  # from the model name's -t<T> suffix
    state: str  # the state as the prompt shows it (JSON text unless sent as a string)
    questions: tuple[Question, ...]
    readout: Literal["single", "averaged"] = "single"


def choice_labels(num_options: int) -> tuple[str, ...]:
    """A-Z, a-z, 0-9 up to 62 options; from 63 on, letter + digit (A0, A1, ... Z9)."""
    if num_options <= len(SINGLE_LABELS):
        return SINGLE_LABELS[:num_options]
    return tuple(LETTERS[i // len(DIGITS)] + DIGITS[i % len(DIGITS)] for i in range(num_options))


def model_temperature(model: str) -> float | None:
    """T from a `-t<T>` suffix (`my-judge-t0.7`), else None."""
    found = _TEMPERATURE_SUFFIX.search(model)
    return float(found.group(1)) if found else None


def state_text(state: str | dict | list) -> str:
    """A string as sent; an object or array as JSON (`json.dumps`, non-ASCII kept)."""
    return state if isinstance(state, str) else json.dumps(state, ensure_ascii=False)


def parse_request(body: Any) -> SystemOneRequest:
    """The request, or `ValidationFailed` listing every schema violation (422); then an
    `ApiError` 400 for a label overflow (a choice of more than 255 options)."""
    if not isinstance(body, dict):
        raise ValidationFailed([violation((), "Input should be a valid dictionary or object to extract fields from",
                                          "model_attributes_type")])  # fmt: skip
    errors: list[dict[str, Any]] = []
    for name in body:
        if name not in _TOP_FIELDS:
            errors.append(violation((name,), "Extra inputs are not permitted", "extra_forbidden"))
    model = _string(body, "model", (), errors)
    temperature = None
    if model is not None:
        temperature = model_temperature(model)
        if temperature is not None and not math.isfinite(temperature):
            errors.append(violation(("model",), "Value error, the -t<T> temperature must be a finite number",
                                    "value_error"))  # fmt: skip
    state = None
    if "state" not in body:
        errors.append(violation(("state",), "Field required", "missing"))
    elif not isinstance(body["state"], (str, dict, list)):
        errors.append(violation(("state",), "Input should be a valid string, object or array", "union_type"))
    else:
        state = body["state"]
    readout = _policy(body.get("policy"), errors)
    questions, overflow = _questions(body, errors)
    if errors:
        raise ValidationFailed(errors)
    if overflow:
        key, count = overflow[0]
        raise ApiError(ErrorKind.INVALID_REQUEST, f"Label overflow: question {key!r} has {count} options; a choice "
                       f"can be labelled with at most {MAX_OPTIONS} (letter + digit labels A0 to Z4).",
                       f"questions.{key}.options", "label_overflow")  # fmt: skip
    return SystemOneRequest(model=model, temperature=temperature, state=state_text(state), questions=tuple(questions),
                            readout=readout)  # fmt: skip


def _string(obj: Mapping[str, Any], name: str, loc: tuple, errors: list, *, required: bool = True) -> str | None:
    """A non-empty string field (a violation for a missing, non-string or empty one)."""
    if name not in obj:
        if required:
            errors.append(violation((*loc, name), "Field required", "missing"))
        return None
    value = obj[name]
    if not isinstance(value, str):
        errors.append(violation((*loc, name), "Input should be a valid string", "string_type"))
        return None
    if not value:
        errors.append(violation((*loc, name), "String should have at least 1 character", "string_too_short"))
        return None
    return value


def _policy(policy: Any, errors: list) -> Literal["single", "averaged"]:
    if policy is None:
        return "single"
    if not isinstance(policy, dict):
        errors.append(violation(("policy",), "Input should be a valid dictionary", "dict_type"))
        return "single"
    for name in policy:
        if name not in _POLICY_FIELDS:
            errors.append(violation(("policy", name), "Extra inputs are not permitted", "extra_forbidden"))
    readout = policy.get("readout", "single")
    if not isinstance(readout, str) or readout not in READOUTS:
        errors.append(violation(("policy", "readout"), "Input should be 'single' or 'averaged'", "literal_error"))
        return "single"
    return readout


def _questions(body: Mapping[str, Any], errors: list) -> tuple[list[Question], list[tuple[str, int]]]:
    if "questions" not in body:
        errors.append(violation(("questions",), "Field required", "missing"))
        return [], []
    raw = body["questions"]
    if not isinstance(raw, dict):
        errors.append(violation(("questions",), "Input should be a valid dictionary", "dict_type"))
        return [], []
    if not raw:
        errors.append(violation(("questions",), "Dictionary should have at least 1 item after validation, not 0",
                                "too_short"))  # fmt: skip
    elif len(raw) > MAX_QUESTIONS:
        errors.append(violation(("questions",), f"Dictionary should have at most {MAX_QUESTIONS} items after "
                                f"validation, not {len(raw)}", "too_long"))  # fmt: skip
        return [], []
    questions, overflow = [], []
    for key, item in raw.items():
        loc = ("questions", key)
        if not isinstance(item, dict):
            errors.append(violation(loc, "Input should be a valid dictionary or object to extract fields from",
                                    "model_attributes_type"))  # fmt: skip
            continue
        if "type" not in item:
            errors.append(violation(loc, "Unable to extract tag using discriminator 'type'", "union_tag_not_found"))
            continue
        kind = item["type"]
        if not isinstance(kind, str) or kind not in KINDS:
            errors.append(violation(loc, f"Input tag {kind!r} found using 'type' does not match any of the expected "
                                    "tags: 'noul', 'choice', 'score'", "union_tag_invalid"))  # fmt: skip
            continue
        loc = (*loc, kind)  # pydantic names a tagged union's member in the path
        for name in item:
            if name not in _QUESTION_FIELDS[kind]:
                errors.append(violation((*loc, name), "Extra inputs are not permitted", "extra_forbidden"))
        before = len(errors)
        text = _string(item, "question", loc, errors)
        options: tuple[str, ...] = ()
        levels = 0
        if kind == "choice":
            options = _options(item, loc, errors)
            if len(options) > MAX_OPTIONS:
                overflow.append((key, len(options)))
        elif kind == "score":
            levels = _levels(item, loc, errors)
        if len(errors) == before:
            questions.append(Question(key=key, kind=kind, text=text, options=options, levels=levels))
    return questions, overflow


def _options(item: Mapping[str, Any], loc: tuple, errors: list) -> tuple[str, ...]:
    if "options" not in item:
        errors.append(violation((*loc, "options"), "Field required", "missing"))
        return ()
    options = item["options"]
    if not isinstance(options, list):
        errors.append(violation((*loc, "options"), "Input should be a valid list", "list_type"))
        return ()
    if not options:
        errors.append(violation((*loc, "options"), "List should have at least 1 item after validation, not 0",
                                "too_short"))  # fmt: skip
    seen: dict[str, int] = {}
    bad = False
    for j, option in enumerate(options):
        if not isinstance(option, str):
            errors.append(violation((*loc, "options", j), "Input should be a valid string", "string_type"))
            bad = True
        elif not option:
            errors.append(violation((*loc, "options", j), "String should have at least 1 character", "string_too_short"))
            bad = True
        elif option in seen:
            errors.append(violation((*loc, "options", j), f"Value error, options must be distinct: {option!r} is "
                                    f"also option {seen[option]}", "value_error"))  # fmt: skip
            bad = True
        else:
            seen[option] = j
    return () if bad else tuple(options)


def _levels(item: Mapping[str, Any], loc: tuple, errors: list) -> int:
    if "levels" not in item:
        errors.append(violation((*loc, "levels"), "Field required", "missing"))
        return 0
    levels = item["levels"]
    if isinstance(levels, bool) or not isinstance(levels, int):
        errors.append(violation((*loc, "levels"), "Input should be a valid integer", "int_type"))
        return 0
    if levels < 1:
        errors.append(violation((*loc, "levels"), "Input should be greater than or equal to 1", "greater_than_equal"))
        return 0
    if levels > MAX_LEVELS:
        errors.append(violation((*loc, "levels"), f"Input should be less than or equal to {MAX_LEVELS}",
                                "less_than_equal"))  # fmt: skip
        return 0
    return levels


# ---- prompts ---------------------------------------------------------------------------------


def system_prompt(state: str) -> str:
    """The system message: the evaluation assistant's instruction, then the state."""
    return SYSTEM_PROMPT.format(state=state)


def legend(levels: int) -> str:
    """A score's scale, as the prompt and the answer state it."""
    top = levels - 1
    return "0 is the only level" if top == 0 else f"0 = lowest, {top} = highest"


def _listing(question: Question) -> str:
    return "\n".join(f"{label}) {option}" for label, option in zip(question.labels, question.options, strict=True))


# Every framing starts and ends with fixed text (the question and the options sit inside), so
# the tokens where the user turn meets the template's own text are the same for every question.
_NOUL = (
    "Question: {q}\nAnswer Yes or No.",
    "Based on the state, is the following true? {q}\nReply with Yes or No only.",
    "Consider this yes-or-no question about the state.\n{q}\nYour answer (Yes or No):",
)
_CHOICE = (
    "Question: {q}\nOptions:\n{listing}\nAnswer with the label of the best option only.",
    "Based on the state, which option best answers this question? {q}\n{listing}\nReply with one label only.",
    "Options:\n{listing}\nConsider the options above. {q}\nYour answer (one label):",
)
_SCORE = (
    "Question: {q}\nRate it on a scale of 0 to {top} ({legend}).\nAnswer with a single digit.",
    "Based on the state, how would you rate this? {q}\nUse a digit from 0 to {top}, where {legend}.\n"
    "Reply with the digit only.",
    "Rate on a scale of 0 to {top} ({legend}).\n{q}\nYour rating (one digit):",
)


def user_turn(question: Question, framing: int = 0) -> str:
    """The question's user turn in one of the NUM_FRAMINGS framings (the single readout: 0)."""
    if question.kind == "noul":
        return _NOUL[framing].format(q=question.text)
    if question.kind == "choice":
        return _CHOICE[framing].format(q=question.text, listing=_listing(question))
    return _SCORE[framing].format(q=question.text, top=question.levels - 1, legend=legend(question.levels))


def framings(readout: str) -> range:
    return range(NUM_FRAMINGS if readout == "averaged" else 1)


@attrs.frozen
class Read:
    """One readout position: the candidate labels read after the question's prompt, plus
    `prefix` (a two-token label's letter, fed first) when it is a second-position read."""

    candidates: tuple[str, ...]
    prefix: str = ""


def reads(question: Question) -> list[Read]:
    """The positions one framing of a question is read at: the first (its labels, or a
    two-token choice's letters), then for a two-token choice one read per letter in use (its
    digits in use, after the letter)."""
    if not question.two_token:
        return [Read(question.labels)]
    by_letter: dict[str, list[str]] = {}
    for label in question.labels:
        by_letter.setdefault(label[0], []).append(label[1])
    return [Read(tuple(by_letter))] + [Read(tuple(digits), letter) for letter, digits in by_letter.items()]


# ---- answers ---------------------------------------------------------------------------------


def tempered(logprobs: Sequence[float], temperature: float | None) -> list[float]:
    """softmax(logprob / T) over the candidates (T None or 0: T = 1, exact renormalization)."""
    t = temperature if temperature else 1.0
    scaled = [lp / t for lp in logprobs]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    total = math.fsum(weights)
    return [w / total for w in weights]


def framing_distribution(question: Question, logprobs: Sequence[Sequence[float]],
                         temperature: float | None) -> list[float]:  # fmt: skip
    """One framing's distribution over the question's labels, from the raw log-probabilities
    of each of its `reads` (in that order)."""
    first = tempered(logprobs[0], temperature)
    if not question.two_token:
        return first
    read_list = reads(question)
    letter_p = dict(zip(read_list[0].candidates, first, strict=True))
    joint: dict[str, float] = {}
    for read, lps in zip(read_list[1:], logprobs[1:], strict=True):
        for digit, p in zip(read.candidates, tempered(lps, temperature), strict=True):
            joint[read.prefix + digit] = letter_p[read.prefix] * p
    return [joint[label] for label in question.labels]


def averaged(distributions: Sequence[Sequence[float]]) -> list[float]:
    """The mean of the framings' distributions, renormalized (they each sum to 1 already)."""
    mean = [math.fsum(ps) / len(distributions) for ps in zip(*distributions, strict=True)]
    total = math.fsum(mean)
    return [p / total for p in mean]


def choice_confidence(probabilities: Sequence[float]) -> float:
    """(N * maxP - 1) / (N - 1): 0 for a uniform distribution, 1 for a certain one (1 for N = 1)."""
    n = len(probabilities)
    if n == 1:
        return 1.0
    return min(1.0, max(0.0, (n * max(probabilities) - 1.0) / (n - 1)))


def expected_score(probabilities: Sequence[float]) -> float:
    return math.fsum(i * p for i, p in enumerate(probabilities))


def score_confidence(probabilities: Sequence[float]) -> float:
    """1 - E|i - mu| / ((N - 1) / 2), mu the expected score: the mean absolute deviation from
    the expected score, normalized by its largest value on 0..N-1 (half the mass at each
    end). 1 when one level holds all the mass, 0 at the widest split (1 for N = 1)."""
    n = len(probabilities)
    if n == 1:
        return 1.0
    mu = expected_score(probabilities)
    spread = math.fsum(p * abs(i - mu) for i, p in enumerate(probabilities))
    return min(1.0, max(0.0, 1.0 - spread / ((n - 1) / 2)))


def answer_json(question: Question, probabilities: Sequence[float]) -> dict[str, Any]:
    """One entry of `answers`: `probabilities` keyed by Yes / No, option or digit, the most
    probable one (`answer`, ties to the earlier), `confidence` and the kind's own fields."""
    keys = question.outcomes
    best = min(range(len(probabilities)), key=lambda i: (-probabilities[i], i))
    out: dict[str, Any] = {"type": question.kind, "answer": keys[best],
                           "probabilities": dict(zip(keys, probabilities, strict=True))}  # fmt: skip
    if question.kind == "noul":
        out["p_yes"] = probabilities[0]
        out["confidence"] = choice_confidence(probabilities)
    elif question.kind == "choice":
        out["labels"] = dict(zip(question.labels, question.options, strict=True))
        out["confidence"] = choice_confidence(probabilities)
    else:
        out["score"] = expected_score(probabilities)
        out["levels"] = question.levels
        out["legend"] = legend(question.levels)
        out["confidence"] = score_confidence(probabilities)
    return out


def response_json(req: SystemOneRequest, distributions: Sequence[Sequence[float]], input_tokens: int, *,
                  id: str, created: int) -> dict[str, Any]:  # fmt: skip
    """The response: `answers` keyed (and ordered) like the questions, and usage."""
    answers = {q.key: answer_json(q, ps) for q, ps in zip(req.questions, distributions, strict=True)}
    usage = {"input_tokens": input_tokens, "output_tokens": 0, "total_tokens": input_tokens}
    return {"id": id, "object": "systemone", "created": created, "model": req.model, "temperature": req.temperature,
            "readout": req.readout, "answers": answers, "usage": usage}  # fmt: skip
