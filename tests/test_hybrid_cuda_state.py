"""The CUDA runner's recurrent-state copies (`snapshot_state` / `restore_state`, hybrid.StatePool)
against the ReferenceRunner: under numba's CUDA simulator in a child process (a tiny float32
model), and on a GPU where there is one (the served configuration: Q8_0 weights, a float16 KV
pool); tests/test_cuda_hybrid.py's models and helpers are reused:

a prompt's state copied to the host matches the reference's; a sequence rewound to it, and a
new sequence started from it at that position (its own slot), sample what the sequence did the
first time; a full pool refuses a restore into a new sequence; a snapshot of a sequence that
holds no state is refused. And the checkpoint slots (the prefix cache's device tier): a state
saved into one restores device to device into new sequences, and demotes to a host copy.

    python tests/test_hybrid_cuda_state.py [tiny|real]   # prints {check: "ok" | traceback}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest


def check_state_copies(scale: str = "tiny") -> None:
    from test_cuda_hybrid import _refused, _row, _runners, _same, _setup

    spec, model, kv, rtol = _setup(scale, num_layers=2)
    cr, rr = _runners(model, kv, max_sequences=2)
    prompt = np.random.default_rng(5).integers(0, spec.vocab_size, 6)
    (tok,) = _same(cr, rr, [_row(1, prompt, 0)], rtol, "prefill")
    got, want = cr.snapshot_state(1), rr.snapshot_state(1)
    assert got.num_tokens == want.num_tokens == 6 and got.nbytes == want.nbytes == cr.state_nbytes
    for g, w in zip(got.arrays, want.arrays, strict=True):
        assert g.shape == w.shape and np.abs(g - w).max() <= rtol * max(np.abs(w).max(), 1.0)
    first = cr.step([_row(1, [tok], 6, index=1)])[0]
    cr.restore_state(1, got)  # rewound: its own slot, from the copy
    again = cr.step([_row(1, [tok], 6, index=1)])[0]
    np.testing.assert_array_equal(again.logits, first.logits)
    # a new sequence over the same pages (seq 5's table is seq 1's), from the copy, in its own slot
    cr.restore_state(5, got)
    assert cr.num_recurrent_states == 2
    rr.restore_state(5, want)
    other = _same(cr, rr, [_row(5, [tok], 6, index=1)], rtol, "a new sequence from the copy")
    assert other == [first.token_id]
    try:
        cr.restore_state(9, got)
    except ValueError as e:
        assert "no free recurrent-state slot" in str(e), e
    else:
        raise AssertionError("a restore into a full pool was not refused")
    cr.release_sequence(5)
    _refused(cr, [_row(5, [tok], 7)], "its recurrent state is none")
    try:
        cr.snapshot_state(5)
    except ValueError as e:
        assert "no recurrent state" in str(e), e
    else:
        raise AssertionError("a snapshot of a released sequence was not refused")


def check_checkpoint_slots(scale: str = "tiny") -> None:
    """The prefix cache's device tier: a state saved into a checkpoint slot (device to device)
    restores into new sequences with the logits the sequence had, and stays in its slot; its
    demoted host copy equals a host snapshot; a freed slot's snapshot is refused."""
    from test_cuda_hybrid import _row, _runners, _setup

    spec, model, kv, rtol = _setup(scale, num_layers=2)
    cr, _ = _runners(model, kv, max_sequences=3, checkpoint_slots=1)
    prompt = np.random.default_rng(6).integers(0, spec.vocab_size, 6)
    (tok,) = [t.token_id for t in cr.step([_row(1, prompt, 0)])]
    saved, host = cr.save_checkpoint(1), cr.snapshot_state(1)
    assert saved.on_device and cr.num_free_checkpoint_slots == 0 and saved.slot_nbytes == cr.state_nbytes
    first = cr.step([_row(1, [tok], 6, index=1)])[0]  # sequence 1 goes on past the checkpoint
    for seq_id in (5, 9):  # each a new sequence from the slot (over sequence 1's pages: _row maps both there)
        cr.restore_state(seq_id, saved)
        np.testing.assert_array_equal(cr.step([_row(seq_id, [tok], 6, index=1)])[0].logits, first.logits)
        cr.release_sequence(seq_id)
    demoted = cr.demote_checkpoint(saved)
    assert not demoted.on_device and cr.num_free_checkpoint_slots == 1
    for got, want in zip(demoted.arrays, host.arrays, strict=True):
        np.testing.assert_array_equal(got, want)
    try:
        cr.restore_state(7, saved)
    except ValueError as e:
        assert "no longer holds" in str(e), e
    else:
        raise AssertionError("a freed checkpoint slot's snapshot was not refused")


CHECKS = {"state_copies": check_state_copies, "checkpoint_slots": check_checkpoint_slots}


def run(scale: str = "tiny") -> dict[str, str]:
    results = {}
    for name, check in CHECKS.items():
        try:
            check(scale)
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - reported to the test
            results[name] = traceback.format_exc()
    return results


def test_cuda_state_copies_under_the_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve())], env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        pytest.fail(f"the simulator child printed no results (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    results = json.loads(lines[-1])
    assert results == dict.fromkeys(CHECKS, "ok"), results


def _has_gpu() -> bool:
    from ninfer.gpu.cuda.available import cuda_available

    return cuda_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs a CUDA GPU")
def test_cuda_state_copies_on_gpu():
    results = run("real")
    assert results == dict.fromkeys(CHECKS, "ok"), results


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        from cuda.simfast import speed_up_simulator

        speed_up_simulator()
    print(json.dumps(run(*sys.argv[1:2])))
