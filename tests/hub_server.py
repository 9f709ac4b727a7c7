"""A local stand-in for the Hugging Face Hub, for tests without network (``HF_ENDPOINT`` pointed at it).

It answers the requests huggingface_hub makes, with the status codes and ``X-Error-Code`` headers the
real hub sends (see ``huggingface_hub.utils._http.hf_raise_for_status``): files under
``/{repo}/resolve/{revision}/{path}`` (HEAD for metadata, GET for bytes), repository info and file
trees under ``/api/{models|datasets}/...``. Repositories are local folders; each can be gated (401
``GatedRepo``), cut a file off halfway through its body, or report sizes other than the real ones. Unknown repositories answer 404
``RepoNotFound``, unknown revisions 404 ``RevisionNotFound``, unknown files 404 ``EntryNotFound``.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REVISIONS = ("main", COMMIT)


@dataclass
class Repo:
    folder: Path
    kind: str = "model"  # or "dataset"
    gated: bool = False
    cut_off: set[str] = field(default_factory=set)  # files whose body stops halfway
    sizes: dict[str, int] = field(default_factory=dict)  # sizes the API reports instead of the real ones

    def size(self, name: str) -> int:
        return self.sizes.get(name, (self.folder / name).stat().st_size)

    def files(self) -> list[str]:
        return sorted(p.relative_to(self.folder).as_posix() for p in self.folder.rglob("*") if p.is_file())


class FakeHub:
    """``with FakeHub() as hub: hub.add("org/name", folder)``; ``hub.url`` goes into ``HF_ENDPOINT``."""

    def __init__(self) -> None:
        self.repos: dict[tuple[str, str], Repo] = {}
        self.requests: list[str] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def add(self, repo_id: str, folder: Path, **options) -> Repo:
        repo = Repo(Path(folder), **options)
        self.repos[(repo.kind, repo_id)] = repo
        return repo

    def __enter__(self) -> FakeHub:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


_RESOLVE = re.compile(r"^/(?:(?P<kind>datasets)/)?(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_API = re.compile(
    r"^/api/(?P<kind>models|datasets)/(?P<repo>[^/]+/[^/]+)"
    r"(?:/(?P<what>revision|tree|paths-info)/(?P<rev>[^/]+)(?:/(?P<path>.*))?)?$"
)


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet test output
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            self._serve(body=True)

        def _serve(self, body: bool) -> None:
            path = unquote(urlparse(self.path).path)
            hub.requests.append(f"{self.command} {path}")
            if match := _RESOLVE.match(path):
                kind = "dataset" if match["kind"] else "model"
                self._file(kind, match["repo"], match["rev"], match["path"], body)
            elif match := _API.match(path):
                kind = match["kind"][:-1]
                self._api(kind, match["repo"], match["what"], match["rev"] or "main", match["path"] or "")
            else:
                self._error(404, "RepoNotFound", "Repository not found")

        def _repo(self, kind: str, repo_id: str, revision: str) -> Repo | None:
            repo = hub.repos.get((kind, repo_id))
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found")
            elif repo.gated:
                self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted.")
            elif revision not in REVISIONS:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            else:
                return repo
            return None

        def _file(self, kind: str, repo_id: str, revision: str, name: str, body: bool) -> None:
            repo = self._repo(kind, repo_id, revision)
            if repo is None:
                return
            file = repo.folder / name
            if not file.is_file():
                self._error(404, "EntryNotFound", f"{name} does not exist")
                return
            data = file.read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
            self.send_header("X-Repo-Commit", COMMIT)
            self.end_headers()
            if not body:
                return
            if name in repo.cut_off:
                self.wfile.write(data[: len(data) // 2])  # the connection drops mid-file
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)
                return
            self.wfile.write(data)

        def _api(self, kind: str, repo_id: str, what: str | None, revision: str, sub: str) -> None:
            repo = self._repo(kind, repo_id, revision)
            if repo is None:
                return
            files = repo.files()
            if what in (None, "revision"):
                info = {
                    "id": repo_id,
                    "sha": COMMIT,
                    "private": False,
                    "gated": False,
                    "siblings": [{"rfilename": f, "size": repo.size(f)} for f in files],
                }
                self._json(info)
                return
            prefix = sub.strip("/")
            entries = [f for f in files if not prefix or f.startswith(prefix + "/")]
            self._json([_entry(repo, f) for f in entries])

        def _json(self, payload) -> None:
            data = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, code: str, message: str) -> None:
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Length", "0")
            self.end_headers()

    return Handler


def _entry(repo: Repo, name: str) -> dict:
    data = (repo.folder / name).read_bytes()
    return {"type": "file", "path": name, "size": repo.size(name), "oid": hashlib.sha1(data).hexdigest()}
