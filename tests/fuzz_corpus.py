"""What the server fuzz suite (test_server_fuzz.py) sends that Hypothesis cannot build alone.

- JSON bodies the stdlib cannot write: `RawJson` fragments (100,000-deep arrays would overflow
  `json.dumps`' recursion) spliced into an otherwise ordinary body by `encode_body`, which
  also keeps lone surrogates as `\\ud800` escapes and NaN / Infinity as their (non-standard)
  tokens; `json_depth` and `has_lone_surrogate` say what the server must make of a body.
- A corpus of raw HTTP/1.1 requests (`raw_corpus`), broken at the protocol level or sent in
  ways an HTTP client library refuses to, and `RawConnection`, a socket that sends them and
  reads back whatever answers come.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

MAX_DEPTH = 64  # the contract: JSON nested deeper than this is a 400

# ---- JSON bodies ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RawJson:
    """JSON text spliced verbatim into a body; `depth` is its own nesting depth."""

    text: str
    depth: int

    def __repr__(self) -> str:  # Hypothesis prints failing examples; 200 KB of brackets helps no one
        return f"RawJson({self.text[:24]!r}..., depth={self.depth}, {len(self.text)} chars)"


def deep_array(levels: int) -> RawJson:
    """`[[[...]]]`, `levels` arrays deep."""
    return RawJson("[" * levels + "]" * levels, levels)


def deep_object(levels: int) -> RawJson:
    """`{"a": {"a": ... 1}}`, `levels` objects deep."""
    return RawJson('{"a":' * levels + "1" + "}" * levels, levels)


def deep_schema(levels: int) -> RawJson:
    """A JSON schema of `levels` nested object properties (two JSON levels each)."""
    text = '{"type":"object","properties":{"a":' * levels + '{"type":"string"}' + "}}" * levels
    return RawJson(text, 2 * levels + 1)


def encode_body(value: Any) -> bytes:
    """`value` as JSON bytes: ASCII-only (surrogates stay `\\udXXX` escapes), NaN allowed,
    each `RawJson` replaced by its text."""
    fragments: dict[str, str] = {}

    def splice(obj):
        if isinstance(obj, RawJson):
            marker = f"@@raw-{uuid.uuid4().hex}@@"
            fragments[json.dumps(marker)] = obj.text
            return marker
        raise TypeError(f"cannot encode {type(obj).__name__}")

    text = json.dumps(value, ensure_ascii=True, allow_nan=True, default=splice)
    for marker, fragment in fragments.items():
        text = text.replace(marker, fragment, 1)
    return text.encode("ascii")


def json_depth(value: Any) -> int:
    """Nesting depth: a scalar is 0, `{}` and `[]` are 1, `[[1]]` is 2."""
    if isinstance(value, RawJson):
        return value.depth
    if isinstance(value, dict):
        return 1 + max((json_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((json_depth(v) for v in value), default=0)
    return 0


def has_lone_surrogate(value: Any) -> bool:
    """Whether any string (or key) holds a UTF-16 surrogate code point.

    The suite's strings never hold a high surrogate right before a low one (which JSON would
    decode as one valid character), so any surrogate here is a lone one on the wire too.
    """
    if isinstance(value, str):
        return any("\ud800" <= c <= "\udfff" for c in value)
    if isinstance(value, dict):
        return any(has_lone_surrogate(k) or has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(has_lone_surrogate(v) for v in value)
    return False


# ---- raw HTTP ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """What the app (not hypercorn) must answer: `status` (None: any but a 5xx) on `path`,
    whose API decides the error shape."""

    status: int | None
    path: str


@dataclass(frozen=True)
class RawCase:
    """Bytes to send on one connection.

    `answers`: the responses the app must give, in order (the request reached the app as
    well-formed HTTP). Anything after them (or everything, when empty) is hypercorn's own
    answer to a protocol error and is only checked for "no 5xx".
    `eof`: shut our sending side after the bytes, so the server sees the input end in the
    middle of a request (a body that never arrives, a chunk cut short). Only for those:
    hypercorn takes an EOF as the client leaving and drops any answer still being made.
    `layer_status`: the one 5xx the HTTP layer may answer (501 for a transfer coding it does
    not implement, as RFC 9112 section 6.1 asks), else None.
    """

    name: str
    data: bytes
    answers: tuple[Answer, ...] = ()
    eof: bool = False
    layer_status: int | None = None


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes


class RawConnection:
    """One TCP connection: send bytes, read HTTP/1.x responses back (tolerating resets)."""

    def __init__(self, host: str, port: int, *, timeout_s: float = 5.0):
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.timeout_s = timeout_s
        self.buffer = b""
        self.closed = False  # the server closed (or reset) the connection

    def __enter__(self) -> RawConnection:
        return self

    def __exit__(self, *exc_info) -> None:
        self.sock.close()

    def send(self, data: bytes) -> bool:
        """Send all of `data`; False when the server had already hung up."""
        try:
            self.sock.sendall(data)
            return True
        except (BrokenPipeError, ConnectionResetError):
            return False

    def half_close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def read_response(self, timeout_s: float | None = None) -> RawResponse | None:
        """The next final response, or None if none came (closed, reset, or timed out)."""
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s)
        while True:
            while b"\r\n\r\n" not in self.buffer:
                if not self._fill(deadline):
                    return None
            head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
            lines = head.split(b"\r\n")
            version, _, rest = lines[0].partition(b" ")
            if not version.startswith(b"HTTP/1.") or not rest[:3].isdigit():
                raise AssertionError(f"not an HTTP/1.x status line: {lines[0][:200]!r}")
            status = int(rest[:3])
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
            if 100 <= status < 200:
                continue  # an interim answer (100 Continue)
            return RawResponse(status, headers, self._read_body(headers, deadline))

    def wait_for(self, marker: bytes, timeout_s: float) -> bool:
        """Read until `marker` has arrived; False if it did not in time."""
        deadline = time.monotonic() + timeout_s
        while marker not in self.buffer:
            if not self._fill(deadline):
                return False
        return True

    def _read_body(self, headers: dict[str, str], deadline: float) -> bytes:
        if "content-length" in headers:
            size = int(headers["content-length"])
            while len(self.buffer) < size and self._fill(deadline):
                pass
            body, self.buffer = self.buffer[:size], self.buffer[size:]
            return body
        if "chunked" in headers.get("transfer-encoding", ""):
            body = b""
            while True:
                while b"\r\n" not in self.buffer:
                    if not self._fill(deadline):
                        return body
                size_line, self.buffer = self.buffer.split(b"\r\n", 1)
                size = int(size_line.split(b";")[0], 16)
                while len(self.buffer) < size + 2 and self._fill(deadline):
                    pass
                body, self.buffer = body + self.buffer[:size], self.buffer[size + 2 :]
                if size == 0:
                    return body
        while self._fill(deadline):  # no framing: the body runs to the end of the connection
            pass
        body, self.buffer = self.buffer, b""
        return body

    def _fill(self, deadline: float) -> bool:
        """Read more bytes into the buffer; False on close, reset or the deadline."""
        if self.closed:
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        self.sock.settimeout(left)
        try:
            chunk = self.sock.recv(65536)
        except TimeoutError:
            return False
        except (ConnectionResetError, ConnectionAbortedError):
            self.closed = True
            return False
        if not chunk:
            self.closed = True
            return False
        self.buffer += chunk
        return True


def raw_request(method: bytes, target: bytes, *, headers: bytes = b"", body: bytes = b"",
                version: bytes = b"HTTP/1.1", content_type: bytes | None = b"application/json",
                length: bool = True) -> bytes:  # fmt: skip
    """One request's bytes: Host, the content type and Content-Length unless told otherwise."""
    lines = [method + b" " + target + b" " + version, b"Host: fuzz"]
    if content_type is not None and (body or method == b"POST"):
        lines.append(b"Content-Type: " + content_type)
    if length and (body or method == b"POST"):
        lines.append(b"Content-Length: " + str(len(body)).encode())
    return b"\r\n".join(lines) + b"\r\n" + headers + b"\r\n" + body


def chunked(*pieces: bytes) -> bytes:
    """A valid chunked body of `pieces`, with its last chunk."""
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def raw_corpus(auth: bytes, limit: int) -> list[RawCase]:
    """The raw HTTP cases; `auth` is an `Authorization: ...\\r\\n` line, `limit` the body limit."""
    chat, messages, tokenize = "/v1/chat/completions", "/v1/messages", "/v1/tokenize"
    prompt = b'{"prompt": "Hi"}'

    def post(path: str, body: bytes = prompt, **kwargs) -> bytes:
        return raw_request(b"POST", path.encode(), headers=auth + kwargs.pop("headers", b""), body=body, **kwargs)

    def get(target: bytes, headers: bytes = b"", version: bytes = b"HTTP/1.1") -> bytes:
        return raw_request(b"GET", target, headers=auth + headers, version=version)

    def te(path: str, body: bytes, extra: bytes = b"") -> bytes:
        return post(path, b"", length=False, headers=b"Transfer-Encoding: chunked\r\n" + extra) + body

    big_chunks = chunked(*[b" " * 4096] * (limit // 4096 + 2))  # whitespace: a 400 would mean it was parsed
    return [
        # -- request lines
        RawCase("garbage request line", b"GARBAGE\r\n\r\n"),
        RawCase("request line without a version", b"GET /health\r\n\r\n"),
        RawCase("unknown HTTP version", b"GET /health HTTP/9.9\r\nHost: fuzz\r\n\r\n", (Answer(None, "/health"),)),
        RawCase("HTTP/1.1 without Host", b"GET /health HTTP/1.1\r\n\r\n"),
        RawCase("binary junk", bytes(range(256)) + b"\r\n\r\n"),
        RawCase("NUL in the target", b"GET /hea\x00lth HTTP/1.1\r\nHost: fuzz\r\n\r\n"),
        RawCase("100 KB target", get(b"/v1/" + b"a" * 100_000)),
        RawCase("lowercase method", b"get /health HTTP/1.1\r\nHost: fuzz\r\n\r\n", (Answer(None, "/health"),)),
        RawCase("absolute-form target", get(b"http://fuzz/health"), (Answer(200, "/health"),)),
        RawCase("asterisk target", b"OPTIONS * HTTP/1.1\r\nHost: fuzz\r\n" + auth + b"\r\n", (Answer(None, "/*"),)),
        RawCase("CONNECT", b"CONNECT fuzz:443 HTTP/1.1\r\nHost: fuzz:443\r\n\r\n", (Answer(None, "/fuzz"),)),
        RawCase("HTTP/2 preface, then junk", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\xff" * 64),
        # -- Content-Length
        RawCase("negative Content-Length", post(tokenize, length=False, headers=b"Content-Length: -1\r\n")),
        RawCase("non-numeric Content-Length", post(tokenize, length=False, headers=b"Content-Length: abc\r\n")),
        RawCase("conflicting Content-Lengths", post(tokenize, headers=b"Content-Length: 3\r\n")),
        RawCase("Content-Length and chunked", post(tokenize, chunked(prompt), headers=b"Transfer-Encoding: chunked\r\n"),
                (Answer(None, tokenize),)),
        RawCase("20-digit Content-Length", post(tokenize, b"", length=False, headers=b"Content-Length: 99999999999999999999\r\n"),
                (Answer(413, tokenize),)),
        RawCase("Content-Length over the limit, body never sent (OpenAI)",
                post(chat, b"", length=False, headers=b"Content-Length: %d\r\n" % (limit + 1)), (Answer(413, chat),)),
        RawCase("Content-Length over the limit, body never sent (Anthropic)",
                post(messages, b"", length=False, headers=b"Content-Length: %d\r\n" % (limit + 1)), (Answer(413, messages),)),
        RawCase("Content-Length shorter than the body", post(tokenize, length=False,
                headers=b"Content-Length: %d\r\n" % len(prompt)) + b"JUNK AFTER THE BODY\r\n\r\n",
                (Answer(200, tokenize),)),
        RawCase("Content-Length longer than the body, then EOF", post(tokenize, length=False,
                headers=b"Content-Length: 1000\r\n"), eof=True),
        RawCase("Content-Length longer than the body, connection held", post(tokenize, length=False,
                headers=b"Content-Length: 1000\r\n")),
        RawCase("truncated JSON with a matching Content-Length", post(tokenize, b'{"prompt": "H'),
                (Answer(400, tokenize),)),
        # -- chunked bodies
        RawCase("valid chunked body", te(tokenize, chunked(b'{"prompt":', b' "Hi"}')), (Answer(200, tokenize),)),
        RawCase("invalid chunk size", te(tokenize, b"zz\r\n" + prompt + b"\r\n0\r\n\r\n")),
        RawCase("chunk size overflow", te(tokenize, b"ffffffffffffffffffffffff\r\n" + prompt + b"\r\n0\r\n\r\n")),
        RawCase("negative chunk size", te(tokenize, b"-5\r\n" + prompt + b"\r\n0\r\n\r\n")),
        RawCase("chunk shorter than its size", te(tokenize, b"40\r\n" + prompt + b"\r\n0\r\n\r\n"), eof=True),
        RawCase("no last chunk, then EOF", te(tokenize, b"10\r\n" + prompt + b"\r\n"), eof=True),
        RawCase("chunk extension junk", te(tokenize, b"10;\x01\x02=\xff\r\n" + prompt + b"\r\n0\r\n\r\n"),
                (Answer(None, tokenize),)),
        RawCase("chunked body over the limit (OpenAI)", te(chat, big_chunks), (Answer(413, chat),)),
        RawCase("chunked body over the limit (Anthropic)", te(messages, big_chunks), (Answer(413, messages),)),
        RawCase("Transfer-Encoding gzip, chunked", post(tokenize, chunked(prompt), length=False,
                headers=b"Transfer-Encoding: gzip, chunked\r\n"), layer_status=501),
        RawCase("Transfer-Encoding identity", post(tokenize, length=False, headers=b"Transfer-Encoding: identity\r\n"),
                layer_status=501),
        # -- methods
        RawCase("unknown method on chat", raw_request(b"BREW", chat.encode(), headers=auth), (Answer(405, chat),)),
        RawCase("DELETE on messages", raw_request(b"DELETE", messages.encode(), headers=auth), (Answer(405, messages),)),
        RawCase("GET on count_tokens", get(b"/v1/messages/count_tokens"), (Answer(405, "/v1/messages/count_tokens"),)),
        RawCase("POST on /health", post("/health"), (Answer(405, "/health"),)),
        RawCase("PUT on a response", raw_request(b"PUT", b"/v1/responses/resp_x", headers=auth, body=prompt),
                (Answer(405, "/v1/responses/resp_x"),)),
        # -- content types
        RawCase("text/plain JSON (OpenAI)", post(chat, content_type=b"text/plain"), (Answer(415, chat),)),
        RawCase("form body (Anthropic)", post(messages, b"a=1&b=2", content_type=b"application/x-www-form-urlencoded"),
                (Answer(415, messages),)),
        RawCase("no Content-Type (Anthropic)", post(messages, content_type=None), (Answer(415, messages),)),
        RawCase("multipart body (OpenAI)", post(tokenize, b"--x\r\n\r\nhi\r\n--x--", content_type=b"multipart/form-data; boundary=x"),
                (Answer(415, tokenize),)),
        RawCase("Content-Type with a charset", post(tokenize, content_type=b"application/json; charset=utf-8"),
                (Answer(200, tokenize),)),
        RawCase("Content-Type with a non-ASCII charset", post(tokenize, content_type=b"application/json; charset=\xff\xfe"),
                (Answer(None, tokenize),)),
        # -- headers
        RawCase("2,000 headers", get(b"/v1/models", b"".join(b"X-Flood-%d: y\r\n" % i for i in range(2000))),
                (Answer(None, "/v1/models"),)),
        RawCase("20,000 headers", get(b"/v1/models", b"".join(b"X-Flood-%d: y\r\n" % i for i in range(20_000)))),
        RawCase("one 100 KB header", get(b"/v1/models", b"X-Big: " + b"y" * 100_000 + b"\r\n")),
        RawCase("header without a colon", get(b"/v1/models", b"NoColonHere\r\n")),
        RawCase("space in a header name", get(b"/v1/models", b"Bad Name: y\r\n")),
        RawCase("obs-fold continuation line", get(b"/v1/models", b"X-Folded: a\r\n  b\r\n"), (Answer(None, "/v1/models"),)),
        RawCase("NUL in a header value", get(b"/v1/models", b"X-Nul: a\x00b\r\n")),
        RawCase("non-ASCII x-request-id", get(b"/v1/models", b"X-Request-Id: \xff\xfe\xc3\xa9\r\n"),
                (Answer(200, "/v1/models"),)),
        RawCase("non-ASCII API key", raw_request(b"GET", b"/v1/models", headers=b"Authorization: Bearer \xff\xfe\r\n"),
                (Answer(401, "/v1/models"),)),
        RawCase("non-ASCII x-api-key (Anthropic)", raw_request(b"POST", b"/v1/messages", body=prompt,
                headers=b"X-Api-Key: \xc3\xa9\xff\r\n"), (Answer(401, messages),)),
        RawCase("websocket upgrade on chat", post(chat, headers=b"Connection: Upgrade\r\nUpgrade: websocket\r\n"
                b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"), (Answer(None, chat),)),
        RawCase("h2c upgrade", get(b"/health", b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: \xff\r\n")),
        RawCase("Expect: 100-continue", post(tokenize, headers=b"Expect: 100-continue\r\n"), (Answer(200, tokenize),)),
        # -- non-ASCII targets
        RawCase("raw 0xff bytes in the path", get(b"/v1/\xff\xfe")),
        RawCase("raw UTF-8 in an Anthropic path", get(b"/v1/messages/\xc3\xa9")),
        RawCase("invalid percent-encoded UTF-8 model id", get(b"/v1/models/%ff%fe"), (Answer(404, "/v1/models/x"),)),
        RawCase("percent-encoded surrogate model id", get(b"/v1/models/%ED%A0%80"), (Answer(404, "/v1/models/x"),)),
        RawCase("percent-encoded surrogate response id", get(b"/v1/responses/%ED%A0%80"), (Answer(404, "/v1/responses/x"),)),
        RawCase("bad percent escape", get(b"/v1/models/%zz%"), (Answer(404, "/v1/models/x"),)),
        RawCase("non-ASCII query string", get(b"/v1/models?\xff=\xfe&%ff")),
        RawCase("percent-encoded query string", get(b"/v1/models?%ff=%ED%A0%80&x"), (Answer(200, "/v1/models"),)),
        # -- HTTP/1.0 and pipelining
        RawCase("HTTP/1.0 GET", get(b"/health", version=b"HTTP/1.0"), (Answer(200, "/health"),)),
        RawCase("HTTP/1.0 POST", post(tokenize, version=b"HTTP/1.0"), (Answer(200, tokenize),)),
        RawCase("three pipelined GETs", get(b"/health") * 3, (Answer(200, "/health"),) * 3),
        RawCase("pipelined POST, GET, bad JSON", post(tokenize) + get(b"/v1/models") + post(tokenize, b"{nope}"),
                (Answer(200, tokenize), Answer(200, "/v1/models"), Answer(400, tokenize))),
        RawCase("pipelined request after a protocol error", b"GARBAGE\r\n\r\n" + get(b"/health")),
    ]
