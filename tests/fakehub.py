"""A local stand-in for the Hugging Face Hub, for the tests: there is no network to the real
hub here. It serves the routes huggingface_hub calls for a pull, over files the tests make:

    GET       /api/models/{org}/{repo}/tree/{revision}     the listing, with LFS sha256s
    HEAD/GET  /{org}/{repo}/resolve/{revision}/{path}      metadata headers, then the bytes
                                                           (Range requests answered with 206)

Revisions are "main", the repository's commit or any name in `refs`. A gated repository
answers 401 with X-Error-Code GatedRepo unless the request carries its token. `cuts[name]`
lists byte counts after which the next downloads of a file drop the connection, one per
download, to exercise resuming; `lie_sha` makes the listing advertise a wrong sha256.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass
class HubRepo:
    files: dict[str, Path] = field(default_factory=dict)
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    refs: tuple[str, ...] = ()
    token: str = ""  # gated: only this bearer token may read
    lie_sha: set[str] = field(default_factory=set)


def _digests(path: Path) -> tuple[str, str]:
    sha, git = hashlib.sha256(), hashlib.sha1(f"blob {path.stat().st_size}\0".encode())  # noqa: S324
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            sha.update(chunk)
            git.update(chunk)
    return sha.hexdigest(), git.hexdigest()


class FakeHub:
    def __init__(self):
        self.repos: dict[str, HubRepo] = {}
        self.requests: list[dict] = []  # method, path, range, authorization
        self.cuts: dict[str, list[int]] = {}  # path -> bytes sent by each next download
        self._digests: dict[Path, tuple[str, str]] = {}
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    def start(self) -> FakeHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add(self, repo_id: str, files: dict[str, Path], **kwargs) -> HubRepo:
        for path in files.values():
            if path not in self._digests:
                self._digests[path] = _digests(path)
        repo = self.repos[repo_id] = HubRepo(files=dict(files), **kwargs)
        return repo

    def downloads(self, name: str) -> list[dict]:
        return [r for r in self.requests if r["method"] == "GET" and r["path"].endswith(name)]

    # ---- HTTP ---------------------------------------------------------------------------

    def _handler(hub):  # noqa: N805 - the handler closes over the hub
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self._route(body=False)

            def do_GET(self):
                self._route(body=True)

            def _error(self, status: int, code: str, message: str) -> None:
                data = json.dumps({"error": message}).encode()
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command == "GET":
                    self.wfile.write(data)

            def _repo(self, repo_id: str, revision: str) -> HubRepo | None:
                repo = hub.repos.get(repo_id)
                if repo is None:
                    self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
                    return None
                if repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}":
                    self._error(401, "GatedRepo", f"Access to {repo_id} is restricted")
                    return None
                if revision not in ("main", repo.commit, *repo.refs):
                    self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                    return None
                return repo

            def _route(self, body: bool) -> None:
                path = self.path.split("?", 1)[0]
                hub.requests.append(
                    {
                        "method": self.command,
                        "path": path,
                        "range": self.headers.get("Range", ""),
                        "authorization": self.headers.get("Authorization", ""),
                    }
                )
                tree = re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?$", path)
                resolve = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
                if tree:
                    self._tree(tree.group(1), tree.group(2))
                elif resolve:
                    self._resolve(resolve.group(1), resolve.group(2), resolve.group(3), body)
                else:
                    self._error(404, "NotFound", f"no route {path}")

            def _tree(self, repo_id: str, revision: str) -> None:
                repo = self._repo(repo_id, revision)
                if repo is None:
                    return
                entries = []
                for name, file in sorted(repo.files.items()):
                    sha, git = hub._digests[file]
                    if name in repo.lie_sha:
                        sha = hashlib.sha256(b"not this file").hexdigest()
                    size = file.stat().st_size
                    entries.append(
                        {
                            "type": "file",
                            "oid": git,
                            "size": size,
                            "path": name,
                            "lfs": {"oid": sha, "size": size, "pointerSize": 134},
                        }
                    )
                data = json.dumps(entries).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _resolve(self, repo_id: str, revision: str, name: str, body: bool) -> None:
                repo = self._repo(repo_id, revision)
                if repo is None:
                    return
                file = repo.files.get(name)
                if file is None:
                    self._error(404, "EntryNotFound", f"{name} does not exist")
                    return
                sha, _ = hub._digests[file]
                size = file.stat().st_size
                start = 0
                m = re.match(r"bytes=(\d+)-", self.headers.get("Range", ""))
                if m and body:
                    start = int(m.group(1))
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", repo.commit)
                self.send_header("ETag", f'"{sha}"')
                self.send_header("X-Linked-Etag", f'"{sha}"')
                self.send_header("X-Linked-Size", str(size))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(size - start))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
                self.end_headers()
                if not body:
                    return
                cuts = hub.cuts.get(name) or []
                limit = cuts.pop(0) if cuts else None
                sent = 0
                with open(file, "rb") as f:
                    f.seek(start)
                    while chunk := f.read(1 << 20):
                        if limit is not None and sent + len(chunk) > limit:
                            self.wfile.write(chunk[: max(limit - sent, 0)])
                            self.close_connection = True
                            self.connection.shutdown(2)  # the connection drops mid-file
                            return
                        self.wfile.write(chunk)
                        sent += len(chunk)

        return Handler
