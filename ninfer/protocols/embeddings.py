"""OpenAI `POST /v1/embeddings`: the request schema, its checks and the response body.

The vectors are the model's own final hidden rows (last-token pooling, L2-normalized; see
`ninfer/server/scoring.py` and docs/serving.md): a chat model's hidden rows, not a trained
embedding model's.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any, Literal

import attrs
import numpy as np

from ninfer.protocols.calls import InvalidRequest
from ninfer.protocols.openai import Prompt, _make_converter
from ninfer.protocols.strict import structure

MAX_INPUTS = 2048  # OpenAI's limit per call
IGNORED_FIELDS = ("user",)

_CONVERTER = _make_converter()


@attrs.frozen(kw_only=True)
class EmbeddingRequest:
    model: str
    input: Prompt  # a string, an array of strings, an array of token ids, or an array of those
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None


def parse_embedding_request(body: Any) -> EmbeddingRequest:
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if k not in IGNORED_FIELDS}
    return structure(_CONVERTER, body, EmbeddingRequest)


def embedding_inputs(req: EmbeddingRequest, hidden_size: int) -> list[str | tuple[int, ...]]:
    """The inputs, one text or token-id tuple each (raises InvalidRequest naming the field)."""
    if req.dimensions is not None:
        message = f"dimensions is not supported: the embeddings have the model's hidden size, {hidden_size}."
        raise InvalidRequest(message + " Leave dimensions out.", "dimensions", code="unsupported_value")
    value = req.input
    single = isinstance(value, str) or (bool(value) and all(isinstance(t, int) for t in value))
    items = [value] if single else list(value)
    if not 1 <= len(items) <= MAX_INPUTS:
        raise InvalidRequest(f"input must hold 1 to {MAX_INPUTS} inputs, got {len(items)}.", "input")
    for i, item in enumerate(items):
        if not item:
            raise InvalidRequest("An input must not be empty.", "input" if len(items) == 1 else f"input.{i}")
    return [item if isinstance(item, str) else tuple(item) for item in items]


def _vector(v: np.ndarray, encoding: str) -> list[float] | str:
    v = np.asarray(v, dtype="<f4")
    if encoding == "base64":
        return base64.b64encode(v.tobytes()).decode("ascii")
    return [float(x) for x in v]


def embeddings_response(vectors: Sequence[np.ndarray], req: EmbeddingRequest, *, model: str,
                        prompt_tokens: int) -> dict[str, Any]:  # fmt: skip
    encoding = req.encoding_format or "float"
    data = [{"object": "embedding", "index": i, "embedding": _vector(v, encoding)} for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}  # fmt: skip
