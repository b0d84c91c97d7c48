"""Erasure: a takedown deletes a revoked asset's bytes from every copy Trainyard made, and proves it.

Revocation (ops/curation/rights.py) keeps an asset out of the next run; ``erase`` deletes what holds
it, for an asset the ledger revokes (anything else is refused):

1. **Shards.** Each live clip plan holding the asset gets a successor: the same rows less the
   asset's clips (``plan.json`` says ``erased``: the plan it comes from, the assets, the erasure), its
   shards the old tars less the asset's samples. A tar is a run of samples, each a whole byte range
   (headers carry no offset), so a rewritten shard is the old bytes of the samples it keeps plus the
   end of archive, byte for byte what the shard writer makes of the old plan's rows less the erased
   ones (a sample's meta.json names the plan that cut it, the old one, in every shard); a shard that held
   no clip of the asset is the same file (a hard link). The successor is built in a hidden folder,
   verified (``build_index`` re-hashes every tar against its rows) and renamed into place, then
   published to the shard store like any set. Only then does the ledger record the ``erased`` event
   with the successor map (old index version -> new), and only then are the old tars deleted: no index
   a reader follows ever names a deleted tar. Stages follow the map (``follow``), as does the ledger's
   reader on every machine (the ledger is published to the bucket with a data root in a store).
2. **Copies.** The old tars (working copy and store), the old shard sets in the store, the shard
   cache's copies of those tars and sets, the media cache's copy of the source, the generated samples
   conditioned on the asset (MP4s; their contact sheet regenerated from the samples left) in run and
   evaluation folders, the same in MLflow (through its artifact API, so on the server in a team
   deployment) and in the run records published to the bucket; the source media only with
   ``delete_source`` (the lab may not own the source store): otherwise it is listed as kept.
3. **What stays, and why.** Manifests, validated sets and the old plan and index records keep their
   rows (the record that the asset existed; no media bytes). Checkpoints trained on it are kept and
   derive a ``tainted`` state from the ledger (``run_taint``): finetune, the drill and the trainer
   refuse a tainted parent unless the config says ``rights.accept_tainted`` (reason and approver).
4. **The certificate.** ``rights/erasures/<id>/certificate.json``, signed like every published record
   (a digest record with the deployment's key): every copy deleted (where, former sha256, size), every
   copy kept and why, everything Trainyard could not reach. Published to the store with the data root.

Killed at any point, running it again completes it: every step is idempotent, a journal
(``journal.jsonl``) records each copy's digest before it is deleted, and an erasure without a
certificate is resumed under its own id. Erasing again once nothing is left records nothing and says so.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tarfile
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ops.curation import rights
from ops.curation.rights import follow, successor_map  # noqa: F401 (follow: re-exported for callers)
from ops.curation.event_chain import locked
from ops.publish.durable import fsync_path, write_file_atomic
from ops.publish.hashing import digest_json, sha256_file

CERTIFICATE_FILE = "certificate.json"
CERTIFICATE_RECORD = "certificate.digests.json"
JOURNAL_FILE = "journal.jsonl"
SAMPLE_RECORD_KEYS = ("generated", "samples")
"""Where a sample gallery's record sits: final.json's ``generated`` (a run's samples), evaluation.json's ``samples``."""
NOT_TRACKED = ("models exported or copied outside Trainyard (a registry, another bucket, a colleague's disk) are "
               "not tracked: erase them where they went")


class ErasureRefused(ValueError):
    """The erasure cannot start: the asset is not revoked, or a copy it must rewrite cannot be trusted."""


def erasures_dir(data_root: str | Path) -> Path:
    return rights.rights_dir(data_root) / "erasures"


def certificate_path(data_root: str | Path, erasure_id: str) -> Path:
    return erasures_dir(data_root) / erasure_id / CERTIFICATE_FILE


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# ---------------------------------------------------------------------------------------------
# Successors: which index replaced which


def superseded_plans(events: Iterable[dict]) -> set[str]:
    return {successor["from_plan"] for event in rights.erasures(events) for successor in event.get("successors") or []}


# ---------------------------------------------------------------------------------------------
# Tainted runs: trained (or initialised from a run trained) on a revoked or erased asset


def run_taint(data_root: str | Path, run_dir: str | Path, *, events: list[dict] | None = None) -> dict | None:
    """Why the run in ``run_dir`` (and so each of its checkpoints) is tainted, or None: it read a shard
    index holding an asset the ledger revokes (or that an erasure replaced), or it was initialised from
    a run that did, transitively. Derived from the ledger and the runs' launch records, never stored
    in a checkpoint's signed record. Returns ``{"state": "tainted", "assets", "how", "run_dir"}``."""
    data_root = Path(data_root)
    events = events if events is not None else rights.read_events(data_root)
    revoked = rights.current(events)
    replaced = successor_map(events)
    if not revoked and not replaced:
        return None
    erased_assets = {event["asset_id"] for event in rights.erasures(events)}
    by_run_id = None
    seen: set[str] = set()
    run_dir = Path(run_dir)
    how_chain: list[str] = []
    while True:
        launch = rights._launch_record(run_dir / "launch.json")  # noqa: SLF001 (the module's own record reader)
        if isinstance(launch, str):
            return {"state": "unknown", "assets": [], "how": launch, "run_dir": str(run_dir)}
        assets: set[str] = set()
        if launch["index"] in replaced:
            assets |= set(replaced[launch["index"]].get("assets") or [])
        if revoked:
            with contextlib.suppress(OSError, ValueError, RuntimeError):  # an index gone from here: the map above
                assets |= rights.index_assets(data_root, _index_location(data_root, launch["index"]),
                                              launch["index"]) & set(revoked)
        if assets:
            state = "erased" if assets & erased_assets else "revoked"
            how = f"trained on shard index {launch['index']} holding {state} asset(s)"
            return {"state": "tainted", "assets": sorted(assets), "run_dir": str(run_dir),
                    "how": " <- ".join([*how_chain, how]) if how_chain else how}
        if not launch["parent"] or launch["parent"] in seen:
            return None
        seen.add(launch["parent"])
        if by_run_id is None:
            by_run_id = {}
            for candidate in rights._run_dirs(data_root):  # noqa: SLF001
                record = rights._launch_record(candidate / "launch.json")  # noqa: SLF001
                if not isinstance(record, str):
                    by_run_id.setdefault(record["run_id"], candidate)
        if launch["parent"] not in by_run_id:
            return None
        how_chain.append(f"initialised from run {launch['parent']}")
        run_dir = by_run_id[launch["parent"]]


def _index_location(data_root: Path, version: str) -> str:
    local = rights.plan_dir_of_index(data_root, version)
    if local is not None:
        return str(local)
    from ops.publish import objstore, paths

    root = paths.shard_store_root()
    return objstore.join(root, version) if root else str(data_root / "shards" / version)


def accepted(accept_tainted: dict | None) -> bool:
    """Whether a config's ``rights.accept_tainted`` names both a reason and an approver."""
    return bool(accept_tainted and str(accept_tainted.get("reason") or "").strip()
                and str(accept_tainted.get("approver") or "").strip())


# ---------------------------------------------------------------------------------------------
# The successor of one clip plan


def _tar_end(handle, offset: int) -> None:
    """The end of a tar as tarfile's stream writer closes it: two zero blocks, then zeros to a whole record."""
    handle.write(b"\0" * (2 * tarfile.BLOCKSIZE))
    offset += 2 * tarfile.BLOCKSIZE
    remainder = offset % tarfile.RECORDSIZE
    if remainder:
        handle.write(b"\0" * (tarfile.RECORDSIZE - remainder))


def _not_the_shard(path: Path, version: str, expected: str) -> ErasureRefused:
    return ErasureRefused(f"{path} is missing or is not the shard index {version} names (sha256 {expected[:12]}...): "
                          "the successor cannot be cut from it; verify the set and rebuild it first")


def build_successor(data_root: Path, old_dir: Path, drop: set[str], erasure_id: str) -> tuple[Path, object]:
    """The plan and shards of ``old_dir`` less every clip of the assets ``drop``, published as a new plan
    folder (built hidden, verified, renamed): (its folder, its ShardIndex). An existing successor that
    verifies is reused, so a rerun after a kill finds it done."""
    from ops.clips import plan as clips, shards

    plan = clips.read_plan(old_dir)
    old_index = shards.read_index(old_dir)
    keep = pc.invert(pc.is_in(plan.table.column("asset_id"), value_set=pa.array(sorted(drop), type=pa.string())))
    table = plan.table.filter(keep)
    erased = {"from_plan": plan.version, "from_index": old_index.version, "assets": sorted(drop),
              "erasure_id": erasure_id}
    version = clips.plan_version(plan.validated_version, plan.config, plan.code_version, table,
                                 manifest_version=plan.manifest_version,
                                 num_sources_too_short=plan.num_sources_too_short, erased=erased)
    successor = clips.ClipPlan(table=table, version=version, config=plan.config, manifest_version=plan.manifest_version,
                               validated_version=plan.validated_version,
                               num_sources_too_short=plan.num_sources_too_short, code_version=plan.code_version,
                               erased=erased)
    target = shards.shard_dir(data_root, version)
    if target.is_dir():
        try:
            index = shards.read_index(target)
            index.verify()
            return target, index
        except (OSError, ValueError, RuntimeError):  # our own half-made or damaged folder: built again
            shutil.rmtree(target)
    dropped_keys = set(plan.table.filter(pc.invert(keep)).column("sample_key").to_pylist())
    rows_by_shard: dict[str, list[dict]] = {}
    for row in old_index.table.to_pylist():
        rows_by_shard.setdefault(row["shard"], []).append(row)
    staging = target.parent / f".{version}.erasing-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    try:
        for shard in successor.shards:
            rows = sorted(rows_by_shard.get(shard, []), key=lambda row: row["offset"])
            old_tar = old_dir / f"{shard}.tar"
            expected = rows[0]["shard_sha256"] if rows else ""
            new_tar = staging / f"{shard}.tar"
            if not dropped_keys & {row["sample_key"] for row in rows}:
                try:
                    os.link(old_tar, new_tar)  # the same bytes: one file, two names
                except FileNotFoundError:
                    raise _not_the_shard(old_tar, old_index.version, expected) from None
                except OSError:
                    shutil.copyfile(old_tar, new_tar)
                if sha256_file(new_tar) != expected:  # hashed after linking: what was linked is what was checked
                    raise _not_the_shard(old_tar, old_index.version, expected)
            else:
                try:
                    source = open(old_tar, "rb")
                except FileNotFoundError:
                    raise _not_the_shard(old_tar, old_index.version, expected) from None
                # Hashed and copied through one open file: a file swapped in between is never what is copied.
                with source, open(new_tar, "wb") as out:
                    if hashlib.file_digest(source, "sha256").hexdigest() != expected:
                        raise _not_the_shard(old_tar, old_index.version, expected)
                    written = 0
                    for row in rows:
                        if row["sample_key"] in dropped_keys:
                            continue
                        source.seek(row["offset"])
                        chunk = source.read(row["length"])
                        if len(chunk) != row["length"]:
                            raise ErasureRefused(f"{old_tar}: sample {row['sample_key']} is cut short")
                        out.write(chunk)
                        written += len(chunk)
                    _tar_end(out, written)
                    out.flush()
                    os.fsync(out.fileno())
            entries = shards.member_index(new_tar, shard=shard, split=rows[0]["split"], sha256=sha256_file(new_tar))
            buffer = pa.BufferOutputStream()
            pq.write_table(pa.Table.from_pylist(entries, schema=shards.SHARD_INDEX_SCHEMA), buffer)
            write_file_atomic(staging / f"{shard}.index.parquet", buffer.getvalue().to_pybytes())
            failures = old_dir / f"{shard}.failures.json"
            if failures.exists():
                kept = [entry for entry in json.loads(failures.read_text() or "[]")
                        if not (isinstance(entry, dict) and str(entry.get("sample_key", "")) in dropped_keys)]
                write_file_atomic(staging / failures.name, json.dumps(kept).encode())
        clips.write_plan(successor, staging)
        index = shards.build_index(successor, staging)  # re-hashes each tar against its rows
        fsync_path(staging)
        os.rename(staging, target)
        fsync_path(target.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target, shards.read_index(target)


# ---------------------------------------------------------------------------------------------
# Galleries: generated samples conditioned on the asset


@dataclass(kw_only=True)
class Gallery:
    directory: Path
    samples: dict[str, str]
    """file name -> the sample key that conditioned it"""
    sheet: str | None
    artifact_path: str
    """Where the same files are in the run's MLflow artifacts."""
    run_dir: Path | None


def _galleries(data_root: Path) -> list[Gallery]:
    """Every sample gallery under the data root with its record: a run's ``generated`` (final.json) and
    the evaluation asset's ``samples`` (evaluation.json)."""
    found = []
    for record_path in sorted([*data_root.glob("runs/*/final.json"), *data_root.glob("drills/**/final.json"),
                               *data_root.glob("evaluations/*/*/evaluation.json")]):
        try:
            record = json.loads(record_path.read_text())
        except (OSError, ValueError):
            continue
        for key in SAMPLE_RECORD_KEYS:
            samples = record.get(key) if isinstance(record, dict) else None
            if not isinstance(samples, dict) or not samples.get("dir"):
                continue
            directory = Path(samples["dir"])
            if record_path.name == "evaluation.json":
                step = int(record.get("checkpoint_step") or 0)
                artifact = f"evaluation/step_{step}"
                checkpoint = record.get("checkpoint")
                run_dir = Path(checkpoint).parents[1] if checkpoint else None
            else:
                artifact = f"samples/step_{int(samples.get('step') or 0)}"
                run_dir = record_path.parent
            found.append(Gallery(directory=directory, sheet=samples.get("contact_sheet"), artifact_path=artifact,
                                 run_dir=run_dir,
                                 samples={entry["path"]: entry["key"] for entry in samples.get("samples") or []
                                          if isinstance(entry, dict) and entry.get("path") and entry.get("key")}))
    return found


def _mlflow_run(run_dir: Path | None) -> tuple[str, str] | None:
    """(MLflow run id, tracking URI) a stage run logged to (its ranks/mlflow.json), or None."""
    if run_dir is None:
        return None
    try:
        said = json.loads((run_dir / "ranks" / "mlflow.json").read_text())
        return str(said["run_id"]), str(said["tracking_uri"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# ---------------------------------------------------------------------------------------------
# The erasure


@dataclass(frozen=True)
class TrackingHooks:
    """How to reach the MLflow store a run's record names (its recorded URI is redacted: the caller gives
    back the one with credentials, trainer.observe.tracking.connect_uri) and how to redact a URI or an
    error before it is written (trainer.launch.redact.redact_uri). ops/ sits below the trainer, so the
    command line and the Dagster asset pass them in."""

    connect: Callable[[str], str] = lambda recorded: recorded
    redact: Callable[[str], str] = lambda text: text


@dataclass(kw_only=True)
class Erasure:
    """What one erasure did: the certificate's content."""

    erasure_id: str
    asset_id: str
    reason: str
    note: str
    by: str
    started_at: str
    delete_source: bool
    deleted: list[dict] = field(default_factory=list)
    kept: list[dict] = field(default_factory=list)
    unreachable: list[dict] = field(default_factory=list)
    successors: list[dict] = field(default_factory=list)
    recorded: bool = True
    """False when nothing was left to erase and nothing was recorded (an erasure done before)."""
    previous: list[dict] = field(default_factory=list)
    hooks: TrackingHooks = field(default_factory=TrackingHooks, repr=False)

    def certificate(self) -> dict:
        return {"erasure_id": self.erasure_id, "asset_id": self.asset_id, "reason": self.reason, "note": self.note,
                "by": self.by, "started_at": self.started_at, "completed_at": _now(),
                "delete_source": self.delete_source, "deleted": self.deleted, "kept": self.kept,
                "unreachable": self.unreachable, "successors": self.successors,
                "complete": not any(entry.get("error") for entry in self.unreachable)}


class _Journal:
    """Each copy's digest, written before the copy is deleted: a killed erasure's rerun still certifies it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.entries: dict[str, dict] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    entry = json.loads(line)
                    self.entries.setdefault(entry["location"], entry)

    def delete(self, entry: dict, action: Callable[[], None]) -> None:
        if entry["location"] not in self.entries:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(entry, sort_keys=True) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            self.entries[entry["location"]] = entry
        action()


def _file_entry(kind: str, path: Path, **extra) -> dict:
    return {"kind": kind, "location": str(path), "sha256": sha256_file(path), "size_bytes": path.stat().st_size,
            **extra}


def _unlink(path: Path) -> Callable[[], None]:
    return lambda: path.unlink(missing_ok=True)


def pending(events: list[dict], data_root: Path, asset_id: str) -> dict | None:
    """The newest ``erased`` event of ``asset_id`` whose certificate was never written (a killed run)."""
    for event in reversed(rights.erasures(events, asset_id)):
        if not certificate_path(data_root, event["erasure_id"]).exists():
            return event
    return None


def erase(data_root: str | Path, asset_id: str, *, reason: str, note: str = "", by: str = "",
          delete_source: bool = False, uris: Iterable[str] = (), log: Callable[[str], None] = lambda line: None,
          hooks: TrackingHooks | None = None, kill_after: str = "") -> Erasure:
    """Erase the revoked ``asset_id`` (module docstring). ``uris``: the names its manifests give its
    source, for ``delete_source``. ``kill_after``: a test hook, the step after which the process exits
    (``successors``, ``recorded``, ``shards``), so a test can kill an erasure exactly there."""
    data_root = Path(data_root)
    asset_id = rights.check_asset_id(asset_id)
    if reason not in rights.REASONS:
        raise ValueError(f"reason must be one of {list(rights.REASONS)}, got {reason!r}")
    with locked(rights.rights_dir(data_root) / "erasure"):  # one erasure at a time per data root
        return _erase(data_root, asset_id, reason=reason, note=note, by=by or rights._who(),  # noqa: SLF001
                      delete_source=delete_source, uris=sorted(set(uris)), log=log, hooks=hooks or TrackingHooks(),
                      kill_after=kill_after)


def _erase(data_root: Path, asset_id: str, *, reason: str, note: str, by: str, delete_source: bool,
           uris: list[str], log: Callable[[str], None], hooks: TrackingHooks, kill_after: str) -> Erasure:
    from ops.publish import paths

    events = rights.read_events(data_root)
    if asset_id not in rights.current(events):
        raise ErasureRefused(f"asset {asset_id} is not revoked: erasure deletes the copies of a revoked asset only; "
                             f"revoke it first (trainyard rights revoke {asset_id[:16]} --reason ...)")
    resumed = pending(events, data_root, asset_id)
    erasure_id = resumed["erasure_id"] if resumed else digest_json(
        {"asset_id": asset_id, "after": events[-1]["chain"]})[:16]
    work = Erasure(erasure_id=erasure_id, asset_id=asset_id, reason=resumed["reason"] if resumed else reason,
                   note=resumed["note"] if resumed else note, by=resumed["by"] if resumed else by,
                   started_at=resumed["at"] if resumed else _now(), delete_source=delete_source,
                   previous=[event for event in rights.erasures(events, asset_id) if event is not resumed], hooks=hooks)
    journal = _Journal(erasures_dir(data_root) / erasure_id / JOURNAL_FILE)
    reach = rights.where(data_root, [asset_id])
    found = reach.reach[asset_id]
    uris = sorted(set(uris) | set(found.uris))  # the names the manifests give it, and those its clips were cut from
    superseded = superseded_plans(events)

    # 1. Successors of the live plans that hold it (built and published before anything is deleted).
    if resumed:
        work.successors = list(resumed.get("successors") or [])
    else:
        for plan in found.plans:
            old_dir = Path(plan["path"])
            if plan["plan_version"] in superseded:
                continue  # an earlier erasure replaced it: its tars go below, nothing reads it any more
            if not any(shard["written"] for shard in found.shards if shard["plan_version"] == plan["plan_version"]):
                continue
            from ops.clips import shards

            try:
                old_index = shards.read_index_info(old_dir)
            except (OSError, ValueError):  # never indexed: nothing trains on it; its tars are deleted below
                continue
            directory, index = build_successor(data_root, old_dir, {asset_id}, erasure_id)
            published = _publish_successor(directory, index)
            work.successors.append({"from_plan": plan["plan_version"], "from_index": old_index.version,
                                    "plan": index.plan_version, "index": index.version,
                                    "path": str(directory.relative_to(data_root)), "published_to": published,
                                    "assets": [asset_id]})
            log(f"successor of shard index {old_index.version}: {index.version} ({directory})"
                + (f", published to {published}" if published else ""))
    if kill_after == "successors":
        os._exit(137)

    # 2. The ledger records the erasure and its successors (published to the bucket with it) before any delete.
    if not resumed:
        copies = _discover(data_root, asset_id, found, uris=uris, delete_source=delete_source)
        if not work.successors and not copies and work.previous:
            work.recorded = False
            return work
        rights.record_erasure(data_root, {"asset_id": asset_id, "erasure_id": erasure_id, "reason": reason,
                                          "note": note, "by": by, "at": work.started_at,
                                          "source": "trainyard rights erase", "delete_source": delete_source,
                                          "successors": work.successors})
    if kill_after == "recorded":
        os._exit(137)

    # 3. Delete every copy (each journaled first).
    _delete_shards(data_root, found, journal, work, log)
    if kill_after == "shards":
        os._exit(137)
    _delete_store_sets(found, journal, log)
    _delete_cached(asset_id, found, journal, log)
    touched = _erase_galleries(data_root, asset_id, found, journal, work, log)
    _republish_run_records(touched, work, log)
    _source(asset_id, uris, delete_source, journal, work, log)

    # 4. What stays, and the certificate.
    for entry in journal.entries.values():
        if entry.get("replaced"):  # regenerated in place without the asset: the former digest is what went
            now = sha256_file(Path(entry["location"])) if os.path.exists(entry["location"]) else None
            work.deleted.append({**entry, "deleted": now != entry["sha256"], "replaced_by": now})
            continue
        gone = not exists(entry["location"])
        work.deleted.append({**entry, "deleted": gone}) if gone else work.unreachable.append(
            {**entry, "error": "still present after deletion"})
    for run in found.runs:
        work.kept.append({"kind": "run", "location": run["run_dir"], "stage": run["stage"], "run_id": run["run_id"],
                          "state": "tainted", "why": f"checkpoints are the lab's to retire, retrain or unlearn; "
                                                     f"{run['how']}"})
    for point in found.checkpoints:
        work.kept.append({"kind": "checkpoint", "location": point["path"], "step": point["step"],
                          "status": point["status"], "state": "tainted",
                          "why": "trained on the asset (or initialised from a run that was): refused as a parent "
                                 "without rights.accept_tainted"})
    mirror = paths.checkpoint_store_root()
    if mirror and found.runs:
        work.kept.extend({"kind": "checkpoint_mirror", "location": f"{mirror.rstrip('/')}/{Path(run['run_dir']).name}",
                          "state": "tainted", "why": "the mirror of a tainted run's checkpoints"}
                         for run in found.runs)
    for plan in found.plans:
        work.kept.append({"kind": "record", "location": plan["path"],
                          "why": "the clip plan and shard index records keep their rows (asset id, uri, caption, "
                                 "sample keys; no media bytes): the record that the asset was planned and erased"})
    work.kept.append({"kind": "record", "location": str(data_root / "manifests"),
                      "why": "manifests and validated sets keep their rows unchanged (their versions are history); "
                             "the ledger marks the asset erased"})
    work.kept.append({"kind": "ledger", "location": str(rights.ledger_path(data_root)),
                      "why": "the rights ledger records the revocation and this erasure"})
    work.unreachable.append({"kind": "exports", "why": NOT_TRACKED})
    for gallery in touched:
        work.unreachable.append({"kind": "dagster_event_log", "location": str(gallery.directory),
                                 "why": "the evaluation's materialization in Dagster's event log shows this gallery's "
                                        "former contact sheet inline; delete that Dagster run if the takedown "
                                        "requires it"})
    if reach.problems:
        work.unreachable.extend({"kind": "cannot_tell", "why": problem} for problem in reach.problems)
    _write_certificate(data_root, work)
    return work


def exists(location: str) -> bool:
    """Whether a copy is still there: a path (a dangling link counts), or a store object or prefix with objects."""
    if "://" in location:
        from ops.publish import objstore

        if location.startswith("mlflow:"):
            return False  # checked by the MLflow step itself (an error there is recorded as unreachable)
        fs, path = objstore.filesystem(location)
        fs.invalidate_cache(path)  # a cached instance may still list what was just deleted through another one
        # An object, or a prefix with objects under it: a filer-backed store (SeaweedFS) keeps an emptied
        # prefix as a directory, which exists() reports, though nothing is left in it.
        return fs.isfile(path) or any(found.rstrip("/") != path.rstrip("/") for found in fs.find(path))
    return os.path.lexists(location)


def _publish_successor(directory: Path, index) -> str | None:
    from ops.publish import objstore, paths

    root = paths.shard_store_root()
    if root is None:
        return None
    url = objstore.join(root, index.version)
    objstore.publish_tree(directory, url, skip_hidden=True,
                          metadata={"shard_index_version": index.version, "plan_version": index.plan_version})
    return url


def _discover(data_root: Path, asset_id: str, found: rights.Reach, *, uris: list[str], delete_source: bool) -> list:
    """Whether anything holding the asset is left (an erasure done before finds nothing): its list."""
    from ops.publish import paths

    left: list[str] = [shard["path"] for shard in found.shards if Path(shard["path"]).exists()]
    left += [str(path) for path in paths.media_cache_dir().glob(f"{asset_id}*")]
    for gallery in _galleries(data_root):
        left += [str(gallery.directory / name) for name, key in gallery.samples.items()
                 if key.startswith(asset_id[:16]) and (gallery.directory / name).exists()]
    for index in found.shard_indexes:
        if index.get("published_to") and exists(index["published_to"]):
            left.append(index["published_to"])
    if delete_source:
        left += [uri for uri in uris if _source_location(uri) and exists(_source_location(uri))]
    return left


def _delete_shards(data_root: Path, found: rights.Reach, journal: _Journal, work: Erasure,
                   log: Callable[[str], None]) -> None:
    for shard in found.shards:
        tar = Path(shard["path"])
        if tar.exists():
            journal.delete(_file_entry("shard", tar, plan_version=shard["plan_version"],
                                       sample_keys=len(shard["sample_keys"])), _unlink(tar))
            log(f"deleted {tar}")


def _delete_store_sets(found: rights.Reach, journal: _Journal, log: Callable[[str], None]) -> None:
    from ops.publish import objstore

    for index in found.shard_indexes:
        url = index.get("published_to")
        if not url:
            continue
        try:
            record = objstore.read_record(url)
        except Exception:  # noqa: BLE001 (no record, or a refused one: the objects are deleted all the same)
            record = {}
        if not exists(url):
            continue
        holding = {shard["shard"] for shard in found.shards if shard["plan_version"] == index["plan_version"]}
        for name, digest in sorted((record.get("files") or {}).items()):
            if name.endswith(".tar"):  # the whole version goes; those holding the asset are marked
                journal.delete({"kind": "store_shard", "location": objstore.join(url, name),
                                "sha256": digest.get("sha256"), "size_bytes": digest.get("size_bytes"),
                                "holds_asset": name.removesuffix(".tar") in holding}, lambda: None)
        journal.delete({"kind": "store_shard_set", "location": url, "sha256": None, "size_bytes": None},
                       lambda url=url: objstore.delete_version(url))
        log(f"deleted shard set {url}")


def _delete_cached(asset_id: str, found: rights.Reach, journal: _Journal, log: Callable[[str], None]) -> None:
    from ops.publish import paths

    # The tars that held the asset (a shard that did not is the same file in the successor, cached once by content).
    shas = {entry["sha256"] for entry in journal.entries.values()
            if entry["kind"] == "shard" or (entry["kind"] == "store_shard" and entry.get("holds_asset"))}
    cache = paths.shard_cache_dir()
    for sha in sorted(sha for sha in shas if sha):
        for path in (cache / "tars").glob(f"{sha}*"):
            journal.delete(_file_entry("shard_cache", path), _unlink(path))
            log(f"deleted {path}")
    for index in found.shard_indexes:
        for directory in (cache / "sets").glob(f"{index['version']}-*"):
            journal.delete({"kind": "shard_cache_set", "location": str(directory), "sha256": None, "size_bytes": None},
                           lambda directory=directory: shutil.rmtree(directory, ignore_errors=True))
    for path in paths.media_cache_dir().glob(f"{asset_id}*"):  # named by content: <sha256><suffix>
        if path.is_file():
            journal.delete(_file_entry("media_cache", path), _unlink(path))
            log(f"deleted {path}")


def _erase_galleries(data_root: Path, asset_id: str, found: rights.Reach, journal: _Journal, work: Erasure,
                     log: Callable[[str], None]) -> list[Gallery]:
    """Delete the samples conditioned on the asset (their key is one of its clips'), regenerate each
    touched contact sheet from the samples left, and do the same to the run's MLflow artifacts."""
    from ops.media.gallery import contact_sheet, mp4_frames

    keys = {key for shard in found.shards for key in shard["sample_keys"]}
    prefix = asset_id[:16]  # a sample key is <asset id[:16]>-<start ms> (ops.clips.plan.sample_key)
    touched = []
    for gallery in _galleries(data_root):
        hit = sorted(name for name, key in gallery.samples.items() if key in keys or key.startswith(prefix + "-"))
        if not hit:
            continue
        deleted_here = []
        for name in hit:
            path = gallery.directory / name
            if path.exists():
                journal.delete(_file_entry("sample", path, conditioned_on=gallery.samples[name]), _unlink(path))
                deleted_here.append(name)
        sheet = gallery.directory / gallery.sheet if gallery.sheet else None
        rest = [gallery.directory / name for name in sorted(gallery.samples) if name not in hit
                and (gallery.directory / name).exists()]
        if sheet is not None and (deleted_here or sheet.exists()):
            if sheet.exists() and deleted_here:  # its former bytes showed the deleted samples: replaced below
                journal.delete(_file_entry("contact_sheet", sheet, replaced=bool(rest)), lambda: None)
            if rest and deleted_here:
                write_file_atomic(sheet, contact_sheet([mp4_frames(path) for path in rest]))
                log(f"regenerated {sheet} from {len(rest)} sample(s) left")
            elif not rest:
                sheet.unlink(missing_ok=True)
        _erase_mlflow(gallery, hit, rest, sheet, journal, work, log)
        touched.append(gallery)
    return touched


def _erase_mlflow(gallery: Gallery, hit: list[str], rest: list[Path], sheet: Path | None, journal: _Journal,
                  work: Erasure, log: Callable[[str], None]) -> None:
    """The same gallery in the stage's MLflow run: the samples deleted through the artifact repository
    (the tracking server's, in a team deployment), the contact sheet replaced."""
    run = _mlflow_run(gallery.run_dir)
    if run is None:
        return
    run_id, tracking_uri = run
    try:
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=work.hooks.connect(tracking_uri))
        listed = {Path(item.path).name for item in client.list_artifacts(run_id, gallery.artifact_path)}
        if not listed:
            return
        repository = get_artifact_repository(client.get_run(run_id).info.artifact_uri)
        names = [name for name in hit if name in listed]
        if gallery.sheet and gallery.sheet in listed and names:
            names.append(gallery.sheet)
        for name in names:
            location = f"mlflow:{run_id}/{gallery.artifact_path}/{name}"
            journal.delete({"kind": "mlflow_artifact", "location": location, "sha256": None, "size_bytes": None,
                            "tracking_uri": work.hooks.redact(tracking_uri)},
                           lambda name=name: repository.delete_artifacts(f"{gallery.artifact_path}/{name}"))
        if sheet is not None and sheet.exists() and names:
            client.log_artifact(run_id, str(sheet), artifact_path=gallery.artifact_path)
        left = {Path(item.path).name for item in client.list_artifacts(run_id, gallery.artifact_path)}
        if left & set(hit):
            raise RuntimeError(f"still listed after deletion: {sorted(left & set(hit))}")
        if names:
            log(f"deleted {len(names)} artifact(s) of MLflow run {run_id} under {gallery.artifact_path}")
    except Exception as error:  # noqa: BLE001 (a server down: recorded as unreachable, the rerun completes it)
        work.unreachable.append({"kind": "mlflow_artifact", "location": f"mlflow:{run_id}/{gallery.artifact_path}",
                                 "error": work.hooks.redact(f"{type(error).__name__}: {error}"),
                                 "why": "MLflow could not be reached or refused the deletion; run the erasure again"})


def _republish_run_records(touched: list[Gallery], work: Erasure, log: Callable[[str], None]) -> None:
    """With a data root in a store, a run's records (published per launch, galleries included) are
    replaced: every version holding a deleted sample goes, and the cleaned folder is published anew."""
    from ops.publish import objstore, paths, store_root

    if paths.data_store_url() is None:
        return
    for run_dir in sorted({gallery.run_dir for gallery in touched if gallery.run_dir is not None}):
        url = store_root.url_for(run_dir)
        if url is None:
            continue
        records = objstore.join(url, store_root.RECORDS)
        listing = objstore.list_versions(records)
        for name in [*listing.committed, *listing.ignored]:
            version = objstore.join(records, name)
            work.deleted.append({"kind": "store_run_records", "location": version, "sha256": None,
                                 "size_bytes": None, "deleted": True})
            objstore.delete_version(version)
        republished = store_root.publish_run_records(run_dir)
        log(f"run records of {run_dir.name} republished without the samples: {republished}")


def _source_location(uri: str) -> str | None:
    from ops.publish import objstore, paths

    media = paths.media_location()
    return objstore.join(media, uri) if "://" in media else str(Path(media) / uri)


def _source(asset_id: str, uris: list[str], delete_source: bool, journal: _Journal, work: Erasure,
            log: Callable[[str], None]) -> None:
    from ops.publish import objstore

    for uri in uris:
        location = _source_location(uri)
        if location is None or not exists(location):
            continue
        if not delete_source:
            work.kept.append({"kind": "source", "location": location,
                              "why": "source media is deleted only with --delete-source (the lab may not own the "
                                     "source store)"})
            continue
        if "://" in location:
            fs, path = objstore.filesystem(location)
            with fs.open(path, "rb") as handle:
                sha = hashlib.file_digest(handle, "sha256").hexdigest()
            if sha == asset_id:
                journal.delete({"kind": "source", "location": location, "sha256": sha,
                                "size_bytes": fs.size(path)}, lambda fs=fs, path=path: fs.rm_file(path))
        else:
            path = Path(location)
            if sha256_file(path) != asset_id:  # the name holds other content now: not this asset
                work.kept.append({"kind": "source", "location": location,
                                  "why": "this name now holds other content (not the erased asset)"})
                continue
            journal.delete(_file_entry("source", path), _unlink(path))
        log(f"deleted source {location}")


def _write_certificate(data_root: Path, work: Erasure) -> Path:
    """certificate.json and its signed digest record (ops.publish.storage); published to the store with the data root."""
    from ops.publish import storage

    directory = erasures_dir(data_root) / work.erasure_id
    directory.mkdir(parents=True, exist_ok=True)
    write_file_atomic(directory / CERTIFICATE_FILE, json.dumps(work.certificate(), indent=2, sort_keys=True).encode())
    storage.write_record(directory, version=work.erasure_id, files=[CERTIFICATE_FILE], record=CERTIFICATE_RECORD)
    from ops.publish import paths

    if paths.data_store_url() is not None:
        from ops.publish import store_root

        store_root.publish_version(directory)
    return directory / CERTIFICATE_FILE


def read_certificate(data_root: str | Path, erasure_id: str) -> dict:
    """A certificate, checked against its signed record (PublishedFileError when edited or unsigned)."""
    from ops.publish import storage

    directory = erasures_dir(data_root) / erasure_id
    _, files = storage.read_verified(directory, version=erasure_id, record=CERTIFICATE_RECORD,
                                     only=[CERTIFICATE_FILE])
    return json.loads(files[CERTIFICATE_FILE])
