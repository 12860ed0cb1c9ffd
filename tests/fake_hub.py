"""A local stand-in for the Hugging Face Hub, for testing download code without network access.

`FakeHub` is a small HTTP server (standard library only, on 127.0.0.1, in a background thread) that
serves in-memory model repos through the parts of the Hub's HTTP API that huggingface_hub 2.4 uses to
download: the REAL, unmodified `snapshot_download`, `hf_hub_download`, `HfApi.repo_info` /
`model_info`, `list_repo_files` and `list_repo_tree` work against it and fill a real Hugging Face
cache (`models--owner--name/{blobs,refs,snapshots,trees}`), exactly as they would from huggingface.co.

Served endpoints (model repos only; every repo has one commit, on branch `main`):

* `GET /api/models/{repo_id}` and `GET /api/models/{repo_id}/revision/{revision}`: repo info (`id`,
  `sha`, `siblings`, ...; with `?blobs=true` the siblings carry `size`, `blobId` and `lfs`).
* `GET /api/models/{repo_id}/tree/{revision}[/{path}]?recursive=..&expand=..`: the tree listing,
  paginated like the Hub (1000 entries a page, 50 with `expand`; a `Link: <...>; rel="next"` header).
* `HEAD` / `GET /{repo_id}/resolve/{revision}/{path}`: file metadata and content, with `X-Repo-Commit`,
  `ETag` (git blob sha1), `Content-Length`, and for LFS files `X-Linked-Etag` (sha256) and
  `X-Linked-Size`; never any Xet header, so huggingface_hub takes its plain HTTP download path.
  `GET` honours `Range: bytes=N-` (huggingface_hub resumes interrupted downloads that way).
* Errors as the Hub reports them: 404 with `X-Error-Code: RepoNotFound` (-> `RepositoryNotFoundError`),
  `RevisionNotFound` (-> `RevisionNotFoundError`) or `EntryNotFound` (-> `EntryNotFoundError`).

Files ending in one of `LFS_SUFFIXES` (weights, archives, images) or larger than 10 MB are LFS files,
as the Hub's default `.gitattributes` makes them: their tree entry has `lfs = {oid: sha256, size,
pointerSize}` and their blob in the cache is named by the sha256. Other files are plain git blobs,
named in the cache by their git blob sha1.

Typical use in a test::

    from fake_hub import SDXL_BASE_FILES, FakeHub, fake_repo, hub_at

    def test_download(tmp_path, monkeypatch):
        repo = fake_repo(SDXL_BASE_FILES, {"unet/config.json": b'{"sample_size": 128}'})
        with FakeHub({"stabilityai/stable-diffusion-xl-base-1.0": repo}) as fake, \\
                hub_at(fake, tmp_path / "hf-cache", monkeypatch):
            folder = huggingface_hub.snapshot_download("stabilityai/stable-diffusion-xl-base-1.0",
                                                       allow_patterns=["unet/*.json"])
        assert fake.downloaded("stabilityai/stable-diffusion-xl-base-1.0") == ["unet/config.json"]

`hub_at(None, cache, monkeypatch)` simulates a machine without network (the endpoint is a closed local
port: connection refused), and `hub_at(..., offline=True)` / `set_offline(monkeypatch)` simulate
`HF_HUB_OFFLINE=1`.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import socket
import threading
import traceback
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlencode, urlsplit

__all__ = [
    "LFS_SUFFIXES",
    "SD15_FILES",
    "SDXL_BASE_FILES",
    "FakeHub",
    "closed_port_url",
    "fake_repo",
    "hub_at",
    "is_lfs",
    "set_offline",
]

# --------------------------------------------------------------------------------------------------
# Real file lists
# --------------------------------------------------------------------------------------------------

# stabilityai/stable-diffusion-xl-base-1.0, branch main (71.6 GB on the Hub).
SDXL_BASE_FILES: tuple[str, ...] = (
    ".gitattributes",
    "01.png",
    "LICENSE.md",
    "README.md",
    "comparison.png",
    "model_index.json",
    "pipeline.png",
    "scheduler/scheduler_config.json",
    "sd_xl_base_1.0.safetensors",
    "sd_xl_base_1.0_0.9vae.safetensors",
    "sd_xl_offset_example-lora_1.0.safetensors",
    "text_encoder/config.json",
    "text_encoder/flax_model.msgpack",
    "text_encoder/model.fp16.safetensors",
    "text_encoder/model.onnx",
    "text_encoder/model.safetensors",
    "text_encoder/openvino_model.bin",
    "text_encoder/openvino_model.xml",
    "text_encoder_2/config.json",
    "text_encoder_2/flax_model.msgpack",
    "text_encoder_2/model.fp16.safetensors",
    "text_encoder_2/model.onnx",
    "text_encoder_2/model.onnx_data",
    "text_encoder_2/model.safetensors",
    "text_encoder_2/openvino_model.bin",
    "text_encoder_2/openvino_model.xml",
    "tokenizer/merges.txt",
    "tokenizer/special_tokens_map.json",
    "tokenizer/tokenizer_config.json",
    "tokenizer/vocab.json",
    "tokenizer_2/merges.txt",
    "tokenizer_2/special_tokens_map.json",
    "tokenizer_2/tokenizer_config.json",
    "tokenizer_2/vocab.json",
    "unet/config.json",
    "unet/diffusion_flax_model.msgpack",
    "unet/diffusion_pytorch_model.fp16.safetensors",
    "unet/diffusion_pytorch_model.safetensors",
    "unet/model.onnx",
    "unet/model.onnx_data",
    "unet/openvino_model.bin",
    "unet/openvino_model.xml",
    "vae/config.json",
    "vae/diffusion_flax_model.msgpack",
    "vae/diffusion_pytorch_model.fp16.safetensors",
    "vae/diffusion_pytorch_model.safetensors",
    "vae_1_0/config.json",
    "vae_1_0/diffusion_pytorch_model.fp16.safetensors",
    "vae_1_0/diffusion_pytorch_model.safetensors",
    "vae_decoder/config.json",
    "vae_decoder/model.onnx",
    "vae_decoder/openvino_model.bin",
    "vae_decoder/openvino_model.xml",
    "vae_encoder/config.json",
    "vae_encoder/model.onnx",
    "vae_encoder/openvino_model.bin",
    "vae_encoder/openvino_model.xml",
)

# stable-diffusion-v1-5/stable-diffusion-v1-5 (the former runwayml/stable-diffusion-v1-5), branch main.
SD15_FILES: tuple[str, ...] = (
    ".gitattributes",
    "README.md",
    "feature_extractor/preprocessor_config.json",
    "model_index.json",
    "safety_checker/config.json",
    "safety_checker/model.fp16.safetensors",
    "safety_checker/model.safetensors",
    "safety_checker/pytorch_model.bin",
    "safety_checker/pytorch_model.fp16.bin",
    "scheduler/scheduler_config.json",
    "text_encoder/config.json",
    "text_encoder/model.fp16.safetensors",
    "text_encoder/model.safetensors",
    "text_encoder/pytorch_model.bin",
    "text_encoder/pytorch_model.fp16.bin",
    "tokenizer/merges.txt",
    "tokenizer/special_tokens_map.json",
    "tokenizer/tokenizer_config.json",
    "tokenizer/vocab.json",
    "unet/config.json",
    "unet/diffusion_pytorch_model.bin",
    "unet/diffusion_pytorch_model.fp16.bin",
    "unet/diffusion_pytorch_model.fp16.safetensors",
    "unet/diffusion_pytorch_model.non_ema.bin",
    "unet/diffusion_pytorch_model.non_ema.safetensors",
    "unet/diffusion_pytorch_model.safetensors",
    "v1-5-pruned-emaonly.ckpt",
    "v1-5-pruned-emaonly.safetensors",
    "v1-5-pruned.ckpt",
    "v1-5-pruned.safetensors",
    "v1-inference.yaml",
    "vae/config.json",
    "vae/diffusion_pytorch_model.bin",
    "vae/diffusion_pytorch_model.fp16.bin",
    "vae/diffusion_pytorch_model.fp16.safetensors",
    "vae/diffusion_pytorch_model.safetensors",
)


def fake_repo(file_list: Iterable[str], contents: Mapping[str, bytes] | None = None) -> dict[str, bytes]:
    """A repo's files for `FakeHub`: every path of `file_list` with its content from `contents`, or
    else small placeholder bytes, distinct per path (so no two files share a blob). A `.json`
    placeholder is a valid JSON object, `{"_fake_hub_placeholder": "<path>"}`; any other is a line of
    text. Paths of `contents` that are not in `file_list` are added too."""
    contents = dict(contents or {})
    repo = {path: contents.pop(path, _placeholder(path)) for path in file_list}
    repo.update(contents)
    return repo


def _placeholder(path: str) -> bytes:
    if path.endswith(".json"):
        return json.dumps({"_fake_hub_placeholder": path}).encode()
    return f"placeholder for {path}\n".encode()


# --------------------------------------------------------------------------------------------------
# Git / LFS bookkeeping
# --------------------------------------------------------------------------------------------------

# The Hub's default .gitattributes (plus what diffusers repos add): these files are stored with LFS.
LFS_SUFFIXES: tuple[str, ...] = (
    ".7z",
    ".arrow",
    ".bin",
    ".bz2",
    ".ckpt",
    ".ftz",
    ".gguf",
    ".gz",
    ".h5",
    ".jpeg",
    ".jpg",
    ".joblib",
    ".mlmodel",
    ".model",
    ".msgpack",
    ".npy",
    ".npz",
    ".onnx",
    ".onnx_data",
    ".ot",
    ".parquet",
    ".pb",
    ".pickle",
    ".pkl",
    ".png",
    ".pt",
    ".pth",
    ".rar",
    ".safetensors",
    ".tar",
    ".tflite",
    ".tgz",
    ".wasm",
    ".webp",
    ".xz",
    ".zip",
    ".zst",
)
_LFS_SIZE_LIMIT = 10 * 1000 * 1000  # the Hub refuses plain git files above 10 MB


def is_lfs(path: str, content: bytes = b"") -> bool:
    """Whether the Hub would store this file with LFS (by its suffix, or its size)."""
    return path.lower().endswith(LFS_SUFFIXES) or len(content) > _LFS_SIZE_LIMIT


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class _File:
    content: bytes
    blob_id: str  # git oid of what git stores: the file itself, or its LFS pointer
    sha256: str | None  # LFS files only
    pointer_size: int | None  # LFS files only

    @classmethod
    def make(cls, path: str, content: bytes) -> _File:
        if not is_lfs(path, content):
            return cls(content, _git_blob_sha1(content), None, None)
        sha256 = hashlib.sha256(content).hexdigest()
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {len(content)}\n".encode()
        return cls(content, _git_blob_sha1(pointer), sha256, len(pointer))

    @property
    def etag(self) -> str:
        """What huggingface_hub names the blob by: the sha256 for LFS files, else the git blob sha1."""
        return self.sha256 or self.blob_id

    def tree_entry(self, path: str) -> dict:
        entry = {"type": "file", "oid": self.blob_id, "size": len(self.content), "path": path}
        if self.sha256 is not None:
            entry["lfs"] = {"oid": self.sha256, "size": len(self.content), "pointerSize": self.pointer_size}
        return entry


@dataclass(frozen=True)
class _Repo:
    repo_id: str
    files: dict[str, _File]
    sha: str  # the one commit, on branch main
    date: str

    @classmethod
    def make(cls, repo_id: str, files: Mapping[str, bytes]) -> _Repo:
        for path in files:
            if not path or path.startswith("/") or path.endswith("/") or ".." in path.split("/"):
                raise ValueError(f"{repo_id}: bad path in repo {path!r}")
        built = {path: _File.make(path, bytes(content)) for path, content in sorted(files.items())}
        listing = "".join(f"{path}\0{f.blob_id}\n" for path, f in built.items())
        sha = hashlib.sha1(f"commit {repo_id}\n{listing}".encode()).hexdigest()
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")
        return cls(repo_id, built, sha, date)

    def resolves(self, revision: str) -> bool:
        return revision == "main" or (len(revision) >= 7 and self.sha.startswith(revision.lower()))

    def folders(self) -> list[str]:
        return sorted({p.rsplit("/", i)[0] for p in self.files for i in range(1, p.count("/") + 1)})

    def tree(self, under: str, recursive: bool) -> list[dict] | None:
        """Tree entries below folder `under` ("" for the root), None if there is no such folder."""
        prefix = under + "/" if under else ""
        folders = self.folders()
        if under and under not in folders:
            return None
        entries = []
        for folder in folders:
            rest = folder[len(prefix) :]
            if folder.startswith(prefix) and rest and (recursive or "/" not in rest):
                tree_id = hashlib.sha1(f"tree {self.sha} {folder}".encode()).hexdigest()
                entries.append({"type": "directory", "oid": tree_id, "size": 0, "path": folder})
        for path, f in self.files.items():
            rest = path[len(prefix) :]
            if path.startswith(prefix) and (recursive or "/" not in rest):
                entries.append(f.tree_entry(path))
        return sorted(entries, key=lambda e: e["path"])

    def info(self, blobs: bool, expand: list[str]) -> dict:
        siblings = []
        for path, f in self.files.items():
            sibling: dict = {"rfilename": path}
            if blobs:
                sibling.update(size=len(f.content), blobId=f.blob_id)
                if f.sha256 is not None:
                    sibling["lfs"] = {"sha256": f.sha256, "size": len(f.content), "pointerSize": f.pointer_size}
            siblings.append(sibling)
        info = {
            "_id": self.sha[:24],
            "id": self.repo_id,
            "modelId": self.repo_id,
            "author": self.repo_id.split("/")[0] if "/" in self.repo_id else None,
            "sha": self.sha,
            "lastModified": self.date,
            "createdAt": self.date,
            "private": False,
            "disabled": False,
            "gated": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "library_name": "diffusers" if "model_index.json" in self.files else None,
            "siblings": siblings,
            "spaces": [],
            "usedStorage": sum(len(f.content) for f in self.files.values()),
        }
        if expand:
            info = {k: v for k, v in info.items() if k in ("_id", "id") or k in expand}
        return info


# --------------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------------


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # snapshot_download opens 8 connections at once, one per file; with the default backlog of 5, the
    # kernel drops some SYNs and the client only retries them a second later.
    request_queue_size = 128


class _HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers or {}


class FakeHub:
    """A local stand-in for the Hugging Face Hub serving in-memory repos.

    Args:
        repos: repo_id ("owner/name") -> {path in repo: content}. Model repos only.
        page_size: entries per page of the tree listing (the Hub's is 1000; 50 with `expand=True`).

    Attributes:
        url: the endpoint, "http://127.0.0.1:PORT".
        requests: (method, path) of every request received, in order; path is the request target as
            sent, query string included (e.g. "/api/models/o/n/tree/<sha>?recursive=true&expand=false").
        errors: tracebacks of requests the fake itself failed on (answered with a 500); should stay empty.

    Starts serving on construction; `close()` it, or use it as a context manager.
    """

    def __init__(self, repos: Mapping[str, Mapping[str, bytes]] | None = None, *, page_size: int = 1000):
        self.page_size = page_size
        self.requests: list[tuple[str, str]] = []
        self.errors: list[str] = []
        self._downloads: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._repos: dict[str, _Repo] = {}
        for repo_id, files in (repos or {}).items():
            self.add_repo(repo_id, files)
        self._server = _Server(("127.0.0.1", 0), _make_handler(self))
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, name="FakeHub", daemon=True
        )
        self._thread.start()

    # -- repos ---------------------------------------------------------------------------------------

    def add_repo(self, repo_id: str, files: Mapping[str, bytes]) -> str:
        """Adds (or replaces, as a new commit) a repo; returns its commit sha."""
        repo = _Repo.make(repo_id, files)
        with self._lock:
            self._repos[repo_id] = repo
        return repo.sha

    def commit(self, repo_id: str) -> str:
        """The commit sha that `main` of `repo_id` points to."""
        return self._repos[repo_id].sha

    def etag(self, repo_id: str, path: str) -> str:
        """The name of the file's blob in a Hugging Face cache (sha256 for LFS files, else git sha1)."""
        return self._repos[repo_id].files[path].etag

    def downloaded(self, repo_id: str) -> list[str]:
        """Repo paths whose content was GET-downloaded from `repo_id`, in request order, one entry per
        download (a path fetched twice appears twice). HEAD requests don't count."""
        with self._lock:
            return [path for rid, path in self._downloads if rid == repo_id]

    def reset_log(self) -> None:
        """Forgets the recorded requests and downloads."""
        with self._lock:
            self.requests.clear()
            self._downloads.clear()

    # -- lifetime ------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stops serving: later requests get "connection refused"."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()

    def __enter__(self) -> FakeHub:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- request handling (called from the server's threads) ----------------------------------------

    def _repo(self, repo_id: str) -> _Repo:
        with self._lock:
            repo = self._repos.get(repo_id)
        if repo is None:
            raise _HubError(404, "RepoNotFound", "Repository not found")
        return repo

    def _split_repo(self, segments: list[str]) -> tuple[str, list[str]]:
        """(repo_id, the segments after it): "owner/name" if known, else a canonical "name" if known."""
        with self._lock:
            for n in (2, 1):
                candidate = "/".join(unquote(s) for s in segments[:n])
                if len(segments) >= n and candidate in self._repos:
                    return candidate, segments[n:]
        raise _HubError(404, "RepoNotFound", "Repository not found")

    def _handle(self, method: str, target: str, headers: Mapping[str, str]) -> tuple[int, dict, bytes]:
        split = urlsplit(target)
        query = parse_qs(split.query)
        segments = split.path.strip("/").split("/")
        if method not in ("GET", "HEAD"):
            return 405, {}, b""
        if segments[0] == "api":
            if len(segments) < 3 or segments[1] not in ("models", "datasets", "spaces", "kernels"):
                raise _HubError(404, None, "Not found")
            if segments[1] != "models":
                raise _HubError(404, "RepoNotFound", "Repository not found")
            repo_id, rest = self._split_repo(segments[2:])
            return self._api(self._repo(repo_id), rest, query, split.path)
        repo_id, rest = self._split_repo(segments)
        if len(rest) < 3 or rest[0] != "resolve":
            raise _HubError(404, None, "Not found")
        return self._resolve(method, self._repo(repo_id), unquote(rest[1]), unquote("/".join(rest[2:])), headers)

    def _revision(self, repo: _Repo, revision: str) -> None:
        if not repo.resolves(revision):
            raise _HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")

    def _api(self, repo: _Repo, rest: list[str], query: dict, url_path: str) -> tuple[int, dict, bytes]:
        def flag(name: str) -> bool:
            return query.get(name, ["false"])[-1].lower() in ("1", "true")

        if not rest or rest[0] == "revision":  # repo info
            if rest and len(rest) != 2:
                raise _HubError(404, None, "Not found")
            self._revision(repo, unquote(rest[1]) if rest else "main")
            expand = query.get("expand", []) + query.get("expand[]", [])
            return _json(200, repo.info(blobs=flag("blobs"), expand=expand))
        if rest[0] == "tree" and len(rest) >= 2:
            self._revision(repo, unquote(rest[1]))
            under = unquote("/".join(rest[2:])).strip("/")
            entries = repo.tree(under, recursive=flag("recursive"))
            if entries is None:
                raise _HubError(404, "EntryNotFound", f'{under} does not exist on "{unquote(rest[1])}"')
            expand = flag("expand")
            if expand:
                commit = {"id": repo.sha, "title": "Upload folder", "date": repo.date}
                entries = [{**e, "lastCommit": commit} for e in entries]
            size = min(self.page_size, 50) if expand else self.page_size
            start = int(query.get("cursor", ["0"])[-1])
            page, extra = entries[start : start + size], {}
            if start + size < len(entries):
                params = {"recursive": str(flag("recursive")).lower(), "expand": str(expand).lower()}
                params["cursor"] = str(start + size)
                extra["Link"] = f'<{self.url}{url_path}?{urlencode(params)}>; rel="next"'
            status, headers, body = _json(200, page)
            return status, {**headers, **extra}, body
        raise _HubError(404, None, "Not found")

    def _resolve(self, method: str, repo: _Repo, revision: str, path: str, headers: Mapping[str, str]):
        self._revision(repo, revision)
        f = repo.files.get(path)
        if f is None:
            raise _HubError(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": repo.sha})
        out = {
            "Content-Type": "application/octet-stream",
            "Accept-Ranges": "bytes",
            "ETag": f'"{f.blob_id}"',
            "X-Repo-Commit": repo.sha,
        }
        if f.sha256 is not None:
            out["X-Linked-Etag"] = f'"{f.sha256}"'
            out["X-Linked-Size"] = str(len(f.content))
        body, status = f.content, 200
        range_header = headers.get("Range")
        if range_header and range_header.startswith("bytes=") and "," not in range_header:
            first, _, last = range_header[len("bytes=") :].partition("-")
            if first:
                start, end = int(first), (int(last) if last else len(body) - 1)
            else:  # a suffix range: the last N bytes
                start, end = max(len(body) - int(last), 0), len(body) - 1
            if start >= len(body):
                return 416, {"Content-Range": f"bytes */{len(body)}"}, b""
            end = min(end, len(body) - 1)
            body, status = body[start : end + 1], 206
            out["Content-Range"] = f"bytes {start}-{end}/{len(f.content)}"
        if method == "GET":
            with self._lock:
                self._downloads.append((repo.repo_id, path))
        out["Content-Length"] = str(len(body))
        return status, out, body


def _json(status: int, payload) -> tuple[int, dict, bytes]:
    return status, {"Content-Type": "application/json; charset=utf-8"}, json.dumps(payload).encode()


def _make_handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        # HTTP/1.0: one request per connection, so no keep-alive connection outlives `close()`.
        protocol_version = "HTTP/1.0"
        server_version = "FakeHub/1.0"

        def log_message(self, format, *args):  # noqa: A002 - silence the per-request stderr log
            pass

        def _serve(self, method: str) -> None:
            with hub._lock:
                hub.requests.append((method, self.path))
            try:
                status, headers, body = hub._handle(method, self.path, self.headers)
            except _HubError as e:
                headers = {**e.headers, "X-Error-Message": e.message}
                if e.code:
                    headers["X-Error-Code"] = e.code
                status, json_headers, body = _json(e.status, {"error": e.message})
                headers.update(json_headers)
            except Exception:
                with hub._lock:
                    hub.errors.append(traceback.format_exc())
                status, headers, body = _json(500, {"error": "FakeHub failed on this request"})
            self.send_response(status)
            headers.setdefault("Content-Length", str(len(body)))
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            if method != "HEAD":
                self.wfile.write(body)

        def do_GET(self):
            self._serve("GET")

        def do_HEAD(self):
            self._serve("HEAD")

        def do_POST(self):
            self._serve("POST")

    return Handler


# --------------------------------------------------------------------------------------------------
# Pointing huggingface_hub at the fake
# --------------------------------------------------------------------------------------------------


def closed_port_url() -> str:
    """An http URL on 127.0.0.1 where nothing listens: connecting to it is refused at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def set_offline(monkeypatch, offline: bool = True) -> None:
    """`HF_HUB_OFFLINE=1` semantics (or `=0`): huggingface_hub reads the variable once, at import, into
    `huggingface_hub.constants.HF_HUB_OFFLINE`, which its HTTP layer checks on every request."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)


@contextlib.contextmanager
def hub_at(fake: FakeHub | None, cache: str | Path, monkeypatch=None, *, offline: bool = False) -> Iterator[str]:
    """Points huggingface_hub at `fake` (or, with `fake=None`, at a closed local port: no network)
    and at the Hugging Face cache folder `cache` (created if missing), so that e.g.
    `snapshot_download("owner/name")` with no extra argument downloads from the fake into `cache`.
    `offline=True` also switches `HF_HUB_OFFLINE` on. Yields the endpoint URL.

    The patches go through `monkeypatch` when given (undone at the test's teardown, and a nested
    `hub_at` or `set_offline` simply re-patches), else through a private one undone on exit.
    huggingface_hub's shared HTTP client is closed on entry and exit, so no connection outlives it.

    huggingface_hub reads its environment once, at import, so setting variables is not enough:
      * `constants.ENDPOINT` / `constants.HUGGINGFACE_CO_URL_TEMPLATE`: `hf_hub_url` builds the
        /resolve URLs from the template; HfApi() takes its endpoint from ENDPOINT when created.
      * `hf_api.api.endpoint`: the module-level HfApi behind the functions `huggingface_hub.model_info`,
        `list_repo_files`, `list_repo_tree`, `repo_info`, ... was created at import with the old endpoint.
      * `utils._http._HUB_ORIGINS`: the origins whose redirects HEAD calls follow (frozen at import).
      * `constants.HF_HUB_CACHE`, `constants.HUGGINGFACE_HUB_CACHE` and `utils._cache_manager.HF_HUB_CACHE`
        (which `scan_cache_dir` imported by value): the default cache folder.
      * `constants.HF_HUB_OFFLINE`: tests/conftest.py sets HF_HUB_OFFLINE=1 for the whole suite, so it is
        switched off here unless `offline=True`.
      * `constants.HF_HUB_DISABLE_IMPLICIT_TOKEN`: never send the developer's own Hub token to the fake.
    The environment variables (HF_ENDPOINT, HF_HUB_CACHE, HF_HUB_OFFLINE) are set as well, for
    subprocesses and for code that reads them itself.
    """
    import huggingface_hub.constants as constants
    import huggingface_hub.hf_api as hf_api
    import huggingface_hub.utils._cache_manager as cache_manager
    import huggingface_hub.utils._http as http

    if monkeypatch is None:
        import pytest

        with pytest.MonkeyPatch.context() as mp, hub_at(fake, cache, mp, offline=offline) as endpoint:
            yield endpoint
        return

    endpoint = fake.url if fake is not None else closed_port_url()
    cache = Path(cache).expanduser().resolve()
    cache.mkdir(parents=True, exist_ok=True)
    mp = monkeypatch
    mp.setenv("HF_ENDPOINT", endpoint)
    mp.setenv("HF_HUB_CACHE", str(cache))
    mp.setattr(constants, "ENDPOINT", endpoint)
    mp.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    mp.setattr(hf_api.api, "endpoint", endpoint)
    mp.setattr(http, "_HUB_ORIGINS", http._HUB_ORIGINS | {http._url_origin(endpoint)})
    mp.setattr(constants, "HF_HUB_CACHE", str(cache))
    mp.setattr(constants, "HUGGINGFACE_HUB_CACHE", str(cache))
    mp.setattr(cache_manager, "HF_HUB_CACHE", str(cache))
    mp.setattr(constants, "HF_HUB_DISABLE_IMPLICIT_TOKEN", True)
    set_offline(mp, offline)
    http.close_session()
    try:
        yield endpoint
    finally:
        http.close_session()
