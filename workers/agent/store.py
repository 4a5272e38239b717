"""The agent's model files, addressed by sha256, fetched from the control plane on demand."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import httpx

from workers.engine.errors import EngineError


class ModelStore:
    """A directory of `sha256-<hex>.gguf` files; one machine may share it with the control plane."""

    def __init__(self, root: str | Path, node_token: str):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.node_token = node_token

    def path_for(self, sha256: str) -> Path:
        return self.root / f"sha256-{sha256}.gguf"

    async def ensure(self, sha256: str, size: int, url: str) -> Path:
        """Return the local file of a model, downloading and verifying it if missing."""
        if not sha256 or len(sha256) != 64 or not all(c in "0123456789abcdef" for c in sha256):
            raise EngineError("BAD_MODEL_FILE", f"invalid sha256 {sha256!r}")
        path = self.path_for(sha256)
        if path.exists() and (not size or path.stat().st_size == size):
            return path
        if not url:
            raise EngineError(
                "BAD_MODEL_FILE",
                f"model {sha256[:12]} is not in {self.root} and has no download URL",
            )
        tmp = path.with_suffix(f".part{os.getpid()}")
        digest = hashlib.sha256()
        headers = {"Authorization": f"Bearer {self.node_token}"}
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=10.0)) as client:
                async with client.stream("GET", url, headers=headers) as resp:
                    if resp.status_code != 200:
                        raise EngineError(
                            "BAD_MODEL_FILE", f"download of {url} failed: HTTP {resp.status_code}"
                        )
                    with open(tmp, "wb") as out:
                        async for chunk in resp.aiter_bytes(1 << 20):
                            digest.update(chunk)
                            out.write(chunk)
        except httpx.HTTPError as exc:
            tmp.unlink(missing_ok=True)
            raise EngineError("BAD_MODEL_FILE", f"download of {url} failed: {exc}") from exc
        if digest.hexdigest() != sha256:
            tmp.unlink(missing_ok=True)
            raise EngineError(
                "BAD_MODEL_FILE",
                f"downloaded file has sha256 {digest.hexdigest()}, expected {sha256}",
            )
        tmp.rename(path)
        return path
