"""The suite's long child processes (the CUDA simulator checks, the PTX compiles) run in the
background, one at a time, from the end of collection: the pytest process is one thread, so
on a 2-core machine they take the other core while the rest of the suite runs. The tests that
read their results run last (conftest.py moves them).

A test module registers its jobs at import (`register`, naming the fixture that waits for
them); only jobs that a selected test waits for are queued. A `wait` on a job still queued runs
it at once; a `wait` on a job the background is running first runs other queued jobs itself
(its core would idle otherwise), so at the end of the suite both cores work off the queue.
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
    cost_s: float = 60.0  # about how long it runs on a busy 2-core machine (the queue runs longest first)
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

    @property
    def done(self) -> bool:
        return self._done

    def wait(self) -> ChildJob:
        if _take(self):
            self.run()
        while not self._done and (other := _take(None)) is not None:
            other.run()  # the background runs this one: help with the rest meanwhile
        self.run()  # blocks on the lock while the background thread runs it
        return self


_jobs: dict[str, ChildJob] = {}


def register(name: str, argv: list[str], env: dict[str, str], timeout_s: float, module: str, fixture: str,
             cost_s: float = 60.0) -> ChildJob:  # fmt: skip
    """The job `name` (registered once per session; a second call returns the first)."""
    if name not in _jobs:
        _jobs[name] = ChildJob(name, list(argv), dict(env), timeout_s, module, fixture, cost_s)
    return _jobs[name]


def simulator_job(name: str, argv: list[str], timeout_s: float, module: str, cost_s: float = 60.0) -> ChildJob:
    """A check harness run under numba's CUDA simulator, waited for by the module's
    `sim_results` fixture (`json_results`)."""
    import os

    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    return register(name, argv, env, timeout_s, module, "sim_results", cost_s)


def needed_by(item) -> list[ChildJob]:
    """The jobs a collected test waits for (through its module's job fixture)."""
    module = getattr(getattr(item, "module", None), "__name__", None)
    names = getattr(item, "fixturenames", ())
    return [job for job in _jobs.values() if job.module == module and job.fixture in names]


_queue: list[ChildJob] = []
_queue_lock = threading.Lock()


def _take(job: ChildJob | None) -> ChildJob | None:
    """Remove `job` (None: the first job) from the queue; what was removed, if anything."""
    with _queue_lock:
        if job is None:
            return _queue.pop(0) if _queue else None
        if job in _queue:
            _queue.remove(job)
            return job
        return None


def start_background(jobs: list[ChildJob]) -> None:
    """Queue `jobs`, longest first, and work the queue off in a daemon thread, one at a time."""
    with _queue_lock:
        _queue.extend(job for job in jobs if not job.done and job not in _queue)
        _queue.sort(key=lambda job: -job.cost_s)

    def worker():
        while (job := _take(None)) is not None:
            job.run()

    threading.Thread(target=worker, name="child-jobs", daemon=True).start()


def json_results(*jobs: ChildJob) -> dict[str, str]:
    """The last JSON line each check harness printed, merged (check name -> "ok" or its
    traceback); the test fails with a child's stderr where there is none."""
    import pytest

    results = {}
    for job in jobs:
        job.wait()
        lines = [line for line in job.stdout.splitlines() if line.startswith("{")]
        if not lines:
            pytest.fail(f"{job.name}: the child printed no results (exit {job.returncode}):\n{job.stderr[-4000:]}")
        results.update(json.loads(lines[-1]))
    return results
