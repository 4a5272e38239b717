"""What this agent generated for each recent request, by request id.

The web process counts a stream's tokens as they pass and writes its usage record at the
end. When that process dies mid-stream, its count dies with it; the engines' work is
counted here too, so that the control plane's sweeper can settle the record from it
(GetRequestUsage). Bounded by age and by count: a sweeper looks minutes after the fact.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

#: Requests are remembered this long, and at most this many (the oldest go first).
KEEP_SECONDS = 3600.0
KEEP_REQUESTS = 100_000


@dataclass
class Counted:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finished: bool = False
    at: float = 0.0  # time.monotonic() when it was last counted


class Ledger:
    def __init__(self, keep_seconds: float = KEEP_SECONDS, keep_requests: int = KEEP_REQUESTS):
        self.keep_seconds, self.keep_requests = keep_seconds, keep_requests
        self._requests: OrderedDict[str, Counted] = OrderedDict()

    def count(self, request_id: str, prompt: int, completion: int, finished: bool = False) -> None:
        """Add tokens of a request as its stream produces them (a request that came back
        here after a move adds up)."""
        if not request_id:
            return
        now = time.monotonic()
        c = self._requests.pop(request_id, None) or Counted()
        c.prompt_tokens = max(c.prompt_tokens, prompt)
        c.completion_tokens += completion
        c.finished = c.finished or finished
        c.at = now
        self._requests[request_id] = c  # the newest last
        while self._requests and (
            len(self._requests) > self.keep_requests
            or now - next(iter(self._requests.values())).at > self.keep_seconds
        ):
            self._requests.popitem(last=False)

    def get(self, request_id: str) -> Counted | None:
        c = self._requests.get(request_id)
        if c is not None and time.monotonic() - c.at > self.keep_seconds:
            return None
        return c
