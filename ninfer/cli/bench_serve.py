"""`ninfer bench serve`: drive a running OpenAI-compatible server with concurrent streaming requests.

Like vLLM's `benchmark_serving`: for each concurrency level (or a request rate), send streaming
chat (or completion) requests of a fixed or jittered prompt and output length, and report the
aggregate output tok/s, TTFT and inter-token latency (p50 / p95 / p99), per-stream tok/s and
errors. Each level runs `--passes` times; the first pass after the server started (cold shapes)
and the later ones (steady state) are shown apart. Works against ninfer or any server that
speaks the OpenAI API (llama-server, vLLM); `--ignore-eos` (a vLLM / llama.cpp extension that
ninfer accepts too) keeps every output at its full length.

The client is a small HTTP/1.1 reader on raw trio sockets (one connection per request): it
costs a few microseconds per streamed frame, so the figures are the server's, not the client's.
Inter-token latency is measured per streamed frame and divided by the tokens the frame carried
(a server may coalesce tokens for a reader that fell behind).

    ninfer bench serve --url http://127.0.0.1:8080 --concurrency 1,4,16,64 --output-tokens 256
    ninfer bench serve --shared-prefix-tokens 2000 --prompt-tokens 150 --output-tokens 64 --concurrency 64
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from urllib.parse import urlsplit

import attrs
import trio

from ninfer.cli.common import CommandParser, positive_int, positive_int_list

_WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book "
    "eye job word business issue side kind head house service friend father power hour game line "
    "end member law car city community name president team minute idea kid body information back "
    "parent face others level office door health person art war history party result change "
    "morning reason research girl guy moment air teacher force education river garden window"
).split()


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="the server's base URL (http://127.0.0.1:8080)")
    parser.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--api", choices=("chat", "completions"), default="chat",
                        help="/v1/chat/completions or /v1/completions (chat)")  # fmt: skip
    parser.add_argument("--concurrency", type=positive_int_list, default=[1, 4, 16, 64],
                        help="concurrency levels: requests in flight at once (1,4,16,64)")  # fmt: skip
    parser.add_argument("--request-rate", type=float, default=None,
                        help="requests a second, Poisson arrivals, instead of fixed concurrency levels")  # fmt: skip
    parser.add_argument("--num-requests", type=positive_int, default=None,
                        help="requests per pass (default: 4 x the concurrency, at least 8)")  # fmt: skip
    parser.add_argument("--prompt-tokens", type=positive_int, default=128, help="approximate prompt length (128)")
    parser.add_argument("--output-tokens", type=positive_int, default=256, help="max_tokens of each request (256)")
    parser.add_argument("--jitter", type=float, default=0.0,
                        help="dataset-like lengths: draw prompt and output lengths uniformly within "
                             "+-JITTER of the given ones (0: fixed)")  # fmt: skip
    parser.add_argument("--shared-prefix-tokens", type=int, default=0,
                        help="a system prompt of about this many tokens shared by every request (0)")  # fmt: skip
    parser.add_argument("--passes", type=positive_int, default=2,
                        help="passes per level; the first after start shows cold shapes (2)")  # fmt: skip
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="ask the server to generate all --output-tokens (default: on)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt words (0)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="give up on a request after this long (600)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON ('-' for stdout)")
    return parser


@attrs.define
class RequestResult:
    ok: bool = False
    error: str = ""
    start_s: float = 0.0
    first_token_s: float | None = None
    end_s: float = 0.0
    num_tokens: int = 0  # output tokens (the server's usage where it reports it)
    num_frames: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    itls_s: list[float] = attrs.Factory(list)  # per token: frame gap / tokens in the frame


# -- a lean streaming HTTP/1.1 client ----------------------------------------------------------


class HttpError(Exception):
    pass


class _Reader:
    """Bytes from a trio stream, with line and exact-size reads."""

    def __init__(self, stream: trio.abc.ReceiveStream):
        self._stream = stream
        self._buf = bytearray()

    async def _fill(self) -> None:
        data = await self._stream.receive_some(65536)
        if not data:
            raise HttpError("the server closed the connection mid-response")
        self._buf += data

    async def line(self) -> bytes:
        while (i := self._buf.find(b"\r\n")) < 0:
            await self._fill()
        out = bytes(self._buf[:i])
        del self._buf[: i + 2]
        return out

    async def exactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            await self._fill()
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    async def some(self) -> bytes:
        if not self._buf:
            data = await self._stream.receive_some(65536)
            return data
        out = bytes(self._buf)
        self._buf.clear()
        return out


async def post_events(url: str, path: str, payload: dict, headers: dict[str, str]):
    """POST `payload` as JSON and yield (receive time, data) for every SSE `data:` field."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80)
    body = json.dumps(payload).encode()
    head = [f"POST {parts.path.rstrip('/')}{path} HTTP/1.1", f"Host: {host}:{port}",
            "Content-Type: application/json", "Accept: text/event-stream", f"Content-Length: {len(body)}",
            "Connection: close", *(f"{k}: {v}" for k, v in headers.items())]  # fmt: skip
    stream = await trio.open_tcp_stream(host, port)
    if parts.scheme == "https":
        import ssl

        stream = trio.SSLStream(stream, ssl.create_default_context(), server_hostname=host)
    async with stream:
        await stream.send_all(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        reader = _Reader(stream)
        status, chunks = await _response(reader)
        if status != 200:
            text = b"".join([c async for c in chunks]).decode("utf-8", "replace")
            raise HttpError(f"HTTP {status}: {text[:300]}")
        pending = b""
        async for chunk in chunks:
            now = time.perf_counter()
            pending += chunk
            *events, pending = pending.replace(b"\r\n", b"\n").split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if line.startswith(b"data:"):
                        yield now, line[5:].strip()


async def _response(reader: _Reader):
    """(status, body chunks) of a response whose head comes next."""
    status_line = await reader.line()
    fields = {}
    while line := await reader.line():
        name, _, value = line.decode("latin-1").partition(":")
        fields[name.strip().lower()] = value.strip()
    chunks = _chunked(reader) if "chunked" in fields.get("transfer-encoding", "") else _raw(reader, fields)
    return int(status_line.split()[1]), chunks


async def _chunked(reader: _Reader):
    while True:
        size = int((await reader.line()).split(b";")[0], 16)
        if size == 0:
            return
        data = await reader.exactly(size)
        await reader.exactly(2)
        yield data


async def _raw(reader: _Reader, fields: dict):
    left = int(fields["content-length"]) if "content-length" in fields else None
    while left is None or left > 0:
        data = await reader.some() if left is None else await reader.exactly(min(left, 65536))
        if not data:
            return
        if left is not None:
            left -= len(data)
        yield data


async def get_json(url: str, path: str, headers: dict[str, str]) -> dict:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    head = [f"GET {parts.path.rstrip('/')}{path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close",
            *(f"{k}: {v}" for k, v in headers.items())]  # fmt: skip
    async with await trio.open_tcp_stream(host, port) as stream:
        await stream.send_all(("\r\n".join(head) + "\r\n\r\n").encode())
        status, chunks = await _response(_Reader(stream))
        data = b"".join([c async for c in chunks])
        if status != 200:
            raise HttpError(f"GET {path}: HTTP {status} {data[:200]!r}")
        return json.loads(data)


# -- the workload ------------------------------------------------------------------------------


def make_prompt(rng: random.Random, num_tokens: int) -> str:
    """About `num_tokens` tokens of common words (one token each in most BPE vocabularies)."""
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, num_tokens - 8)))


def _jittered(rng: random.Random, value: int, jitter: float) -> int:
    if jitter <= 0:
        return value
    return max(1, round(value * rng.uniform(1 - jitter, 1 + jitter)))


def build_payload(args, model: str, rng: random.Random, shared_prefix: str) -> dict:
    question = f"Request {rng.randrange(10**9)}: continue this list. " + make_prompt(
        rng, _jittered(rng, args.prompt_tokens, args.jitter)
    )
    max_tokens = _jittered(rng, args.output_tokens, args.jitter)
    payload: dict = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                     "stream_options": {"include_usage": True}}  # fmt: skip
    if args.ignore_eos:
        payload["ignore_eos"] = True
    if args.api == "chat":
        messages = [{"role": "system", "content": shared_prefix}] if shared_prefix else []
        payload["messages"] = [*messages, {"role": "user", "content": question}]
    else:
        payload["prompt"] = (shared_prefix + "\n\n" if shared_prefix else "") + question
    return payload


async def run_request(args, headers, payload: dict) -> RequestResult:
    path = "/v1/chat/completions" if args.api == "chat" else "/v1/completions"
    result = RequestResult(start_s=time.perf_counter())
    last_s = None
    counted = 0
    try:
        with trio.fail_after(args.timeout_s):
            async for now, data in post_events(args.url, path, payload, headers):
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise HttpError(f"stream error: {json.dumps(event['error'])[:300]}")
                usage = event.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens")
                    result.num_tokens = usage.get("completion_tokens", counted)
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens")
                n = _frame_tokens(event)
                if n == 0:
                    continue
                counted += n
                result.num_frames += 1
                if last_s is None:
                    result.first_token_s = now
                else:
                    result.itls_s += [(now - last_s) / n] * n
                last_s = now
        result.ok = True
        result.num_tokens = result.num_tokens or counted
    except (HttpError, OSError, trio.TooSlowError, ValueError, KeyError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.end_s = time.perf_counter()
    return result


def _frame_tokens(event: dict) -> int:
    """Output tokens a streamed frame carries: its logprob entries where present, else 1 per
    non-empty text piece (a coalescing server still reports usage at the end)."""
    n = 0
    for choice in event.get("choices") or ():
        logprobs = (choice.get("logprobs") or {}).get("content")
        if logprobs:
            n += len(logprobs)
            continue
        delta = choice.get("delta") or {}
        text = delta.get("content") if "delta" in choice else choice.get("text")
        if text or delta.get("tool_calls"):
            n += max(1, int(choice.get("num_tokens", 1)))
    return n


async def run_pass(args, headers, model: str, concurrency: int | None, num_requests: int, seed: int) -> dict:
    rng = random.Random(seed)
    shared = make_prompt(random.Random(args.seed + 7), args.shared_prefix_tokens) if args.shared_prefix_tokens else ""
    payloads = [build_payload(args, model, rng, shared) for _ in range(num_requests)]
    results: list[RequestResult] = []
    limiter = trio.CapacityLimiter(concurrency or num_requests)
    arrivals = random.Random(seed + 1)

    async def one(payload):
        async with limiter:
            results.append(await run_request(args, headers, payload))

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for payload in payloads:
            if args.request_rate:
                await trio.sleep(arrivals.expovariate(args.request_rate))
            nursery.start_soon(one, payload)
    return summarize(results, time.perf_counter() - start)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def summarize(results: list[RequestResult], wall_s: float) -> dict:
    ok = [r for r in results if r.ok]
    ttfts = [r.first_token_s - r.start_s for r in ok if r.first_token_s is not None]
    itls = [x for r in ok for x in r.itls_s]
    per_stream = [
        (r.num_tokens - 1) / (r.end_s - r.first_token_s)
        for r in ok
        if r.first_token_s is not None and r.num_tokens > 1 and r.end_s > r.first_token_s
    ]
    tokens = sum(r.num_tokens for r in ok)
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    ms = lambda v: None if v is None else round(v * 1e3, 2)  # noqa: E731
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "first_errors": sorted({r.error for r in results if not r.ok})[:3],
        "wall_s": round(wall_s, 3),
        "output_tokens": tokens,
        "tok_s": round(tokens / wall_s, 1) if wall_s > 0 else 0.0,
        "ttft_ms": {f"p{q}": ms(_pct(ttfts, q)) for q in (50, 95, 99)},
        "itl_ms": {f"p{q}": ms(_pct(itls, q)) for q in (50, 95, 99)},
        "stream_tok_s": round(statistics.fmean(per_stream), 1) if per_stream else None,
        "tokens_per_frame": round(tokens / max(1, sum(r.num_frames for r in ok)), 2),
        "prompt_tokens_mean": round(statistics.fmean(prompts), 1) if prompts else None,
        "cached_tokens_mean": round(statistics.fmean(cached), 1) if cached else None,
    }


def format_table(rows: list[dict]) -> str:
    header = ("level", "pass", "reqs", "err", "tok/s", "TTFT p50/p95/p99 ms", "ITL p50/p95/p99 ms",
              "stream tok/s", "tok/frame", "prompt", "cached")  # fmt: skip
    lines = [header]
    for row in rows:
        s = row["summary"]
        trio3 = lambda d: "/".join("-" if v is None else f"{v:g}" for v in d.values())  # noqa: E731
        lines.append((row["level"], row["pass"], str(s["requests"]), str(s["errors"]), f"{s['tok_s']:,.0f}",
                      trio3(s["ttft_ms"]), trio3(s["itl_ms"]), str(s["stream_tok_s"]), str(s["tokens_per_frame"]),
                      str(s["prompt_tokens_mean"]), str(s["cached_tokens_mean"])))  # fmt: skip
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(str(c).rjust(w) for c, w in zip(line, widths)) for line in lines)


async def bench(args) -> list[dict]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model
    if model is None:
        listing = await get_json(args.url, "/v1/models", headers)
        model = listing["data"][0]["id"]
    levels = [None] if args.request_rate else args.concurrency
    rows = []
    for level in levels:
        num_requests = args.num_requests or max(8, 4 * (level or 8))
        name = f"rate {args.request_rate:g}/s" if level is None else f"c={level}"
        for index in range(args.passes):
            summary = await run_pass(args, headers, model, level, num_requests, args.seed + 1000 * index)
            label = "first" if index == 0 else f"steady{index}" if args.passes > 2 else "steady"
            rows.append({"level": name, "pass": label, "concurrency": level, "request_rate": args.request_rate,
                         "summary": summary})  # fmt: skip
            print(format_table([rows[-1]]).splitlines()[-1], file=sys.stderr, flush=True)
            for error in summary["first_errors"]:
                print(f"  error: {error}", file=sys.stderr)
    return rows


def run(args: argparse.Namespace) -> int:
    try:
        rows = trio.run(bench, args)
    except (HttpError, OSError) as exc:
        print(f"ninfer bench serve: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    print(format_table(rows))
    if args.json:
        text = json.dumps({"url": args.url, "args": {k: v for k, v in vars(args).items() if k != "api_key"},
                           "results": rows}, indent=2, default=str)  # fmt: skip
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(text + "\n")
    return 1 if any(row["summary"]["errors"] for row in rows) else 0


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(CommandParser(prog="ninfer bench serve", description=__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter))  # fmt: skip
    return run(parser.parse_args(argv))
