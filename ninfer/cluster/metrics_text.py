"""Prometheus text from several replicas as one exposition: every sample labelled by replica.

The exposition format wants each metric family once (one HELP, one TYPE, then all of its
samples), so the replicas' texts are merged family by family rather than concatenated.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?(\s.*)$")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def relabel(line: str, label: str, value: str) -> str:
    """A sample line with `label="value"` added first among its labels."""
    match = _SAMPLE.match(line)
    if match is None:
        return line
    name, labels, rest = match.groups()
    pair = f'{label}="{_escape(value)}"'
    inner = labels[1:-1].strip() if labels else ""
    return f"{name}{{{pair}{',' + inner if inner else ''}}}{rest}"


def merge_expositions(texts: Mapping[str, str], *, label: str = "replica") -> str:
    """One exposition from `{replica: text}`: families in first-seen order, samples labelled."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for replica, text in texts.items():
        family = None
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    headers.setdefault(family, [])
                    samples.setdefault(family, [])
                    if not any(h.split(None, 3)[1] == parts[1] for h in headers[family]):
                        headers[family].append(line)
                continue
            if family is None:  # a sample with no HELP / TYPE before it
                family = _SAMPLE.match(line).group(1) if _SAMPLE.match(line) else "untyped"
                headers.setdefault(family, [])
                samples.setdefault(family, [])
            samples[family].append(relabel(line, label, replica))
    out = []
    for family, lines in headers.items():
        out.extend(lines)
        out.extend(samples[family])
    return "\n".join(out) + ("\n" if out else "")
