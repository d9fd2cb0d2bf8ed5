"""The README's set-up section holds exactly the two commands, and CI runs the test one."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def setup_blocks() -> list[str]:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```sh\n(.*?)```", section, re.S)]


def test_readme_has_exactly_two_setup_commands():
    blocks = setup_blocks()
    assert len(blocks) == 2, blocks
    serve, test = blocks
    for cmd in blocks:
        assert cmd.startswith("python3 -m venv .venv && .venv/bin/pip install -e ")
    assert serve.endswith(".venv/bin/ninfer serve")
    assert test.endswith(".venv/bin/python -m pytest")


def test_ci_runs_the_readme_test_command():
    script = REPO / ".ci" / "run"
    # The script prints the command it extracted before running it; run only the extraction.
    extract = script.read_text(encoding="utf-8").split('echo "ci: $cmd"')[0] + 'printf "%s" "$cmd"\n'
    out = subprocess.run(["bash", "-c", extract], capture_output=True, text=True, cwd=REPO / ".ci")
    assert out.stdout.strip() == setup_blocks()[1]
