"""The agent's model files, addressed by sha256, fetched from the control plane on demand."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import shutil
import uuid
from pathlib import Path

import httpx

from workers.engine import errors
from workers.engine.errors import EngineError


class ModelStore:
    """A directory of `sha256-<hex>.gguf` files; one machine may share it with the control plane."""

    def __init__(self, root: str | Path, node_token: str):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.node_token = node_token
        self._locks: dict[str, asyncio.Lock] = {}

    def path_for(self, sha256: str) -> Path:
        return self.root / f"sha256-{sha256}.gguf"

    async def ensure_model(self, files) -> Path:
        """The path llama.cpp should open for a model of one file or of several (a split):
        every file is fetched and verified; a split's parts are linked side by side under the
        names llama.cpp looks for (in a folder named by the parts' hashes, which is the
        model's sha256 in the catalog), and the first part's link is returned."""
        paths = [await self.ensure(f.sha256, f.size_bytes, f.download_url) for f in files]
        if len(paths) == 1:
            return paths[0]
        parts = hashlib.sha256("\n".join(f.sha256 for f in files).encode()).hexdigest()
        return self._link_split(self.root / f"split-{parts[:32]}", paths)

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
            raise EngineError(errors.BAD_MODEL_FILE, f"invalid sha256 {sha256!r}")
        path = self.path_for(sha256)
        if self._complete(path, size):
            return path
        if not url:
            raise EngineError(
                errors.BAD_MODEL_FILE,
                f"model {sha256[:12]} is not in {self.root} and has no download URL",
            )
        async with self._lock(sha256):
            if self._complete(path, size):  # another load fetched it meanwhile
                return path
            await self._download(sha256, size, url, path)
        return path

    @staticmethod
    def _complete(path: Path, size: int) -> bool:
        return path.exists() and (not size or path.stat().st_size == size)

    @contextlib.asynccontextmanager
    async def _lock(self, sha256: str):
        """One download per file: an asyncio lock in this agent, and a file lock for other
        agents that share the directory."""
        async with self._locks.setdefault(sha256, asyncio.Lock()):
            locks = self.root / ".locks"
            locks.mkdir(exist_ok=True)
            fd = os.open(locks / f"sha256-{sha256}", os.O_CREAT | os.O_RDWR, 0o600)
            try:
                await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)

    async def _download(self, sha256: str, size: int, url: str, path: Path) -> None:
        """Fetch into `<file>.part`, continuing what an earlier attempt left (a Range
        request), after checking there is room; the whole file is verified before it is
        renamed into place, and a partial file that does not verify is dropped."""
        part = path.with_name(path.name + ".part")
        have = part.stat().st_size if part.exists() else 0
        if size and have > size:
            have = 0
        free = shutil.disk_usage(self.root).free
        if size and free < size - have:
            raise EngineError(
                errors.BAD_MODEL_FILE,
                f"model {sha256[:12]} needs {size - have} more bytes, "
                f"{free} are free in {self.root}",
            )
        digest = await asyncio.to_thread(_hash_prefix, part, have)
        headers = {"Authorization": f"Bearer {self.node_token}"}
        if have:
            headers["Range"] = f"bytes={have}-"
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=10.0)) as client:
                async with client.stream("GET", url, headers=headers) as resp:
                    if resp.status_code not in (200, 206):
                        raise EngineError(
                            errors.BAD_MODEL_FILE,
                            f"download of {url} failed: HTTP {resp.status_code}",
                        )
                    if resp.status_code == 200 and have:  # the server sent it all again
                        digest, have = hashlib.sha256(), 0
                    with open(part, "ab" if have else "wb") as out:
                        async for chunk in resp.aiter_bytes(1 << 20):
                            digest.update(chunk)
                            out.write(chunk)
        except httpx.HTTPError as exc:
            raise EngineError(
                errors.BAD_MODEL_FILE,
                f"download of {url} failed: {exc}; the partial file is kept and the next load "
                "continues it",
            ) from exc
        if digest.hexdigest() != sha256:
            part.unlink(missing_ok=True)
            raise EngineError(
                errors.BAD_MODEL_FILE,
                f"downloaded file has sha256 {digest.hexdigest()}, expected {sha256}",
            )
        part.rename(path)


def _hash_prefix(path: Path, length: int):
    """The sha256 state after the first `length` bytes of a partial download."""
    digest = hashlib.sha256()
    if length:
        with open(path, "rb") as f:
            while length and (chunk := f.read(min(4 << 20, length))):
                digest.update(chunk)
                length -= len(chunk)
    return digest
