"""Shard backfills, here or on the cluster: what ``clip_shards`` does with the partitions of its run.

A run holds one partition (a UI materialization, or a backfill on this machine: one run per
partition) or several (a backfill where the launcher runs data work on the cluster: the asset's
backfill policy groups ``TRAINYARD_BACKFILL_PARTITIONS_PER_RUN`` partitions per run, and the run
submits them as one array job, resources/slurm_array.py).

Either way each partition that was written gets its own materialization, with the same metadata and
lineage wherever it was cut (``materialize_partition``), after the step checked the published shard
against the sha256 its writer recorded. A partition that failed after every round is named with its
reason in the step's failure; the others stay materialized. The run's backfill report
(``<data root>/backfills/<run id>/report.json``) records per node: partitions written, decode and
encode time, bytes read and written, failures; and the queue wait apart from the work time.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import dagster as dg

from assets.metadata import markdown_table
from ops import array_tasks
from ops.publish.durable import write_json_atomic

PARTITIONS_PER_RUN_ENV = "TRAINYARD_BACKFILL_PARTITIONS_PER_RUN"
REPORT_FILE = "report.json"


def backfill_policy() -> dg.BackfillPolicy | None:
    """Where data work runs on SLURM (TRAINYARD_ENV slurm or cluster+slurm), a backfill's partitions go
    in runs of TRAINYARD_BACKFILL_PARTITIONS_PER_RUN (default 64), each one array job; elsewhere one
    run per partition (Dagster's default), which a local run queue runs side by side."""
    if not (os.environ.get("TRAINYARD_ENV") or "local").endswith("slurm"):
        return None
    text = os.environ.get(PARTITIONS_PER_RUN_ENV, "64")
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{PARTITIONS_PER_RUN_ENV}={text!r} must be a whole number >= 1")
    return dg.BackfillPolicy.multi_run(int(text))


def backfills_dir(data_root: str | Path) -> Path:
    return Path(data_root) / "backfills"


def _read(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # absent, or torn by a task killed mid-write: the task left no result
    return record if isinstance(record, dict) else None


def write_on_cluster(context: dg.AssetExecutionContext, launcher: Any, *, plan_dir: str, media_root: str,
                     partitions: Sequence[str], data_root: Path) -> tuple[dict[str, dict], dict[str, Any]]:
    """Every partition as array tasks; (partition -> its result record, or a failure record) and the
    attempts per partition. Refused before submission, naming the setting, when the tasks would lack
    the media root, the data root or the object store's credentials."""
    from resources.slurm_array import task_env

    work_dir = backfills_dir(data_root) / context.run.run_id
    needs = task_needs(media_root=media_root, plan_dir=plan_dir, out_dir=plan_dir)
    problems = launcher.check_data({"the media root (TRAINYARD_MEDIA_ROOT)": media_root,
                                    "the data root (TRAINYARD_DATA_ROOT)": str(data_root)})
    problems += array_tasks.check_needs(needs)
    if problems:
        raise dg.Failure(description="clip_shards: array job refused before submission:\n- " + "\n- ".join(problems),
                         allow_retries=False, metadata={"problems": len(problems)})
    outcomes = launcher.run_tasks(
        context, work_dir=work_dir, name="clip_shards", items=list(partitions), per_task=launcher.shards_per_task,
        spec_for=lambda round_number, groups: {
            "kind": "shards", "work_dir": str(work_dir), "tasks": groups, "plan_dir": plan_dir,
            "media_root": media_root, "out_dir": plan_dir, "needs": needs},
        result_of=lambda partition: _read(array_tasks.partition_result_path(work_dir, partition)),
        env=task_env(), out_dirs=[Path(plan_dir)])
    _records_its_own_materializations(context)
    records = {}
    for partition, outcome in outcomes.items():
        if outcome.ok:
            records[partition] = outcome.result
        else:
            records[partition] = {**(outcome.result or {}), "partition": partition, "class": outcome.failure_class,
                                  "reason": outcome.reason}
    return records, {partition: outcome.attempts for partition, outcome in outcomes.items()}


def _records_its_own_materializations(context: dg.AssetExecutionContext) -> None:
    """dg.open_pipes_session marks the step as one that must yield its results (the Pipes results as
    a MaterializeResult); clip_shards records each partition with its own AssetMaterialization
    instead, since a yielded result would materialize every partition of the run with one metadata.
    Dagster 1.13 has no public way to say so: the step's private flag is reset here (without it the
    step fails 'did not yield or return expected outputs'); tests/test_slurm_nodes.py holds it."""
    step = getattr(context.op_execution_context, "_step_execution_context", None)
    if step is not None and hasattr(step, "_requires_typed_event_stream"):
        step._requires_typed_event_stream = False


def task_needs(*, media_root: str, plan_dir: str, out_dir: str) -> dict[str, Any]:
    """What each task checks before it starts (ops.array_tasks.check_needs)."""
    env = {}
    if media_root.startswith("s3://"):
        env = {"TRAINYARD_S3_ENDPOINT_URL": "the object store holding the media",
               "AWS_ACCESS_KEY_ID": "the data pipeline's access key", "AWS_SECRET_ACCESS_KEY": "its secret key"}
    return {"paths": {"the media root (TRAINYARD_MEDIA_ROOT)": media_root,
                      "the clip plan (TRAINYARD_DATA_ROOT)": plan_dir},
            "writable": {"the shard folder (TRAINYARD_DATA_ROOT)": out_dir}, "env": env}


def write_here(context: dg.AssetExecutionContext, plan: Any, *, media_root: str, out_dir: str,
               partitions: Sequence[str]) -> dict[str, dict]:
    """The local path: each partition written in this step, recorded as an array task records it."""
    return array_tasks.write_shards_here(plan, partitions, media_root, out_dir,
                                         log=lambda message, warning=False: (
                                             context.log.warning if warning else context.log.info)(message))


def verify_published(record: Mapping[str, Any], out_dir: Path) -> str:
    """"" when the partition's published shard is what its writer recorded; else why not.

    The shard's size and its published index (whose every row carries the sha256 the writer
    hashed) must agree with the record, without reading the shard again here: for a backfill of
    large shards that is every byte once more over the network, and shard_index re-hashes each
    shard against its index before any reader sees the set."""
    import pyarrow.parquet as pq

    partition = record["partition"]
    path = out_dir / f"{partition}.tar"
    try:
        size = path.stat().st_size
        shas = set(pq.read_table(out_dir / f"{partition}.index.parquet", columns=["shard_sha256"])
                   .column("shard_sha256").to_pylist())
    except (OSError, ValueError) as error:  # absent, or not a Parquet file
        return f"{partition}: its published shard or index cannot be read: {type(error).__name__}: {error}"
    if size != record.get("size_bytes") or shas - {record.get("sha256")}:
        return (f"{path} ({size} bytes, index sha256 {sorted(shas)[:1]}) is not what its writer recorded "
                f"({record.get('size_bytes')} bytes, sha256 {str(record.get('sha256'))[:16]}): changed after it was "
                "published")
    return ""


def materialize_partition(context: dg.AssetExecutionContext, record: Mapping[str, Any], *, plan_version: str,
                          code_version: str, lineage: Mapping[str, Any], report_path: Path,
                          queue_wait_s: float) -> dg.AssetMaterialization:
    """One partition's materialization, for the asset to yield (yielded, it is stored at once: a
    failure of another partition raised after it cannot drop it): the metadata and data version a local run records, with where
    it was written (node, SLURM job and task, queue wait and work time)."""
    partition = record["partition"]
    failures = list(record.get("failures") or [])
    metadata = {"shard": partition, "data_path": str(record["path"]), "sha256": record["sha256"],
                "plan_version": plan_version, "size_bytes": int(record["size_bytes"]),
                "dagster/row_count": int(record["num_samples"]), "num_failed_clips": len(failures),
                "failed_clips": markdown_table(failures, ["sample_key", "uri", "reason"]),
                "node": str(record.get("node", "")),
                "slurm_job": f"{record['job_id']}_{record['task']}" if record.get("job_id") else "none",
                "queue_wait_s": round(float(queue_wait_s), 3),
                "work_s": round(float(record["ended_at"]) - float(record["started_at"]), 3),
                "decode_s": float(record.get("decode_s", 0.0)), "encode_s": float(record.get("encode_s", 0.0)),
                "bytes_read": int(record.get("bytes_read", 0)), "bytes_written": int(record.get("bytes_written", 0)),
                "backfill_report": str(report_path), **lineage}
    tags = {"dagster/data_version": str(record["sha256"])[:20], "dagster/data_version_is_user_provided": "true",
            "dagster/code_version": code_version}
    plan_event = _latest(context, dg.AssetKey("clip_plan"))
    if plan_event is not None:  # what a returned Output would carry: the staleness of each partition
        storage_id, plan_tags = plan_event
        if plan_tags.get("dagster/data_version"):
            tags["dagster/input_data_version/clip_plan"] = plan_tags["dagster/data_version"]
            tags["dagster/input_event_pointer/clip_plan"] = str(storage_id)
    return dg.AssetMaterialization(asset_key=context.asset_key, partition=partition, metadata=metadata, tags=tags)


def _latest(context: dg.AssetExecutionContext, key: dg.AssetKey) -> tuple[int, dict[str, str]] | None:
    try:
        records = context.instance.fetch_materializations(key, limit=1).records
    except Exception:  # noqa: BLE001 - a direct invocation has no instance: the tags are left out
        return None
    if not records:
        return None
    materialization = records[0].asset_materialization
    return records[0].storage_id, dict(materialization.tags or {}) if materialization else {}


def build_report(context: dg.AssetExecutionContext, records: Mapping[str, Mapping[str, Any]],
                 attempts: Mapping[str, list], *, plan_version: str, where: str, started: float) -> dict[str, Any]:
    """The run's backfill report: per partition, per node, and the queue wait apart from the work."""
    submitted = {(line["job_id"], line["task"]): line.get("submitted_at") for lines in attempts.values()
                 for line in lines if line.get("job_id")}
    first_start: dict[tuple, float] = {}
    for record in records.values():
        if record.get("job_id") and record.get("started_at") is not None:
            key = (str(record["job_id"]), record["task"])
            first_start[key] = min(first_start.get(key, float("inf")), float(record["started_at"]))
    nodes: dict[str, dict[str, Any]] = {}
    partitions = {}
    for partition, record in records.items():
        ok = record.get("class") == "ok"
        node = str(record.get("node") or "none")
        wait = 0.0
        key = (str(record.get("job_id", "")), record.get("task"))
        if ok and submitted.get(key) and key in first_start:
            wait = max(0.0, first_start[key] - float(submitted[key]))
        work = float(record["ended_at"]) - float(record["started_at"]) if ok else 0.0
        partitions[partition] = {"class": record.get("class"), "reason": record.get("reason", ""), "node": node,
                                 "queue_wait_s": round(wait, 3), "work_s": round(work, 3),
                                 "attempts": attempts.get(partition, [])}
        stats = nodes.setdefault(node, {"partitions_written": 0, "failures": 0, "decode_s": 0.0, "encode_s": 0.0,
                                        "work_s": 0.0, "bytes_read": 0, "bytes_written": 0, "frames": 0})
        if ok:
            stats["partitions_written"] += 1
            stats["work_s"] += work
            for name in ("decode_s", "encode_s"):
                stats[name] += float(record.get(name, 0.0))
            for name in ("bytes_read", "bytes_written"):
                stats[name] += int(record.get(name, 0))
            stats["frames"] += int(record.get("num_frames", 0))
        else:
            stats["failures"] += 1
    # Failed attempts count against the node they ran on, even when a later round wrote the partition.
    for lines in attempts.values():
        for line in lines:
            if line.get("class") not in ("ok", None) and line is not lines[-1]:
                nodes.setdefault(str(line.get("node") or "none"), {"partitions_written": 0, "failures": 0,
                                                                   "decode_s": 0.0, "encode_s": 0.0, "work_s": 0.0,
                                                                   "bytes_read": 0, "bytes_written": 0,
                                                                   "frames": 0})["failures"] += 1
    waits = {key: max(0.0, first_start[key] - float(value)) for key, value in submitted.items()
             if value and key in first_start}
    return {"run_id": context.run.run_id, "plan_version": plan_version, "where": where,
            "host": socket.gethostname(), "wall_s": round(time.time() - started, 3),
            "num_partitions": len(records), "num_written": sum(r.get("class") == "ok" for r in records.values()),
            "queue_wait_s": {"tasks": len(waits), "total": round(sum(waits.values()), 3),
                             "max": round(max(waits.values(), default=0.0), 3)},
            "work_s": round(sum(p["work_s"] for p in partitions.values()), 3),
            "nodes": {node: {key: round(value, 4) if isinstance(value, float) else value
                             for key, value in stats.items()} for node, stats in sorted(nodes.items())},
            "partitions": partitions}


def write_report(data_root: Path, report: Mapping[str, Any]) -> Path:
    path = backfills_dir(data_root) / str(report["run_id"]) / REPORT_FILE
    write_json_atomic(path, report)
    return path


def plan_backfills(data_root: Path, plan_version: str) -> dict[str, Any]:
    """Every backfill report of one plan, summed per node (data_profile's view of the cluster): the
    partitions each node wrote, its decode and encode time, bytes read and written, failures, and
    the queue wait apart from the work."""
    nodes: dict[str, dict[str, Any]] = {}
    runs, waits, work = 0, [], 0.0
    for path in sorted(backfills_dir(data_root).glob(f"*/{REPORT_FILE}")):
        report = _read(path)
        if report is None or report.get("plan_version") != plan_version:
            continue
        runs += 1
        waits.append(float(report.get("queue_wait_s", {}).get("max", 0.0)))
        work += float(report.get("work_s", 0.0))
        for node, stats in (report.get("nodes") or {}).items():
            total = nodes.setdefault(node, {})
            for key, value in stats.items():
                total[key] = total.get(key, 0) + value
    return {"runs": runs, "queue_wait_max_s": round(max(waits, default=0.0), 3), "work_s": round(work, 3),
            "nodes": {node: {key: round(value, 4) if isinstance(value, float) else value
                             for key, value in stats.items()} for node, stats in sorted(nodes.items())}}


def nodes_table(report: Mapping[str, Any]) -> dg.MetadataValue:
    rows = [{"node": node, **stats} for node, stats in report["nodes"].items()]
    return markdown_table(rows, ["node", "partitions_written", "failures", "work_s", "decode_s", "encode_s",
                                 "bytes_read", "bytes_written"])


# ---- probing on the cluster ----

def cluster_prober(context: dg.AssetExecutionContext, launcher: Any, data_root: Path):
    """A ops.curation.manifest.Prober that probes a listing larger than ``probe_objects_per_task`` as
    array tasks, one listing chunk each, and merges their results by object: the rows, built in
    listing order by the caller, and so the manifest version, are those of a one-machine build.
    A chunk that no round finished fails the step, naming its objects: never a row left out."""
    from ops.curation import manifest as manifest_ops
    from ops.media import probe
    from resources.slurm_array import task_env

    def prober(media: Any, targets: list, config: Any) -> dict:
        per_task = launcher.probe_objects_per_task
        if len(targets) <= per_task:
            context.log.info(f"dataset_manifest: {len(targets)} object(s) to probe, no more than one task's share "
                             f"(SlurmLauncher.probe_objects_per_task={per_task}): probed here")
            return manifest_ops.probe_targets(media, targets, config)
        chunks = [targets[start:start + per_task] for start in range(0, len(targets), per_task)]
        work_dir = data_root / "probes" / context.run.run_id
        needs = task_needs(media_root=media.location, plan_dir=media.location, out_dir=str(work_dir))
        needs["paths"].pop("the clip plan (TRAINYARD_DATA_ROOT)")
        work_dir.mkdir(parents=True, exist_ok=True)
        problems = launcher.check_data({"the media root (TRAINYARD_MEDIA_ROOT)": media.location,
                                        "the data root (TRAINYARD_DATA_ROOT)": str(data_root)})
        problems += array_tasks.check_needs(needs)
        if problems:
            raise dg.Failure(description="dataset_manifest: probe array job refused before submission:\n- "
                             + "\n- ".join(problems), allow_retries=False, metadata={"problems": len(problems)})
        items = [_listed_item(item) for item in targets]
        bounds = [(start, min(start + per_task, len(items))) for start in range(0, len(items), per_task)]
        context.log.info(f"dataset_manifest: probing {len(targets)} object(s) as {len(chunks)} array task(s) of "
                         f"at most {per_task}")
        outcomes = launcher.run_tasks(
            context, work_dir=work_dir, name="dataset_manifest", items=[str(n) for n in range(len(chunks))],
            per_task=1,
            spec_for=lambda round_number, groups: {
                "kind": "probe", "work_dir": str(work_dir), "media_root": media.location,
                "tasks": [items[slice(*bounds[int(group[0])])] for group in groups],
                "chunks": [int(group[0]) for group in groups], "limits": _limits(config.limits),
                "num_workers": max(1, launcher.array_cpus_per_task), "needs": needs},
            result_of=lambda chunk: _read(array_tasks.probe_result_path(work_dir, int(chunk))),
            env=task_env())
        failed = {chunk: outcome for chunk, outcome in outcomes.items() if not outcome.ok}
        if failed:
            raise dg.Failure(
                description=f"dataset_manifest: {len(failed)} of {len(chunks)} probe chunk(s) failed after every "
                            f"round; no manifest was written:\n- " + "\n- ".join(
                                f"chunk {chunk} ({chunks[int(chunk)][0].uri} .. {chunks[int(chunk)][-1].uri}): "
                                f"{outcome.failure_class}: {outcome.reason}" for chunk, outcome in failed.items()),
                allow_retries=False, metadata={"failed_chunks": ", ".join(failed)})
        results = {}
        for chunk in range(len(chunks)):
            record = outcomes[str(chunk)].result or {}
            for uri, values in (record.get("results") or {}).items():
                results[uri] = probe.ProbeResult(**values)
        nodes: dict[str, int] = {}
        for outcome in outcomes.values():
            node = str((outcome.result or {}).get("node", "none"))
            nodes[node] = nodes.get(node, 0) + 1
        context.log.info(f"dataset_manifest: {len(results)} probe result(s) merged from {len(chunks)} task(s); "
                         f"chunks per node: {nodes}")
        return results

    return prober


def _listed_item(item: Any) -> dict[str, Any]:
    """A listed object for a task: the device number left out of its identity (it differs between
    the clients of one network filesystem; inode, size and times do not)."""
    from dataclasses import asdict

    values = asdict(item)
    values["identity"] = [None, *list(item.identity)[1:]] if item.identity else []
    return values


def _limits(limits: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(limits)
