"""A bounded in-process store of finished Responses, for `previous_response_id` and GET / DELETE.

Each entry keeps the wire Response and the conversation it ends: the neutral chat messages
of every earlier turn plus this one's input and output, without `instructions` (OpenAI's API
does not carry them to the next response). Least recently used entries go first once the
store is full. Everything lives in this process's memory and is lost on restart.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import attrs

from ninfer.protocols.responses_events import Response

DEFAULT_MAX_RESPONSES = 1024


@attrs.frozen(eq=False)
class StoredResponse:
    response: Response
    conversation: tuple[dict[str, Any], ...]  # chat messages up to and including the output


@attrs.frozen
class StoreStatistics:
    num_responses: int
    max_responses: int
    num_evicted: int


class ResponsesStore:
    """An LRU map from response id to `StoredResponse`, holding at most `max_responses`."""

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES):
        if max_responses < 1:
            raise ValueError(f"max_responses must be at least 1, got {max_responses}")
        self.max_responses = max_responses
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._num_evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._entries

    def put(self, entry: StoredResponse) -> None:
        """Store (or replace) an entry as the most recent; evict the oldest beyond the bound."""
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        while len(self._entries) > self.max_responses:
            self._entries.popitem(last=False)
            self._num_evicted += 1

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry (now the most recently used), or None when unknown or evicted."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        """Forget an entry; False when there was none."""
        return self._entries.pop(response_id, None) is not None

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(len(self._entries), self.max_responses, self._num_evicted)
