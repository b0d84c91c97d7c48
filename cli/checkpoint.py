"""``trainyard checkpoint``: list a run's checkpoints, verify one, sign old ones, outside Dagster.

    trainyard checkpoint list RUN_DIR [--verify] [--hmac-key-env VAR] [--json]
    trainyard checkpoint verify CHECKPOINT_DIR [--hmac-key-env VAR] [--run-id ID] [--json]
    trainyard checkpoint sign RUN_DIR|CHECKPOINT_DIR [--hmac-key-env VAR] [--run-id ID] [--json]

``sign`` is the migration path for checkpoints committed unsigned (before records were signed
by default), which resume refuses once a key exists: it re-hashes every file against the record,
loads ``.metadata`` through the allowlist, and signs only what passes (a run folder: each of its
step dirs; quarantined ones are left alone). A record that is already signed is checked, never
re-signed. Sign only checkpoints you know your own runs wrote: the signature vouches for them.

Exit codes: 0 OK; 1 a checkpoint fails verification (each failing file is named; for ``list
--verify``, any step dir of the run; for ``sign``, any checkpoint it refused); 2 bad path, usage
or key. The signing key comes from the
variable named by --hmac-key-env, else the configured key ($TRAINYARD_CHECKPOINT_HMAC_KEY, else
the key file under the Trainyard home); it is never printed. A signed record checked without
any key fails by name.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

from ops.checkpoints import store as store

EXIT_OK, EXIT_CHECK_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``checkpoint list``, ``verify`` and ``sign`` to the ``trainyard`` parser."""
    commands = subparsers.add_parser("checkpoint", help="list, verify and sign training checkpoints").add_subparsers(
        dest="checkpoint_command", required=True)
    listing = commands.add_parser("list", help="committed, known-good and incomplete checkpoints of a run")
    listing.add_argument("run_dir", type=Path, help="the run folder (holding checkpoints/)")
    listing.add_argument("--verify", action="store_true", help="re-hash every file (slow on big checkpoints)")
    listing.add_argument("--hmac-key-env", metavar="VAR",
                         help="environment variable holding the signing key (implies --verify; "
                              "default: the configured key)")
    listing.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    listing.set_defaults(handler=_refusing_damaged_records(_list))
    check = commands.add_parser("verify", help="re-hash a checkpoint against its COMMITTED.json; exit 1 on failure")
    check.add_argument("checkpoint_dir", type=Path, help="a checkpoint folder, e.g. RUN/checkpoints/step_000100")
    check.add_argument("--hmac-key-env", metavar="VAR",
                       help="environment variable holding the signing key (default: the configured key)")
    check.add_argument("--run-id", help="refuse a checkpoint whose lineage names another run")
    check.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    check.set_defaults(handler=_refusing_damaged_records(_verify))
    signing = commands.add_parser("sign", help="sign checkpoints committed unsigned, after verifying every file")
    signing.add_argument("path", type=Path, help="a run folder (signs each step dir) or one checkpoint folder")
    signing.add_argument("--hmac-key-env", metavar="VAR",
                         help="environment variable holding the signing key (default: the configured key, "
                              "created under the Trainyard home if there is none, as a training run would)")
    signing.add_argument("--run-id", help="refuse a checkpoint whose lineage names another run")
    signing.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    signing.set_defaults(handler=_refusing_damaged_records(_sign))


def _error(message: str) -> int:
    print(f"trainyard: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _hmac_key(var: str | None) -> tuple[bytes | None, str]:
    """(key, "") or (None, why not): $var for --hmac-key-env, else the configured key (maybe None)."""
    if var is None:
        try:
            return store.configured_key(), ""
        except store.SigningKeyError as error:
            return None, str(error)
    value = os.environ.get(var, "")
    return (value.encode(), "") if value else (None, f"environment variable {var} is not set "
                                                     "(it should hold the signing key)")


def _failed(info: store.CheckpointInfo) -> bool:
    """A step dir that is corrupt or failed verification (hidden tmp/deleting dirs never count)."""
    return not info.is_hidden and info.status != store.STATUS_COMMITTED


def _taint(run_dir: Path) -> dict | None:
    """The run's rights state, derived from the ledger of the data root it lies in (ops.curation.erasure)."""
    from ops.curation import erasure

    run_dir = Path(run_dir).resolve()
    if run_dir.parent.name not in ("runs", "drills") and run_dir.parent.parent.name != "drills":
        return None  # a run folder outside a data root: no ledger speaks of it
    data_root = run_dir.parent.parent if run_dir.parent.name in ("runs", "drills") else run_dir.parent.parent.parent
    try:
        return erasure.run_taint(data_root, run_dir)
    except (OSError, ValueError, RuntimeError) as error:  # a ledger that cannot be trusted: say so, never "clean"
        return {"state": "unknown", "assets": [], "how": f"the rights ledger cannot be read: {error}"}


def _data_root_of(run_dir: Path) -> Path | None:
    run_dir = Path(run_dir).resolve()
    if run_dir.parent.name == "runs":
        return run_dir.parent.parent
    return None


def _reproductions(run_dir: Path, infos: list[store.CheckpointInfo]) -> dict[int, dict]:
    """Step -> the newest reproduction of that checkpoint (ops/drills/replay.py), when it is still the checkpoint
    that was reproduced (a mark of a checkpoint replaced since, by a rollback or another save, is left out)."""
    from ops.drills.replay import read_marks
    from ops.drills.reproduce import data_files_digest

    data_root = _data_root_of(run_dir)
    marks = read_marks(data_root, Path(run_dir).name) if data_root is not None else {}
    found = {}
    for info in infos:
        mark = marks.get(info.step)
        if mark is None or info.is_hidden:
            continue
        try:
            digest = data_files_digest(store.read_record(info.path)["files"])
        except (OSError, ValueError, KeyError, store.CheckpointRecordCorrupt):
            continue
        if mark.get("data_digest") == digest:
            found[info.step] = mark
    return found


def _reproduction_flag(mark: dict | None) -> str:
    if mark is None:
        return ""
    if mark.get("status") != "reproduced":
        return f"NOT-REPRODUCED({mark.get('status')})"
    return "reproduced" if mark.get("rule") in (None, "bit_identical") else f"reproduced({mark['rule']})"


def _list(args: argparse.Namespace) -> int:
    if not args.run_dir.is_dir():
        return _error(f"{args.run_dir} is not a directory")
    key, problem = _hmac_key(args.hmac_key_env)
    if problem:
        return _error(problem)
    verifying = args.verify or args.hmac_key_env is not None
    infos = store.list_checkpoints(args.run_dir, verify_files=verifying, hmac_key=key)
    taint = _taint(args.run_dir)
    rights_state = taint["state"] if taint else "clean"
    reproductions = _reproductions(args.run_dir, infos)
    if args.json:
        print(json.dumps({"run_dir": str(args.run_dir), "latest": store.read_latest(args.run_dir),
                          "rights": taint or {"state": "clean"},
                          "checkpoints": [{"name": i.name, "step": i.step, "status": i.status,
                                           "known_good": i.known_good, "latest": i.is_latest,
                                           "rights_state": rights_state, "reason": i.reason,
                                           "reproduction": reproductions.get(i.step)} for i in infos]}))
    else:
        counts = {status: sum(i.status == status for i in infos)
                  for status in (store.STATUS_COMMITTED, store.STATUS_INCOMPLETE, store.STATUS_CORRUPT)}
        print(f"{store.checkpoints_dir(args.run_dir)}: " + ", ".join(f"{n} {s}" for s, n in counts.items())
              + f"; latest -> {store.read_latest(args.run_dir) or 'none'}")
        if taint:
            print(f"  rights: {taint['state'].upper()}: {taint['how']} "
                  f"({', '.join(asset[:12] for asset in taint['assets'])}); a stage refuses it as a parent without "
                  "rights.accept_tainted")
        for info in infos:
            reproduction = _reproduction_flag(reproductions.get(info.step))
            flags = ",".join(flag for flag, on in (("known-good", info.known_good), ("latest", info.is_latest),
                                                   ("tainted", rights_state == "tainted"),
                                                   (reproduction, bool(reproduction))) if on)
            reason = f"  ({info.reason})" if info.reason else ""
            if reproduction.startswith("NOT"):
                reason += f"  (reproduction: {reproductions[info.step].get('reason')})"
            print(f"  {info.step:>9}  {info.status:<10}  {flags:<28}  {info.name}{reason}")
    failed = [info.name for info in infos if _failed(info)]
    if failed:  # a listing that shows damage must not exit like one that shows none
        print(f"trainyard: {len(failed)} checkpoint(s) failed: {', '.join(failed)}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    if not args.checkpoint_dir.is_dir():
        return _error(f"{args.checkpoint_dir} is not a directory")
    key, problem = _hmac_key(args.hmac_key_env)
    if problem:
        return _error(problem)
    report = store.verify(args.checkpoint_dir, key, args.run_id)
    if args.json:
        print(json.dumps({"ok": report.ok, "checkpoint_dir": str(args.checkpoint_dir),
                          "problems": [{"file": name, "problem": why} for name, why in report.problems],
                          "summary": _summary(report.record) if report.record else None}))
    elif report.ok:
        print(f"OK {args.checkpoint_dir}")
        for name, value in _summary(report.record).items():
            print(f"  {name:<18} {value}")
        if not report.signature_checked:
            print("  (unsigned and no signing key configured: the sha256 of every file matched, "
                  "but who wrote the record is not proven)")
    else:
        print(f"FAIL {args.checkpoint_dir}")
        for name, why in report.problems:
            print(f"  {name}: {why}")
    return EXIT_OK if report.ok else EXIT_CHECK_FAILED


def _signing_key(var: str | None) -> tuple[bytes | None, str]:
    """(key, "") or (None, why not): $var, else the configured key, created if none (as a save does)."""
    if var is not None:
        return _hmac_key(var)
    try:
        return store.signing_key(), ""
    except store.SigningKeyError as error:
        return None, str(error)


def _checkpoints_to_sign(path: Path) -> list[Path] | None:
    """The step dirs under a run folder, or ``path`` itself when it is a checkpoint; None if neither."""
    if (path / store.RECORD_NAME).exists() or store.checkpoint_step(path.name) is not None:
        return [path]
    if store.checkpoints_dir(path).is_dir():
        return [info.path for info in store.list_checkpoints(path) if not info.is_hidden]
    return None


def _sign(args: argparse.Namespace) -> int:
    if not args.path.is_dir():
        return _error(f"{args.path} is not a directory")
    targets = _checkpoints_to_sign(args.path)
    if targets is None:
        return _error(f"{args.path} is neither a checkpoint folder (holding {store.RECORD_NAME}) "
                      "nor a run folder (holding checkpoints/)")
    key, problem = _signing_key(args.hmac_key_env)
    if problem:
        return _error(problem)
    outcomes = [store.sign_unsigned(target, key, args.run_id) for target in targets]
    if args.json:
        print(json.dumps({"path": str(args.path), "checkpoints": [
            {"checkpoint_dir": str(o.checkpoint_dir), "action": o.action,
             "problems": [{"file": name, "problem": why} for name, why in o.problems]} for o in outcomes]}))
    else:
        for outcome in outcomes:
            print(f"{outcome.action.upper().replace('_', ' ')} {outcome.checkpoint_dir}")
            for name, why in outcome.problems:
                print(f"  {name}: {why}")
        if not outcomes:
            print(f"{args.path}: no checkpoints to sign")
    return EXIT_CHECK_FAILED if any(o.action == store.SIGN_REFUSED for o in outcomes) else EXIT_OK


def _summary(record: dict) -> dict[str, object]:
    content, lineage = record.get("content", {}), record.get("lineage", {})
    created = datetime.datetime.fromtimestamp(record["created_unix_s"], tz=datetime.UTC)
    return {"step": record["step"], "world_size": record["world_size"], "run_id": lineage.get("run_id"),
            "created_utc": created.isoformat(timespec="seconds"),
            "files": len(record["files"]),
            "size_bytes": sum(entry["size_bytes"] for entry in record["files"].values()),
            "model_fingerprint": record["model_fingerprint"],
            "signed": "signature" in record,
            "progress": content.get("progress"), "references": content.get("references")}


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m cli.checkpoint``), same commands as ``trainyard checkpoint``."""
    parser = argparse.ArgumentParser(prog="trainyard")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.handler(args)


def _refusing_damaged_records(handler):
    """A run's record that cannot be read (a truncated KNOWN_GOOD.json, a ``latest`` file naming no
    checkpoint) ends the command with exit 2 and the file's name, never a traceback."""
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except store.CheckpointRecordCorrupt as error:
            return _error(f"damaged checkpoint record: {error}")
    return run



if __name__ == "__main__":
    sys.exit(main())
