"""The agent's ledger of tokens per request: what settles a stream whose web process died."""

from workers.agent import ledger as L


def test_counts_add_up_and_the_prompt_counts_once():
    book = L.Ledger()
    book.count("a", 40, 1)
    book.count("a", 40, 3)
    book.count("a", 0, 0, finished=True)
    c = book.get("a")
    assert (c.prompt_tokens, c.completion_tokens, c.finished) == (40, 4, True)
    assert book.get("b") is None
    book.count("", 5, 5)  # a request without an id is not kept
    assert book.get("") is None


def test_it_forgets_the_oldest_beyond_its_bounds(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(L.time, "monotonic", lambda: now[0])
    book = L.Ledger(keep_seconds=60, keep_requests=2)
    book.count("a", 1, 1)
    book.count("b", 1, 1)
    book.count("a", 1, 1)  # a is the newest now
    book.count("c", 1, 1)  # over 2: b, the oldest, goes
    assert book.get("b") is None and book.get("a").completion_tokens == 2
    now[0] += 61
    assert book.get("a") is None  # too old to be trusted
    book.count("d", 1, 1)  # and counting drops what aged out
    assert list(book._requests) == ["d"]
