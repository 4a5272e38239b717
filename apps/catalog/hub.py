"""Pulls from the Hugging Face Hub through huggingface_hub.

Names, as `llama-server -hf` and `ollama pull hf.co/...` take them:

    hf://org/repo/path/to/file.gguf      one file (or, for a split part, the whole split)
    hf://org/repo:Q4_K_M                 the file whose name carries that quantization tag
    hf://org/repo                        Q4_K_M when the repository has it, else its only GGUF
    hf://org/repo@REVISION...            any of the above at a branch, tag or commit

The repository's listing (the hub's tree route) gives each file's size and LFS sha256. The
revision is resolved to a commit once and every part is downloaded at that commit, so a
multi-file model cannot mix two pushes. Downloads go to a staging folder under the store that
outlives a failed pull: its `.incomplete` file is continued with a Range request next time
(huggingface_hub's transfer, which also retries within one pull). Every file is hashed and
checked against the listing's sha256.
The token (HF_TOKEN) and the endpoint (HF_ENDPOINT, for mirrors) come from settings.
"""

from __future__ import annotations

import hashlib
import io
import re
from dataclasses import dataclass
from pathlib import Path

import httpx

from apps.catalog.gguf_meta import SPLIT_NAME
from apps.catalog.sources import Progress, SourceError

PREFIX = "hf://"
DEFAULT_TAG = "Q4_K_M"
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_NAME = re.compile(
    rf"^(?P<repo>{_PART}/{_PART})(?:@(?P<rev>[A-Za-z0-9._-]{{1,100}}))?"
    r"(?::(?P<tag>[A-Za-z0-9_.-]{1,40})|/(?P<file>[^\s:@]+\.gguf))?$"
)


@dataclass(frozen=True)
class HubRef:
    """A parsed hf:// name."""

    repo_id: str
    revision: str = "main"
    filename: str = ""  # a file in the repository, or
    tag: str = ""  # a quantization tag that picks one

    def __str__(self) -> str:
        at = f"@{self.revision}" if self.revision != "main" else ""
        pick = f"/{self.filename}" if self.filename else (f":{self.tag}" if self.tag else "")
        return f"{PREFIX}{self.repo_id}{at}{pick}"

    def default_name(self) -> str:
        """A catalog name for the model: the file's stem, or the repository and tag."""
        if self.filename:
            stem = Path(self.filename).name.removesuffix(".gguf")
            m = SPLIT_NAME.match(Path(self.filename).name)
            stem = m.group("stem") if m else stem
        else:
            stem = self.repo_id.split("/")[1] + (f"-{self.tag}" if self.tag else "")
        return re.sub(r"[^a-z0-9_-]+", "-", stem.lower()).strip("-")[:100]


@dataclass(frozen=True)
class HubFile:
    path: str
    size: int
    sha256: str  # from the LFS pointer; empty for a file kept in git itself
    blob_id: str  # git's sha1 of the blob


def is_hub_name(name: str) -> bool:
    return name.startswith(PREFIX)


def parse(name: str) -> HubRef:
    """Parse an hf:// name; raises SourceError with the accepted forms."""
    m = _NAME.match(name.removeprefix(PREFIX)) if is_hub_name(name) else None
    if m is None or ".." in (m.group("file") or ""):
        raise SourceError(
            f"{name!r} is not a Hugging Face name; use hf://org/repo/file.gguf, "
            "hf://org/repo:Q4_K_M or hf://org/repo (optionally org/repo@revision)"
        )
    return HubRef(
        repo_id=m.group("repo"),
        revision=m.group("rev") or "main",
        filename=m.group("file") or "",
        tag=m.group("tag") or "",
    )


def _api(endpoint: str, token: str):
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint, token=token or False, library_name="llamafleet")


def _explain(exc: Exception, ref: HubRef) -> SourceError:
    """huggingface_hub's errors, said in one line that names what to do."""
    from huggingface_hub import errors

    if isinstance(exc, errors.GatedRepoError):
        return SourceError(
            f"{ref.repo_id} is gated: accept its terms on the hub and set HF_TOKEN "
            "to a token of that account"
        )
    if isinstance(exc, errors.RevisionNotFoundError):
        return SourceError(f"{ref.repo_id} has no revision {ref.revision!r}")
    if isinstance(exc, errors.EntryNotFoundError):
        return SourceError(f"{ref.repo_id}@{ref.revision} has no file {ref.filename!r}")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return SourceError(
            f"repository {ref.repo_id} not found (or private: set HF_TOKEN to a token with access)"
        )
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return SourceError(f"Hugging Face: {text}")


def choose(ref: HubRef, listing: list[HubFile]) -> list[HubFile]:
    """The file (or the parts of a split, in order) a name designates in a listing."""
    ggufs = [
        f
        for f in listing
        if f.path.endswith(".gguf") and not Path(f.path).name.lower().startswith("mmproj")
    ]
    if ref.filename:
        chosen = [f for f in ggufs if f.path == ref.filename]
        if not chosen:
            raise SourceError(f"{ref.repo_id}@{ref.revision} has no file {ref.filename}")
        return _whole_split(chosen[0], ggufs)
    sets: dict[str, list[HubFile]] = {}
    for f in ggufs:
        m = SPLIT_NAME.match(Path(f.path).name)
        key = str(Path(f.path).parent / m.group("stem")) if m else f.path
        sets.setdefault(key, []).append(f)
    tag = ref.tag or DEFAULT_TAG
    token = re.compile(rf"(^|[^A-Za-z0-9]){re.escape(tag)}($|[^A-Za-z0-9])", re.IGNORECASE)
    matching = {k: v for k, v in sets.items() if token.search(k)}
    if not matching and not ref.tag and len(sets) == 1:
        matching = sets  # no tag given and only one model in the repository
    if len(matching) != 1:
        names = ", ".join(sorted(sets)) or "none"
        what = "several files match" if matching else "no file matches"
        raise SourceError(
            f"{what} tag {tag} in {ref.repo_id}@{ref.revision}; its GGUF files: {names}"
        )
    (files,) = matching.values()
    return _whole_split(files[0], ggufs)


def _whole_split(first: HubFile, ggufs: list[HubFile]) -> list[HubFile]:
    m = SPLIT_NAME.match(Path(first.path).name)
    if not m:
        return [first]
    parent, stem, count = Path(first.path).parent, m.group("stem"), int(m.group("count"))
    by_path = {f.path: f for f in ggufs}
    parts = []
    for i in range(1, count + 1):
        path = str(parent / f"{stem}-{i:05d}-of-{count:05d}.gguf")
        if path not in by_path:
            raise SourceError(f"split part {path} is missing from the repository")
        parts.append(by_path[path])
    return parts


def _progress_bar(progress: Progress, phase: str, offset: int, total: int):
    """A tqdm class that reports bytes to our progress callback instead of a terminal."""
    from tqdm import tqdm

    class Bar(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)
            kwargs.update(file=io.StringIO(), disable=False)
            super().__init__(*args, **kwargs)
            if self.n:
                progress(f"{phase}, resuming at {self.n} bytes", offset + self.n, total)

        def update(self, n=1):
            super().update(n)
            progress(phase, offset + self.n, total)

    return Bar


def fetch(
    ref: HubRef, staging: Path, progress: Progress, *, endpoint: str, token: str
) -> tuple[str, list[tuple[Path, str]]]:
    """Download what `ref` names into `staging`; returns (commit, [(file, sha256)])."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError

    api = _api(endpoint, token)
    progress(f"listing {ref.repo_id}@{ref.revision}", 0, 0)
    try:
        listing = [
            HubFile(
                path=e.path,
                size=int(e.size),
                sha256=(e.lfs.sha256 if e.lfs else ""),
                blob_id=e.blob_id,
            )
            for e in api.list_repo_tree(ref.repo_id, revision=ref.revision, recursive=True)
            if hasattr(e, "size")
        ]
        files = choose(ref, listing)
        meta = get_hf_file_metadata(
            hf_hub_url(ref.repo_id, files[0].path, revision=ref.revision, endpoint=endpoint),
            token=token or False,
        )
    except HfHubHTTPError as exc:
        raise _explain(exc, ref) from exc
    commit = meta.commit_hash or ref.revision
    total, done, out = sum(f.size for f in files), 0, []
    for i, f in enumerate(files):
        phase = f"downloading {f.path}" + (f" ({i + 1}/{len(files)})" if len(files) > 1 else "")
        bar = _progress_bar(progress, phase, done, total)
        try:
            local = _download(ref, f, commit, staging, bar, endpoint=endpoint, token=token)
        except HfHubHTTPError as exc:
            raise _explain(exc, ref) from exc
        except (OSError, httpx.HTTPError) as exc:  # a connection that kept failing
            raise SourceError(f"download of {f.path} stopped: {exc}; pull again to resume") from exc
        out.append((local, _verify(local, f, progress, done, total)))
        done += f.size
    return commit, out


def _download(
    ref: HubRef, f: HubFile, commit: str, staging: Path, bar, *, endpoint: str, token: str
) -> Path:
    """One file into staging at a pinned commit, continuing a partial file left by an earlier
    pull (huggingface_hub's own downloads resume only within one call)."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    final = staging / f.path
    if final.exists() and final.stat().st_size == f.size:
        return final  # complete from an earlier pull that failed later; verified again
    url = hf_hub_url(ref.repo_id, f.path, revision=commit, endpoint=endpoint)
    meta = get_hf_file_metadata(url, token=token or False)
    partial = final.with_name(final.name + ".incomplete")
    partial.parent.mkdir(parents=True, exist_ok=True)
    have = partial.stat().st_size if partial.exists() else 0
    if have > f.size:
        have = 0
    with open(partial, "r+b" if have else "wb") as fh:
        fh.seek(have)
        fh.truncate()
        http_get(
            meta.location,
            fh,
            resume_size=have,
            headers=build_hf_headers(token=token or False, library_name="llamafleet"),
            expected_size=f.size,
            tqdm_class=bar,
        )
    partial.replace(final)
    return final


def _verify(path: Path, f: HubFile, progress: Progress, offset: int, total: int) -> str:
    """Hash the file and hold it to the listing: LFS sha256, or git's blob sha1."""
    if path.stat().st_size != f.size:
        raise SourceError(f"{f.path} has {path.stat().st_size} bytes, the hub lists {f.size}")
    sha, git = hashlib.sha256(), hashlib.sha1(f"blob {f.size}\0".encode())  # noqa: S324
    done = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(4 << 20):
            sha.update(chunk)
            git.update(chunk)
            done += len(chunk)
            progress(f"verifying {f.path}", offset + done, total)
    if f.sha256 and sha.hexdigest() != f.sha256:
        raise SourceError(f"{f.path} has sha256 {sha.hexdigest()}, the hub lists {f.sha256}")
    if not f.sha256 and git.hexdigest() != f.blob_id:
        raise SourceError(f"{f.path} does not match its git blob id {f.blob_id}")
    return sha.hexdigest()
