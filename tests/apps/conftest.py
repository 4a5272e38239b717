import pytest


@pytest.fixture(autouse=True)
async def _usage_writes_done():
    """Usage records are written in the background after a response: let them land before
    the test database is emptied (on PostgreSQL a TRUNCATE racing an INSERT deadlocks).

    Here, not for every test: the browser test's Playwright runs its own loop in the thread.
    """
    yield
    from apps.usage.services import flush

    await flush()
