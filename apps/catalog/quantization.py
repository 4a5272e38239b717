"""Quantization jobs: a variant of a catalog model made by llama.cpp's quantizer on a node of
the fleet, measured against its source, and kept in the catalog with what it was made from.

The node is the one with the most free memory among those that have room for the work (the
source loaded twice over, for quantizing then measuring) and disk for the files. The agent
streams progress and then the file; this side verifies its sha256 and reads its facts, as a
pull does.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from datetime import timedelta
from pathlib import Path

import grpc
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from llamafleet.agent.v1 import agent_pb2 as pb

from apps.catalog.gguf_meta import BadGGUF, read_metadata
from apps.catalog.models import CatalogModel, QuantizeJob, store_path
from apps.catalog.services import ProgressWriter, agent_files, register_files
from apps.nodes import agent_client
from apps.nodes.models import Node
from controlplane.errors import Conflict, DomainError
from workers.engine import errors

log = logging.getLogger(__name__)

#: What llama.cpp quantizes from without a large loss (it requantizes Q8_0 on request).
SOURCE_TYPES = {"ALL_F32": "F32", "F16": "F16", "BF16": "BF16", "Q8_0": "Q8_0"}
EVAL_TEXT = Path(__file__).parent / "data" / "eval_text.txt"
_MiB = 1 << 20


class QuantizeError(Exception):
    """The job cannot finish; the message says why for the operator."""


def check_quantize(source: CatalogModel, target: str, name: str = "") -> str:
    """Validate a request; returns the result's catalog name."""
    if target not in QuantizeJob.Target.values:
        raise DomainError(f"target must be one of {', '.join(QuantizeJob.Target.values)}")
    if source.state != CatalogModel.State.READY:
        raise DomainError(f"{source.name} is {source.state}, not ready")
    if source.quantization not in SOURCE_TYPES:
        raise DomainError(
            f"{source.name} is {source.quantization}; quantize from a full-precision "
            f"({', '.join(v for v in SOURCE_TYPES.values() if v != 'Q8_0')}) or Q8_0 model"
        )
    name = name or f"{source.name}-{target.lower()}"
    if CatalogModel.objects.filter(name=name).exists():
        raise Conflict(f"the catalog already has a model named {name}")
    if QuantizeJob.objects.filter(
        name=name, state__in=[QuantizeJob.State.PENDING, QuantizeJob.State.RUNNING]
    ).exists():
        raise Conflict(f"{name} is already being made")
    return name


def create_quantize(source: CatalogModel, target: str, name: str = "") -> QuantizeJob:
    """A pending job, not enqueued (the command line runs it in-process)."""
    with transaction.atomic():
        name = check_quantize(source, target, name)
        return QuantizeJob.objects.create(source=source, target=target, name=name)


def start_quantize(source: CatalogModel, target: str, name: str = "") -> QuantizeJob:
    """Create a job and enqueue it once the transaction commits."""
    from apps.catalog.tasks import run_quantize

    with transaction.atomic():
        job = create_quantize(source, target, name)
        run_quantize.delay_on_commit(job.pk)
    return job


def needs(source: CatalogModel) -> tuple[int, int]:
    """(memory, disk) a node must have free: the source mapped while the result is written,
    then each loaded to be measured; the source's files and a result no larger."""
    return int(source.size_bytes * 1.5) + 256 * _MiB, 2 * source.size_bytes


def choose_node(source: CatalogModel) -> Node:
    memory, disk = needs(source)
    nodes = list(Node.objects.filter(state=Node.State.READY, draining=False))
    fit = [n for n in nodes if n.memory_available_bytes >= memory and n.disk_free_bytes >= disk]
    if not fit:
        seen = "; ".join(
            f"{n.name}: {n.memory_available_bytes // _MiB} MiB free memory, "
            f"{n.disk_free_bytes // _MiB} MiB free disk"
            for n in nodes
        )
        raise QuantizeError(
            f"no ready node has {memory // _MiB} MiB free memory and {disk // _MiB} MiB free "
            f"disk for quantizing {source.name} ({seen or 'no ready nodes'})"
        )
    return max(fit, key=lambda n: n.memory_available_bytes)


def _request(job: QuantizeJob) -> pb.QuantizeRequest:
    return pb.QuantizeRequest(
        job_id=str(job.pk),
        source_files=agent_files(job.source),
        target=job.target,
        eval_text=EVAL_TEXT.read_text(encoding="utf-8"),
    )


def _receive(job: QuantizeJob, node: Node, out: Path, progress) -> pb.QuantizeProgress:
    """Drive the agent's Quantize stream into `out`; returns its last message (verified)."""
    digest, last = hashlib.sha256(), None
    calls = agent_client.stub(node.address).Quantize(
        _request(job), metadata=agent_client.metadata(), timeout=settings.QUANTIZE_TIMEOUT
    )
    with open(out, "wb") as f:
        for msg in calls:
            if msg.chunk:
                digest.update(msg.chunk)
                f.write(msg.chunk)
            progress(f"{msg.phase} on {node.name}", msg.done, msg.total)
            last = msg
    if last is None or not last.sha256:
        raise QuantizeError(f"{node.name} ended the stream without a result")
    if digest.hexdigest() != last.sha256 or out.stat().st_size != last.size_bytes:
        raise QuantizeError(f"the file from {node.name} does not match its sha256")
    return last


def _evaluation(last: pb.QuantizeProgress, node: Node) -> dict:
    """The result against its source on the evaluation text."""
    src, res = last.source, last.result
    if not res.tokens:
        return {}
    return {
        "text": EVAL_TEXT.name,
        "tokens": res.tokens,
        "mean_nll": round(res.mean_nll, 4),
        "parent_mean_nll": round(src.mean_nll, 4),
        "nll_change": round(res.mean_nll - src.mean_nll, 4),
        "perplexity": round(math.exp(res.mean_nll), 3),
        "parent_perplexity": round(math.exp(src.mean_nll), 3),
        "decode_tokens_per_second": round(res.decode_tokens_per_second, 1),
        "parent_decode_tokens_per_second": round(src.decode_tokens_per_second, 1),
        "node": node.name,
        "seconds": round(last.seconds, 1),
    }


def run_quantize(job_id: int, on_progress=None) -> QuantizeJob:
    """Execute a job: pick a node, quantize there, keep the verified result in the catalog.
    Every way out leaves the job done or failed, never running."""
    claimed = QuantizeJob.objects.filter(pk=job_id, state=QuantizeJob.State.PENDING).update(
        state=QuantizeJob.State.RUNNING,
        started_at=timezone.now(),
        phase="choosing a node",
        lease_expires_at=timezone.now() + timedelta(seconds=settings.QUANTIZE_TIMEOUT + 300),
    )
    job = QuantizeJob.objects.select_related("source").get(pk=job_id)
    if not claimed:
        return job
    progress = ProgressWriter(job.pk, on_progress, job_model=QuantizeJob)
    store = Path(settings.MODEL_STORE_DIR)
    store.mkdir(parents=True, exist_ok=True)
    out = store / f".quantize-{job.pk}.gguf"
    try:
        node = choose_node(job.source)
        QuantizeJob.objects.filter(pk=job.pk).update(node=node)
        last = _receive(job, node, out, progress)
        progress("reading GGUF metadata", last.size_bytes, last.size_bytes)
        meta = read_metadata(out)
        os.replace(out, store_path(last.sha256))
        with transaction.atomic():
            model = CatalogModel.objects.create(
                name=job.name,
                source=f"quantized:{job.source.name}:{job.target}",
                description=f"{job.source.name} quantized to {job.target} on {node.name}",
                chat_template=job.source.chat_template,
                parent=job.source,
                evaluation=_evaluation(last, node),
            )
            register_files(model, [(last.sha256, f"{job.name}.gguf")], meta)
            QuantizeJob.objects.filter(pk=job.pk).update(
                state=QuantizeJob.State.DONE,
                phase="done",
                result=model,
                finished_at=timezone.now(),
            )
    except Exception as exc:  # whatever it was: a final state and the reason
        if isinstance(exc, grpc.RpcError):
            message = f"agent: {errors.describe(exc)}"
        elif isinstance(exc, (QuantizeError, BadGGUF, OSError)):
            message = str(exc)
        else:
            message = f"{type(exc).__name__}: {exc}"
        log.warning("quantization job %s failed: %s", job.pk, message)
        out.unlink(missing_ok=True)
        QuantizeJob.objects.filter(pk=job.pk).update(
            state=QuantizeJob.State.FAILED, error=message, finished_at=timezone.now()
        )
    job.refresh_from_db()
    return job
