"""Agents fetch model files from the control plane by sha256, over real HTTP, and verify them."""

import asyncio

import pytest

from workers.agent.store import ModelStore
from workers.engine.errors import EngineError

pytestmark = pytest.mark.django_db(transaction=True)


def url_for(live_server, sha):
    return f"{live_server.url}/api/v1/agent/models/{sha}/file"


def test_agent_downloads_and_verifies_a_model(live_server, smollm2_model, settings, tmp_path):
    store = ModelStore(tmp_path / "agent-store", settings.NODE_TOKEN)
    sha = smollm2_model.sha256
    path = asyncio.run(store.ensure(sha, smollm2_model.size_bytes, url_for(live_server, sha)))
    assert path == store.path_for(sha)
    assert path.stat().st_size == smollm2_model.size_bytes
    assert path.read_bytes() == smollm2_model.path.read_bytes()


def test_download_needs_the_node_token_and_a_known_file(live_server, smollm2_model, tmp_path):
    sha = smollm2_model.sha256
    wrong = ModelStore(tmp_path / "a", "not-the-token")
    with pytest.raises(EngineError, match="HTTP 403"):
        asyncio.run(wrong.ensure(sha, smollm2_model.size_bytes, url_for(live_server, sha)))
    assert not list((tmp_path / "a").iterdir())  # no partial file left behind


def test_a_file_that_does_not_match_its_hash_is_refused(
    live_server, smollm2_model, settings, tmp_path
):
    store = ModelStore(tmp_path / "b", settings.NODE_TOKEN)
    claimed = "f" * 64  # the agent was told another hash than the file served has
    with pytest.raises(EngineError, match="HTTP 404"):
        asyncio.run(store.ensure(claimed, 0, url_for(live_server, claimed)))
    real = smollm2_model.sha256
    with pytest.raises(EngineError, match="expected"):
        asyncio.run(store.ensure(claimed, 0, url_for(live_server, real)))
    assert not list((tmp_path / "b").iterdir())
