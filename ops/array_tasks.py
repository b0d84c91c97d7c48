"""Data work as array tasks: what one task of a SLURM array job runs (resources/slurm_array.py submits
the jobs, assets/clips.py and assets/data.py cut the work).

A backfill of ``clip_shards`` partitions, or the probing of a large listing, is cut into tasks. Task
``i`` of a job reads the job's spec (``spec.json``, written by the Dagster step on the filesystem the
nodes share) and does its share::

    python -m ops.array_tasks --spec WORK/round-1/spec.json --task "$SLURM_ARRAY_TASK_ID" --offset 0

- ``shards``: each of its partitions through ``ops.clips.shards.write_shard``: the same atomic,
  digest-checked publish as a local run, so a shard is byte-identical wherever it was cut. One result
  file per partition (``results/<partition>.json``) as soon as that partition is published, so the
  partitions a task finished before its node was lost are kept.
- ``probe``: its chunk of the listing through ``ops.curation.manifest.probe_listed``; one result
  file per task, holding every object of the chunk (the step merges them in listing order).

Before any work the task checks what it needs (``check_needs``): the media root, the data root (and
that it may write there) and the credentials' variables (names only, never values). A missing piece
is every item's result, ``refused``, naming the setting; the step checks the same before it submits.

SIGTERM (scancel, the job's time limit, the warning signal) becomes SystemExit, so the shard being
written removes its staging file on the way out; a SIGKILL after KillWait leaves a staging file named
after its job (``write_shard``'s ``tmp_tag``), which the step removes once the job has left the queue.

Logs and progress reach the Dagster run through Pipes when the job carries a Pipes context
(``DAGSTER_PIPES_CONTEXT``); they also go to the task's own log file.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from ops.publish.durable import write_json_atomic

SPEC_FILE = "spec.json"
RESULTS = "results"
KINDS = ("shards", "probe")
# Result classes of one item (a partition, or a probe chunk).
OK, ERROR, REFUSED = "ok", "error", "refused"


def results_dir(work_dir: str | Path) -> Path:
    return Path(work_dir) / RESULTS


def partition_result_path(work_dir: str | Path, partition: str) -> Path:
    return results_dir(work_dir) / f"{partition}.json"


def probe_result_path(work_dir: str | Path, chunk: int) -> Path:
    return results_dir(work_dir) / f"probe-chunk-{chunk:06d}.json"


def write_spec(path: Path, spec: Mapping[str, Any]) -> Path:
    if spec.get("kind") not in KINDS:
        raise ValueError(f"spec kind {spec.get('kind')!r} is not one of {KINDS}")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, spec)
    return path


def check_needs(needs: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> list[str]:
    """What a task needs that it does not have, each naming its setting.

    ``needs``: {"paths": {setting: folder or URL}, "writable": {setting: folder}, "env": {name: what}}.
    A URL needs the object store's variables; a folder must exist (on the node: the shared filesystem)."""
    environ = os.environ if environ is None else environ
    problems = []
    for setting, location in (needs.get("paths") or {}).items():
        location = str(location)
        if "://" in location and not location.startswith("file://"):
            missing = [name for name in ("TRAINYARD_S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
                       if not environ.get(name)] if location.startswith("s3://") else []
            if missing:
                problems.append(f"{setting} is {location}, but {', '.join(missing)} is not set where the task runs")
        elif not Path(location.removeprefix("file://")).is_dir():
            problems.append(f"{setting}: {location} is not a folder on {socket.gethostname()} (is it on the "
                            f"filesystem every node mounts?)")
    for setting, folder in (needs.get("writable") or {}).items():
        path = Path(str(folder))
        probe_at = next((parent for parent in (path, *path.parents) if parent.exists()), None)
        if probe_at is None or not os.access(probe_at, os.W_OK | os.X_OK):
            problems.append(f"{setting}: {folder} cannot be written on {socket.gethostname()}")
    for name, what in (needs.get("env") or {}).items():
        if not environ.get(name):
            problems.append(f"{name} ({what}) is not set where the task runs")
    return problems


# ---- the task ----

class _Log:
    """Lines to the task's log (stdout) and, when the job carries a Pipes context, to the Dagster run."""

    def __init__(self, pipes: Any | None, prefix: str) -> None:
        self.pipes, self.prefix = pipes, prefix

    def __call__(self, message: str, *, warning: bool = False) -> None:
        line = f"{self.prefix} {message}"
        print(line, flush=True)
        if self.pipes is not None:
            (self.pipes.log.warning if warning else self.pipes.log.info)(line)


@contextmanager
def _pipes(task: int) -> Iterator[Any | None]:
    """The job's Pipes session, with this task's own message file (resources.slurm_array.TaskMessagesReader)."""
    if not os.environ.get("DAGSTER_PIPES_CONTEXT") or not os.environ.get("DAGSTER_PIPES_MESSAGES"):
        yield None
        return
    from dagster_pipes import decode_param, encode_param, open_dagster_pipes

    params = decode_param(os.environ["DAGSTER_PIPES_MESSAGES"])
    if isinstance(params, dict) and "{task}" in str(params.get("path", "")):
        os.environ["DAGSTER_PIPES_MESSAGES"] = encode_param({**params, "path": params["path"].format(
            task=os.environ.get("SLURM_ARRAY_TASK_ID", task))})
    with open_dagster_pipes() as pipes:
        yield pipes


def _on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _common(spec: Mapping[str, Any], task: int) -> dict[str, Any]:
    return {"node": socket.gethostname(), "job_id": os.environ.get("SLURM_ARRAY_JOB_ID", os.environ.get("SLURM_JOB_ID", "")),
            "task": task, "round": spec.get("round", 1), "pid": os.getpid()}


def run_task(spec_path: str | Path, task: int) -> int:
    """Task ``task`` of the spec; 0 when every item has its result written (ok or failed), 2 when refused."""
    spec_path = Path(spec_path)
    spec = json.loads(spec_path.read_text())
    work_dir = Path(spec["work_dir"])
    tasks = spec["tasks"]
    if not 0 <= task < len(tasks):
        print(f"[trainyard] task {task} is not in {spec_path} ({len(tasks)} tasks)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)
    common = _common(spec, task)
    with _pipes(task) as pipes:
        log = _Log(pipes, f"[task {task} on {common['node']}]")
        problems = check_needs(spec.get("needs") or {})
        if problems:
            for problem in problems:
                log(f"refused: {problem}", warning=True)
            _refuse(spec, task, "; ".join(problems), common)
            return 2
        if spec["kind"] == "shards":
            _run_shards(spec, tasks[task], work_dir, common, log)
        else:
            _run_probe(spec, task, tasks[task], work_dir, common, log)
    return 0


def _refuse(spec: Mapping[str, Any], task: int, reason: str, common: Mapping[str, Any]) -> None:
    now = time.time()
    if spec["kind"] == "shards":
        for partition in spec["tasks"][task]:
            write_json_atomic(partition_result_path(spec["work_dir"], partition),
                              {**common, "partition": partition, "class": REFUSED, "reason": reason,
                               "started_at": now, "ended_at": now})
    else:
        write_json_atomic(probe_result_path(spec["work_dir"], spec["chunks"][task]),
                          {**common, "chunk": spec["chunks"][task], "class": REFUSED, "reason": reason,
                           "started_at": now, "ended_at": now, "results": {}})


def _run_shards(spec: Mapping[str, Any], partitions: Sequence[str], work_dir: Path, common: Mapping[str, Any],
                log: Callable[..., None]) -> None:
    from ops.clips import shards
    from ops.clips.plan import read_plan

    plan = read_plan(Path(spec["plan_dir"]))
    tag = f"j{common['job_id']}" if str(common["job_id"]).isdigit() else ""
    for number, partition in enumerate(partitions, 1):
        started = time.time()
        record: dict[str, Any] = {**common, "partition": partition, "started_at": started}
        try:
            result = shards.write_shard(plan, partition, spec["media_root"], spec["out_dir"], tmp_tag=tag)
        except (OSError, ValueError, RuntimeError) as error:  # named, with its partition; the others go on
            record |= {"class": ERROR, "reason": f"{type(error).__name__}: {error}", "ended_at": time.time()}
            write_json_atomic(partition_result_path(work_dir, partition), record)
            log(f"{partition} failed: {record['reason']}", warning=True)
            continue
        record |= shard_record(result)
        write_json_atomic(partition_result_path(work_dir, partition), record)
        log(f"{partition} written ({number}/{len(partitions)} of this task): {result.num_samples} clips, "
            f"{result.size_bytes / 1e6:.2f} MB in {record['ended_at'] - started:.2f} s"
            + (f", {len(result.failures)} clip(s) refused" if result.failures else ""))


def shard_record(result: Any) -> dict[str, Any]:
    """What a written shard's result holds (ops.clips.shards.ShardResult), wherever it was written: the
    array task's result file and the local path's record are the same fields."""
    return {"class": OK, "reason": "", "sha256": result.sha256, "path": str(result.path),
            "size_bytes": result.size_bytes, "num_samples": result.num_samples, "failures": result.failures,
            "decode_s": round(result.decode_s, 4), "encode_s": round(result.encode_s, 4),
            "bytes_read": result.bytes_read, "bytes_written": result.size_bytes, "num_frames": result.num_frames,
            "ended_at": time.time()}


def write_shards_here(plan: Any, partitions: Sequence[str], media_root: str, out_dir: str,
                      log: Callable[..., None] = lambda message, warning=False: None) -> dict[str, dict[str, Any]]:
    """The local path: each partition written in this process, one record each (as a task's)."""
    from ops.clips import shards

    records = {}
    for partition in partitions:
        started = time.time()
        record: dict[str, Any] = {"node": socket.gethostname(), "job_id": "", "task": -1, "round": 1,
                                  "pid": os.getpid(), "partition": partition, "started_at": started}
        try:
            result = shards.write_shard(plan, partition, media_root, out_dir)
        except (OSError, ValueError, RuntimeError) as error:
            record |= {"class": ERROR, "reason": f"{type(error).__name__}: {error}", "ended_at": time.time()}
            log(f"{partition} failed: {record['reason']}", warning=True)
        else:
            record |= shard_record(result)
        records[partition] = record
    return records


def _run_probe(spec: Mapping[str, Any], task: int, items: Sequence[Mapping[str, Any]], work_dir: Path,
               common: Mapping[str, Any], log: Callable[..., None]) -> None:
    from ops.curation.manifest import probe_listed
    from ops.media import probe, scan
    from ops.media.roots import open_root

    started = time.time()
    names = {field.name for field in fields(scan.ListedFile)}
    targets = [scan.ListedFile(**{key: (tuple(value) if key == "identity" else value)
                                  for key, value in item.items() if key in names}) for item in items]
    results = probe_listed(open_root(spec["media_root"]), targets, probe.ProbeLimits(**spec["limits"]),
                           num_workers=int(spec.get("num_workers", 1)))
    chunk = spec["chunks"][task]
    write_json_atomic(probe_result_path(work_dir, chunk), {
        **common, "chunk": chunk, "class": OK, "reason": "", "started_at": started, "ended_at": time.time(),
        "results": {uri: asdict(result) for uri, result in results.items()}})
    flagged = sum(result.error is not None for result in results.values())
    log(f"probe chunk {chunk}: {len(results)} object(s) probed, {flagged} flagged, in {time.time() - started:.2f} s")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", required=True)
    parser.add_argument("--task", type=int, required=True, help="the array task id ($SLURM_ARRAY_TASK_ID)")
    parser.add_argument("--offset", type=int, default=0, help="added to --task: where this array job's tasks start")
    args = parser.parse_args(argv)
    return run_task(args.spec, args.offset + args.task)


if __name__ == "__main__":
    sys.exit(main())
