"""Hugging Face pulls with the real huggingface_hub client against a local hub (tests/fakehub.py),
and multi-file (split) GGUF models from pull to store."""

import logging

import pytest

from apps.catalog import hub, services
from apps.catalog.gguf_meta import BadGGUF, read_metadata
from apps.catalog.models import CatalogModel, PullJob, model_digest, store_path
from apps.catalog.sources import SourceError
from tests.fakehub import FakeHub
from tests.ggufs import rewrite

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def split_parts(smollm2_path, tmp_path_factory):
    """SmolLM2 as three files in llama.cpp's gguf-split layout."""
    return rewrite(smollm2_path, tmp_path_factory.mktemp("split") / "smol.gguf", parts=3)


@pytest.fixture
def fake_hub(settings, tmp_path, smollm2_path, split_parts):
    readme = tmp_path / "README.md"
    readme.write_text("# smol GGUF\n")
    running = FakeHub().start()
    running.add(
        "acme/smol-GGUF",
        {
            "smol-Q4_1.gguf": smollm2_path,
            "README.md": readme,  # not a GGUF: never picked
            # Named as if it were another quantization, to be picked by its own tag.
            "Q8_0/smol-Q8_0-00001-of-00003.gguf": split_parts[0],
            "Q8_0/smol-Q8_0-00002-of-00003.gguf": split_parts[1],
            "Q8_0/smol-Q8_0-00003-of-00003.gguf": split_parts[2],
        },
        refs=("v1.0",),
    )
    settings.HF_ENDPOINT = running.url
    settings.HF_TOKEN = ""
    settings.MODEL_STORE_DIR = tmp_path / "store"
    yield running
    running.stop()


def _pull(source: str, name: str = "", seen=None) -> PullJob:
    job = services.create_pull(name, source=source)
    listener = (lambda *a: seen.append(a)) if seen is not None else None
    return services.run_pull(job.pk, on_progress=listener)


def test_names_parse_and_bad_ones_say_the_accepted_forms():
    assert hub.parse("hf://acme/smol-GGUF:Q4_K_M") == hub.HubRef("acme/smol-GGUF", tag="Q4_K_M")
    ref = hub.parse("hf://acme/smol-GGUF@v1.0/sub/smol.Q8_0.gguf")
    assert (ref.revision, ref.filename, ref.default_name()) == (
        "v1.0",
        "sub/smol.Q8_0.gguf",
        "smol-q8_0",
    )
    assert hub.parse("hf://acme/smol-GGUF").default_name() == "smol-gguf"
    assert str(hub.parse("hf://acme/x@abc:Q5_K_M")) == "hf://acme/x@abc:Q5_K_M"
    for bad in ["hf://acme", "hf://acme/x/../../etc/passwd.gguf", "hf://a/b:Q4 K", "acme/x"]:
        with pytest.raises(SourceError, match="hf://org/repo"):
            hub.parse(bad)


def test_a_tag_picks_one_file_or_a_whole_split():
    files = [
        hub.HubFile(p, 1, "", "")
        for p in [
            "m-Q4_K_M.gguf",
            "m-Q8_0-00001-of-00002.gguf",
            "m-Q8_0-00002-of-00002.gguf",
            "mmproj-m-Q4_K_M.gguf",
            "x-Q5_K_M.gguf",
            "y-Q5_K_M.gguf",
        ]
    ]
    pick = lambda name: [f.path for f in hub.choose(hub.parse(name), files)]  # noqa: E731
    assert pick("hf://a/b") == ["m-Q4_K_M.gguf"]  # Q4_K_M by default, mmproj never
    assert pick("hf://a/b:q8_0") == ["m-Q8_0-00001-of-00002.gguf", "m-Q8_0-00002-of-00002.gguf"]
    assert pick("hf://a/b/m-Q8_0-00002-of-00002.gguf") == pick("hf://a/b:Q8_0")
    with pytest.raises(SourceError, match="several files match tag Q5_K_M"):
        pick("hf://a/b:Q5_K_M")
    with pytest.raises(SourceError, match="no file matches tag IQ2_XS.*m-Q4_K_M.gguf"):
        pick("hf://a/b:IQ2_XS")
    with pytest.raises(SourceError, match="part m-Q3-00002-of-00002.gguf is missing"):
        hub.choose(hub.parse("hf://a/b:Q3"), [hub.HubFile("m-Q3-00001-of-00002.gguf", 1, "", "")])


def test_pull_by_tag_verifies_pins_the_commit_and_reports_progress(
    fake_hub, smollm2_path, settings
):
    seen = []
    job = _pull("hf://acme/smol-GGUF:Q4_1", name="smol", seen=seen)
    assert job.state == PullJob.State.DONE, job.error
    model = CatalogModel.objects.get(name="smol")
    assert model.state == "ready" and model.source == "hf://acme/smol-GGUF:Q4_1"
    assert model.revision == fake_hub.repos["acme/smol-GGUF"].commit
    assert model.sha256 == services.sources.KNOWN_MODELS["smollm2-135m-instruct"].sha256
    assert model.path.read_bytes() == smollm2_path.read_bytes()
    assert [(f.index, f.name) for f in model.files.all()] == [(0, "smol-Q4_1.gguf")]
    # Every download names the commit, not the branch: all parts come from one push.
    gets = fake_hub.downloads("smol-Q4_1.gguf")
    assert gets and all(f"/resolve/{model.revision}/" in g["path"] for g in gets)
    phases = [p for p, *_ in seen]
    assert any(p.startswith("downloading smol-Q4_1.gguf") for p in phases)
    assert any(p.startswith("verifying") for p in phases)
    assert seen[-1][1] == seen[-1][2] == model.size_bytes
    # The staging folder is gone once the files are in the store.
    assert not (settings.MODEL_STORE_DIR / ".hf" / "acme--smol-GGUF").exists()


def test_a_dropped_connection_resumes_where_it_stopped(fake_hub):
    # The first transfer drops after 25 MB, the next six at once. Within one pull
    # huggingface_hub asks for the rest (Range) until a few tries bring nothing; the pull then
    # fails and keeps its partial file, and the next pull asks only for what is missing.
    fake_hub.cuts["smol-Q4_1.gguf"] = [25_000_000] + [0] * 6
    first = _pull("hf://acme/smol-GGUF/smol-Q4_1.gguf", name="smol")
    assert first.state == PullJob.State.FAILED and "pull again to resume" in first.error
    ranges = [g["range"] for g in fake_hub.downloads("smol-Q4_1.gguf")]
    kept = int(ranges[1].removeprefix("bytes=").rstrip("-"))
    assert ranges[0] in ("", "bytes=0-") and 10_000_000 <= kept <= 25_000_000
    assert CatalogModel.objects.get(name="smol").state == "failed"
    before = len(fake_hub.downloads("smol-Q4_1.gguf"))
    fake_hub.cuts.clear()
    second = _pull("hf://acme/smol-GGUF/smol-Q4_1.gguf", name="smol")
    assert second.state == PullJob.State.DONE, second.error
    resumed = fake_hub.downloads("smol-Q4_1.gguf")[before:]
    assert resumed[0]["range"] == f"bytes={kept}-"
    model = CatalogModel.objects.get(name="smol")
    assert model.state == "ready" and model.path.stat().st_size == model.size_bytes


def test_a_file_that_does_not_match_the_hubs_sha256_is_refused(fake_hub, settings):
    fake_hub.repos["acme/smol-GGUF"].lie_sha.add("smol-Q4_1.gguf")
    job = _pull("hf://acme/smol-GGUF:Q4_1", name="smol")
    assert job.state == PullJob.State.FAILED and "the hub lists" in job.error
    assert CatalogModel.objects.get(name="smol").state == "failed"
    assert not list(settings.MODEL_STORE_DIR.glob("sha256-*.gguf"))


def test_gated_repository_needs_the_token_which_never_reaches_a_log(
    fake_hub, settings, caplog, monkeypatch
):
    token = "hf_test_gated_token_0123456789"
    fake_hub.repos["acme/smol-GGUF"].token = token
    caplog.set_level(logging.DEBUG)
    job = _pull("hf://acme/smol-GGUF:Q4_1", name="smol")
    assert job.state == PullJob.State.FAILED
    assert "gated" in job.error and "HF_TOKEN" in job.error
    settings.HF_TOKEN = token
    monkeypatch.setenv("HF_TOKEN", token)  # as the settings read it: the log filter masks it
    job = _pull("hf://acme/smol-GGUF:Q4_1", name="smol")
    assert job.state == PullJob.State.DONE, job.error
    assert fake_hub.downloads("smol-Q4_1.gguf")[-1]["authorization"] == f"Bearer {token}"
    from controlplane.logs import RedactSecrets

    for record in caplog.records:
        RedactSecrets().filter(record)
        assert token not in record.getMessage()


def test_unknown_revision_and_file_say_what_is_missing(fake_hub):
    job = _pull("hf://acme/smol-GGUF@v9:Q4_1", name="smol")
    assert job.state == PullJob.State.FAILED and "no revision 'v9'" in job.error
    job = _pull("hf://acme/smol-GGUF/nope.gguf", name="smol")
    assert job.state == PullJob.State.FAILED and "has no file nope.gguf" in job.error
    job = _pull("hf://acme/other:Q4_1", name="other")
    assert job.state == PullJob.State.FAILED and "not found" in job.error
    job = _pull("hf://acme/smol-GGUF@v1.0:Q4_1", name="smol")  # a tag that exists
    assert job.state == PullJob.State.DONE, job.error


def test_split_model_pulls_as_one_model_with_its_parts(fake_hub, smollm2_path, split_parts):
    job = _pull("hf://acme/smol-GGUF:Q8_0")
    assert job.state == PullJob.State.DONE, job.error
    model = CatalogModel.objects.get(name="smol-gguf-q8_0")  # named from the repository and tag
    files = list(model.files.all())
    assert [f.name for f in files] == [p.name.replace("smol", "smol-Q8_0") for p in split_parts]
    assert [f.size_bytes for f in files] == [p.stat().st_size for p in split_parts]
    assert model.sha256 == model_digest([f.sha256 for f in files]) and model.is_split
    assert model.size_bytes == sum(p.stat().st_size for p in split_parts)
    assert all(store_path(f.sha256).exists() for f in files)
    # The estimator reads every part: the same facts as the one-file model.
    single = read_metadata(smollm2_path)
    for key in ("n_layers", "parameters", "bytes_per_layer", "bytes_outside_layers", "n_vocab"):
        assert getattr(model, key) == single[key], key


def test_local_import_of_a_split_takes_every_part_and_checks_them(settings, tmp_path, split_parts):
    settings.MODEL_STORE_DIR = tmp_path / "store"
    job = services.run_pull(services.create_pull("local-split", str(split_parts[1])).pk)
    assert job.state == PullJob.State.DONE, job.error
    model = CatalogModel.objects.get(name="local-split")
    assert [f.name for f in model.files.all()] == [p.name for p in split_parts]
    # A part missing, or parts out of order: refused with the reason.
    lonely = tmp_path / "lonely-00001-of-00002.gguf"
    lonely.write_bytes(split_parts[0].read_bytes())
    job = services.run_pull(services.create_pull("lonely", str(lonely)).pk)
    assert job.state == PullJob.State.FAILED and "lonely-00002-of-00002.gguf" in job.error
    with pytest.raises(BadGGUF, match="split.count=3, 2 parts"):
        read_metadata(split_parts[:2])
    with pytest.raises(BadGGUF, match="part 1 does not say split.no=0"):
        read_metadata([split_parts[1], split_parts[0], split_parts[2]])


def test_pull_api_takes_an_hf_source(fake_hub, ops):
    resp = ops.post("/api/v1/models/pull/", {"source": "hf://acme/smol-GGUF:Q4_1"}, format="json")
    assert resp.status_code == 202, resp.content
    assert resp.json()["model"] == "smol-gguf-q4_1"
    resp = ops.post("/api/v1/models/pull/", {"source": "hf://nope"}, format="json")
    assert resp.status_code == 400 and "hf://org/repo" in resp.json()["detail"]
