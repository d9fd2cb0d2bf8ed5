"""Route keys of HTTP requests: each prompt rendered to token ids as a replica renders it, then
hashed into the prefix cache's own page key (`routing.page_route_key`).

The ingress loads the model's tokenizer and chat template once (`load_prompt_model`; for a GGUF
file from its metadata alone, no tensor is read) and renders every request with the server's own
code: `render_chat` for chat calls (OpenAI chat, Anthropic messages, Responses), the tokenizer with
the model's special tokens for a completion's prompt, the chat template for the shared prefix of
/v1/score and /v1/rerank questions. The model salt is the engine's (`engine_model_salt`), so a
route key is the very key under which a replica's prefix cache holds that page.

The key's page (`routing.route_depth`): the full pages of the conversation's first turn (the
messages up to and including the first user message, rendered with the generation prompt, i.e.
exactly turn one's prompt), at most `route_pages`, so every turn of a conversation has one key.
A completion's anchor is its whole prompt; a /v1/score call's, its messages (the prefix its questions
share); a /v1/rerank call's, its query (its key is the last full page before the documents, however
deep, since every rerank starts with the server's own system prompt). Requests that name no
prompt the ingress can render (a Responses call continuing a stored response, embeddings,
tokenize, a body the replica will refuse) get no key and are routed by load.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from ninfer.cache.prefix import model_salt
from ninfer.cluster.routing import DEFAULT_PAGE_SIZE, DEFAULT_ROUTE_PAGES, PageKeying, page_route_key, route_depth

# `ninfer serve --backend X` runs this runner class; its name is part of the engine's model salt.
RUNNER_NAMES = {"reference": "ReferenceRunner", "cpu": "CpuRunner", "cuda": "CudaRunner"}
_NO_LIMIT = 1 << 30  # rerank's document limit is the replica's to enforce


def engine_model_salt(spec, backend: str, prefix_salt: str = "") -> bytes:
    """The salt `ninfer.sched.engine.default_prefix_cache` gives the prefix cache of an engine
    running `spec` on `backend` (`ninfer serve` leaves the prefix salt empty)."""
    if backend not in RUNNER_NAMES:
        raise ValueError(f"a route key needs the replicas' backend resolved, one of {', '.join(RUNNER_NAMES)}; "
                         f"got {backend!r}")  # fmt: skip
    return model_salt(spec, RUNNER_NAMES[backend], prefix_salt).encode()


def serve_page_size(serve_flags: Sequence[str]) -> int:
    """The `--page-size` among `ninfer serve` flags (its default when absent)."""
    flags = list(serve_flags)
    for i, flag in enumerate(flags):
        if flag == "--page-size" and i + 1 < len(flags):
            return int(flags[i + 1])
        if flag.startswith("--page-size="):
            return int(flag.split("=", 1)[1])
    return DEFAULT_PAGE_SIZE


@attrs.frozen(eq=False)
class PromptModel:
    """What rendering needs of a model (`render_chat` reads `chat_template`), and its spec for the salt."""

    spec: Any
    tokenizer: Any
    chat_template: Any


def load_prompt_model(model_arg: str | Path | None) -> PromptModel:
    """The model's spec, tokenizer and chat template. A GGUF file is read for its metadata only
    (`read_gguf_header`: the readers `load_gguf` itself uses, so the spec is the replicas'); a Hugging
    Face directory goes through the loader (its safetensors are memory-mapped, not read)."""
    from ninfer.models.registry import ensure_model

    path = Path(ensure_model(model_arg, progress=False))
    if path.is_file():
        from ninfer.models.gguf_file import read_gguf_header

        return PromptModel(*read_gguf_header(path))
    from ninfer.models.loader import load_model

    model = load_model(path)
    return PromptModel(model.spec, model.tokenizer, model.chat_template)


@attrs.frozen
class RoutePrompt:
    """A request's prompt token ids, the length of its anchor (turn one's prompt) and its salt."""

    token_ids: tuple[int, ...]
    anchor_tokens: int
    cache_salt: str | None
    capped: bool = True  # the key's page is at most route_pages deep (False: the anchor's last full page)


class PromptKeyer:
    """Route keys for request bodies, by route (one per ingress; thread-safe, no state)."""

    def __init__(self, model: PromptModel, model_salt: bytes, keying: PageKeying = PageKeying()):
        self.model = model
        self.model_salt = model_salt
        self.keying = keying

    @classmethod
    def load(cls, model_arg: str | Path | None, backend: str, *, page_size: int = DEFAULT_PAGE_SIZE,
             route_pages: int = DEFAULT_ROUTE_PAGES) -> PromptKeyer:  # fmt: skip
        model = load_prompt_model(model_arg)
        keying = PageKeying(page_size=page_size, route_pages=route_pages)
        return cls(model, engine_model_salt(model.spec, backend), keying)

    def route_key(self, path: str, body: bytes | Any) -> bytes | None:
        """The key of a POST to `path` with this body; None when it has none (routed by load)."""
        prompt = self.prompt(path, body)
        if prompt is None:
            return None
        keying = self.keying
        if not prompt.capped:
            keying = attrs.evolve(keying, route_pages=max(1, len(prompt.token_ids)))
        depth = route_depth(prompt.anchor_tokens, len(prompt.token_ids), keying)
        return page_route_key(prompt.token_ids, self.model_salt, prompt.cache_salt, depth=depth,
                              page_size=self.keying.page_size)  # fmt: skip

    def prompt(self, path: str, body: bytes | Any) -> RoutePrompt | None:
        """The prompt a replica would run for this request; None for a route without one or a
        body the replica will refuse (it answers that itself)."""
        from ninfer.protocols.json_body import parse_json_body

        handler = _ROUTES.get(path.split("?", 1)[0].rstrip("/"))
        if handler is None:
            return None
        try:
            if isinstance(body, (bytes, bytearray, str)):
                body = parse_json_body(body.encode() if isinstance(body, str) else bytes(body))
            return handler(self, body)
        except Exception:  # invalid for the replica too: it answers with the error
            return None

    # ---- per route -----------------------------------------------------------------------

    def _encode(self, text: str, add_special_tokens: bool) -> tuple[int, ...]:
        return tuple(int(t) for t in self.model.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _chat(self, call) -> RoutePrompt:
        """As `GenerationService._chat_ids`: the rendered template, tokenized without special tokens."""
        from ninfer.server.chat_prompt import render_chat

        ids = self._encode(render_chat(self.model, call), False)
        roles = [m.get("role") for m in call.messages]
        first_user = roles.index("user") if "user" in roles else len(roles) - 1
        anchor = len(ids)
        if first_user < len(roles) - 1:  # a later turn: turn one's prompt, rendered on its own
            first_turn = attrs.evolve(call, messages=call.messages[: first_user + 1])
            anchor = len(self._encode(render_chat(self.model, first_turn), False))
        return RoutePrompt(ids, anchor, call.cache_salt)

    def _openai_chat(self, body) -> RoutePrompt:
        from ninfer.protocols import openai, openai_calls

        return self._chat(openai_calls.chat_call(openai.parse_chat_request(body), ""))

    def _anthropic(self, body) -> RoutePrompt:
        from ninfer.protocols import anthropic

        return self._chat(anthropic.to_chat_call(anthropic.parse_messages_request(body)))

    def _responses(self, body) -> RoutePrompt | None:
        from ninfer.protocols import responses

        request = responses.parse_responses_request(body)
        if request.previous_response_id is not None:  # its history is stored on one replica
            return None
        return self._chat(responses.to_chat_call(request))

    def _completion(self, body) -> RoutePrompt:
        """As `GenerationService.start_completion`: text with the model's special tokens, or ids as sent."""
        from ninfer.protocols import openai, openai_calls

        call = openai_calls.completion_call(openai.parse_completion_request(body), "")
        ids = self._encode(call.prompt, True) if isinstance(call.prompt, str) else tuple(call.prompt)
        return RoutePrompt(ids, len(ids), call.cache_salt)

    def _shared_prefix(self, call) -> tuple[int, ...]:
        """As `Scorer._prepare` renders questions: the token ids every question's prompt starts
        with whatever the question (two one-letter questions' prompts, up to where they part)."""
        from ninfer.models.chat_template import ChatTemplate

        template = self.model.chat_template or ChatTemplate.chatml()
        prompts = []
        for q in call.questions[:2]:
            messages = [*call.messages, {"role": "user", "content": q.content}]
            text = template.render(messages, tools=None, add_generation_prompt=True, **call.template_kwargs)
            prompts.append(self._encode(text, False))
        return prompts[0][: _common_prefix(prompts)]

    def _score(self, body) -> RoutePrompt:
        """On the call's messages (the context its questions share), as a conversation's first turn."""
        from ninfer.protocols import scoring

        call = scoring.score_call(scoring.parse_score_request(body))
        questions = tuple(attrs.evolve(call.questions[0], content=c) for c in ("A", "B"))
        shared = self._shared_prefix(attrs.evolve(call, questions=questions))
        return RoutePrompt(shared, len(shared), None)

    def _rerank(self, body) -> RoutePrompt:
        """On the query: every rerank shares the server's own system prompt, so the key is the
        last full page before the documents, however deep (not capped at route_pages)."""
        from ninfer.protocols import scoring

        request = attrs.evolve(scoring.parse_rerank_request(body, _NO_LIMIT), documents=["A", "B"])
        shared = self._shared_prefix(scoring.rerank_call(request))
        return RoutePrompt(shared, len(shared), None, capped=False)


def _common_prefix(prompts: list[tuple[int, ...]]) -> int:
    """Length of the longest token prefix every prompt shares."""
    first, n = prompts[0], min(len(p) for p in prompts)
    for p in prompts[1:]:
        n = next((i for i, (a, b) in enumerate(zip(first[:n], p[:n])) if a != b), n)
    return n


_ROUTES = {
    "/v1/chat/completions": PromptKeyer._openai_chat,
    "/v1/messages": PromptKeyer._anthropic,
    "/v1/responses": PromptKeyer._responses,
    "/v1/completions": PromptKeyer._completion,
    "/v1/score": PromptKeyer._score,
    "/v1/rerank": PromptKeyer._rerank,
}
