"""Turning sampled token ids into client-visible text: detokenizing and stop strings.

Stop strings are matched on the detokenized text, across token boundaries. Text that could
still grow into a stop string is held back; the stop string itself and everything after it are
never emitted. Pure logic, no IO.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import attrs


class Detokenizer(Protocol):
    def push(self, token_id: int) -> str:
        """Newly completed text after appending one token."""

    def flush(self) -> str:
        """Whatever text is still buffered (the end of the output)."""


@attrs.frozen
class TextChunk:
    text: str  # safe to emit now
    stop_sequence: str | None = None  # set when a stop string completed (text ends before it)


class StopStringMatcher:
    """Holds back text that may be the start of a stop string; reports the first full match."""

    def __init__(self, stop_strings: Iterable[str]):
        self._stops = tuple(s for s in stop_strings if s)
        self._held = ""

    def feed(self, text: str) -> TextChunk:
        if not self._stops:
            return TextChunk(text)
        pending = self._held + text
        match = self._earliest_match(pending)
        if match is not None:
            index, stop = match
            self._held = ""
            return TextChunk(pending[:index], stop)
        keep = self._longest_stop_prefix_suffix(pending)
        self._held = pending[len(pending) - keep :] if keep else ""
        return TextChunk(pending[: len(pending) - keep])

    def flush(self) -> str:
        """The held-back text, once no more text will come."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, text: str) -> tuple[int, str] | None:
        found = [(text.find(stop), stop) for stop in self._stops]
        found = [(index, stop) for index, stop in found if index >= 0]
        # Earliest start wins; on a tie the longer stop string (it contains the shorter).
        return min(found, key=lambda item: (item[0], -len(item[1])), default=None)

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest


class OutputText:
    """Detokenizer + stop-string matcher for one request."""

    def __init__(self, detokenizer: Detokenizer, stop_strings: Iterable[str]):
        self._detokenizer = detokenizer
        self._matcher = StopStringMatcher(stop_strings)

    def push(self, token_id: int) -> TextChunk:
        return self._matcher.feed(self._detokenizer.push(token_id))

    def finish(self) -> TextChunk:
        """Flush everything at the end of generation (a stop string may still complete)."""
        chunk = self._matcher.feed(self._detokenizer.flush())
        if chunk.stop_sequence is not None:
            return chunk
        return TextChunk(chunk.text + self._matcher.flush())
