"""The ASGI app hypercorn serves from the moment the socket listens: "loading" until the engine
is warm, then the real app.

`ninfer serve` binds its port first and answers while it loads the model, creates the runner
and compiles / captures every shape the configuration can produce (llama-server does the same):
`/health` is 503 `{"status": "loading", "stage": ...}` and every other route 503 in its API's
own error shape with `Retry-After`. `run_app(app)` runs the real app's lifespan (its startup)
and switches to it; from then on every request goes straight to the app.
"""

from __future__ import annotations

import json

import trio

from ninfer.protocols import systemone
from ninfer.protocols.errors import ApiError, ErrorKind

RETRY_AFTER_S = 2


class ReadinessSwitch:
    def __init__(self) -> None:
        self.stage = "starting"
        self._app = None
        self._app_stop = trio.Event()

    @property
    def is_ready(self) -> bool:
        return self._app is not None

    async def __call__(self, scope, receive, send) -> None:
        app = self._app
        if app is not None and scope["type"] != "lifespan":
            await app(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._loading(scope, send)

    async def run_app(self, app, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run `app`'s lifespan until the server stops; requests go to it once it has started."""
        started = False

        async def receive():
            nonlocal started
            if not started:
                started = True
                return {"type": "lifespan.startup"}
            await self._app_stop.wait()
            return {"type": "lifespan.shutdown"}

        async def send(message):
            if message["type"] == "lifespan.startup.complete":
                self._app = app
                task_status.started()
            elif message["type"].endswith(".failed"):
                raise RuntimeError(f"the app failed its {message['type']}: {message.get('message', '')}")

        await app({"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}}, receive, send)

    async def _lifespan(self, receive, send) -> None:
        """Hypercorn's own lifespan: the switch is ready to accept at once; at shutdown the
        app's lifespan ends too."""
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self._app_stop.set()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _loading(self, scope, send) -> None:
        path = scope.get("path", "")
        if path == "/health":
            body = {"status": "loading", "stage": self.stage}
        else:
            error = ApiError(ErrorKind.UNAVAILABLE, f"The model is loading ({self.stage}); retry shortly.",
                             code="model_loading")  # fmt: skip
            if systemone.is_systemone_path(path):
                body = systemone.detail_error(error)[1]
            else:
                body = (error.anthropic() if path.startswith("/v1/messages") else error.openai())[1]
        data = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                   (b"retry-after", str(RETRY_AFTER_S).encode())]  # fmt: skip
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": data})
