"""Reproduce a committed checkpoint from its signed record alone (``trainyard reproduce``, the
``reproduction`` asset; docs/lineage.md, "Reproducing a checkpoint").

    report = reproduce("/data/runs/pretrain-ab12/checkpoints/step_000020", Options(repo=REPO_ROOT, data_root=data))

The steps, each refusing by kind (``ReproductionError.kind``) before anything is claimed:

1. ``record``: the checkpoint verifies against its signed record (every reader's check); an unsigned
   record is refused, as is one whose environment list does not hash to its own ``env_digest``.
   ``missing``: a record written before reproduction records names what it lacks.
2. ``dirty`` / ``commit``: the recorded commit, clean, checked out in a temporary git worktree.
3. ``environment``: this interpreter's environment when its digest is the recorded one; else one
   built under ``<home>/envs/<digest>`` from the recorded freeze (and checked against the digest);
   the packages that differ are named either way.
4. ``data`` / ``rights``: the recorded shard set where it lies (every shard's sha256 checked), else
   rebuilt from the validated manifest by the recorded commit's shard code (ops/drills/rebuild_shards.py)
   and checked byte for byte; an asset the rights ledger revokes now is never written again.
5. ``parent``: the parent checkpoint where it was, or a passing reproduction of it, by its data digest.
6. ``run``: the stage again from its parent or from scratch, with the recorded config, from the worktree,
   on the recorded world size (or another: the restore drill's rules).
7. The rebuilt checkpoint against the recorded one (ops/drills/reproduce.py): bit-identical on CPU,
   the record's numerics rule elsewhere; the first differing loss step and the most different tensor.

Each result (and each refusal) is written to ``<data>/reproductions/<id>/reproduction.json`` and marks
the checkpoint in ``<data>/reproductions/marks/<run>/step_<N>.json`` (`read_marks`), which
``trainyard checkpoint list`` and the stage pages show.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ops import lineage, process_tree
from ops.checkpoints import store
from ops.publish.hashing import canonical_json
from ops.drills.reproduce import (
    Recorded, ReproductionError, Rule, data_files_digest, package_differences, recorded_inputs, revoked_in_data,
    shard_set_problems)

ENVS_DIR = "envs"
_PIN = re.compile(r"[a-z0-9][a-z0-9.-]*==[A-Za-z0-9.+!_-]+")
_TRAIN_LOG_TAIL = 2000


@dataclass(kw_only=True, slots=True)
class Options:
    repo: Path
    """The git repository holding the recorded commit."""
    data_root: Path
    """The data root: validated manifests, shard sets, the rights ledger, reproductions."""
    home: Path | None = None
    """The Trainyard home (rebuilt environments under ``envs/``); default: the data root's parent."""
    world_size: int | None = None
    """Ranks of the re-run; None: the recorded world size."""
    timeout_s: float = 3600.0
    keep: bool = False
    """Keep the worktree (for a look at the code that ran); the re-run's folder is always kept."""
    log: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr, flush=True))


def reproductions_root(data_root: Path) -> Path:
    return Path(data_root) / "reproductions"


def mark_path(data_root: Path, run_id: str, step: int) -> Path:
    return reproductions_root(data_root) / "marks" / run_id / f"{store.step_dir_name(step)}.json"


def _mark_signature(mark: dict[str, Any], key: bytes) -> str:
    unsigned = {name: value for name, value in mark.items() if name != "signature"}
    return hmac.new(key, canonical_json(unsigned).encode(), hashlib.sha256).hexdigest()


def read_marks(data_root: Path, run_id: str) -> dict[int, dict[str, Any]]:
    """Step -> the newest reproduction result of that checkpoint of ``run_id``. Marks are signed with the
    checkpoint key: an unreadable, unsigned or edited mark is reported as ``unknown``, never as reproduced."""
    marks: dict[int, dict[str, Any]] = {}
    key = store.configured_key()
    for path in sorted((reproductions_root(data_root) / "marks" / run_id).glob("step_*.json")):
        step = store.checkpoint_step(path.stem)
        if step is None:
            continue
        try:
            mark = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            marks[step] = {"status": "unknown", "reason": f"{path} is unreadable: {error}"}
            continue
        signature = mark.get("signature") if isinstance(mark, dict) else None
        if key is None or not isinstance(signature, str) or not hmac.compare_digest(signature,
                                                                                     _mark_signature(mark, key)):
            marks[step] = {"status": "unknown", "data_digest": mark.get("data_digest") if isinstance(mark, dict) else None,
                           "reason": f"{path}: the mark's signature does not verify (edited, or another key)"}
            continue
        marks[step] = mark
    return marks


def reproduce(checkpoint: str | Path, options: Options) -> dict[str, Any]:
    """Reproduce ``checkpoint`` (a committed checkpoint folder); returns the report (``passed`` and why).

    A refusal is a report too (``status: refused``, ``kind``, ``reason``): nothing is compared, nothing claimed."""
    started = time.time()
    options.data_root, options.repo = Path(options.data_root).resolve(), Path(options.repo).resolve()
    checkpoint = Path(checkpoint).resolve()
    work = reproductions_root(options.data_root) / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    work.mkdir(parents=True)
    report: dict[str, Any] = {"checkpoint": str(checkpoint), "reproduction_dir": str(work),
                              "started_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    recorded: Recorded | None = None
    try:
        recorded = _read(Path(checkpoint), options)
        report |= {"run_id": recorded.run_id, "step": recorded.step, "stage": recorded.lineage.get("stage"),
                   "commit": recorded.lineage.get("git_commit"), "world_size": recorded.world_size,
                   "notes": recorded.notes}
        report |= _replay(recorded, work, options, report)
        report["status"] = "reproduced" if report["passed"] else "failed"
    except ReproductionError as error:
        report |= {"status": "refused", "passed": False, "kind": error.kind, "reason": str(error)}
    except Exception as error:  # noqa: BLE001 - a full disk, a torch error while reading: reported, never claimed
        report |= {"status": "refused", "passed": False, "kind": "error", "reason": f"{type(error).__name__}: {error}"}
    report["wall_s"] = round(time.time() - started, 2)
    (work / "reproduction.json").write_text(json.dumps(report, indent=1, sort_keys=True, default=str))
    if recorded is not None:
        _mark(options.data_root, recorded, report)
    return report


def _mark(data_root: Path, recorded: Recorded, report: dict[str, Any]) -> None:
    path = mark_path(data_root, recorded.run_id, recorded.step)
    path.parent.mkdir(parents=True, exist_ok=True)
    mark = {key: report.get(key) for key in ("status", "passed", "kind", "reason", "first_difference",
                                              "reproduction_dir", "started_utc", "rule", "rerun_checkpoint",
                                              "rerun_run_id")}
    mark["checkpoint"] = str(recorded.checkpoint_dir)
    mark["data_digest"] = data_files_digest(recorded.record["files"])
    # The newest passing reproduction stays known after a later refusal or failure: its rebuilt copy can still
    # stand in for a gone parent (`_parent`), and the mark says when the checkpoint last reproduced.
    previous = read_marks(data_root, recorded.run_id).get(recorded.step, {})
    if report.get("status") == "reproduced":
        mark["last_reproduced"] = {key: report.get(key) for key in ("rerun_checkpoint", "rerun_run_id", "started_utc")}
    elif previous.get("data_digest") == mark["data_digest"] and previous.get("last_reproduced"):
        mark["last_reproduced"] = previous["last_reproduced"]
    mark = json.loads(json.dumps(mark, default=str))
    mark["signature"] = _mark_signature(mark, store.signing_key())
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(mark, indent=1, sort_keys=True))
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# 1. The record


def _read(checkpoint: Path, options: Options) -> Recorded:
    if not (checkpoint / store.RECORD_NAME).is_file():
        raise ReproductionError("record", f"{checkpoint} holds no {store.RECORD_NAME}: not a committed checkpoint")
    key = store.configured_key()
    verified = store.verify(checkpoint, key)
    if not verified.ok:
        raise ReproductionError("record", f"{checkpoint} failed verification, so its record proves nothing: "
                                          f"{verified.summary()}")
    if not verified.signature_checked:
        raise ReproductionError("record", f"{checkpoint}'s record is unsigned (or no signing key is configured): who "
                                          "wrote it is not proven, and a reproduction of a forged record proves "
                                          "nothing; sign it (trainyard checkpoint sign) or configure the key")
    recorded = recorded_inputs(checkpoint, verified.record, data_root=options.data_root)
    if recorded.missing:
        raise ReproductionError("missing", "the record cannot be reproduced; it lacks: " + "; ".join(recorded.missing))
    if recorded.pins is not None and lineage.digest_of_pins(recorded.pins) != recorded.lineage.get("env_digest"):
        raise ReproductionError("record", "the recorded package list does not hash to the recorded env_digest")
    return recorded


# ---------------------------------------------------------------------------------------------
# 2-7


def _replay(recorded: Recorded, work: Path, options: Options, report: dict[str, Any]) -> dict[str, Any]:
    commit = str(recorded.lineage.get("git_commit", "unknown"))
    dirty = recorded.lineage.get("git_dirty")
    if dirty not in ("false", False):
        raise ReproductionError("dirty", (f"the checkpoint was trained from a checkout with uncommitted changes to "
                                          f"commit {commit[:12]}: the code that ran is in no commit, so it cannot be "
                                          "reproduced (commit before training)") if dirty in ("true", True) else
                                f"the record does not say whether the checkout was clean (git_dirty {dirty!r}): "
                                "the code that ran is not proven to be commit " + commit[:12])
    worktree = work / "src"
    _checkout(options.repo, commit, worktree)
    try:
        report["environment"] = environment = _environment(recorded, worktree, options)
        python = environment.pop("python")
        config = json.loads(json.dumps(recorded.config))
        if recorded.shard_set is not None:
            report["data"] = data = _data(recorded, python, worktree, work, options)
            config["data"]["shard_index"] = data["path"]
        if recorded.has_parent:
            report["parent"] = parent = _parent(recorded, options, work)
            _point_at_parent(config, parent)
        world = options.world_size or recorded.world_size
        run_dir = _run(config, recorded, world, python, worktree, work, options)
        report["rerun_dir"] = str(run_dir)
        return _judge(recorded, run_dir, world, options)
    finally:
        if not options.keep:
            _remove_worktree(options.repo, worktree)
        # A set rebuilt beside a damaged one is a copy no erasure would reach (ops.curation.erasure walks
        # <data>/shards): it goes when the reproduction ends; the damaged copy stays as the evidence.
        shutil.rmtree(work / "shards", ignore_errors=True)


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=300, check=False)


def _checkout(repo: Path, commit: str, worktree: Path) -> None:
    if len(commit) != 40 or any(c not in "0123456789abcdef" for c in commit):
        raise ReproductionError("commit", f"the record names commit {commit!r}: not a commit id (trained outside a git "
                                          "checkout?), so there is no code to check out")
    if _git(repo, "cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        raise ReproductionError("commit", f"commit {commit} is not in the repository {repo}: fetch it first "
                                          f"(git -C {repo} fetch origin {commit}), or name the repository that has "
                                          "it (--repo)")
    added = _git(repo, "worktree", "add", "--detach", "--", str(worktree), commit)
    if added.returncode != 0:
        raise ReproductionError("commit", f"git worktree add {commit[:12]} failed: {added.stderr.strip()}")


def _remove_worktree(repo: Path, worktree: Path) -> None:
    if worktree.exists():
        _git(repo, "worktree", "remove", "--force", str(worktree))
        shutil.rmtree(worktree, ignore_errors=True)
    _git(repo, "worktree", "prune")


def _environment(recorded: Recorded, worktree: Path, options: Options) -> dict[str, Any]:
    """The interpreter to re-run with: this one when its environment is the recorded one, else one built
    from the recorded freeze; ReproductionError('environment') when none can be had."""
    wanted = str(recorded.lineage.get("env_digest"))
    here = lineage.environment_pins()
    differences = package_differences(recorded.pins, here) if recorded.pins is not None else []
    if lineage.digest_of_pins(here) == wanted:
        return {"python": sys.executable, "how": "reused this environment", "digest": wanted, "differences": []}
    options.log(f"reproduce: this environment differs from the recorded one: {'; '.join(differences[:10])}")
    if recorded.pins is None:
        raise ReproductionError("environment", f"this environment's digest is not the recorded {wanted[:12]}, and the "
                                               "record lists no packages to rebuild it from")
    home = options.home or Path(options.data_root).parent
    target = home / ENVS_DIR / wanted
    python = target / "bin" / "python"
    if not python.exists():
        _build_environment(recorded.pins, target, worktree, differences, options)
    got = _digest_of(python, worktree)
    if got != wanted:
        raise ReproductionError("environment", f"the environment at {target} has digest {str(got)[:12]}, not the "
                                               f"recorded {wanted[:12]}; recorded packages that differ here: "
                                               + "; ".join(differences[:20]))
    return {"python": str(python), "how": f"built at {target}", "digest": wanted, "differences": differences}


def _build_environment(pins: list[str], target: Path, worktree: Path, differences: list[str],
                       options: Options) -> None:
    interpreter = pins[0]
    here = lineage.environment_pins()[0]
    why = "; ".join(differences[:20])
    if interpreter != here:
        raise ReproductionError("environment", f"the recorded interpreter is {interpreter}, this machine runs {here}: "
                                               f"the environment cannot be rebuilt here (differences: {why})")
    project = {"trainyard"}  # the checkout itself: installed from the worktree, never from an index
    odd = [pin for pin in pins[1:] if not _PIN.fullmatch(pin)]
    if odd:  # signed, but never handed to pip as anything but a name and a version
        raise ReproductionError("environment", f"the recorded package list holds entries that are not name==version: "
                                               f"{odd[:5]}")
    # The pins this environment lacks first: pip looks requirements up in order, so one the index no longer
    # has fails in a second instead of after every other lookup.
    installed = set(lineage.environment_pins())
    packages = sorted((pin for pin in pins[1:] if pin.split("==")[0] not in project), key=lambda pin: pin in installed)
    staging = target.with_name(f".{target.name}.{uuid.uuid4().hex[:6]}")
    options.log(f"reproduce: building the recorded environment ({len(packages)} packages) at {target}")
    # No pip or setuptools of the venv's own: the environment holds what the record lists (pip too, when it
    # does), installed by this environment's pip into it (pip --python).
    pip = [sys.executable, "-m", "pip", "--python", str(staging / "bin" / "python"), "install", "--quiet", "--no-deps"]
    steps = [[sys.executable, "-m", "venv", "--without-pip", str(staging)], [*pip, "--", *packages],
             [*pip, "-e", str(worktree)]]
    try:
        for command in steps:
            done = subprocess.run(command, capture_output=True, text=True, timeout=options.timeout_s, check=False)
            if done.returncode != 0:
                tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
                raise ReproductionError("environment", f"the recorded environment cannot be rebuilt here "
                                                       f"({' '.join(command[1:7])}... failed: {' | '.join(tail)}); "
                                                       f"recorded packages that differ here: {why}")
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(staging, target)
        except OSError:
            if not (target / "bin" / "python").exists():  # not another reproduction's build of the same digest
                raise
    except subprocess.TimeoutExpired as error:
        raise ReproductionError("environment", f"building the recorded environment took over {error.timeout} s") from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _digest_of(python: Path, worktree: Path) -> str | None:
    done = subprocess.run([str(python), "-c", "from ops.lineage import env_digest; print(env_digest())"],
                          cwd=worktree, env=_worktree_env(worktree), capture_output=True, text=True, timeout=120,
                          check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def _worktree_env(worktree: Path) -> dict[str, str]:
    """The environment of a process of the recorded commit: its modules first on the path, no Dagster
    pipes or MLflow server of whoever runs the reproduction, no checkpoint mirror."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("DAGSTER_PIPES", "MLFLOW_", "TORCHELASTIC", "SLURM_")) and name not in (
               "TRAINYARD_CHECKPOINT_ROOT", "PYTHONPATH", "PYTHONSAFEPATH", "RANK", "LOCAL_RANK", "WORLD_SIZE",
               "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return env | {"PYTHONPATH": str(worktree)}


def _data(recorded: Recorded, python: str, worktree: Path, work: Path, options: Options) -> dict[str, Any]:
    """The recorded shard set: where it lies when every shard matches, else rebuilt and checked."""
    from ops.curation import rights

    wanted = recorded.shard_set
    data_root = Path(options.data_root)
    canonical = data_root / "shards" / wanted["plan_version"]
    try:
        revoked = rights.revoked(data_root)
    except (OSError, ValueError, RuntimeError) as error:
        raise ReproductionError("rights", f"the rights ledger cannot be read, so the data cannot be checked: {error}") \
            from error
    found, problems = None, {}
    if objstore_url(wanted["location"]):
        problems[wanted["location"]], index_dir = _store_set_problems(wanted)
        if not problems[wanted["location"]]:
            # Read through the shard cache, which checks each shard's bytes against this index's sha256 as it
            # fetches it; its plan (fetched with the index) says which assets it holds.
            held = revoked_in_data(revoked, _plan_assets(index_dir))
            if held:
                raise _revoked(held)
            return {"how": "found in the store", "path": wanted["location"], "index_version": wanted["index_version"]}
    for candidate in dict.fromkeys([Path(wanted["location"]), canonical]):
        if objstore_url(wanted["location"]) and candidate != canonical or not (candidate / "index.json").exists():
            continue
        problems[str(candidate)] = shard_set_problems(candidate, wanted)
        if not problems[str(candidate)]:
            found = candidate
            break
    if found is not None:
        held = revoked_in_data(revoked, _plan_assets(found))
        if held:
            raise _revoked(held)
        return {"how": "found", "path": str(found), "index_version": wanted["index_version"]}
    if wanted.get("erased") or wanted.get("rebuildable") is False:
        raise ReproductionError("data", f"the recorded shard set {wanted['index_version']} is gone or differs "
                                        f"({_first(problems)}), and it cannot be rebuilt from the record")
    validated = data_root / "validated" / wanted["validated_version"]
    accepted = _accepted_assets(validated)
    exclude = sorted(revoked_in_data(revoked, accepted))
    target = work / "shards" / wanted["plan_version"]
    options.log(f"reproduce: rebuilding shard set {wanted['index_version']} into {target} "
                f"({'; '.join(f'{where}: {why[0]}' for where, why in problems.items() if why) or 'it is gone'})")
    spec = {"validated_dir": str(validated), "exclude": exclude, "config": wanted["config"],
            "code_version": wanted["code_version"], "plan_version": wanted["plan_version"], "out_dir": str(target)}
    (work / "rebuild_spec.json").write_text(json.dumps(spec))
    script = shutil.copy(Path(__file__).with_name("rebuild_shards.py"), work / "rebuild_shards.py")
    done = subprocess.run([python, str(script), str(work / "rebuild_spec.json")], cwd=worktree,
                          env=_worktree_env(worktree), capture_output=True, text=True, timeout=options.timeout_s,
                          check=False)
    try:
        result = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        result = {"ok": False, "kind": "error", "message": (done.stderr or done.stdout).strip()[-_TRAIN_LOG_TAIL:]}
    if not result["ok"]:
        if result.get("kind") == "plan" and exclude:
            raise _revoked(revoked_in_data(revoked, exclude))
        raise ReproductionError("data", f"the recorded shard set could not be rebuilt from validated set "
                                        f"{wanted['validated_version']}: {result['message']}")
    rebuilt = shard_set_problems(target, wanted)
    if rebuilt:
        raise ReproductionError("data", "the shard set rebuilt from the manifests differs from the recorded one: "
                                        + "; ".join(rebuilt[:10]))
    if not canonical.exists():  # checked byte for byte, then put where the data root keeps that version
        canonical.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(target, canonical)
            target = canonical
        except OSError:  # another reproduction put it there first, or it is not a folder we may replace
            pass
    return {"how": "rebuilt", "path": str(target), "index_version": wanted["index_version"],
            "found_problems": problems, "revoked_left_out": exclude}


def _store_set_problems(wanted: dict[str, Any]) -> tuple[list[str], Path | None]:
    """Why the store's copy of the recorded set is not it (empty: it is), and the local folder its index and
    plan were fetched into."""
    from ops.clips.shard_cache import read_any_index

    try:
        index = read_any_index(wanted["location"])
    except Exception as error:  # noqa: BLE001 - any failure to read the store's copy sends us to the rebuild
        return [f"{wanted['location']}: the index cannot be read: {type(error).__name__}: {error}"], None
    shas = dict(zip(index.table.column("shard").to_pylist(), index.table.column("shard_sha256").to_pylist()))
    problems = [] if index.version == wanted["index_version"] else [
        f"{wanted['location']}: index version {index.version}, recorded {wanted['index_version']}"]
    return problems + [f"shard {shard}: sha256 {str(shas.get(shard))[:12]}, recorded {sha[:12]}"
                       for shard, sha in wanted["shards"].items() if shas.get(shard) != sha], index.directory


def objstore_url(location: str) -> bool:
    return "://" in location


def _first(problems: dict[str, list[str]]) -> str:
    return next((f"{where}: {why[0]}" for where, why in problems.items() if why), "no copy is left")


def _revoked(held: dict[str, Any]) -> ReproductionError:
    from ops.curation import rights

    return ReproductionError("rights", "the recorded data holds asset(s) the rights ledger revokes now, and a revoked "
                                       "clip is never reintroduced to reproduce a model: " + "; ".join(
                                           f"{asset[:12]} ({rights.describe(event)})" for asset, event in held.items()))


def _accepted_assets(validated: Path) -> list[str]:
    from ops.curation.quarantine import load_validation

    try:
        return load_validation(validated).accepted.column("asset_id").to_pylist()
    except (OSError, ValueError, KeyError) as error:
        raise ReproductionError("data", f"the recorded data is gone and its validated set {validated} cannot be read "
                                        f"to rebuild it: {error}") from error


def _plan_assets(directory: Path) -> list[str]:
    from ops.clips import plan as clips

    return clips.read_plan(directory).table.column("asset_id").to_pylist()


def _fetched(location: str, work: Path) -> tuple[Path | None, str]:
    """A parent in a checkpoint store, fetched into ``work`` (its files re-hashed against its store record)."""
    from ops.checkpoints.mirror import CheckpointMirror
    from ops.publish import objstore

    parent, name = location.rstrip("/").rsplit("/", 1)
    try:
        return CheckpointMirror(parent, keep_last_k=1, keep_every_m=0).fetch(name, work / "parent").path, ""
    except objstore.ObjectStoreError as error:
        return None, f"{location}: {error}"


def _parent(recorded: Recorded, options: Options, work: Path) -> dict[str, Any]:
    """The parent checkpoint: where the record says (a folder, or a store URL fetched here), or a passing
    reproduction of it; taken only when its record names the recorded run and step and its data digest is
    the recorded one."""
    wanted = recorded.parent
    key = store.configured_key()
    candidates = [(str(wanted["path"]), wanted["run_id"])]
    marks = read_marks(options.data_root, wanted["run_id"])
    last = (marks.get(int(wanted["step"])) or {}).get("last_reproduced") or {}
    if last.get("rerun_checkpoint") and wanted.get("data_digest"):  # a stand-in needs a digest to be judged by
        candidates.append((str(last["rerun_checkpoint"]), last["rerun_run_id"]))
    seen = []
    for location, run_id in candidates:
        path: Path | None = Path(location)
        if objstore_url(location):
            path, problem = _fetched(location, work)
            if path is None:
                seen.append(problem)
                continue
        if not (path / store.RECORD_NAME).exists():
            seen.append(f"{path}: gone")
            continue
        verified = store.verify(path, key)
        if not verified.ok:
            seen.append(f"{path}: {verified.summary()}")
            continue
        digest = data_files_digest(verified.record["files"])
        said = (verified.record["step"], verified.record["lineage"].get("run_id"))
        if said != (int(wanted["step"]), run_id):
            seen.append(f"{path}: its record names run {said[1]} step {said[0]}, not run {run_id} step {wanted['step']}")
            continue
        if wanted.get("data_digest") not in (None, digest):
            seen.append(f"{path}: its data digest {digest[:12]} is not the recorded {wanted['data_digest'][:12]}")
            continue
        return {"path": str(path), "run_id": run_id, "step": wanted["step"],
                "how": "recorded" if location == str(wanted["path"]) else "reproduction"}
    raise ReproductionError("parent", f"the parent checkpoint (run {wanted['run_id']}, step {wanted['step']}) is not "
                                      f"available: {'; '.join(seen)}; reproduce it first (trainyard reproduce), and "
                                      "this reproduction starts from the reproduced copy")


def _point_at_parent(config: dict, parent: dict[str, Any]) -> None:
    stage = config["stage"]
    key = "init_from" if stage.get("init_from") else "resume_from"
    stage[key], stage[f"{'init_from' if key == 'init_from' else 'resume'}_run_id"] = parent["path"], parent["run_id"]


# Settings that change where a re-run writes and who hears of it, never what it computes: no MLflow run,
# no mirror, no Dagster run, no evaluation (it never changes training: trainer/heldout.py), no study.
def _rerun_config(config: dict, recorded: Recorded, run_dir: Path, world: int) -> dict:
    stage, train = config["stage"], config["train"]
    stage |= {"mlflow": False, "mirror": False, "checkpoint_io": "local", "dagster_run_id": "", "retry_of": "",
              "start_over": False, "checkpoint": True}
    # A save only reads the state: saving every recorded-step steps re-creates a checkpoint that a stop, a
    # pruning rule or the end of the run committed off the original's schedule, and changes nothing computed.
    train |= {"run_dir": str(run_dir), "eval_every": 0, "checkpoint_every": recorded.step}
    stage["keep_last_k"] = max(int(stage.get("keep_last_k") or 1), int(train["steps"]) // recorded.step + 1)
    device = (recorded.record["content"].get("numerics") or {}).get("device_type")
    if device:  # the recorded device type, never what "auto" finds on this machine
        train["device"] = device
    if world != recorded.world_size:  # the drill's rules: one rank alone, several data-parallel
        if world == 1:
            train["parallelism"] = "none"
        elif train.get("parallelism", "none") == "none":
            train["parallelism"] = "ddp"
    if "sweep" in config:
        config["sweep"] |= {"study": "", "storage": "", "mlflow_parent": ""}
    return config


def _run(config: dict, recorded: Recorded, world: int, python: str, worktree: Path, work: Path,
         options: Options) -> Path:
    run_dir = work / f"{recorded.run_id}-reproduction"
    config = _rerun_config(config, recorded, run_dir, world)
    config_path = work / "config.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=True))
    train = ["-m", "trainer.train", "--config", str(config_path)]
    command = [python, *train] if world == 1 else [
        python, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc-per-node={world}", *train]
    options.log(f"reproduce: re-running {recorded.lineage.get('stage')} to step {recorded.step} on {world} rank(s) "
                f"from commit {str(recorded.lineage.get('git_commit'))[:12]} (log: {work / 'train.log'})")
    with open(work / "train.log", "wb") as out:
        # Its own session: on a timeout, or when this process is interrupted, torchrun and every rank it started go.
        process = subprocess.Popen(command, cwd=worktree, env=_worktree_env(worktree), stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = process.wait(timeout=options.timeout_s)
        except BaseException as error:
            process_tree.kill_tree(process)  # torchrun and its ranks, each of which leads its own session
            if isinstance(error, subprocess.TimeoutExpired):
                raise ReproductionError("run", f"the re-run took over {error.timeout} s (log: {work / 'train.log'})") \
                    from error
            raise
    if returncode != 0:
        tail = (work / "train.log").read_text(errors="replace")[-_TRAIN_LOG_TAIL:]
        raise ReproductionError("run", f"the re-run exited {returncode} (log: {work / 'train.log'}): ...{tail}")
    return run_dir


def _judge(recorded: Recorded, run_dir: Path, world: int, options: Options) -> dict[str, Any]:
    from ops.drills import restore
    from ops.drills.reproduce import compare_checkpoints, read_state

    rebuilt_dir = store.checkpoints_dir(run_dir) / store.step_dir_name(recorded.step)
    if not (rebuilt_dir / store.RECORD_NAME).exists():
        raise ReproductionError("run", f"the re-run committed no checkpoint at step {recorded.step} ({rebuilt_dir})")
    key = store.configured_key()
    rebuilt_record = store.read_record(rebuilt_dir)
    numerics = recorded.record["content"].get("numerics", {})  # signed: an edited run file cannot loosen the rule
    same_world = world == recorded.world_size
    base = restore.comparison_rule(numerics, same_world=same_world)
    rule = Rule(name=base.name, loss_rtol=base.loss_rtol, param_atol=base.param_atol, why=base.why)
    comparison = compare_checkpoints(read_state(recorded.checkpoint_dir, key), read_state(rebuilt_dir, key),
                                     rule=rule, same_world=same_world)
    lineage_checks = {name: (recorded.lineage.get(name), rebuilt_record["lineage"].get(name))
                      for name in ("git_commit", "env_digest", "code_version", "manifest_version")}
    differing = {name: pair for name, pair in lineage_checks.items() if pair[0] != pair[1]}
    numerics_now = rebuilt_record["content"].get("numerics", {})
    if numerics and numerics_now != numerics:  # another device, precision or kernel mode is another computation
        differing["numerics"] = (numerics, numerics_now)
    started_from = (rebuilt_record["content"].get("reproduction") or {}).get("sampler_at_start")
    if recorded.sampler_at_start is not None and same_world and started_from != recorded.sampler_at_start:
        differing["sampler_at_start"] = (recorded.sampler_at_start, started_from)
    if differing:
        comparison["reasons"].insert(0, "the re-run's lineage differs: " + "; ".join(
            f"{name} recorded {a}, re-run {b}" for name, (a, b) in differing.items()))
        comparison["passed"] = False
    first = comparison["reasons"][0] if comparison["reasons"] else None
    return {"passed": comparison["passed"], "rule": rule.name, "comparison": comparison, "first_difference": first,
            "reason": first or f"reproduced ({rule.name}: {rule.why})",
            "rerun_checkpoint": str(rebuilt_dir), "rerun_run_id": rebuilt_record["lineage"]["run_id"]}
