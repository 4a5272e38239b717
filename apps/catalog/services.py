"""Pulling and importing models into the store."""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.catalog import sources
from apps.catalog.gguf_meta import BadGGUF, read_metadata
from apps.catalog.models import CatalogModel, PullJob, store_path
from controlplane.errors import Conflict, DomainError, NotFound

log = logging.getLogger(__name__)


def check_pull(name: str, local_path: str = "") -> CatalogModel:
    """Validate a pull or import request; returns the (possibly new) catalog row."""
    if local_path:
        if not Path(local_path).is_file():
            raise DomainError(f"{local_path} is not a file")
    elif name not in sources.KNOWN_MODELS:
        known = ", ".join(sorted(sources.KNOWN_MODELS))
        raise NotFound(f"unknown model {name!r}; known models: {known} (or import a local file)")
    source = (
        f"file:{os.path.abspath(local_path)}"
        if local_path
        else f"pypi:{sources.KNOWN_MODELS[name].label}"
    )
    known = None if local_path else sources.KNOWN_MODELS[name]
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


def start_pull(name: str, local_path: str = "") -> PullJob:
    """Create a pull job and enqueue it once the transaction commits."""
    from apps.catalog.tasks import run_pull

    with transaction.atomic():
        model = check_pull(name, local_path)
        job = PullJob.objects.create(model=model, local_path=local_path)
        transaction.on_commit(lambda: run_pull.delay(job.pk))
    return job


def create_pull(name: str, local_path: str = "") -> PullJob:
    """Create a pull job without enqueueing it (the command line runs it in-process)."""
    with transaction.atomic():
        model = check_pull(name, local_path)
        return PullJob.objects.create(model=model, local_path=local_path)


class _ProgressWriter:
    """Writes progress to the job row at most a few times a second."""

    def __init__(self, job_id: int, listener=None):
        self.job_id = job_id
        self.listener = listener
        self.last = 0.0

    def __call__(self, phase: str, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last < 0.25 and done != total:
            return
        self.last = now
        PullJob.objects.filter(pk=self.job_id).update(
            phase=phase, bytes_done=done, bytes_total=total
        )
        if self.listener is not None:
            self.listener(phase, done, total)


def run_pull(job_id: int, on_progress=None) -> PullJob:
    """Execute a pull job: fetch, verify, read metadata, mark the model ready or failed.

    on_progress(phase, bytes_done, bytes_total) is called as the job row is updated.
    """
    claimed = PullJob.objects.filter(pk=job_id, state=PullJob.State.PENDING).update(
        state=PullJob.State.RUNNING, started_at=timezone.now(), phase="starting"
    )
    job = PullJob.objects.select_related("model").get(pk=job_id)
    if not claimed:
        return job  # another worker got there first, or it already ran
    model = job.model
    # A model that serves keeps serving while it is pulled again: its file stays until the new
    # one is verified and swapped in (os.replace), and a failed re-pull leaves it as it was.
    serving = model.state == CatalogModel.State.READY and model.path.exists()
    if not serving:
        CatalogModel.objects.filter(pk=model.pk).update(state=CatalogModel.State.PULLING, error="")
    progress = _ProgressWriter(job.pk, on_progress)
    store = Path(settings.MODEL_STORE_DIR)
    store.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(dir=store, prefix=".pull-") as tmp:
            out = Path(tmp) / "model.gguf"
            if job.local_path:
                sha = _copy_hashing(Path(job.local_path), out, progress)
            else:
                source = sources.KNOWN_MODELS[model.name]
                sha = sources.fetch(source, Path(tmp), out, progress)
                if sha != source.sha256:
                    raise sources.SourceError(f"sha256 is {sha}, expected {source.sha256}")
            progress("reading GGUF metadata", out.stat().st_size, out.stat().st_size)
            meta = read_metadata(out)
            final = store_path(sha)
            os.replace(out, final)
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
    CatalogModel.objects.filter(pk=model.pk).update(
        state=CatalogModel.State.READY,
        error="",
        sha256=sha,
        size_bytes=final.stat().st_size,
        **{k: v for k, v in meta.items()},
    )
    PullJob.objects.filter(pk=job.pk).update(
        state=PullJob.State.DONE, phase="done", finished_at=timezone.now()
    )
    job.refresh_from_db()
    return job


def _copy_hashing(src: Path, dst: Path, progress) -> str:
    total = src.stat().st_size
    digest, done = hashlib.sha256(), 0
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        while chunk := fi.read(4 << 20):
            digest.update(chunk)
            fo.write(chunk)
            done += len(chunk)
            progress("copying and hashing", done, total)
    return digest.hexdigest()


def delete_model(model: CatalogModel) -> None:
    """Remove a model from the catalog (refused while a deployment uses it)."""
    if model.deployments.exclude(state__in=["stopped"]).exists():
        raise Conflict(f"{model.name} is used by a deployment; undeploy it first")
    sha = model.sha256
    model.delete()
    if sha and not CatalogModel.objects.filter(sha256=sha).exists():
        store_path(sha).unlink(missing_ok=True)
