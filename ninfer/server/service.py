"""The generation service: one protocol-neutral layer between every HTTP API and the engine.

Usage (inside `serve`, which owns the engine)::

    async with open_service(engine, model, max_context=4096) as service:
        stream = await service.start_chat(ChatCall(messages=({"role": "user", "content": "Hi"},)))
        async with stream:
            async for event in stream:   # CallStarted, TextDelta / ToolCallDelta..., CallFinished
                ...                       # Idle whenever nothing happened for keepalive_s
        result = await service.chat(call)  # or: the whole answer at once (a CallResult)

What it does for a call (records in `ninfer.protocols.calls`):

- renders `messages` (+ `tools` unless tool_choice is "none") through the model's chat
  template and tokenizes them; `count_tokens(call)` returns that length;
- fills omitted sampler knobs and `max_tokens` from the server defaults (`ServiceDefaults`),
  `max_tokens` capped to the context left when it was not given;
- builds a grammar constraint for `response_format` json_object / json_schema and for
  tool_choice "required" or {"name": ...} (Hermes tool-call JSON for a declared tool whose
  arguments match its schema);
- with tools and tool_choice other than "none", parses Hermes `<tool_call>` blocks out of the
  text into `ToolCallDelta`s; the finish reason becomes "tool_calls" when any were made.

Errors: `start_*` raise `InvalidRequest` (message, param, code; `ModelNotFound` is one),
or the engine's `Overloaded`, `RequestTooLarge`, `EngineUnhealthy` — all before any event. A
request that times out in the queue raises `QueueTimeout` from the iterator before
`CallStarted`; an engine failure mid-answer ends with `CallFinished(reason="error")`.
Leaving the stream (or `aclose()`, or cancelling the consumer) cancels the request.

Each request is held by a task in the service's own nursery (`event_stream.hold_request`); the
consumer reads the engine's stream itself and waits with a timeout (for `Idle`) without
cancelling the request.
"""

from __future__ import annotations

import contextvars
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import attrs
import trio

from ninfer.core.params import SamplingParams
from ninfer.protocols.calls import (
    CallResult, CallStarted, ChatCall, CompletionCall, GenerationOptions, InvalidRequest, ModelNotFound,
    SamplingOptions, TextDelta, ToolCall, ToolCallDelta, CallFinished,
)  # fmt: skip
from ninfer.protocols.tool_calls import END_TAG
from ninfer.sched.engine import Engine
from ninfer.sched.request import EngineError, GenerationRequest
from ninfer.server.chat_prompt import (
    build_constraint, render_chat, tool_specs, uses_tool_parser, validate_tool_choice,
)  # fmt: skip
from ninfer.server.event_stream import CallObserver, CallRecord, EventStream, FrameTicks, hold_request
from ninfer.server.live import LiveTracker
from ninfer.server.quiesce import AdmissionGate
from ninfer.server.settings import DEFAULT_FRAME_GAP_US

log = logging.getLogger(__name__)

# Frame pacing (`_frame_gap`): a text frame costs ~100-150 us of Python on the event loop (an
# H100 host, 2026-12-06); holding each stream's frames `frame_gap_s` per stream running (from
# the 5th on; `serve --frame-gap-us`) lets each frame carry several tokens at many streams.
FRAME_GAP_PER_STREAM_S = DEFAULT_FRAME_GAP_US * 1e-6
PACED_FROM_STREAMS = 5

# Large inputs templated / tokenized at once, in worker threads: few, so a burst of huge
# prompts leaves cores to the engine. Small inputs never queue behind them.
LARGE_INPUT_THREADS = 2
LARGE_INPUT_CHARS = 1 << 16
# Normalizers may turn several characters into one (ligatures, stripped accents): a margin.
_NORMALIZER_MARGIN = 4
# A request's `model` may always name the served model this way (as llama-server accepts any).
DEFAULT_MODEL_NAME = "default"


class UnknownModel(ModelNotFound):
    """A 404 whose message lists every name the server accepts."""

    def __init__(self, model: str, accepted: tuple[str, ...]):
        names = ", ".join(f"'{name}'" for name in accepted)
        InvalidRequest.__init__(self, f"The model '{model}' does not exist; this server accepts {names}.", "model",
                                code="model_not_found")  # fmt: skip


# The HTTP route of the request being handled (the app sets it): the dashboard's table shows it.
current_route: contextvars.ContextVar[str] = contextvars.ContextVar("current_route", default="")


@attrs.frozen(kw_only=True)
class ServiceDefaults:
    """Process-level defaults applied when a request omits a field."""

    max_tokens: int | None = None  # None: up to the context limit
    sampling: SamplingParams = SamplingParams()


class GenerationService:
    """Created by `open_service`; every method is safe to call from any request handler."""

    def __init__(self, engine: Engine, model, nursery: trio.Nursery, *, model_id: str, max_context: int,
                 defaults: ServiceDefaults, grammar, keepalive_s: float,
                 observer: CallObserver | None, frame_gap_s: float = FRAME_GAP_PER_STREAM_S,
                 aliases: tuple[str, ...] = ()):  # fmt: skip
        self.engine = engine
        self.model = model
        self.model_id = model_id
        self.aliases = tuple(name for name in dict.fromkeys(aliases) if name != model_id)  # --served-model-name
        self.gate = AdmissionGate()  # POST /admin/quiesce holds new requests here
        self.live = LiveTracker()  # the dashboard's requests in flight and latencies
        self.max_context = max_context
        self.defaults = defaults
        self.grammar = grammar  # GrammarCompiler, or None when llguidance cannot load it
        self.keepalive_s = keepalive_s
        self.frame_gap_s = frame_gap_s
        self.observer = observer
        self.created_s = int(time.time())  # the model's "created" in /v1/models
        self._nursery = nursery
        self.frame_ticks = FrameTicks(self._frame_gap)  # open_service runs its clock
        self._large_input_limiter = trio.CapacityLimiter(LARGE_INPUT_THREADS)
        self._max_chars_per_token = _max_chars_per_token(model.tokenizer)

    # ---- model, tokens ----------------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        return self.engine.is_healthy

    def statistics(self):
        return self.engine.statistics()

    def drain(self) -> None:
        """Shutdown, first part: refuse new calls, answer the queued ones 503 at once (those
        held by a quiesce too)."""
        self.engine.drain()
        self.gate.open()

    def cancel_all(self) -> None:
        """Shutdown, last part: end every running call (its stream ends with its API's error)."""
        self.engine.cancel_all()

    @property
    def served_names(self) -> tuple[str, ...]:
        """The names /v1/models lists: the id, then the --served-model-name aliases."""
        return (self.model_id, *self.aliases)

    @property
    def accepted_names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.served_names, self.model.name, DEFAULT_MODEL_NAME)))

    def check_model(self, name: str | None) -> None:
        """Raise ModelNotFound (its message lists the accepted names) unless `name` is this
        server's model: its id, an alias, the model's own name or `default`."""
        if name is not None and name not in self.accepted_names:
            raise UnknownModel(name, self.accepted_names)

    # Templating, tokenizing and detokenizing run in worker threads (`_off_loop`): a prompt of
    # megabytes takes seconds, and on the event loop it would stall every stream and /health.

    async def tokenize(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return await self._off_loop(len(text), self._encode, text, add_special_tokens)

    async def detokenize(self, token_ids: list[int]) -> str:
        self._check_token_ids(token_ids, "tokens")
        return await self._off_loop(len(token_ids), self.model.tokenizer.decode, list(token_ids))

    async def chat_prompt_ids(self, call: ChatCall) -> list[int]:
        """The token ids the model sees for this chat call."""
        validate_tool_choice(call)
        return await self._off_loop(_num_chars(call), self._chat_ids, call, False)

    async def count_tokens(self, call: ChatCall) -> int:
        return len(await self.chat_prompt_ids(call))

    async def in_worker(self, num_chars: int, fn, *args):
        """`fn(*args)` off the event loop, as templating and tokenizing run here (scoring uses it)."""
        return await self._off_loop(num_chars, fn, *args)

    async def _off_loop(self, num_chars: int, fn, *args):
        """`fn(*args)` in a worker thread; inputs of LARGE_INPUT_CHARS or more take turns."""
        limiter = self._large_input_limiter if num_chars >= LARGE_INPUT_CHARS else None
        return await trio.to_thread.run_sync(fn, *args, limiter=limiter)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.model.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _chat_ids(self, call: ChatCall, to_run: bool) -> list[int]:
        """(in a worker thread) Render and tokenize; `to_run`: refuse a prompt too long to run
        before tokenizing it."""
        text = render_chat(self.model, call)
        if to_run:
            self._check_prompt_length(text, call.max_tokens)
        return self._encode(text, False)

    def _check_prompt_length(self, text: str, max_tokens: int | None) -> None:
        """Refuse a text that cannot fit the context whatever it tokenizes to (no token covers
        more than `_max_chars_per_token` characters), without spending seconds tokenizing it."""
        if self._max_chars_per_token is None:
            return
        min_tokens = len(text) // self._max_chars_per_token
        if min_tokens + (max_tokens or 1) > self.max_context:
            raise _context_exceeded(self.max_context, min_tokens, max_tokens or 1, at_least=True)

    def token_text(self, token_id: int) -> str:
        return self.model.tokenizer.decode([int(token_id)])

    def token_bytes(self, token_id: int) -> bytes:
        """Exact bytes of one token (llguidance's view works for every vocabulary kind)."""
        if self.grammar is not None:
            return self.grammar.token_bytes(token_id)
        return self.model.tokenizer.token_bytes(int(token_id))

    # ---- generation ------------------------------------------------------------------

    async def start_chat(self, call: ChatCall) -> EventStream:
        """Validate, render and submit a chat call; the returned stream yields its events."""
        validate_tool_choice(call)
        prompt_ids = await self._off_loop(_num_chars(call), self._chat_ids, call, True)
        constraint = None
        if self._needs_grammar(call):
            compiler = self._require_grammar()
            constraint = await trio.to_thread.run_sync(build_constraint, compiler, call)
        stop = call.stop
        parse_tools = uses_tool_parser(call)
        if parse_tools and not call.parallel_tool_calls and constraint is None:
            stop = (*stop, END_TAG)  # one call only: end the answer at its closing tag
        request = self._request(prompt_ids, call, stop=stop, constraint=constraint)
        return await self._start(request, parse_tools=parse_tools)

    async def start_completion(self, call: CompletionCall) -> EventStream:
        """Submit a raw-text (or token-id) completion; no template, no tools."""
        if isinstance(call.prompt, str):
            self._check_prompt_length(call.prompt, call.max_tokens)
            prompt_ids = await self.tokenize(call.prompt, add_special_tokens=True)
        else:
            prompt_ids = list(call.prompt)
            self._check_token_ids(prompt_ids, "prompt")
        if not prompt_ids:
            raise InvalidRequest("The prompt must not be empty.", "prompt")
        request = self._request(prompt_ids, call, stop=call.stop, constraint=None)
        return await self._start(request, parse_tools=False)

    async def chat(self, call: ChatCall) -> CallResult:
        """The whole answer of a chat call (non-streaming APIs)."""
        async with await self.start_chat(call) as stream:
            return await collect(stream)

    async def complete(self, call: CompletionCall) -> CallResult:
        async with await self.start_completion(call) as stream:
            return await collect(stream)

    # ---- internals -------------------------------------------------------------------

    def _needs_grammar(self, call: ChatCall) -> bool:
        forced_tool = call.tools and (call.tool_choice == "required" or isinstance(call.tool_choice, dict))
        json_format = call.response_format is not None and call.response_format.kind != "text"
        return bool(forced_tool or json_format)

    def _require_grammar(self):
        if self.grammar is None:
            raise InvalidRequest(
                "Structured output is unavailable: the grammar engine could not load this "
                "model's tokenizer.", "response_format", code="unsupported_feature",
            )  # fmt: skip
        return self.grammar

    def _request(self, prompt_ids, call: GenerationOptions, *, stop: tuple[str, ...], constraint) -> GenerationRequest:
        max_tokens = self._max_tokens(len(prompt_ids), call.max_tokens)
        sampling = self._sampling(call.sampling)
        try:
            return GenerationRequest(
                prompt_ids=tuple(int(t) for t in prompt_ids), max_tokens=max_tokens, sampling=sampling,
                stop=stop, seed=call.seed, logprobs=call.logprobs, top_logprobs=call.top_logprobs,
                constraint=constraint, cache_salt=call.cache_salt, cache_read_only=call.cache_read_only,
                request_id=call.request_id, ignore_eos=call.ignore_eos,
            )  # fmt: skip
        except ValueError as e:  # the engine's own checks, should a call get past the edge's
            raise InvalidRequest(f"{e}.", code="invalid_value") from None

    def _max_tokens(self, num_prompt_tokens: int, requested: int | None) -> int:
        room = self.max_context - num_prompt_tokens
        if requested is not None:
            if requested < 1:
                raise InvalidRequest(f"max_tokens must be at least 1, got {requested}.", "max_tokens")
            if requested > room:
                raise _context_exceeded(self.max_context, num_prompt_tokens, requested)
            return requested
        if room < 1:
            raise _context_exceeded(self.max_context, num_prompt_tokens, 1)
        default = self.defaults.max_tokens
        return room if default is None else min(default, room)

    def _sampling(self, options: SamplingOptions) -> SamplingParams:
        chosen = {k: v for k, v in attrs.asdict(options).items() if v is not None}
        for name, value in chosen.items():
            try:
                SamplingParams(**{name: value})
            except (ValueError, TypeError) as e:
                raise InvalidRequest(f"{e}.", name, code="invalid_value") from None
        return attrs.evolve(self.defaults.sampling, **chosen)

    def _check_token_ids(self, token_ids, param: str) -> None:
        vocab = self.model.spec.vocab_size
        for i, t in enumerate(token_ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequest(f"Token id {t!r} is out of range [0, {vocab}).", f"{param}.{i}")

    async def _start(self, request: GenerationRequest, *, parse_tools: bool) -> EventStream:
        record = CallRecord(self.observer)
        scope = await self._nursery.start(self._hold_gated, request, record, current_route.get())
        return EventStream(
            record, scope, request_id=request.request_id, keepalive_s=self.keepalive_s,
            parse_tools=parse_tools, new_call_id=new_call_id, describe_token=self._describe_token,
            frame_ticks=self.frame_ticks,
        )  # fmt: skip

    async def _hold_gated(self, request: GenerationRequest, record: CallRecord, route: str, *, task_status) -> None:
        """The request's holder, inside the admission gate (held while the engine is quiesced)."""
        async with self.gate.entered():
            record.on_event = self.live.begin(request.request_id, route, len(request.prompt_ids))
            try:
                await hold_request(self.engine, request, record, task_status=task_status)
            finally:
                record.on_event(None)

    def _frame_gap(self) -> float:
        """Seconds between the frame clock's ticks (a stream that sent a text frame sends its
        next at the next tick): none for a few streams; with many, each stream's frames carry
        several tokens, so the handlers' work per token (JSON, SSE, the socket write, all on
        this one event loop) leaves the engine its steps. Tokens still arrive in order and
        nothing is dropped; the first token is never held, the end at most one gap."""
        return self.frame_gap_s * max(0, self.engine.num_running - PACED_FROM_STREAMS + 1)

    def _describe_token(self, token_id: int) -> tuple[str, bytes]:
        return self.token_text(token_id), self.token_bytes(token_id)


def _context_exceeded(max_context: int, num_prompt: int, num_new: int, *, at_least: bool = False) -> InvalidRequest:
    more = "at least " if at_least else ""
    return InvalidRequest(
        f"This model's maximum context length is {max_context} tokens. However, you requested "
        f"{more}{num_prompt + num_new} tokens ({more}{num_prompt} in the prompt, {num_new} for the answer).",
        "messages", code="context_length_exceeded",
    )  # fmt: skip


def _num_chars(call: ChatCall) -> int:
    """About how much text a chat call renders (its messages' contents; tools are small)."""
    return sum(len(content) if isinstance(content := m.get("content"), str) else 0 for m in call.messages)


def _max_chars_per_token(tokenizer) -> int | None:
    """The most characters of text one token can stand for, with a margin (None: unknown)."""
    try:
        longest = max(map(len, tokenizer.hf.get_vocab()))
    except Exception:  # a tokenizer without a vocabulary to read: no early length check
        return None
    return max(1, longest) * _NORMALIZER_MARGIN


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


async def collect(stream: EventStream) -> CallResult:
    """Gather a stream's events into one CallResult (raises what the stream raises)."""
    request_id, text, calls, ids, logprobs = "", [], [], [], []
    any_logprobs = False
    async for event in stream:
        if isinstance(event, CallStarted):
            request_id = event.request_id
        elif isinstance(event, TextDelta):
            text.append(event.text)
            ids.extend(event.token_ids)
            if event.logprobs is not None:
                any_logprobs = True
                logprobs.extend(event.logprobs)
        elif isinstance(event, ToolCallDelta):
            calls.append(ToolCall(event.id, event.name, event.arguments))
        elif isinstance(event, CallFinished):
            return CallResult(
                request_id=request_id, text="".join(text), tool_calls=tuple(calls),
                reason=event.reason, usage=event.usage, token_ids=tuple(ids),
                logprobs=tuple(logprobs) if any_logprobs else None,
                stop_sequence=event.stop_sequence, error=event.error, timings=event.timings,
            )  # fmt: skip
    raise EngineError("the request ended without finishing")


@asynccontextmanager
async def open_service(
    engine: Engine, model, *, max_context: int, model_id: str | None = None,
    defaults: ServiceDefaults = ServiceDefaults(), keepalive_s: float = 10.0,
    observer: CallObserver | None = None, frame_gap_s: float = FRAME_GAP_PER_STREAM_S, aliases: tuple[str, ...] = (),
) -> AsyncIterator[GenerationService]:  # fmt: skip
    """A service over an open engine; owns the tasks that hold each request, and the frame clock."""
    grammar = await trio.to_thread.run_sync(_load_grammar, model)
    async with trio.open_nursery() as nursery:
        service = GenerationService(
            engine, model, nursery, model_id=model_id or model.name, max_context=max_context,
            defaults=defaults, grammar=grammar, keepalive_s=keepalive_s, observer=observer, frame_gap_s=frame_gap_s,
            aliases=aliases,
        )  # fmt: skip
        nursery.start_soon(service.frame_ticks.run)
        try:
            yield service
        finally:
            nursery.cancel_scope.cancel()


def _load_grammar(model):
    """A GrammarCompiler for the model's tokenizer, or None (logged) when it cannot load."""
    try:
        from ninfer.grammar import GrammarCompiler

        return GrammarCompiler(
            model.tokenizer.to_json_str(), vocab_size=model.spec.vocab_size, stop_token_ids=model.stop_token_ids
        )
    except Exception as e:  # structured output is optional; plain generation still works
        log.warning("structured output disabled: %s", e)
        return None


__all__ = ["GenerationService", "ServiceDefaults", "open_service", "collect", "tool_specs"]
