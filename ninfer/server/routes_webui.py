"""The web pages: the dashboard (`/dashboard`) and a streaming chat page (`/chat`; `/` redirects
there). Plain HTML, CSS and JavaScript shipped in the package (`ninfer/server/webui/`, package
data): no build step, nothing fetched from elsewhere (the Content-Security-Policy allows only
this origin). The pages themselves need no key; the JSON they call does, so with `--api-key`
they ask for it once and keep it in the tab's sessionStorage. `--no-webui` leaves them out.
"""

from __future__ import annotations

import importlib.resources

from quart import Response, redirect

from ninfer.protocols.errors import ApiError, ErrorKind

ASSET_PREFIX = "/webui/"
PAGES = {"/chat": "chat.html", "/dashboard": "dashboard.html"}
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}  # fmt: skip
_SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
    "Referrer-Policy": "no-referrer",
}


def is_open_path(path: str) -> bool:
    """Paths served without a key (the pages and their assets; they hold no data)."""
    return path == "/" or path in PAGES or path.startswith(ASSET_PREFIX)


def _assets() -> dict[str, bytes]:
    """Every file in the package's webui/ folder, read once at start-up."""
    folder = importlib.resources.files("ninfer.server").joinpath("webui")
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file() and _suffix(f.name) in _TYPES}


def _suffix(name: str) -> str:
    return name[name.rfind(".") :] if "." in name else ""


def register(app) -> None:
    assets = _assets()

    def serve_file(name: str) -> Response:
        response = Response(assets[name], status=200, content_type=_TYPES[_suffix(name)])
        response.headers.update(_SECURITY_HEADERS)
        return response

    async def index():
        return redirect("/chat", code=302)

    async def asset(name: str):
        if name not in assets:
            raise ApiError(ErrorKind.NOT_FOUND, f"No route for GET {ASSET_PREFIX}{name}.", code="unknown_url")
        return serve_file(name)

    app.add_url_rule("/", "webui_index", index, methods=["GET"])
    for path, name in PAGES.items():
        app.add_url_rule(path, f"webui_{name.split('.')[0]}", _page(serve_file, name), methods=["GET"])
    app.add_url_rule(ASSET_PREFIX + "<name>", "webui_asset", asset, methods=["GET"])


def _page(serve_file, name: str):
    async def page() -> Response:
        return serve_file(name)

    return page
