"""The agent's model files, addressed by sha256, fetched from the control plane on demand."""

from __future__ import annotations

import hashlib
import os
import uuid
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

    async def ensure_model(self, sha256: str, files) -> Path:
        """The path llama.cpp should open for a model of one file or of several (a split):
        every file is fetched and verified; a split's parts are linked side by side under the
        names llama.cpp looks for, and the first part's link is returned."""
        paths = [await self.ensure(f.sha256, f.size_bytes, f.download_url) for f in files]
        if len(paths) == 1:
            return paths[0]
        return self._link_split(self.root / f"split-{sha256[:32]}", paths)

    @staticmethod
    def _link_split(folder: Path, paths: list[Path]) -> Path:
        folder.mkdir(exist_ok=True)
        links = [folder / f"model-{i + 1:05d}-of-{len(paths):05d}.gguf" for i in range(len(paths))]
        for link, target in zip(links, paths, strict=True):
            tmp = link.with_suffix(f".tmp-{uuid.uuid4().hex[:12]}")
            tmp.symlink_to(os.path.relpath(target, folder))
            tmp.replace(link)  # atomic, so a concurrent load never sees a missing part
        return links[0]

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
        # A name of its own per download: two loads of one file at once must not share it.
        tmp = path.with_suffix(f".part-{uuid.uuid4().hex[:12]}")
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
