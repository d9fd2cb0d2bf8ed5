"""POST /v1/systemone (and /systemone): TypeSafe "System One" decisions, answered in one JSON
body, with FastAPI-shaped errors (`{"detail": ...}`; the app renders every error on these
paths this way, `detail_response`). Parsing, prompts and the answers' arithmetic are in
`ninfer.protocols.systemone`; the reads run through `ninfer.server.scoring.Scorer`.

Each question (in each framing of the readout) is one user turn after the system message that
carries the state, rendered through the chat template with the generation prompt and thinking
off. The state's part of the prompt is tokenized once: the template is rendered once around a
placeholder user turn, and each question's turn is tokenized on its own and appended; the
first question of each framing is checked against tokenizing its whole prompt, and any
difference falls back to tokenizing every prompt whole. The reads are prefill-only requests
of one score call: the prefix they share is computed and published once, a two-token choice's
second-position reads branch off its first read's prompt (see `ninfer.server.scoring`).
"""

from __future__ import annotations

import time

from quart import Response, g, request

from ninfer.protocols import systemone as wire
from ninfer.protocols.calls import InvalidRequest
from ninfer.protocols.errors import ApiError, ErrorKind
from ninfer.protocols.scoring import QuestionError, ScoreCall, ScoreQuestion
from ninfer.protocols.strict import WireFormatError
from ninfer.server.http_io import json_response, read_json
from ninfer.server.scoring import PreparedQuestion, Scorer, thinking_off_kwargs

_PLACEHOLDER = "NINFER-SYSTEMONE-USER-TURN"  # a user turn's stand-in while the template is rendered once


def register(app, service, metrics) -> None:
    """Add the System One routes to a Quart app serving `service`."""
    scorer = Scorer(service)

    async def systemone():
        try:
            return await _systemone(service, scorer, metrics)
        except wire.ValidationFailed as e:
            return json_response(e.body(), 422)

    for i, route in enumerate(wire.ROUTES):
        app.add_url_rule(route, f"systemone_{i}", systemone, methods=["POST"])


def detail_response(error: ApiError) -> Response:
    """An ApiError in FastAPI's shape, for these routes' paths."""
    status, body, headers = wire.detail_error(error)
    response = json_response(body, status)
    response.headers.update(headers)
    return response


async def _systemone(service, scorer: Scorer, metrics) -> Response:
    try:
        body = await read_json(request)
    except WireFormatError as e:
        raise wire.ValidationFailed([wire.violation((), f"JSON decode error: {e.message}", "json_invalid")]) from None
    req = wire.parse_request(body)
    # One scored question per read: (question index, framing, its reads' rows).
    plan: list[tuple[int, int, list[int]]] = []
    questions: list[ScoreQuestion] = []
    contents: list[tuple[str, wire.Read, tuple[str, int]]] = []  # (user turn, read, framing kind)
    for qi, q in enumerate(req.questions):
        for framing in wire.framings(req.readout):
            content = wire.user_turn(q, framing)
            first = len(questions)
            for r, read in enumerate(wire.reads(q)):
                questions.append(ScoreQuestion(id=f"{q.key}/{framing}/{r}", content=content, candidates=read.candidates))
                contents.append((content, read, (q.kind, framing)))
            plan.append((qi, framing, list(range(first, len(questions)))))
    if len(questions) > wire.MAX_READS:
        raise InvalidRequest(f"This call needs {len(questions)} reads (one per question and framing, plus one per "
                             f"letter of a choice of more than 62 options); the limit is {wire.MAX_READS}.",
                             "questions")  # fmt: skip
    system = wire.system_prompt(req.state)
    call = ScoreCall(messages=({"role": "system", "content": system},), questions=tuple(questions),
                     request_id=g.request_id)  # fmt: skip
    num_chars = len(system) + sum(len(c) for c, _, _ in contents)
    prepared = await service.in_worker(num_chars, _prepare, service, system, contents)
    outcome = await scorer.score(call, prepared=prepared, max_rows=None)
    distributions: list[list[list[float]]] = [[] for _ in req.questions]
    for qi, _framing, rows in plan:
        for k in rows:
            failed = outcome.results[k]
            if isinstance(failed, QuestionError):  # no slot for it in this shape: the call fails
                key = req.questions[qi].key
                raise ApiError(failed.kind, f"Question {key!r}: {failed.message}", f"questions.{key}", failed.code)
        logprobs = [[c.logprob for c in outcome.results[k].candidates] for k in rows]
        distributions[qi].append(wire.framing_distribution(req.questions[qi], logprobs, req.temperature))
    answers = [ps[0] if len(ps) == 1 else wire.averaged(ps) for ps in distributions]
    metrics.count_scored_tokens(request.url_rule.rule, outcome.prompt_tokens)
    body = wire.response_json(req, answers, outcome.prompt_tokens, id="systemone-" + g.request_id.removeprefix("req_"),
                              created=int(time.time()))  # fmt: skip
    return json_response(body)


# ---- templating and tokenizing (in a worker thread) ---------------------------------------------


def _prepare(service, system: str, contents: list) -> list[PreparedQuestion]:
    """Each read's prompt and candidate ids. The prompt is the system message (the state) plus
    the user turn, through the chat template with the generation prompt, thinking off; a
    second-position read appends its letter's ids (`branch_len` marks where)."""
    model = service.model
    encode = _encoder(model.tokenizer)
    head, tail, whole = _template_parts(model, system)
    prompts: dict[str, tuple[int, ...]] = {}
    split = head is not None
    if split:
        head_ids = encode(head)
        if len(head_ids) >= service.max_context:
            raise InvalidRequest(f"The state and the instructions take {len(head_ids)} tokens; the model's context "
                                 f"holds {service.max_context}.", "state", code="context_length_exceeded")  # fmt: skip
        checked: set[tuple[str, int]] = set()
        for content, _, kind in contents:
            if content in prompts:
                continue
            ids = head_ids + encode(content + tail)
            if kind not in checked:  # does the framing's join tokenize as the whole prompt does?
                checked.add(kind)
                if encode(head + content + tail) != ids:
                    split = False
                    break
            prompts[content] = ids
    if not split:
        prompts = {content: encode(whole(content)) for content in dict.fromkeys(c for c, _, _ in contents)}
    out = []
    for content, read, _ in contents:
        prompt = prompts[content]
        candidates = tuple(encode(c) for c in read.candidates)
        if read.prefix:
            out.append(PreparedQuestion(prompt + encode(read.prefix), candidates, branch_len=len(prompt)))
        else:
            out.append(PreparedQuestion(prompt, candidates))
    return out


def _encoder(tokenizer):
    cache: dict[str, tuple[int, ...]] = {}

    def encode(text: str) -> tuple[int, ...]:
        if len(text) > 64:
            return tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))
        if text not in cache:
            cache[text] = tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))
        return cache[text]

    return encode


def _template_parts(model, system: str):
    """(the prompt's text before the user turn, the text after it, a function rendering a
    whole prompt): the template rendered once around a placeholder turn. A template that
    refuses a system message gets the state at the top of the user turn instead."""
    from ninfer.models.chat_template import ChatTemplate, ChatTemplateError

    template = model.chat_template or ChatTemplate.chatml()
    kwargs = thinking_off_kwargs(template)

    def render(messages) -> str:
        return template.render(messages, tools=None, add_generation_prompt=True, **kwargs)

    def with_system(content: str) -> list[dict]:
        return [{"role": "system", "content": system}, {"role": "user", "content": content}]

    def in_user_turn(content: str) -> list[dict]:
        return [{"role": "user", "content": f"{system}\n\n{content}"}]

    try:
        messages_of = with_system
        text = render(messages_of(_PLACEHOLDER))
    except ChatTemplateError:
        try:
            messages_of = in_user_turn
            text = render(messages_of(_PLACEHOLDER))
        except ChatTemplateError as e:
            raise ApiError(ErrorKind.INTERNAL, f"The model's chat template cannot render these prompts: {e}") from None

    def whole(content: str) -> str:
        return render(messages_of(content))

    if text.count(_PLACEHOLDER) != 1:  # the template does more than insert the turn: render each prompt whole
        return None, None, whole
    head, _, tail = text.partition(_PLACEHOLDER)
    return head, tail, whole
