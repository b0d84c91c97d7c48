"""``trainyard reproduce``: rebuild a checkpoint from its signed record and compare (ops/drills/replay.py).

    trainyard reproduce CHECKPOINT_DIR|STORE_URL [--world-size N] [--repo PATH] [--keep-worktree] [--json]
    trainyard reproduce --run RUN [...]      # the newest committed checkpoint of run RUN (a name or a folder)

Prints a readable summary (``--json``: one JSON object, the same report) and marks the checkpoint
(``trainyard checkpoint list`` shows it). Exit codes: 0 reproduced; 1 reproduced and it differs (the
first thing that differs is named: environment, a data digest, the first step whose loss differs, the
tensor that differs most); 2 refused before anything was compared (bad input, an unsigned or dirty
record, a commit not in the repository, revoked data, an environment that cannot be rebuilt, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EXIT_OK, EXIT_DIFFERS, EXIT_REFUSED = 0, 1, 2


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("reproduce", help="rebuild a checkpoint from its record alone and compare")
    parser.add_argument("checkpoint", nargs="?", help="a committed checkpoint folder, or its URL in a checkpoint store")
    parser.add_argument("--run", help="the newest committed checkpoint of this run (its name under the data root's "
                                      "runs/, or its folder)")
    parser.add_argument("--world-size", type=int, help="ranks of the re-run (default: the recorded world size; "
                                                       "another one is judged by the restore drill's rules)")
    parser.add_argument("--repo", type=Path, help="git repository holding the recorded commit (default: this checkout)")
    parser.add_argument("--keep-worktree", action="store_true", help="keep the checkout of the recorded commit")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for each build or re-run")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.set_defaults(handler=_reproduce)


def _refused(message: str) -> int:
    print(f"trainyard: refused: {message}", file=sys.stderr)
    return EXIT_REFUSED


def _checkpoint(args: argparse.Namespace, data_root: Path, work: Path) -> Path:
    """The local checkpoint folder to reproduce (a store URL or a run's newest is fetched or found)."""
    from ops.checkpoints import store
    from ops.checkpoints.mirror import CheckpointMirror
    from ops.drills.reproduce import ReproductionError
    from ops.publish import objstore

    if args.run:
        run_dir = Path(args.run) if "/" in args.run else data_root / "runs" / args.run
        mirror = CheckpointMirror.for_run(run_dir.name, keep_last_k=1, keep_every_m=0)
        if run_dir.is_dir():
            committed = [info for info in store.list_checkpoints(run_dir) if info.status == store.STATUS_COMMITTED]
            if committed:
                return committed[-1].path
        if mirror is not None:
            try:
                committed = mirror.committed()
                if committed:
                    return mirror.fetch(committed[-1].name, work).path
            except objstore.ObjectStoreError as error:  # VersionRefused too: the store's copy is not what it says
                raise ReproductionError("record", f"run {args.run}: the checkpoint store {mirror.url}: {error}") \
                    from error
        raise ReproductionError("record", f"run {args.run}: no committed checkpoint in {run_dir}"
                                          + (f" or {mirror.url}" if mirror is not None else ""))
    location = str(args.checkpoint)
    if objstore.is_remote(location):
        parent, name = location.rstrip("/").rsplit("/", 1)
        try:
            return CheckpointMirror(parent, keep_last_k=1, keep_every_m=0).fetch(name, work).path
        except objstore.ObjectStoreError as error:  # VersionRefused too: the store's copy is not what it says
            raise ReproductionError("record", f"{location}: {error}") from error
    return Path(location)


def _reproduce(args: argparse.Namespace) -> int:
    import tempfile

    from ops.checkpoints import store
    from ops.drills.replay import Options, reproduce
    from ops.drills.reproduce import ReproductionError
    from ops.publish import paths

    if bool(args.checkpoint) == bool(args.run):
        return _refused("name one checkpoint (a folder or a store URL), or --run RUN")
    if args.world_size is not None and args.world_size < 1:
        return _refused(f"--world-size must be >= 1, got {args.world_size}")
    data_root = paths.data_root()
    repo = (args.repo or paths.REPO_ROOT).resolve()
    with tempfile.TemporaryDirectory(prefix="trainyard-reproduce-") as fetched:
        try:
            checkpoint = _checkpoint(args, data_root, Path(fetched))
        except (ReproductionError, OSError, store.CheckpointRecordCorrupt) as error:
            if args.json:
                print(json.dumps({"status": "refused", "passed": False, "kind": "record", "reason": str(error)}))
            return _refused(str(error))
        try:
            report = reproduce(checkpoint, Options(repo=repo, data_root=data_root, home=paths.trainyard_home(),
                                                   world_size=args.world_size, timeout_s=args.timeout,
                                                   keep=args.keep_worktree))
        except OSError as error:  # the reproductions folder cannot be written (a full disk, no permission)
            return _refused(f"the reproduction's folder under {data_root} cannot be written: {error}")
    if args.json:
        print(json.dumps(report, sort_keys=True, default=str))
    else:
        print(summary(report))
    if report["status"] == "refused":
        print(f"trainyard: refused ({report['kind']}): {report['reason']}", file=sys.stderr)
        return EXIT_REFUSED
    return EXIT_OK if report["passed"] else EXIT_DIFFERS


def summary(report: dict) -> str:
    """The report as a few readable lines."""
    head = {"reproduced": "REPRODUCED", "failed": "DIFFERS", "refused": "REFUSED"}[report["status"]]
    lines = [f"{head} {report.get('run_id', '?')} step {report.get('step', '?')} ({report['checkpoint']})"]
    if report.get("commit"):
        lines.append(f"  commit       {report['commit']}")
    environment = report.get("environment")
    if environment:
        lines.append(f"  environment  {environment['how']}" + (
            f"; differs here: {'; '.join(environment['differences'][:5])}" if environment["differences"] else ""))
    if report.get("data"):
        lines.append(f"  data         {report['data']['how']}: {report['data']['path']}")
    if report.get("parent"):
        lines.append(f"  parent       {report['parent']['how']}: {report['parent']['path']}")
    comparison = report.get("comparison")
    if comparison:
        lines.append(f"  rule         {comparison['rule']} ({comparison['rule_why']})")
        lines.append(f"  compared     {comparison['steps_compared']} losses, {comparison['tensors_compared']} tensors; "
                     f"{comparison['tensors_differing']} differ" + (
                         f", most: {comparison['most_different_tensor']} ({comparison['max_tensor_abs_diff']:.3e})"
                         if comparison["most_different_tensor"] else ""))
    label = "why" if report["status"] != "reproduced" else "result"
    lines.append(f"  {label:<12} {report['reason']}" if report.get("reason") else "")
    lines.append(f"  report       {report['reproduction_dir']}/reproduction.json ({report['wall_s']} s)")
    return "\n".join(line for line in lines if line)
