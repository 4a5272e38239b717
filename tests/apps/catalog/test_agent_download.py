"""Agents fetch model files from the control plane by sha256, over real HTTP, and verify them."""

import asyncio
import time

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
    assert not list((tmp_path / "a").glob("sha256-*"))  # no partial file left behind


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
    assert not list((tmp_path / "b").glob("sha256-*"))


def test_the_file_view_answers_a_range_with_the_rest(live_server, smollm2_model, settings):
    import httpx

    url = url_for(live_server, smollm2_model.sha256)
    auth = {"Authorization": f"Bearer {settings.NODE_TOKEN}"}
    whole = smollm2_model.path.read_bytes()
    resp = httpx.get(url, headers=auth | {"Range": "bytes=98000000-"})
    assert resp.status_code == 206 and resp.content == whole[98_000_000:]
    assert resp.headers["Content-Range"] == f"bytes 98000000-{len(whole) - 1}/{len(whole)}"
    assert resp.headers["Accept-Ranges"] == "bytes"


def test_an_interrupted_download_is_continued_not_restarted(
    live_server, smollm2_model, settings, tmp_path
):
    store = ModelStore(tmp_path / "c", settings.NODE_TOKEN)
    sha, size = smollm2_model.sha256, smollm2_model.size_bytes
    whole = smollm2_model.path.read_bytes()
    part = store.path_for(sha).with_name(store.path_for(sha).name + ".part")
    # A partial file whose bytes are wrong: continuing it (a Range request for the rest)
    # must end in a hash mismatch, which proves the kept bytes were not fetched again;
    # the bad partial is dropped and the next load starts over and succeeds.
    part.write_bytes(b"\0" * 30_000_000)
    with pytest.raises(EngineError, match="expected"):
        asyncio.run(store.ensure(sha, size, url_for(live_server, sha)))
    assert not part.exists()
    # A good partial file is continued to the right file.
    part.write_bytes(whole[:30_000_000])
    path = asyncio.run(store.ensure(sha, size, url_for(live_server, sha)))
    assert path.read_bytes() == whole and not part.exists()


def test_two_loads_of_one_file_download_it_once_and_space_is_checked_first(
    live_server, smollm2_model, settings, tmp_path, monkeypatch
):
    store = ModelStore(tmp_path / "d", settings.NODE_TOKEN)
    sha, size = smollm2_model.sha256, smollm2_model.size_bytes
    fetched = []
    real = store._download

    async def counting(*args):
        fetched.append(args[0])
        await real(*args)

    monkeypatch.setattr(store, "_download", counting)

    async def both():
        url = url_for(live_server, sha)
        return await asyncio.gather(store.ensure(sha, size, url), store.ensure(sha, size, url))

    a, b = asyncio.run(both())
    assert a == b == store.path_for(sha) and fetched == [sha]
    # No room: refused before a byte is fetched, saying how much is needed and free.
    import shutil as real_shutil

    from workers.agent import store as store_module

    full = real_shutil.disk_usage(tmp_path)._replace(free=1000)
    monkeypatch.setattr(store_module.shutil, "disk_usage", lambda _p: full)
    other = ModelStore(tmp_path / "e", settings.NODE_TOKEN)
    with pytest.raises(EngineError, match=f"needs {size} more bytes, 1000 are free"):
        asyncio.run(other.ensure(sha, size, url_for(live_server, sha)))
    assert not list((tmp_path / "e").glob("sha256-*"))


def test_files_are_served_in_constant_memory_under_asgi(
    asgi_server, settings, tmp_path, transactional_db
):
    """Under uvicorn a 600 MB file travels without the process growing by its size."""
    import threading

    import httpx

    from apps.catalog.models import CatalogModel

    settings.MODEL_STORE_DIR = tmp_path
    sha, size = "ab" * 32, 600 << 20
    with open(tmp_path / f"sha256-{sha}.gguf", "wb") as f:
        f.truncate(size)  # sparse: no disk, the reads cost no I/O
    model = CatalogModel.objects.create(name="big", source="test", state="ready", sha256=sha)
    model.files.create(index=0, sha256=sha, size_bytes=size, name="big.gguf")

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS"))

    peak, done = [rss()], threading.Event()

    def sample():
        while not done.is_set():
            peak.append(rss())
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    received = 0
    try:
        with httpx.stream(
            "GET",
            f"{asgi_server}/api/v1/agent/models/{sha}/file",
            headers={"Authorization": f"Bearer {settings.NODE_TOKEN}"},
            timeout=60,
        ) as resp:
            assert resp.status_code == 200
            for chunk in resp.iter_bytes(1 << 20):
                received += len(chunk)
    finally:
        done.set()
        sampler.join()
    assert received == size
    assert max(peak) - peak[0] < 100 << 20, f"grew by {(max(peak) - peak[0]) >> 20} MiB"
