"""Publication where there is no rename: versions of a directory tree in an object store.

An object store (S3 and the stores that speak it) has no atomic directory rename, and a
listing may show a half-uploaded prefix. So a version ``<parent>/<name>/`` is published as:

    1. every data object                 <parent>/<name>/<relative path>     (any order, retries fine)
    2. the commit record, last           <parent>/<name>/_COMMIT.json        (sha256 and size of each object)
    3. the pointer, after the record     <parent>/latest                     (name + the record's sha256)

A reader accepts a version only through its commit record: no record (a writer killed in
step 1) means the prefix is not a version and is ignored; an object that differs from its
record's sha256 or size, an object the record does not list, or a listed object that is missing
refuses it. ``latest`` is a hint: it is followed only when the version it names carries the
record whose sha256 it states, and otherwise the newest committed version is used, with a
note. A writer killed between steps 2 and 3 leaves a committed version that ``latest`` does
not name yet, which is safe (the previous one stays current).

Deletion runs the protocol backwards: the record first (the version stops being one at once),
then its objects, so a half-deleted version is never accepted either.

Fetching (`fetch`) copies a version into a local folder and re-hashes the copy against the
record, and callers read the copy. Verifying the remote objects and then reading them again
would let the bytes change between the check and the use; the local copy is what was hashed.

Every operation goes through fsspec (s3fs for ``s3://``; a plain path is the local
filesystem), so a local folder behaves the same way and the tests can compare both.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec

from ops.publish.durable import FileDigest, digest_of

LOGGER = logging.getLogger(__name__)
COMMIT_NAME = "_COMMIT.json"
LATEST_NAME = "latest"
_FORMAT = 1
_CHUNK = 8 << 20


def _drop_inherited_s3_sessions() -> None:
    """In a forked child (a DataLoader worker): forget the parent's s3fs sessions.

    s3fs closes each session from a finalizer at exit, on the event loop that made it. In a
    forked child that loop is the parent's and runs no thread, so every worker's exit logged
    "Task exception was never retrieved ... attached to a different loop" per inherited session
    (measured: two per worker per loader). The child opens sessions of its own (fsspec forgets
    the parent's cached instances after a fork); the parent's are detached here, not closed:
    their sockets belong to the parent. weakref.finalize's registry is private to CPython; it
    has been stable since 3.4, and without it this does nothing.
    """
    try:
        from s3fs import S3FileSystem
    except ImportError:
        return
    for finalizer, info in list(getattr(weakref.finalize, "_registry", {}).items()):
        if getattr(info, "func", None) is S3FileSystem.close_session:
            finalizer.detach()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_inherited_s3_sessions)


class ObjectStoreError(RuntimeError):
    """An object-store operation failed (unreachable store, refused credentials, missing bucket)."""


class StoreFull(ObjectStoreError):
    """The store has no room left for a write. Retrying does not help: someone must free or add space."""


class VersionRefused(ObjectStoreError):
    """A prefix is not an intact committed version: no record, or objects that differ from it."""

    def __init__(self, url: str, problems: list[str]) -> None:
        self.url, self.problems = url, problems
        super().__init__(f"{url} is not an intact committed version: " + "; ".join(problems))


def is_remote(location: str | os.PathLike) -> bool:
    """True for a URL with a scheme other than file:// (a plain path is local)."""
    text = str(location)
    return "://" in text and not text.startswith("file://")


def storage_options(url: str) -> dict[str, Any]:
    """fsspec options for ``url``: for s3:// the endpoint and keys come from the environment only.

    ``TRAINYARD_S3_ENDPOINT_URL`` (an S3-compatible store), ``AWS_ACCESS_KEY_ID`` and
    ``AWS_SECRET_ACCESS_KEY``. Listings are not cached: a reader must see what is there now,
    and a store that went away must fail within seconds, not retry for minutes.
    """
    if not is_remote(url):
        return {"auto_mkdir": True}  # an object store has no folders to make first
    if not str(url).startswith("s3://"):
        return {}
    options: dict[str, Any] = {
        "use_listings_cache": False, "skip_instance_cache": True,
        "config_kwargs": {"connect_timeout": 5, "read_timeout": 30,
                          "retries": {"max_attempts": 2, "mode": "standard"}},
    }
    endpoint = os.environ.get("TRAINYARD_S3_ENDPOINT_URL")
    if endpoint:
        options["endpoint_url"] = endpoint
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        options["key"] = os.environ["AWS_ACCESS_KEY_ID"]
        options["secret"] = os.environ.get("AWS_SECRET_ACCESS_KEY", "")
    return options


ROLE_VARIABLES = {
    "training": ("TRAINYARD_S3_TRAINING_ACCESS_KEY_ID", "TRAINYARD_S3_TRAINING_SECRET_ACCESS_KEY"),
    "reader": ("TRAINYARD_S3_READER_ACCESS_KEY_ID", "TRAINYARD_S3_READER_SECRET_ACCESS_KEY"),
}
"""The store's identities besides the data pipeline's own (AWS_ACCESS_KEY_ID): the training ranks read
data and write checkpoints only; the reader reads (dashboards). `make cluster-up` makes each one."""


def role_credentials(role: str) -> dict[str, str]:
    """The ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` a process acting as ``role`` runs with (the
    launchers give them to the training ranks); empty when the deployment names no identity for the
    role (an embedded or test store, where one identity does everything)."""
    key_name, secret_name = ROLE_VARIABLES[role]
    key, secret = os.environ.get(key_name), os.environ.get(secret_name)
    if not key and not secret:
        return {}
    if not key or not secret:
        raise ObjectStoreError(f"{key_name} and {secret_name} go together: set both (the {role} identity) or neither")
    return {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}


def filesystem(url: str | os.PathLike) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem for ``url`` and the path inside it (no trailing slash)."""
    text = str(url)
    fs, path = fsspec.core.url_to_fs(text, **storage_options(text))
    return fs, path.rstrip("/")


_SHARED: dict[tuple[int, str, str], fsspec.AbstractFileSystem] = {}
_SHARED_LOCK = threading.Lock()


def shared_filesystem(url: str | os.PathLike) -> tuple[fsspec.AbstractFileSystem, str]:
    """``filesystem(url)``, but one instance per process, protocol and settings, reused across calls.

    Making an s3fs filesystem costs a client and a session (about 0.3 s against SeaweedFS here), which
    dominates reading many small objects (a media scan) one call each. Listings stay uncached; the key holds
    the endpoint and keys, so changed credentials get a new instance, and a forked child (its own pid)
    never uses its parent's."""
    text = str(url)
    options = storage_options(text)
    protocol = fsspec.core.split_protocol(text)[0] or "file"
    key = (os.getpid(), protocol, json.dumps(options, sort_keys=True, default=str))
    with _SHARED_LOCK:
        fs = _SHARED.get(key)
        if fs is None:
            fs = _SHARED[key] = fsspec.filesystem(protocol, **options)
    return fs, fsspec.core.strip_protocol(text).rstrip("/")


def join(url: str | os.PathLike, *parts: str) -> str:
    return "/".join([str(url).rstrip("/"), *(p.strip("/") for p in parts)])


@contextlib.contextmanager
def store_errors(action: str, url: str) -> Iterator[None]:
    """Name the operation and the URL when the store fails (s3fs raises OSError and botocore errors);
    a store with no room left raises StoreFull."""
    with full_store_errors(action, url):
        try:
            yield
        except (ObjectStoreError, FileNotFoundError):
            raise
        except Exception as error:  # botocore's errors are not OSErrors; every one means the same to a caller
            raise ObjectStoreError(f"{action} {url}: {type(error).__name__}: {error}") from error


@contextlib.contextmanager
def full_store_errors(action: str, url: str) -> Iterator[None]:
    """Turn a write that failed because the store is full into StoreFull; any other error passes unchanged.

    SeaweedFS answers a write past its last volume with a generic InternalError ("No writable volumes
    and no free volumes left" is only in its log), so the store's master is asked
    (TRAINYARD_S3_MASTER_URL, which `make cluster-up` and tools.s3_server set). StoreFull is raised
    outside the failed call's handler: the root cause a run reports (trainer/checkpointing/checkpointer.py follows
    the chain to its end) is then the full store, not the store's generic reply, whose text the
    message keeps.
    """
    full: StoreFull | None = None
    try:
        yield
    except StoreFull:
        raise
    except Exception as error:
        answer = _server_error(error)
        if answer is None or not store_is_full(url):
            raise
        capacity = store_capacity()
        size = f" ({_size(capacity.total_bytes)} in all)" if capacity is not None else ""
        full = StoreFull(f"store_full: {action} {url}: the object store has no room left{size}; free space "
                         f"(retention, old runs) or give it more disk (the store answered {answer})")
    if full is not None:
        raise full


def _server_error(error: BaseException) -> str | None:
    """The store's answer when it was a 5xx (InternalError and kin) somewhere along the chain of causes."""
    seen: list[BaseException] = []
    link: BaseException | None = error
    while link is not None and link not in seen:
        seen.append(link)
        response = getattr(link, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            code = response.get("Error", {}).get("Code")
            if status >= 500 or code in ("InternalError", "ServiceUnavailable"):
                return f"{code or status}: {response.get('Error', {}).get('Message', '')}".strip()
        link = link.__cause__ or link.__context__
    return None


def _master() -> str | None:
    return (os.environ.get("TRAINYARD_S3_MASTER_URL") or "").rstrip("/") or None


def store_is_full(url: str) -> bool:
    """Whether the store behind ``url`` has no writable volume left for its bucket (asked of the master:
    an assignment it cannot make). False when there is no master to ask (another S3 store)."""
    import urllib.error
    import urllib.parse
    import urllib.request

    master = _master()
    if master is None or not str(url).startswith("s3://"):
        return False
    bucket = str(url)[len("s3://"):].split("/", 1)[0]
    try:
        with urllib.request.urlopen(f"{master}/dir/assign?collection={urllib.parse.quote(bucket)}", timeout=5):
            return False  # a volume took the assignment: there is room
    except urllib.error.HTTPError as error:
        return error.code == 406 and b"no free volumes left" in error.read().lower()
    except (urllib.error.URLError, OSError) as error:
        LOGGER.warning("objstore: the store's master at TRAINYARD_S3_MASTER_URL=%s does not answer (%s); "
                       "a full store cannot be told from another failure", master, error)
        return False


@dataclass(frozen=True, slots=True)
class StoreCapacity:
    """A SeaweedFS store's room: ``volumes_max`` volumes of ``volume_bytes`` each, ``left_bytes`` still writable."""

    volumes_max: int
    volumes_free: int
    volume_bytes: int
    used_bytes: int
    left_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.volumes_max * self.volume_bytes

    def describe(self) -> str:
        return (f"{_size(self.left_bytes)} left of {_size(self.total_bytes)} ({self.volumes_free} of "
                f"{self.volumes_max} volumes of {self.volume_bytes >> 20} MiB not started, "
                f"{_size(self.used_bytes)} written)")


def _size(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.1f} GiB" if num_bytes >= 1 << 30 else f"{num_bytes / (1 << 20):.1f} MiB"


def store_capacity() -> StoreCapacity | None:
    """The store's capacity from its master (TRAINYARD_S3_MASTER_URL, with the volume size in
    TRAINYARD_S3_VOLUME_MB); None when no master is named. ObjectStoreError when it does not answer."""
    import urllib.error
    import urllib.request

    master = _master()
    if master is None:
        return None
    try:
        volume_bytes = int(os.environ.get("TRAINYARD_S3_VOLUME_MB", "")) << 20
    except ValueError:
        raise ObjectStoreError("TRAINYARD_S3_VOLUME_MB (the store's volume size in MiB, which `make cluster-up` "
                               f"writes) is {os.environ.get('TRAINYARD_S3_VOLUME_MB')!r}, not a number") from None
    try:
        with urllib.request.urlopen(f"{master}/vol/status", timeout=5) as response:
            status = json.loads(response.read())["Volumes"]
    except (urllib.error.URLError, OSError, ValueError, KeyError) as error:
        raise ObjectStoreError(f"the store's master at TRAINYARD_S3_MASTER_URL={master} does not answer "
                               f"its volume status: {error}") from None
    volumes = [volume for data_center in status.get("DataCenters", {}).values() for rack in data_center.values()
               for node in rack.values() for volume in node or []]
    used = sum(int(volume["Size"]) for volume in volumes)
    # Room left: the writable volumes' unused part and every volume not yet started.
    left = sum(max(0, volume_bytes - int(volume["Size"])) for volume in volumes if not volume.get("ReadOnly"))
    free = int(status.get("Free", 0))
    return StoreCapacity(volumes_max=int(status.get("Max", 0)), volumes_free=free, volume_bytes=volume_bytes,
                         used_bytes=used, left_bytes=left + free * volume_bytes)


# ---- writing ----

@dataclass(kw_only=True, slots=True, frozen=True)
class Published:
    url: str
    record: dict[str, Any]
    record_sha256: str
    seconds: float
    bytes: int


class DigestMismatch(ObjectStoreError):
    """A file's bytes differ from the digest its own record states: it is not published."""


def publish_tree(local_dir: str | Path, url: str, *, metadata: dict[str, Any] | None = None,
                 point_latest: bool = True, skip_hidden: bool = False,
                 expected: Mapping[str, FileDigest] | None = None,
                 before_record: Callable[[], None] | None = None) -> Published:
    """Publish the files under ``local_dir`` as the version at ``url`` (objects, record, ``latest``).

    Each file is hashed while it streams to the store, so the commit record states exactly the
    bytes uploaded. ``expected`` holds the digests a record of the caller's states for the files
    (a checkpoint's signed COMMITTED.json): a file whose uploaded bytes differ from it (changed or
    damaged on disk since its commit) raises DigestMismatch, and nothing of the version is left
    committed; the store never receives a copy its own record would refuse.

    An intact committed version already at ``url`` is left alone and returned (re-publishing
    the same name is a no-op only when the files are the same; different files are refused:
    versions are immutable). Objects left there by a writer that died before its record are
    removed first: they were never a version. ``skip_hidden`` leaves out paths with a part that
    starts with "." (a folder's in-flight temporary files; never for a DCP checkpoint, whose
    ``.metadata`` is part of it).
    """
    local_dir = Path(local_dir)
    started = time.monotonic()
    files = _local_files(local_dir, skip_hidden=skip_hidden)
    if not files:  # e.g. a folder retention moved away mid-listing: never commit an empty version
        raise ObjectStoreError(f"{local_dir} holds no files: nothing to publish as {url}")
    fs, root = filesystem(url)
    with store_errors("publish to", url):
        require_bucket(fs, url)
        existing = _read_record(fs, root)
        if existing is not None:
            recorded = {name: FileDigest(**d) for name, d in existing["files"].items()}
            if recorded != {name: digest_of(local_dir / name) for name in files}:
                raise ObjectStoreError(f"{url} is already a committed version with other contents; "
                                       "versions are immutable (publish under a new name)")
            return Published(url=url, record=existing, record_sha256=_sha(_record_bytes(existing)),
                             seconds=time.monotonic() - started, bytes=0)
        if fs.exists(root):
            LOGGER.warning("objstore: removing objects under %s left by a writer that died before its record", url)
            fs.rm(root, recursive=True)
        try:
            digests = {name: _upload(fs, local_dir / name, f"{root}/{name}") for name in files}
            if differing := _against_expected(digests, expected or {}):
                fs.rm(root, recursive=True)  # no record was written: this was never a version
                raise DigestMismatch(f"{local_dir}: {'; '.join(differing)}: the local copy differs from its own "
                                     f"record, so it was not published to {url}")
            if before_record is not None:
                before_record()
            record, data = _write_record(fs, root, digests, metadata, point_latest)
        except Exception as error:
            if _server_error(error) is not None and store_is_full(url):
                _remove_uncommitted_after_full(fs, root, url)
            raise
    return Published(url=url, record=record, record_sha256=_sha(data), seconds=time.monotonic() - started,
                     bytes=sum(d.size_bytes for d in digests.values()))


def _remove_uncommitted_after_full(fs: fsspec.AbstractFileSystem, root: str, url: str) -> None:
    """The objects of a version the full store stopped before its record: never a version, they only take
    the room that is missing. (After any other failure the next publish removes them.)"""
    try:
        if _read_record(fs, root) is None:  # a record made it: a committed version, whose pointer failed
            fs.rm(root, recursive=True)
    except FileNotFoundError:
        pass
    except Exception as removal:  # the StoreFull raised next says more; the next publish removes them
        LOGGER.error("objstore: could not remove the partial version at %s: %s", url, removal)


def _write_record(fs: fsspec.AbstractFileSystem, root: str, digests: Mapping[str, FileDigest],
                  metadata: dict[str, Any] | None, point_latest: bool) -> tuple[dict[str, Any], bytes]:
    """Steps 2 and 3: the commit record, then ``latest``."""
    record = {"format": _FORMAT, "name": root.rsplit("/", 1)[-1], "metadata": metadata or {},
              "files": {name: {"sha256": d.sha256, "size_bytes": d.size_bytes} for name, d in sorted(digests.items())}}
    data = _record_bytes(record)
    fs.pipe_file(f"{root}/{COMMIT_NAME}", data)
    if point_latest:
        parent, name = root.rsplit("/", 1)
        try:
            fs.pipe_file(f"{parent}/{LATEST_NAME}", json.dumps({"name": name, "record_sha256": _sha(data)}).encode())
        except Exception as error:  # committed already; `latest` is a hint that readers check (module docstring)
            LOGGER.error("objstore: %s is committed, but %s/%s was not updated: %s", root, parent, LATEST_NAME, error)
    return record, data


def commit_objects(url: str, digests: Mapping[str, FileDigest], *, metadata: dict[str, Any] | None = None,
                   point_latest: bool = True) -> dict[str, Any]:
    """Commit objects written at ``url`` by another writer (DCP's fsspec writer): steps 2 and 3.

    ``digests`` are what the writers hashed as they streamed. The listing must hold exactly
    those objects at those sizes (one missing, cut short or not hashed refuses the commit, and
    no record is written); an existing record is never replaced. Returns the record.
    """
    fs, root = filesystem(url)
    with store_errors("commit", url):
        if _read_record(fs, root) is not None:
            raise ObjectStoreError(f"{url} is already a committed version; versions are immutable")
        problems = _object_problems({"files": {name: {"size_bytes": d.size_bytes} for name, d in digests.items()}},
                                    _listed_sizes(fs, root))
        if problems:
            raise VersionRefused(url, problems)
        record, _ = _write_record(fs, root, digests, metadata, point_latest)
    return record


def set_aside(url: str, target: str) -> None:
    """Move the version at ``url`` out of the way, to ``target`` (kept for inspection, under a name no
    listing of its parent takes for a version): every object copied, then ``url`` deleted record first."""
    fs, root = filesystem(url)
    _, target_root = filesystem(target)
    with store_errors("set aside", url):
        for name in sorted(_listed_sizes(fs, root)):
            fs.copy(f"{root}/{name}", f"{target_root}/{name}")
    delete_version(url)


def clear_uncommitted(url: str) -> bool:
    """Remove objects left at ``url`` by a writer that died before its record; True when some were.
    ObjectStoreError when ``url`` is a committed version (never removed here)."""
    fs, root = filesystem(url)
    with store_errors("clear", url):
        require_bucket(fs, url)
        if _read_record(fs, root) is not None:
            raise ObjectStoreError(f"{url} is a committed version; it is not overwritten")
        if not fs.exists(root):
            return False
        LOGGER.warning("objstore: removing objects under %s left by a writer that died before its record", url)
        fs.rm(root, recursive=True)
        return True


def _upload(fs: fsspec.AbstractFileSystem, local: Path, remote: str) -> FileDigest:
    """Stream ``local`` to ``remote``, hashing the bytes as they go: the digest of what was uploaded."""
    digest, size = hashlib.sha256(), 0
    with open(local, "rb") as source, fs.open(remote, "wb", block_size=_CHUNK) as target:
        while chunk := source.read(_CHUNK):
            digest.update(chunk)
            target.write(chunk)
            size += len(chunk)
    return FileDigest(sha256=digest.hexdigest(), size_bytes=size)


def _against_expected(digests: Mapping[str, FileDigest], expected: Mapping[str, FileDigest]) -> list[str]:
    return [f"{name}: sha256 {digest.sha256[:12]}... ({digest.size_bytes} bytes) != recorded "
            f"{expected[name].sha256[:12]}... ({expected[name].size_bytes} bytes)"
            for name, digest in digests.items() if name in expected and expected[name] != digest]


def require_bucket(fs: fsspec.AbstractFileSystem, url: str) -> None:
    """Refuse a bucket that does not exist (some stores, SeaweedFS among them, would create it on write)."""
    if not url.startswith("s3://"):
        return
    bucket = url[len("s3://"):].split("/", 1)[0]
    if not fs.exists(bucket):
        raise ObjectStoreError(f"bucket {bucket!r} of {url} does not exist: create it, or fix the URL "
                               "(TRAINYARD_CHECKPOINT_ROOT, the data root)")


def delete_version(url: str) -> None:
    """Delete a version: its record first (it stops being a version at once), then its objects."""
    fs, root = filesystem(url)
    with store_errors("delete", url):
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(f"{root}/{COMMIT_NAME}")
        if fs.exists(root):
            fs.rm(root, recursive=True)


def _local_files(local_dir: Path, *, skip_hidden: bool = False) -> list[str]:
    if not local_dir.is_dir():
        raise FileNotFoundError(f"{local_dir} is not a folder")
    files = sorted(p.relative_to(local_dir).as_posix() for p in local_dir.rglob("*") if p.is_file()
                   and not (skip_hidden and any(part.startswith(".") for part in p.relative_to(local_dir).parts)))
    if COMMIT_NAME in files:
        raise ValueError(f"{local_dir} holds a file named {COMMIT_NAME}, the commit record's name")
    return files


def _record_bytes(record: dict[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True, indent=1).encode()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_object(url: str, data: bytes) -> None:
    """One small object (a pin, a pointer) written whole: S3 makes a single PUT visible all at once."""
    fs, path = filesystem(url)
    with store_errors("write", url):
        require_bucket(fs, url)
        fs.pipe_file(path, data)


# ---- reading ----

def read_object(url: str) -> bytes | None:
    """One small object's bytes, or None when there is none."""
    fs, path = filesystem(url)
    with store_errors("read", url):
        try:
            return fs.cat_file(path)
        except FileNotFoundError:
            return None


def _read_record(fs: fsspec.AbstractFileSystem, root: str) -> dict[str, Any] | None:
    try:
        data = fs.cat_file(f"{root}/{COMMIT_NAME}")
    except FileNotFoundError:
        return None
    try:
        record = json.loads(data)
    except ValueError as error:
        raise VersionRefused(root, [f"{COMMIT_NAME} is not JSON ({error})"]) from error
    problems = _record_problems(record)
    if problems:
        raise VersionRefused(root, problems)
    return record


def _record_problems(record: Any) -> list[str]:
    if not isinstance(record, dict) or record.get("format") != _FORMAT or not isinstance(record.get("files"), dict):
        return [f"{COMMIT_NAME} is not a format-{_FORMAT} commit record"]
    problems = []
    for name, digest in record["files"].items():
        parts = name.split("/")
        if not name or name.startswith("/") or ".." in parts or "" in parts:
            problems.append(f"{COMMIT_NAME} names an unsafe path {name!r}")
        elif not (isinstance(digest, dict) and isinstance(digest.get("sha256"), str)
                  and isinstance(digest.get("size_bytes"), int)):
            problems.append(f"{COMMIT_NAME} has no sha256/size for {name!r}")
    return problems


def read_record(url: str) -> dict[str, Any]:
    """The commit record of the version at ``url``; VersionRefused when there is none."""
    fs, root = filesystem(url)
    with store_errors("read", url):
        record = _read_record(fs, root)
    if record is None:
        raise VersionRefused(url, [f"no {COMMIT_NAME}: never committed (a writer died before its record), "
                                   "or not a version"])
    return record


def _listed_sizes(fs: fsspec.AbstractFileSystem, root: str) -> dict[str, int]:
    sizes = {}
    for path, info in fs.find(root, detail=True).items():
        if info.get("type") == "directory" or path.endswith("/"):
            continue  # a folder placeholder key (zero bytes, "dir/"), as consoles and some tools make: no object
        name = path[len(root) + 1:] if path.startswith(root + "/") else path.split(root + "/", 1)[-1]
        sizes[name] = int(info.get("size") or 0)
    return sizes


def verify(url: str, *, rehash: bool = True) -> dict[str, Any]:
    """Check the version at ``url`` against its record (listing, sizes and, with rehash, sha256 of every object).

    Returns the record; raises VersionRefused naming each difference.
    """
    record = read_record(url)
    fs, root = filesystem(url)
    with store_errors("verify", url):
        listed = _listed_sizes(fs, root)
        problems = _object_problems(record, listed)
        if rehash and not problems:
            for name, digest in record["files"].items():
                hasher = hashlib.sha256()
                with fs.open(f"{root}/{name}", "rb", block_size=_CHUNK) as handle:
                    while chunk := handle.read(_CHUNK):
                        hasher.update(chunk)
                if hasher.hexdigest() != digest["sha256"]:
                    problems.append(f"{name}: sha256 differs from the record")
    if problems:
        raise VersionRefused(url, problems)
    return record


def _object_problems(record: dict[str, Any], listed: dict[str, int]) -> list[str]:
    problems = []
    for name, digest in record["files"].items():
        if name not in listed:
            problems.append(f"{name}: listed in the record, missing from the store")
        elif listed[name] != digest["size_bytes"]:
            problems.append(f"{name}: {listed[name]} bytes, the record says {digest['size_bytes']}")
    extra = sorted(set(listed) - set(record["files"]) - {COMMIT_NAME})
    if extra:
        problems.append(f"objects the record does not list: {extra[:5]}")
    return problems


@dataclass(kw_only=True, slots=True)
class Listing:
    """The versions under a parent prefix: committed ones (oldest name first) and what was ignored."""
    committed: list[str] = field(default_factory=list)
    ignored: dict[str, str] = field(default_factory=dict)
    latest: str | None = None
    notes: list[str] = field(default_factory=list)


def list_versions(parent_url: str, *, accept: Callable[[str], bool] = lambda name: True) -> Listing:
    """Committed versions under ``parent_url``; prefixes without a valid record are ignored, with the reason.

    ``latest`` is the version the pointer names when that version's record has the pointer's
    sha256, else the last committed name (sorted), with a note saying why.
    """
    fs, parent = filesystem(parent_url)
    listing = Listing()
    with store_errors("list", parent_url):
        require_bucket(fs, parent_url)  # "no versions" must never stand for "wrong bucket"
        if not fs.exists(parent):
            return listing
        for entry in sorted(fs.ls(parent, detail=True), key=lambda e: e["name"]):
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            if entry.get("type") != "directory" or not accept(name):
                continue
            try:
                record = _read_record(fs, f"{parent}/{name}")
            except VersionRefused as refused:
                listing.ignored[name] = "; ".join(refused.problems)
                continue
            if record is None:
                listing.ignored[name] = f"no {COMMIT_NAME} (never committed)"
            else:
                listing.committed.append(name)
        pointer = _read_pointer(fs, parent)
    if pointer is not None:
        name, sha = pointer
        if name in listing.committed and _sha(fs.cat_file(f"{parent}/{name}/{COMMIT_NAME}")) == sha:
            listing.latest = name
        else:
            listing.notes.append(f"{LATEST_NAME} names {name!r}, which is not the committed version it recorded")
    if listing.latest is None and listing.committed:
        listing.latest = listing.committed[-1]
    return listing


def _read_pointer(fs: fsspec.AbstractFileSystem, parent: str) -> tuple[str, str] | None:
    try:
        pointer = json.loads(fs.cat_file(f"{parent}/{LATEST_NAME}"))
        return str(pointer["name"]), str(pointer["record_sha256"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        return ("<unreadable>", "")


def fetch(url: str, local_dir: str | Path, *, only: Iterable[str] | None = None) -> dict[str, Any]:
    """Copy the version at ``url`` into ``local_dir`` and re-hash the copy against the record.

    The copy is made beside ``local_dir`` and renamed into place once it matches, so a
    fetch that dies leaves no folder a caller could mistake for the version. ``only`` names the
    objects to copy (each must be in the record), e.g. a shard set's index without its tars.
    Returns the record.
    """
    local_dir = Path(local_dir)
    record = read_record(url)
    fs, root = filesystem(url)
    with store_errors("verify", url):
        problems = _object_problems(record, _listed_sizes(fs, root))
    wanted = list(record["files"]) if only is None else list(only)
    problems += [f"{name}: not an object of this version" for name in wanted if name not in record["files"]]
    if problems:
        raise VersionRefused(url, problems)
    staging = local_dir.with_name(f".{local_dir.name}.fetching-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        try:
            with store_errors("fetch", url):
                for name in wanted:
                    target = staging / name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    fs.get_file(f"{root}/{name}", str(target))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as error:  # deleted or malformed meanwhile
            raise VersionRefused(url, [f"could not be fetched whole: {error}"]) from error
        problems = [f"{name}: the fetched copy differs from the record" for name in wanted
                    if digest_of(staging / name) != FileDigest(**record["files"][name])]
        if problems:
            raise VersionRefused(url, problems)
        if local_dir.exists():
            shutil.rmtree(local_dir)
        os.replace(staging, local_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return record
