"""WebDataset clip shards: write, index, verify and read back by sample.

A shard is a plain POSIX (ustar) tar readable by ``webdataset.WebDataset``. Each sample has
members ``<key>.meta.json`` plus ``<key>.clip.mkv`` (compressed encoding: H.264 video and FLAC
audio in one Matroska container) or ``<key>.video.npy`` and ``<key>.audio.npy`` (decoded
encoding: uint8 frames [T, H, W, 3] and float32 mono PCM). Writers fill a temporary file,
fsync and rename it, then write the shard's index (member offsets and the shard's sha256) the
same way, so a reader never sees a half-written shard. Tar headers carry no time, user or
group, so the same inputs give a byte-identical shard.

The index gives random access: a sample is the byte range [offset, offset + length) of its
shard, parsed with the standard ``tarfile`` module.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import tarfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute
import pyarrow.parquet as pq

from ops.media import codec
from ops import progress
from ops.clips.plan import ClipPlan, ShardConfig, config_of, read_plan
from ops.publish.hashing import digest_json, sha256_file, table_digest
from ops.curation.reason_codes import CHECKSUM_MISMATCH
from ops.media import scan
from ops.media.roots import LocalMediaRoot, MediaRoot, open_root
from ops.publish.durable import fsync_path, write_file_atomic
from ops.publish.storage import PublishedFileCorrupt, read_verified, verify_record, write_record

SHARD_INDEX_SCHEMA = pa.schema([
    ("sample_key", pa.string()),
    ("shard", pa.string()),
    ("split", pa.string()),
    ("offset", pa.int64()),     # byte offset of the sample's first tar header
    ("length", pa.int64()),     # bytes up to the end of its last member (padding included)
    ("shard_sha256", pa.string()),
    ("bucket", pa.string()),    # clip shape "TxHxW", a key of ShardConfig.bucket_shapes
])
INDEX_FILE = "index.parquet"
INDEX_INFO_FILE = "index.json"
INDEX_RECORD_FILE = "index.digests.json"
"""sha256 and size of index.parquet and index.json as the index version, signed, written last."""


TMP_TAG = re.compile(r"[A-Za-z0-9_]{1,64}", re.ASCII)
"""What a writer may put in its staging files' names (write_shard's tmp_tag)."""

# Shard failure reason: a planned clip reaches past the last frame its source really holds.
SOURCE_ENDED = "source_ended"


class ShardIntegrityError(RuntimeError):
    """A shard's bytes no longer match its index (truncated, modified or missing)."""


@dataclass(kw_only=True, slots=True)
class ShardResult:
    shard: str
    path: Path
    sha256: str
    size_bytes: int
    num_samples: int
    failures: list[dict]
    """Planned clips that could not be cut: {sample_key, uri, reason}; recorded, not dropped silently."""
    decode_s: float = 0.0
    """Seconds spent decoding (and resizing) the sources' clips."""
    encode_s: float = 0.0
    """Seconds spent encoding the clips' members."""
    bytes_read: int = 0
    """Bytes of the sources cut (each source once)."""
    num_frames: int = 0
    """Video frames written (the shard-writing throughput's numerator, benchmarks/backfill.py)."""


def shard_dir(data_root: str | Path, plan_version: str) -> Path:
    return Path(data_root) / "shards" / plan_version


@dataclass(slots=True)
class _Timings:
    decode_s: float = 0.0
    encode_s: float = 0.0
    bytes_read: int = 0


def _source_samples(rows: list[dict], media: MediaRoot, config: ShardConfig,
                    timings: _Timings | None = None) -> tuple[list[tuple[dict, dict]], list[dict]]:
    """Cut every planned clip of one source (one bucket) in a single decoding pass; (row, members) pairs.

    The bytes cut are the bytes planned: a store's copy is checked against the planned asset id (its
    content sha256) by the media root, and a folder's file here, through the one descriptor the
    decoder then reads (``_verified_local``), so a source edited or swapped since it was probed is
    refused by name, never cut into a shard under the old asset id."""
    uri, asset_id = rows[0]["uri"], rows[0]["asset_id"]
    starts = [row["start_s"] for row in rows]
    shape = config.bucket_shapes[rows[0]["bucket"]]
    timings = timings if timings is not None else _Timings()

    def refused(reason: str) -> tuple[list, list[dict]]:
        return [], [{"sample_key": row["sample_key"], "uri": uri, "reason": reason} for row in rows]

    with media.local_files([(uri, asset_id)]) as copies, contextlib.ExitStack() as stack:
        if uri in copies.problems:
            code, detail = copies.problems[uri]
            return refused(f"{code}: {detail}")
        path = str(copies.paths[uri])
        if isinstance(media, LocalMediaRoot):
            try:
                path, size, unchanged = stack.enter_context(_verified_local(media, uri, asset_id))
            except _Changed as error:
                return refused(f"{CHECKSUM_MISMATCH}: {error}")
            except OSError as error:
                return refused(f"{type(error).__name__}: {error}")
        else:
            size, unchanged = os.path.getsize(path), None
        timings.bytes_read += size
        started = time.perf_counter()
        try:
            videos = codec.decode_source_clips(path, starts, shape)
            audios = codec.decode_source_audio(path, starts, shape)
        except (codec.ClipDecodeError, OSError, ValueError) as error:
            # av's errors subclass ValueError / OSError; the source changed or broke since validation.
            return refused(f"{type(error).__name__}: {error}")
        finally:
            timings.decode_s += time.perf_counter() - started
        if unchanged is not None and not unchanged():
            return refused(f"{CHECKSUM_MISMATCH}: {uri} was written to while it was being cut")
    samples, failures = [], []
    started = time.perf_counter()
    for index, row in enumerate(rows):
        if index in videos.short:  # past the source's real end: a counted failure, never a frozen clip
            failures.append({"sample_key": row["sample_key"], "uri": row["uri"],
                             "reason": f"{SOURCE_ENDED}: {videos.short[index]}"})
            continue
        audio = audios[index] if audios is not None else np.zeros(shape.num_audio_samples, np.float32)
        samples.append((row, _encode_members(videos.frames[index], audio, config, shape)))
    timings.encode_s += time.perf_counter() - started
    return samples, failures


class _Changed(Exception):
    """A folder's source is not the file that was probed (its bytes no longer hash to the asset id)."""


@contextlib.contextmanager
def _verified_local(media: LocalMediaRoot, uri: str, asset_id: str):
    """(a path the decoder opens, its size, a check that it is still unchanged) for the source ``uri``,
    whose bytes must hash to ``asset_id``. The file is opened once (no symlink followed out of the
    root: ops.media.scan.open_regular) and hashed through that descriptor; the decoder reads the
    same open file through /proc/self/fd, so a file renamed over it after the check is never read,
    and one written in place while it is cut is caught by its changed (size, mtime, ctime)."""
    import hashlib

    try:
        descriptor = scan.open_regular(media.root, uri)
    except scan.NotRegularFile as error:
        raise _Changed(f"{uri} is no longer a regular file under the media root: {error}") from error
    try:
        before = os.fstat(descriptor)
        digest = hashlib.sha256()
        with os.fdopen(os.dup(descriptor), "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        if digest.hexdigest() != asset_id:
            raise _Changed(f"{uri} changed since it was probed: its bytes hash to {digest.hexdigest()[:16]}, "
                           f"the plan's asset id is {asset_id[:16]}")
        proc = f"/proc/self/fd/{descriptor}"

        def unchanged() -> bool:
            after = os.fstat(descriptor)
            return (after.st_size, after.st_mtime_ns, after.st_ctime_ns) == (
                before.st_size, before.st_mtime_ns, before.st_ctime_ns)

        yield (proc if os.path.exists(proc) else str(media.root / uri)), before.st_size, unchanged
    finally:
        os.close(descriptor)


def _encode_members(video: np.ndarray, audio: np.ndarray, config: ShardConfig,
                    shape: codec.ClipShape) -> dict[str, bytes]:
    if config.encoding == "compressed":
        return {"clip.mkv": codec.encode_clip(video, audio, shape)}
    return {"video.npy": _npy(video), "audio.npy": _npy(audio)}


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def _meta(row: dict, plan: ClipPlan) -> bytes:
    shape = plan.config.bucket_shapes[row["bucket"]]
    return json.dumps({
        "asset_id": row["asset_id"], "uri": row["uri"], "start_s": row["start_s"], "end_s": row["end_s"],
        "split": row["split"], "caption": row["caption"], "has_audio": row["has_audio"],
        "manifest_version": plan.manifest_version, "plan_version": plan.version, "encoding": plan.config.encoding,
        "num_frames": shape.num_frames, "fps": shape.fps, "width": shape.width, "height": shape.height,
        "audio_rate": shape.audio_rate, "bucket": row["bucket"],
    }, sort_keys=True).encode()


def write_shard(plan: ClipPlan, shard: str, media_root: str | Path, out_dir: str | Path, *,
                tmp_tag: str = "") -> ShardResult:
    """Cut, encode and publish one shard atomically, then its member index; ``media_root`` is a folder or a URL.

    ``tmp_tag`` goes into the staging file's name (``.<shard>.tar.tmp-<tag>-<random>``): a cluster
    task names its job there, so what a killed task left behind is found and removed by its job
    alone (resources/slurm_array.py), never another writer's staging file of the same shard."""
    if tmp_tag and not TMP_TAG.fullmatch(tmp_tag):
        raise ValueError(f"tmp_tag {tmp_tag!r} must match {TMP_TAG.pattern}")
    rows = plan.rows_for(shard)
    if not rows:
        raise ValueError(f"shard {shard!r} is not in plan {plan.version} (shards: {plan.shards[:5]}...)")
    out_dir, media = Path(out_dir), open_root(media_root)
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / f"{shard}.tar"
    staging = out_dir / f".{shard}.tar.tmp-{tmp_tag + '-' if tmp_tag else ''}{uuid.uuid4().hex}"
    failures: list[dict] = []
    timings = _Timings()
    frames = 0
    try:
        with open(staging, "wb") as handle:
            # The writer is closed on failure too, before its file: left to the garbage collector,
            # its tar stream flushes into the closed file.
            with _SampleTarWriter(handle) as writer, \
                    progress.task(f"writing shard {shard}", len(rows), unit="clips") as bar:
                for uri in dict.fromkeys(row["uri"] for row in rows):
                    source_rows = [row for row in rows if row["uri"] == uri]
                    samples, failed = _source_samples(source_rows, media, plan.config, timings)
                    failures.extend(failed)
                    for row, members in samples:
                        frames += plan.config.bucket_shapes[row["bucket"]].num_frames
                        writer.write({"__key__": row["sample_key"], "meta.json": _meta(row, plan), **members})
                    bar.advance(len(source_rows))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, final)
        fsync_path(out_dir)
    finally:
        if staging.exists():
            staging.unlink()
    sha256 = sha256_file(final)
    entries = member_index(final, shard=shard, split=rows[0]["split"], sha256=sha256)
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(entries, schema=SHARD_INDEX_SCHEMA), buffer)
    write_file_atomic(out_dir / f"{shard}.index.parquet", buffer.getvalue())
    write_file_atomic(out_dir / f"{shard}.failures.json", json.dumps(failures, indent=1).encode())
    return ShardResult(shard=shard, path=final, sha256=sha256, size_bytes=final.stat().st_size,
                       num_samples=len(entries), failures=failures, decode_s=timings.decode_s,
                       encode_s=timings.encode_s, bytes_read=timings.bytes_read, num_frames=frames)


class _SampleTarWriter:
    """WebDataset samples into a tar stream, as ``webdataset.TarWriter(user="", group="", mtime=0,
    encoder=False)`` writes them, byte for byte: each sample's members ``<key>.<ext>`` in sorted
    extension order, mode 0444, no owner, no time. Plain ``tarfile``, because importing webdataset
    imports torch: over a second of every array task's start (resources/slurm_array.py) and of every
    shard-writing step, for a class this size. tests/test_shards.py reads the shards back with
    ``webdataset.WebDataset`` and checks them against webdataset's own writer.

    The names are short ASCII and the members under 8 GiB, so the headers are plain ustar: readers
    parse one 512-byte header per member (read_members)."""

    def __init__(self, handle: BinaryIO) -> None:
        self._tar = tarfile.open(fileobj=handle, mode="w|")

    def write(self, sample: dict[str, Any]) -> None:
        key = sample["__key__"]
        for extension in sorted(name for name in sample if not name.startswith("_")):
            data = sample[extension]
            info = tarfile.TarInfo(f"{key}.{extension}")
            info.size, info.mtime, info.mode, info.uname, info.gname = len(data), 0, 0o444, "", ""
            self._tar.addfile(info, io.BytesIO(data))

    def close(self) -> None:
        self._tar.close()

    def __enter__(self) -> _SampleTarWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def member_index(path: Path, *, shard: str, split: str, sha256: str, require_bucket: bool = True) -> list[dict]:
    """Byte range of each sample in a tar: from its first header to the end of its last member.

    The sample's bucket comes from its own meta.json, so the index is a function of the shard alone.
    ``require_bucket=False`` reads shards written before buckets existed (bucket None).
    """
    spans: dict[str, list[int]] = {}
    buckets: dict[str, str] = {}
    with tarfile.open(path, "r:") as archive:
        for member in archive:
            key, _, extension = member.name.partition(".")
            end = member.offset_data + ((member.size + tarfile.BLOCKSIZE - 1) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
            span = spans.setdefault(key, [member.offset, end])
            span[1] = end
            if extension == "meta.json":
                buckets[key] = json.loads(archive.extractfile(member).read())["bucket"]
    missing = sorted(set(spans) - set(buckets))
    if missing and require_bucket:
        raise ShardIntegrityError(f"{path}: samples without a meta.json bucket: {missing[:5]}")
    return [{"sample_key": key, "shard": shard, "split": split, "offset": start, "length": end - start,
             "shard_sha256": sha256, "bucket": buckets.get(key)} for key, (start, end) in spans.items()]


def read_members(handle, offset: int, length: int) -> dict[str, bytes]:
    """Members of one sample from an open shard file: {extension: bytes}.

    Parses the ustar headers of the sample's byte range directly: ``tarfile`` measured about
    a fifth of the loader's time on small clips, and the index already says where the sample
    lies, so all that is needed is each header's name and size.
    """
    handle.seek(offset)
    chunk = handle.read(length)
    if len(chunk) != length:
        raise tarfile.ReadError(f"sample cut short: read {len(chunk)} of {length} bytes at offset {offset}")
    members, position = {}, 0
    view = memoryview(chunk)
    while position + tarfile.BLOCKSIZE <= length:
        header = chunk[position:position + tarfile.BLOCKSIZE]
        if header.count(0) == tarfile.BLOCKSIZE:
            break  # end-of-archive padding
        name, size, kind = _ustar_header(header, offset + position)
        start = position + tarfile.BLOCKSIZE
        if kind not in (tarfile.REGTYPE, tarfile.AREGTYPE) or start + size > length:
            raise tarfile.ReadError(f"member {name!r} at byte {offset + position} is not a regular file inside the sample")
        members[name.split(".", 1)[1] if "." in name else name] = bytes(view[start:start + size])
        position = start + -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    return members


def _ustar_header(header: bytes, at: int) -> tuple[str, int, bytes]:
    """(name, size, type) of a ustar header, after checking its checksum."""
    stored = header[148:156].split(b"\0", 1)[0].strip()
    computed = sum(header[:148]) + 8 * 32 + sum(header[156:])
    try:
        if int(stored, 8) != computed:
            raise tarfile.ReadError(f"tar header checksum mismatch at byte {at}")
        size = int(header[124:136].split(b"\0", 1)[0].strip() or b"0", 8)
    except ValueError as error:
        raise tarfile.ReadError(f"unreadable tar header at byte {at}: {error}") from error
    prefix = header[345:500].split(b"\0", 1)[0].decode()
    name = header[:100].split(b"\0", 1)[0].decode()
    return (f"{prefix}/{name}" if prefix else name), size, header[156:157]


def decode_members(members: dict[str, bytes], shape: codec.ClipShape, *, thread_count: int = 1,
                   out: np.ndarray | None = None, hwaccel: object | None = None) -> tuple[np.ndarray, np.ndarray, dict]:
    """(frames [T,H,W,3] uint8, audio [A] float32, meta) of one sample; raises ClipDecodeError.

    Compressed clips decode straight into ``out`` when given (frames [T,H,W,3] uint8), with
    ``hwaccel`` (media_io.decode_clip) when given.
    """
    try:
        meta = json.loads(members["meta.json"])
        if "clip.mkv" in members:
            return (*codec.decode_clip(members["clip.mkv"], shape, thread_count=thread_count, out=out,
                                          hwaccel=hwaccel), meta)
        video = np.load(io.BytesIO(members["video.npy"]), allow_pickle=False)
        audio = np.load(io.BytesIO(members["audio.npy"]), allow_pickle=False)
    except (KeyError, json.JSONDecodeError, ValueError, EOFError) as error:
        raise codec.ClipDecodeError(f"bad sample members: {type(error).__name__}: {error}") from error
    expected = (shape.num_frames, shape.height, shape.width, 3)
    if video.shape != expected or video.dtype != np.uint8 or audio.shape != (shape.num_audio_samples,):
        raise codec.ClipDecodeError(f"sample arrays {video.shape}/{audio.shape} do not match {expected}")
    return video, audio, meta


@dataclass(kw_only=True, slots=True)
class IndexInfo:
    """What index.json says of a shard index: enough to check a config against it, without the table."""
    directory: Path
    version: str
    plan_version: str
    manifest_version: str
    config: ShardConfig

    @property
    def bucket_shapes(self) -> dict[str, codec.ClipShape]:
        """Bucket name -> clip shape, in config order (ids 0, 1, ... for the loader)."""
        return self.config.bucket_shapes


@dataclass(kw_only=True, slots=True)
class ShardIndex(IndexInfo):
    """All shards of one plan: the random-access index the loader reads."""
    table: pa.Table
    cache: Any = None
    """An ops.clips.shard_cache.ShardCache when the tars are in an object store (read through a local
    cache); None when they lie in ``directory`` beside the index."""
    _shas: dict[str, str] | None = field(default=None, compare=False, repr=False)

    def split(self, name: str) -> pa.Table:
        return self.table.filter(pa.compute.equal(self.table.column("split"), name))

    def open_shard(self, shard: str) -> BinaryIO:
        """An open handle on ``shard``'s tar: beside the index, or through the shard cache (fetched on
        first use and checked against this index's sha256). Every reader of shard bytes comes here."""
        if self.cache is None:
            path = self.directory / f"{shard}.tar"
            try:
                return open(path, "rb")
            except FileNotFoundError:  # not a bad sample to skip: every sample of the shard would go silently
                raise ShardIntegrityError(
                    f"{path} is gone while shard index {self.version} is read: erased (trainyard rights erase: the "
                    "ledger names its successor index) or deleted; start again on the successor index") from None
        if self._shas is None:
            self._shas = dict(zip(self.table.column("shard").to_pylist(), self.table.column("shard_sha256").to_pylist()))
        if shard not in self._shas:
            raise ShardIntegrityError(f"{shard} is not a shard of index {self.version}")
        return self.cache.open(shard, self._shas[shard])

    def verify(self, shards: list[str] | None = None, *, index_files: bool = True) -> None:
        """Check shards against this index: each tar's sha256 and its samples' rows (ShardIntegrityError
        naming every mismatch), and with ``index_files`` re-hash the index files against their record
        (PublishedFileError). The loader passes ``index_files=False``: it reads only this in-memory
        table, which read_index already checked, so re-hashing the files on every rank proves nothing.

        Rows are compared with the tar's own members (`member_index`): an index whose rows and
        record were rewritten together still cannot move, drop or add a sample of a listed shard.
        """
        if index_files:
            verify_record(self.directory, version=self.version, record=INDEX_RECORD_FILE)
        by_shard: dict[str, list[dict]] = {}
        for row in self.table.to_pylist():
            by_shard.setdefault(row["shard"], []).append(row)
        problems = []
        for shard in sorted(shards if shards is not None else by_shard):
            problems.extend(self._shard_problems(shard, by_shard.get(shard, [])))
        if problems:
            raise ShardIntegrityError(f"shards in {self.directory} do not match index {self.version}: "
                                      + "; ".join(problems))

    def _shard_problems(self, shard: str, rows: list[dict]) -> list[str]:
        expected = rows[0]["shard_sha256"] if rows else ""
        if self.cache is None:
            return self._tar_problems(shard, rows, expected, self.directory / f"{shard}.tar")
        try:  # fetched into the cache when missing (its sha256 checked there), then checked as a local tar
            handle = self.cache.open(shard, expected)
        except ShardIntegrityError as error:
            return [str(error)]
        with handle:  # read through the open file: another process may evict the cached name meanwhile
            return self._tar_problems(shard, rows, expected, Path(f"/proc/self/fd/{handle.fileno()}"))

    def _tar_problems(self, shard: str, rows: list[dict], expected: str, path: Path) -> list[str]:
        if not path.exists():
            return [f"{shard}.tar is missing"]
        if (actual := sha256_file(path)) != expected:
            return [f"{shard}.tar sha256 {actual[:12]}... != index {expected[:12]}..."]
        members = member_index(path, shard=shard, split=rows[0]["split"], sha256=actual, require_bucket=False)
        # A shard written before buckets names none: its rows' bucket was filled in by read_index.
        members = [{**member, "bucket": member["bucket"] or row["bucket"]} for member, row in zip(
            members, sorted(rows, key=lambda row: row["offset"]))] if len(members) == len(rows) else members
        if sorted(rows, key=lambda row: row["offset"]) != members:
            return [f"{shard}.tar holds samples other than the index rows of shard {shard}"]
        return []


def _index_version(info: dict, table: pa.Table) -> str:
    """The index version: everything index.json says but the version (its plan, manifest, config and
    sample count) and every column of every row (ops.publish.hashing.table_digest): the offsets, buckets and
    splits the loader reads are as bound to it as the shards' sha256."""
    facts = {name: value for name, value in info.items() if name != "version"}
    return digest_json({**facts, "rows": table_digest(table)})[:20]


_INDEX_INFO_KEYS = {"version", "plan_version", "manifest_version", "config", "num_samples"}
"""index.json's keys: each is in the index version (`_index_version`) but ``version`` itself."""


def _shard_entries(plan: ClipPlan, directory: Path, shard: str) -> pa.Table:
    """One shard's index, checked against the shard itself: its rows must be exactly what the tar holds.

    A per-shard index is a function of its tar (`member_index`), so an edited or cut file is caught
    here instead of silently dropping or moving samples in the merged index.
    """
    path = directory / f"{shard}.index.parquet"
    try:
        table = pq.read_table(path, schema=SHARD_INDEX_SCHEMA)
    except (OSError, pa.ArrowException) as error:  # a flipped byte can break the Parquet footer
        raise ShardIntegrityError(f"{path}: unreadable shard index of plan {plan.version} "
                                  f"({type(error).__name__}: {error}); rewrite shard {shard}") from error
    tar = directory / f"{shard}.tar"
    shas = set(table.column("shard_sha256").to_pylist())
    if not tar.exists():
        raise ShardIntegrityError(f"{tar} is missing, but {path.name} indexes it; rewrite shard {shard}")
    actual = sha256_file(tar)
    if shas != {actual}:
        raise ShardIntegrityError(f"{tar}: sha256 {actual[:12]}... is not the {sorted(shas)} that {path.name} records "
                                  f"(plan {plan.version}); rewrite shard {shard}")
    rows = plan.rows_for(shard)
    expected = member_index(tar, shard=shard, split=rows[0]["split"], sha256=actual)
    if table.to_pylist() != expected:
        raise ShardIntegrityError(f"{path}: rows differ from the samples in {tar.name} (plan {plan.version}); "
                                  f"rewrite shard {shard}")
    return table


def build_index(plan: ClipPlan, directory: Path) -> ShardIndex:
    """Merge the per-shard indexes of a fully written plan and publish index.parquet + index.json.

    Each shard's tar is re-hashed and its index checked against it first (`_shard_entries`): a
    rebuild over damaged shards refuses with ShardIntegrityError instead of indexing them.
    """
    tables, missing = [], []
    for shard in plan.shards:
        if not (directory / f"{shard}.index.parquet").exists():
            missing.append(shard)
            continue
        tables.append(_shard_entries(plan, directory, shard))
    if missing:
        raise ShardIntegrityError(f"plan {plan.version}: shards not written yet: {missing}")
    table = pa.concat_tables(tables) if tables else SHARD_INDEX_SCHEMA.empty_table()
    info = {"plan_version": plan.version, "manifest_version": plan.manifest_version,
            "config": plan.config.as_dict(), "num_samples": table.num_rows}
    info["version"] = version = _index_version(info, table)
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    write_file_atomic(directory / INDEX_FILE, buffer.getvalue())
    write_file_atomic(directory / INDEX_INFO_FILE, json.dumps(info, indent=2, sort_keys=True).encode())
    write_record(directory, version=version, files=[INDEX_FILE, INDEX_INFO_FILE], record=INDEX_RECORD_FILE)
    return ShardIndex(directory=directory, table=table, version=version, plan_version=plan.version,
                      manifest_version=plan.manifest_version, config=plan.config)


def _info(directory: Path, version: str, data: bytes) -> IndexInfo:
    info = json.loads(data)
    if info["version"] != version:
        raise PublishedFileCorrupt(f"{directory / INDEX_INFO_FILE}: says index version {info['version']!r}, but "
                                   f"{INDEX_RECORD_FILE} published it as {version}; rebuild the shard index")
    return IndexInfo(directory=directory, version=info["version"], plan_version=info["plan_version"],
                     manifest_version=info["manifest_version"], config=config_of(info, directory / INDEX_INFO_FILE))


def _require_index(directory: Path) -> None:
    if not (directory / INDEX_INFO_FILE).exists() and not (directory / INDEX_RECORD_FILE).exists():
        raise FileNotFoundError(f"no shard index at {directory} (expected {INDEX_INFO_FILE})")


def read_index_info(directory: str | Path) -> IndexInfo:
    """index.json alone, verified against the index's digest record (preflight checks use it; the table can be large)."""
    directory = Path(directory)
    _require_index(directory)
    version, files = read_verified(directory, record=INDEX_RECORD_FILE, only=[INDEX_INFO_FILE])
    return _info(directory, version, files[INDEX_INFO_FILE])


def _check_against_plan(directory: Path, info: IndexInfo) -> None:
    """index.json must describe the plan published beside it (read_plan recomputes that plan's version)."""
    plan = read_plan(directory)
    said = (info.plan_version, info.manifest_version, info.config.as_dict())
    if said != (plan.version, plan.manifest_version, plan.config.as_dict()):
        raise PublishedFileCorrupt(f"{directory / INDEX_INFO_FILE}: index {info.version} names plan {info.plan_version} "
                                   f"(manifest {info.manifest_version}) and a config that differ from plan "
                                   f"{plan.version} beside it; rebuild the shard index")


def read_index(directory: str | Path) -> ShardIndex:
    """The whole index, both files read once and checked against its digest record (the shards
    themselves: `ShardIndex.verify`).

    The record only binds bytes, so the meaning is checked too: the rows' shard digests and the
    plan must hash to the index version, and the plan beside it must be the one index.json names.
    """
    directory = Path(directory)
    _require_index(directory)
    version, files = read_verified(directory, record=INDEX_RECORD_FILE, only=[INDEX_INFO_FILE, INDEX_FILE])
    info = _info(directory, version, files[INDEX_INFO_FILE])
    config = info.config
    table = pq.read_table(pa.BufferReader(files[INDEX_FILE]), schema=SHARD_INDEX_SCHEMA)
    said = json.loads(files[INDEX_INFO_FILE])
    if (recomputed := _index_version(said, table)) != version or set(said) != _INDEX_INFO_KEYS \
            or said["num_samples"] != table.num_rows:
        raise PublishedFileCorrupt(f"{directory / INDEX_FILE}: its rows (every column) and the facts in "
                                   f"{INDEX_INFO_FILE} hash to {recomputed}, not to index version {version} (or "
                                   f"{INDEX_INFO_FILE} miscounts its rows or holds other keys): rows were rewritten; "
                                   "rebuild the shard index")
    _check_against_plan(directory, info)
    buckets = table.column("bucket")
    if buckets.null_count:
        # An index written before buckets existed: every clip has the one shape of its config.
        if len(config.bucket_shapes) != 1:
            raise ShardIntegrityError(f"{directory / INDEX_FILE}: {buckets.null_count} samples have no bucket, but "
                                      f"the config defines {list(config.bucket_shapes)}")
        table = table.set_column(table.schema.get_field_index("bucket"), "bucket",
                                 pyarrow.compute.fill_null(buckets, next(iter(config.bucket_shapes))))
    return ShardIndex(directory=directory, table=table, version=info.version, plan_version=info.plan_version,
                      manifest_version=info.manifest_version, config=config)
