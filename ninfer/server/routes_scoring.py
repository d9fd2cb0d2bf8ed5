"""Prefill-only routes: POST /v1/score (closed-set questions over one shared prefix),
POST /v1/rerank (Jina's shape) and POST /v1/embeddings (OpenAI's shape). Each answers in one
JSON body; their errors are OpenAI-shaped (`{"error": {...}}`), like every route outside
/v1/messages. Parsing and response shapes are in `ninfer.protocols.scoring` and
`ninfer.protocols.embeddings`, the engine work in `ninfer.server.scoring`.
"""

from __future__ import annotations

import time

from quart import Response, g, request

from ninfer.protocols import embeddings as embedding_wire
from ninfer.protocols import scoring as wire
from ninfer.server.http_io import json_response, read_json
from ninfer.server.scoring import Scorer
from ninfer.server.settings import ServerSettings

SCORE_ROUTE, RERANK_ROUTE, EMBEDDINGS_ROUTE = "/v1/score", "/v1/rerank", "/v1/embeddings"


def register(app, service, settings: ServerSettings, metrics) -> None:
    """Add the scoring routes to a Quart app serving `service`."""
    scorer = Scorer(service)

    async def score():
        return await _score(service, scorer, metrics)

    async def rerank():
        return await _rerank(service, scorer, settings, metrics)

    async def embeddings():
        return await _embeddings(service, scorer, metrics)

    app.add_url_rule(SCORE_ROUTE, "score", score, methods=["POST"])
    app.add_url_rule(RERANK_ROUTE, "rerank", rerank, methods=["POST"])
    app.add_url_rule(EMBEDDINGS_ROUTE, "embeddings", embeddings, methods=["POST"])


async def _score(service, scorer: Scorer, metrics) -> Response:
    req = wire.parse_score_request(await read_json(request))
    service.check_model(req.model)
    call = wire.score_call(req, g.request_id)
    outcome = await scorer.score(call)
    metrics.count_scored_tokens(SCORE_ROUTE, outcome.prompt_tokens)
    response_id = "score-" + g.request_id.removeprefix("req_")
    return json_response(wire.score_response(call, outcome, id=response_id, created=int(time.time()), model=req.model))


async def _rerank(service, scorer: Scorer, settings: ServerSettings, metrics) -> Response:
    req = wire.parse_rerank_request(await read_json(request), settings.rerank_max_documents)
    service.check_model(req.model)
    outcome = await scorer.score(wire.rerank_call(req, g.request_id))
    for i, result in enumerate(outcome.results):
        if isinstance(result, wire.QuestionError):  # no slot for it in Jina's shape: the call fails
            raise result.api_error(f"documents.{i}")
    metrics.count_scored_tokens(RERANK_ROUTE, outcome.prompt_tokens)
    body = wire.rerank_response(req, outcome, settings.rerank_weights, model=req.model or service.model_id,
                                id="rerank-" + g.request_id.removeprefix("req_"))  # fmt: skip
    return json_response(body)


async def _embeddings(service, scorer: Scorer, metrics) -> Response:
    req = embedding_wire.parse_embedding_request(await read_json(request))
    service.check_model(req.model)
    inputs = embedding_wire.embedding_inputs(req, service.model.spec.d_model)
    vectors, prompt_tokens = await scorer.embed(inputs, g.request_id)
    metrics.count_scored_tokens(EMBEDDINGS_ROUTE, prompt_tokens)
    return json_response(embedding_wire.embeddings_response(vectors, req, model=req.model, prompt_tokens=prompt_tokens))
