"""The suite's long child processes (the CUDA simulator checks, the PTX compiles) run in the
background, one at a time, from the end of collection: the pytest process is one thread, so
on a 2-core machine they take the other core while the rest of the suite runs. The tests that
read their results run last (conftest.py moves them), so by then the results are in.

A test module registers its jobs at import (`register`, naming the fixture that waits for
them); only jobs that a selected test waits for start. A job not started in the background
runs in the foreground at its first `wait`.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time

import attrs


@attrs.define(eq=False)
class ChildJob:
    name: str
    argv: list[str]
    env: dict[str, str]
    timeout_s: float
    module: str  # the registering test module's __name__ ...
    fixture: str  # ... and the fixture of it that waits for the job
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    _lock: threading.Lock = attrs.field(factory=threading.Lock)
    _done: bool = False

    def run(self) -> None:
        """Run the child now, unless it ran already (from any thread; once)."""
        with self._lock:
            if self._done:
                return
            start = time.monotonic()
            try:
                proc = subprocess.Popen(self.argv, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)  # fmt: skip
                try:
                    self.stdout, self.stderr = proc.communicate(timeout=self.timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    self.stdout, self.stderr = proc.communicate()
                    self.stderr += f"\n(killed after {self.timeout_s:.0f} s)"
                self.returncode = proc.returncode
            except OSError as exc:
                self.stderr = f"could not start {self.argv[:2]}: {exc}"
            self.seconds = time.monotonic() - start
            self._done = True

    def wait(self) -> ChildJob:
        self.run()  # blocks on the lock while the background thread runs it
        return self


_jobs: dict[str, ChildJob] = {}


def register(name: str, argv: list[str], env: dict[str, str], timeout_s: float, module: str, fixture: str) -> ChildJob:
    """The job `name` (registered once per session; a second call returns the first)."""
    if name not in _jobs:
        _jobs[name] = ChildJob(name, list(argv), dict(env), timeout_s, module, fixture)
    return _jobs[name]


def simulator_job(name: str, argv: list[str], timeout_s: float, module: str) -> ChildJob:
    """A check harness run under numba's CUDA simulator, waited for by the module's
    `sim_results` fixture (`json_results`)."""
    import os

    return register(name, argv, dict(os.environ, NUMBA_ENABLE_CUDASIM="1"), timeout_s, module, "sim_results")


def needed_by(item) -> list[ChildJob]:
    """The jobs a collected test waits for (through its module's job fixture)."""
    module = getattr(getattr(item, "module", None), "__name__", None)
    names = getattr(item, "fixturenames", ())
    return [job for job in _jobs.values() if job.module == module and job.fixture in names]


def start_background(jobs: list[ChildJob]) -> None:
    """Run `jobs`, one after another, in a daemon thread."""
    if jobs:
        threading.Thread(target=lambda: [job.run() for job in jobs], name="child-jobs", daemon=True).start()


def json_results(job: ChildJob) -> dict[str, str]:
    """The last JSON line a check harness printed (check name -> "ok" or its traceback); the
    test fails with the child's stderr when there is none."""
    import pytest

    job.wait()
    lines = [line for line in job.stdout.splitlines() if line.startswith("{")]
    if not lines:
        pytest.fail(f"{job.name}: the child printed no results (exit {job.returncode}):\n{job.stderr[-4000:]}")
    return json.loads(lines[-1])
