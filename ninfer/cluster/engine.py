"""One replica's engine: `ninfer serve` in a child process on a loopback port.

A child process rather than a thread in the replica actor: the engine keeps its own trio loop,
signal handling and memory, every route, error shape and auth check is the single server's,
and a crashed engine is a dead process the replica's health check sees at once. The child
watches its parent and exits when the replica actor is gone (killed or crashed), so engines
never outlive their replicas.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

# Runs `ninfer serve` with a watchdog: exit as soon as the parent (the replica actor) is gone.
_LAUNCHER = """\
import os, sys, threading, time
parent = os.getppid()
def watch():
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)
threading.Thread(target=watch, daemon=True).start()
from ninfer.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


class EngineStartError(RuntimeError):
    pass


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EngineProcess:
    """`ninfer serve MODEL --host 127.0.0.1 --port PORT *serve_flags` in a child process."""

    def __init__(self, model: str | None, serve_flags: Sequence[str] = (), *, backend: str = "auto"):
        self.port = free_loopback_port()
        argv = ["serve", *([model] if model else []), "--host", "127.0.0.1", "--port", str(self.port),
                "--backend", backend, *serve_flags]  # fmt: skip
        self.process = subprocess.Popen([sys.executable, "-c", _LAUNCHER, *argv], start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def health_status(self, timeout_s: float = 2.0) -> int | None:
        """`GET /health`'s status (200 ready, 503 loading or unhealthy); None when unreachable."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout_s) as response:
                return response.status
        except urllib.error.HTTPError as error:
            return error.code
        except (OSError, ValueError):
            return None

    def wait_ready(self, timeout_s: float) -> None:
        """Block until `/health` is 200; EngineStartError if the process exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.is_alive():
                raise EngineStartError(f"the engine exited with status {self.process.returncode} while starting")
            if self.health_status() == 200:
                return
            time.sleep(0.25)
        self.stop()
        raise EngineStartError(f"the engine was not ready after {timeout_s:g} s")

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM (the server's graceful shutdown), then SIGKILL after `grace_s`."""
        if not self.is_alive():
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        except ProcessLookupError:
            pass
