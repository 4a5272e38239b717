"""Quantization jobs on an agent: llama.cpp's quantizer in a child process, progress streamed
back, then the result file in chunks (the control plane keeps it in the catalog)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from llamafleet.agent.v1 import agent_pb2 as pb

from workers.agent.store import ModelStore
from workers.engine import errors
from workers.engine.errors import EngineError
from workers.engine.quantize import TARGETS

CHUNK = 1 << 20  # well under gRPC's 4 MiB message limit


def _evaluation(d: dict | None) -> pb.Evaluation | None:
    return pb.Evaluation(**d) if d else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            digest.update(chunk)
    return digest.hexdigest()


async def run(
    store: ModelStore, request: pb.QuantizeRequest, threads: int
) -> AsyncIterator[pb.QuantizeProgress]:
    if request.target not in TARGETS:
        raise EngineError(
            errors.INVALID_ARGUMENT, f"target must be one of {', '.join(sorted(TARGETS))}"
        )
    if not request.source_files:
        raise EngineError(errors.INVALID_ARGUMENT, "source_files is empty")
    started = time.monotonic()
    yield pb.QuantizeProgress(phase="fetching the source")
    source = await store.ensure_model(request.source_files)
    out = store.root / f".quantize-{uuid.uuid4().hex[:12]}.gguf"
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as text:
        text.write(request.eval_text)
        text.flush()
        cmd = [
            sys.executable,
            "-m",
            "workers.engine.quantize",
            "--source",
            str(source),
            "--out",
            str(out),
            "--target",
            request.target,
            "--threads",
            str(request.threads or threads),
        ] + (["--eval-text-file", text.name] if request.eval_text else [])
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        result: dict = {}
        try:
            stderr = asyncio.ensure_future(proc.stderr.read())
            async for line in proc.stdout:
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue  # not ours
                if "result" in msg:
                    result = msg["result"]
                else:
                    yield pb.QuantizeProgress(
                        phase=msg["phase"], done=msg["done"], total=msg["total"]
                    )
            if await proc.wait() != 0 or not result:
                tail = (await stderr).decode(errors="replace").strip().splitlines()[-3:]
                raise EngineError(errors.ENGINE_FAILED, f"quantizer failed: {' '.join(tail)}")
        finally:
            if proc.returncode is None:  # the caller went away: stop the work
                proc.kill()
                await proc.wait()
            if not result:
                out.unlink(missing_ok=True)
    sha = await asyncio.to_thread(_sha256, out)
    final = store.path_for(sha)
    os.replace(out, final)  # kept: deploying the result here needs no download
    size = final.stat().st_size
    with open(final, "rb") as f:
        sent = 0
        while chunk := f.read(CHUNK):
            sent += len(chunk)
            yield pb.QuantizeProgress(
                phase="sending the result", done=sent, total=size, chunk=chunk
            )
    yield pb.QuantizeProgress(
        phase="done",
        sha256=sha,
        size_bytes=size,
        seconds=time.monotonic() - started,
        source=_evaluation(result.get("source")),
        result=_evaluation(result.get("result")),
    )
