"""Reproduction from lineage (ops/drills/reproduce.py, ops/drills/replay.py, ``trainyard reproduce``).

Tiny runs on synthetic data, trained by real ``python -m trainer.train`` processes from a clone of this
repository, so their records name a commit of a repository the test owns: one where a planted,
irreproducible one-line change in the loss is committed. The demo's shard data (rebuild, revoked
assets, corrupted shards) is tests/test_end_to_end.py's.
"""

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ops import lineage
from ops.checkpoints import store
from ops.drills import replay
from ops.drills.reproduce import (
    ReproductionError, Rule, compare_checkpoints, data_files_digest, package_differences, recorded_inputs)
from ops.publish.durable import FileDigest
from ops.publish.hashing import digest_json

REPO = Path(__file__).resolve().parent.parent
LOSS_LINE = "                    loss = self.faults.corrupt_loss(step, loss)\n"
# Irreproducible from step 3 on: a factor no seed fixes (1 + 1e-2 * (1 + U), U uniform from the OS).
PLANTED = ("                    loss = self.faults.corrupt_loss(step, loss) * (1 + 1e-2 * (1 + __import__('random')"
           ".SystemRandom().random()) * (step >= 3))\n")
BIT = Rule(name="bit_identical", loss_rtol=0.0, param_atol=0.0, why="test")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def _train(repo: Path, run_dir: Path, home: Path, *sets: str) -> Path:
    """A tiny run from ``repo``'s code (its commit in the lineage); returns its newest checkpoint."""
    env = {**os.environ, "PYTHONPATH": str(repo), "TRAINYARD_HOME": str(home)}
    env = {key: value for key, value in env.items() if not key.startswith(("MLFLOW_", "DAGSTER_PIPES"))}
    done = subprocess.run([sys.executable, "-m", "trainer.train", "--config", "configs/test_tiny.yaml",
                           "--set", f"train.run_dir={run_dir}", "--set", "stage.mlflow=false", *sets],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [info.path for info in store.list_checkpoints(run_dir) if info.status == "committed"][-1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> dict:
    """A clone of this repository with a planted commit on top, and one run trained from each commit."""
    root = tmp_path_factory.mktemp("reproduce")
    repo = root / "repo"
    if (REPO / ".git").exists():
        subprocess.run(["git", "clone", "-q", str(REPO), str(repo)], check=True)
    else:  # a copy of the tree without its history (tests/mutants/run.py): a repository of its own
        shutil.copytree(REPO, repo, ignore=shutil.ignore_patterns(".venv", ".trainyard", "__pycache__", "*.egg-info"))
        subprocess.run(["git", "init", "-q", str(repo)], check=True)
    _git(repo, "config", "user.email", "test@trainyard.invalid")
    _git(repo, "config", "user.name", "test")
    if not (REPO / ".git").exists():
        _git(repo, "add", "-A")
        _git(repo, "commit", "-qm", "the tree under test")
    clean = _git(repo, "rev-parse", "HEAD")
    good = _train(repo, root / "data" / "runs" / "good", root)
    loop = repo / "trainer" / "loop.py"
    source = loop.read_text()
    assert source.count(LOSS_LINE) == 1, "the planted line's anchor moved: update LOSS_LINE"
    loop.write_text(source.replace(LOSS_LINE, PLANTED))
    _git(repo, "commit", "-qam", "planted: an irreproducible factor in the loss from step 3")
    planted = _train(repo, root / "data" / "runs" / "planted", root)
    _git(repo, "checkout", "-q", clean)
    return {"root": root, "repo": repo, "good": good, "planted": planted, "clean": clean,
            "planted_commit": _git(repo, "rev-parse", "HEAD@{1}")}


def _env(lab: dict) -> dict[str, str]:
    return {**os.environ, "TRAINYARD_HOME": str(lab["root"]), "TRAINYARD_DATA_ROOT": str(lab["root"] / "data")}


def _options(lab: dict, **kwargs) -> replay.Options:
    return replay.Options(repo=kwargs.pop("repo", lab["repo"]), data_root=lab["root"] / "data", home=lab["root"],
                          log=lambda line: None, **kwargs)


def _copy(checkpoint: Path, to: Path) -> Path:
    shutil.copytree(checkpoint, to)
    return to


def _resign(checkpoint: Path, edit) -> None:
    """Rewrite ``checkpoint``'s record with ``edit`` applied and a valid signature (a forger with the key,
    or a record that predates a field)."""
    record = store.read_record(checkpoint)
    edit(record)
    full = store.signed_record({key: record[key] for key in ("step", "world_size", "lineage", "model_fingerprint",
                                                             "content")},
                               {name: FileDigest(sha256=entry["sha256"], size_bytes=entry["size_bytes"])
                                for name, entry in record["files"].items()}, store.signing_key(), name=checkpoint.name)
    (checkpoint / store.RECORD_NAME).write_text(json.dumps(full, indent=1, sort_keys=True))


# ---------------------------------------------------------------------------------------------
# What the record holds


def test_every_checkpoint_records_what_a_reproduction_needs(lab: dict):
    record = store.read_record(lab["good"])
    block = record["content"]["reproduction"]
    assert digest_json(block["config"]) == record["lineage"]["config_hash"]
    pins = [block["environment"]["interpreter"], *block["environment"]["packages"]]
    assert lineage.digest_of_pins(pins) == record["lineage"]["env_digest"] == lineage.env_digest()
    assert any(pin.startswith("torch==") for pin in pins)
    assert block["parent"] is None and block["shard_set"] is None  # from scratch, synthetic data
    assert block["sampler_at_start"]["sampler"]["consumed"] == 0
    assert record["lineage"]["git_commit"] == lab["clean"] and record["lineage"]["git_dirty"] == "false"


def test_package_differences_name_each_package_and_the_interpreter():
    lines = package_differences(["cpython==3.11.7", "torch==2.13.0", "numpy==2.0.0", "gone==1"],
                                ["cpython==3.12.1", "torch==2.12.0", "numpy==2.0.0", "extra==0.1"])
    assert lines == ["cpython: recorded 3.11.7, here 3.12.1", "extra: not recorded, 0.1 installed here",
                     "gone: recorded 1, not installed here", "torch: recorded 2.13.0, here 2.12.0"]


def test_the_comparison_names_the_first_differing_step_and_the_most_different_tensor():
    base = {"model.w": torch.ones(3), "model.b": torch.zeros(2), "optimizer.state.w.exp_avg": torch.ones(3),
            "train_state.losses": [1.0, 0.9, 0.8, 0.7], "lr_scheduler.last_epoch": 4}
    same = compare_checkpoints(base, {**base}, rule=BIT, same_world=True)
    assert same["passed"] and same["tensors_compared"] == 3 and same["first_differing_step"] is None
    one_ulp = torch.nextafter(torch.ones(3), torch.full((3,), 2.0))
    other = {**base, "model.w": one_ulp, "optimizer.state.w.exp_avg": torch.ones(3) * 1.5,
             "train_state.losses": [1.0, 0.9, math.nextafter(0.8, 1.0), 0.7]}
    result = compare_checkpoints(base, other, rule=BIT, same_world=True)
    assert not result["passed"]
    assert result["first_differing_step"] == 3
    assert result["tensors_differing"] == 2 and result["most_different_tensor"] == "optimizer.state.w.exp_avg"
    loose = Rule(name="reassociation", loss_rtol=1e-4, param_atol=1e-4, why="test")
    assert not compare_checkpoints(base, other, rule=loose, same_world=False)["passed"]  # 0.5 > 1e-4
    close = {**base, "model.w": one_ulp, "train_state.losses": [1.0, 0.9, math.nextafter(0.8, 1.0), 0.7]}
    assert compare_checkpoints(base, close, rule=loose, same_world=False)["passed"]
    assert not compare_checkpoints(base, close, rule=BIT, same_world=True)["passed"]  # one ulp is not bit-identical
    saved = compare_checkpoints(base, {**base, "lr_scheduler.last_epoch": 5}, rule=BIT, same_world=True)
    assert not saved["passed"] and "lr_scheduler.last_epoch" in saved["reasons"][0]


# ---------------------------------------------------------------------------------------------
# Reproducing


def test_a_checkpoint_reproduces_bit_identically_from_a_worktree_of_its_commit(lab: dict):
    report = replay.reproduce(lab["good"], _options(lab))
    assert report["status"] == "reproduced", report
    assert report["commit"] == lab["clean"] and report["environment"]["how"] == "reused this environment"
    assert report["comparison"]["tensors_compared"] > 10 and report["comparison"]["tensors_differing"] == 0
    assert report["comparison"]["steps_compared"] == 6
    assert _git(lab["repo"], "worktree", "list").count("\n") == 0  # the worktree is gone again
    mark = replay.read_marks(lab["root"] / "data", "good")[6]
    assert mark["status"] == "reproduced" and mark["data_digest"] == data_files_digest(
        store.read_record(lab["good"])["files"])
    listing = subprocess.run([sys.executable, "-m", "cli.checkpoint", "checkpoint", "list", str(lab["good"].parent.parent)],
                             cwd=REPO, capture_output=True, text=True, env=_env(lab))
    assert "reproduced" in listing.stdout.splitlines()[-1], listing.stdout
    # A mark edited by hand (or copied from another checkpoint's) is not believed.
    path = replay.mark_path(lab["root"] / "data", "good", 6)
    original = path.read_text()
    try:
        path.write_text(original.replace('"reproduced (', '"reproduced by hand ('))
        assert replay.read_marks(lab["root"] / "data", "good")[6]["status"] == "unknown"
        listing = subprocess.run([sys.executable, "-m", "cli.checkpoint", "checkpoint", "list",
                                  str(lab["good"].parent.parent)], cwd=REPO, capture_output=True, text=True, env=_env(lab))
        assert "NOT-REPRODUCED(unknown)" in listing.stdout, listing.stdout
    finally:
        path.write_text(original)


def test_a_planted_irreproducible_change_is_caught_and_named_by_step(lab: dict):
    record = store.read_record(lab["planted"])
    assert record["lineage"]["git_commit"] == lab["planted_commit"]
    done = subprocess.run([str(Path(sys.executable).parent / "trainyard"), "reproduce", str(lab["planted"]),
                           "--repo", str(lab["repo"]), "--json"], cwd=REPO, capture_output=True, text=True,
                          env=_env(lab), timeout=600)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["status"] == "failed"
    assert report["comparison"]["first_differing_step"] == 3
    assert report["first_difference"].startswith("loss differs first at step 3")
    assert report["comparison"]["most_different_tensor"]  # and the parameters went their own way after it
    listing = subprocess.run([sys.executable, "-m", "cli.checkpoint", "checkpoint", "list", str(lab["planted"].parent.parent)],
                             cwd=REPO, capture_output=True, text=True,
                             env=_env(lab))
    assert "NOT-REPRODUCED(failed)" in listing.stdout and "step 3" in listing.stdout, listing.stdout


# ---------------------------------------------------------------------------------------------
# Bad input: each refused by name, nothing compared


def test_a_commit_missing_from_the_repository_is_named_with_a_hint_to_fetch_it(lab: dict, tmp_path: Path):
    empty = tmp_path / "empty"
    subprocess.run(["git", "init", "-q", str(empty)], check=True)
    report = replay.reproduce(lab["good"], _options(lab, repo=empty))
    assert report["status"] == "refused" and report["kind"] == "commit", report
    assert lab["clean"] in report["reason"] and f"fetch origin {lab['clean']}" in report["reason"]
    assert "comparison" not in report


def test_a_dirty_record_is_refused_as_irreproducible(lab: dict, tmp_path: Path):
    repo = tmp_path / "dirty"
    subprocess.run(["git", "clone", "-q", str(lab["repo"]), str(repo)], check=True)
    (repo / "README.md").write_text((repo / "README.md").read_text() + "\nan uncommitted edit\n")
    checkpoint = _train(repo, lab["root"] / "data" / "runs" / "dirty", lab["root"])
    report = replay.reproduce(checkpoint, _options(lab))
    assert report["kind"] == "dirty" and "uncommitted changes" in report["reason"], report


def test_a_forged_or_unsigned_record_is_refused(lab: dict, tmp_path: Path):
    forged = _copy(lab["good"], tmp_path / "forged" / "checkpoints" / "step_000006")
    record = json.loads((forged / store.RECORD_NAME).read_text())
    record["content"]["reproduction"]["config"]["optim"]["lr"] = 0.5  # edited without the key
    (forged / store.RECORD_NAME).write_text(json.dumps(record))
    report = replay.reproduce(forged, _options(lab))
    assert report["kind"] == "record" and "bad signature" in report["reason"], report
    unsigned = _copy(lab["good"], tmp_path / "unsigned" / "checkpoints" / "step_000006")
    record = json.loads((unsigned / store.RECORD_NAME).read_text())
    del record["signature"]
    (unsigned / store.RECORD_NAME).write_text(json.dumps(record))
    report = replay.reproduce(unsigned, _options(lab))
    assert report["kind"] == "record" and "unsigned" in report["reason"], report


def test_an_environment_that_cannot_be_rebuilt_is_a_clear_error_and_no_comparison(lab: dict, tmp_path: Path):
    def other_environment(extra: str, interpreter: str | None = None):
        def edit(record):
            environment = record["content"]["reproduction"]["environment"]
            environment["packages"] = sorted([*environment["packages"], extra])
            if interpreter:
                environment["interpreter"] = interpreter
            record["lineage"]["env_digest"] = lineage.digest_of_pins([environment["interpreter"],
                                                                      *environment["packages"]])
        return edit

    moved = _copy(lab["good"], tmp_path / "python" / "checkpoints" / "step_000006")
    _resign(moved, other_environment("six==1.16.0", interpreter="cpython==3.99.0"))
    report = replay.reproduce(moved, _options(lab))
    assert report["kind"] == "environment" and "cpython==3.99.0" in report["reason"], report
    assert "cpython: recorded 3.99.0" in report["reason"] and "comparison" not in report and not report["passed"]
    unknown = _copy(lab["good"], tmp_path / "package" / "checkpoints" / "step_000006")
    _resign(unknown, other_environment("trainyard-no-such-distribution==0.0.1"))
    report = replay.reproduce(unknown, _options(lab))
    assert report["kind"] == "environment" and "cannot be rebuilt here" in report["reason"], report
    assert "trainyard-no-such-distribution: recorded 0.0.1, not installed here" in report["reason"]
    assert "comparison" not in report
    assert not list((lab["root"] / replay.ENVS_DIR).glob("*"))  # no half-built environment left to be reused
    # A signed list whose entry would read as a pip option never reaches pip.
    option = _copy(lab["good"], tmp_path / "option" / "checkpoints" / "step_000006")
    _resign(option, other_environment("--index-url==http://example.invalid"))
    report = replay.reproduce(option, _options(lab))
    assert report["kind"] == "environment" and "not name==version" in report["reason"], report


def test_a_record_that_lists_a_package_list_not_behind_its_digest_is_refused(lab: dict, tmp_path: Path):
    edited = _copy(lab["good"], tmp_path / "pins" / "checkpoints" / "step_000006")
    _resign(edited, lambda record: record["content"]["reproduction"]["environment"]["packages"].append("x==1"))
    report = replay.reproduce(edited, _options(lab))
    assert report["kind"] == "record" and "does not hash to the recorded env_digest" in report["reason"], report


def test_a_checkpoint_made_before_reproduction_records_uses_what_its_record_vouches_for(lab: dict, tmp_path: Path):
    run = tmp_path / "data" / "runs" / "old"
    old = _copy(lab["good"], run / "checkpoints" / "step_000006")
    _resign(old, lambda record: record["content"].pop("reproduction"))
    # Without the block and without the run's launch.json: the missing fields are named.
    report = replay.reproduce(old, _options(lab))
    assert report["kind"] == "missing" and "config (not in the record" in report["reason"], report
    # The run folder's launch.json, whose config hashes to the signed config_hash, suffices.
    config = json.loads((lab["good"].parent.parent / "final.json").read_text())["config"]
    (run / "launch.json").write_text(json.dumps({"config": config}))
    report = replay.reproduce(old, _options(lab))
    assert report["status"] == "reproduced", report
    assert any("launch.json" in note for note in report["notes"])
    # A launch.json edited after the fact does not hash to the record's config_hash: refused, named.
    config["optim"]["lr"] = 0.5
    (run / "launch.json").write_text(json.dumps({"config": config}))
    report = replay.reproduce(old, _options(lab))
    assert report["kind"] == "missing" and "does not hash to the signed config_hash" in report["reason"], report


def test_recorded_inputs_refuses_a_config_that_does_not_hash_to_the_lineage(lab: dict):
    record = store.read_record(lab["good"])
    record["content"]["reproduction"]["config"]["train"]["seed"] = 7
    found = recorded_inputs(lab["good"], record, data_root=None)
    assert found.config is None and any("does not hash" in line for line in found.missing)


def test_the_cli_refuses_bad_usage(lab: dict):
    trainyard = str(Path(sys.executable).parent / "trainyard")
    env = _env(lab)
    neither = subprocess.run([trainyard, "reproduce"], capture_output=True, text=True, env=env)
    assert neither.returncode == 2 and "--run" in neither.stderr
    missing = subprocess.run([trainyard, "reproduce", "--run", "no-such-run"], capture_output=True, text=True, env=env)
    assert missing.returncode == 2 and "no committed checkpoint" in missing.stderr
    nothing = subprocess.run([trainyard, "reproduce", str(lab["root"])], capture_output=True, text=True, env=env)
    assert nothing.returncode == 2 and "not a committed checkpoint" in nothing.stderr


def test_reproduction_error_kinds_are_the_documented_ones():
    documented = (REPO / "docs" / "lineage.md").read_text()
    for kind in ("record", "missing", "dirty", "commit", "environment", "data", "rights", "parent", "run"):
        assert f"`{kind}`" in documented, kind
    assert ReproductionError("data", "x").kind == "data"


def test_a_child_starts_from_its_recorded_parent_and_a_swapped_parent_is_refused(lab: dict, tmp_path: Path):
    parent_run = tmp_path / "data" / "runs" / "parent"
    parent = _copy(lab["good"], parent_run / "checkpoints" / "step_000006")
    child = _train(lab["repo"], lab["root"] / "data" / "runs" / "child", lab["root"], "--set",
                   f"stage.init_from={parent}", "--set", "stage.init_from_run_id=good")
    recorded = store.read_record(child)["content"]["reproduction"]["parent"]
    assert recorded["data_digest"] == data_files_digest(store.read_record(lab["good"])["files"])
    report = replay.reproduce(child, _options(lab))
    assert report["status"] == "reproduced" and report["parent"]["how"] == "recorded", report
    # Another checkpoint put where the parent was (a rollback, a swap): its data digest gives it away.
    shutil.rmtree(parent)
    _copy(lab["planted"], parent)
    marks = replay.reproductions_root(lab["root"] / "data") / "marks" / "good"
    if marks.exists():  # with a passing reproduction of the parent known, that copy would serve instead
        shutil.move(marks, tmp_path / "marks")
    try:
        report = replay.reproduce(child, _options(lab))
        assert report["kind"] == "parent" and "names run planted step 6, not run good step 6" in report["reason"]
        # Even one that names the parent's run and step (signed by a forger with the key): the data digest.
        _resign(parent, lambda record: record["lineage"].update(run_id="good"))
        report = replay.reproduce(child, _options(lab))
    finally:
        if (tmp_path / "marks").exists():
            shutil.move(tmp_path / "marks", marks)
    assert report["kind"] == "parent" and "is not the recorded" in report["reason"], report


def test_shard_set_problems_name_every_shard_that_is_not_the_recorded_one(demo_validation, tmp_path: Path):
    from helpers import write_shards

    from ops.clips.plan import ShardConfig
    from ops.drills.reproduce import shard_set_problems, shard_set_record

    directory = tmp_path / "set"
    plan, index = write_shards(demo_validation, ShardConfig(splits=("val", "test"), clips_per_shard=4), directory)
    recorded = shard_set_record(directory)
    assert recorded["index_version"] == index.version and len(recorded["shards"]) == len(plan.shards) >= 3
    assert shard_set_problems(directory, recorded) == []
    first, *_, last = sorted(recorded["shards"])
    (directory / f"{last}.tar").write_bytes((directory / f"{last}.tar").read_bytes() + b"\0")
    (directory / f"{first}.tar").unlink()
    problems = shard_set_problems(directory, recorded)
    now = hashlib.sha256((directory / f"{last}.tar").read_bytes()).hexdigest()
    assert problems == [f"shard {first}: missing",
                        f"shard {last}: sha256 {now[:12]}, recorded {recorded['shards'][last][:12]}"], problems
    other = {**recorded, "index_version": "0" * 20}
    assert shard_set_problems(directory, other)[0].endswith(f"recorded {'0' * 20}")


def test_a_run_on_another_world_size_is_judged_by_the_restore_drills_rule(lab: dict):
    done = subprocess.run([str(Path(sys.executable).parent / "trainyard"), "reproduce", "--run", "good",
                           "--world-size", "2", "--repo", str(lab["repo"]), "--json"], cwd=REPO, capture_output=True,
                          text=True, env=_env(lab), timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["status"] == "reproduced" and report["rule"] == "reassociation", report
    assert report["comparison"]["param_atol"] > 0 and report["comparison"]["steps_compared"] == 6


def test_a_checkpoint_in_a_store_reproduces_by_its_url(lab: dict, s3_live):
    from ops.publish import objstore

    url = s3_live.url("checkpoints", "good", "step_000006")
    objstore.publish_tree(lab["good"], url)
    trainyard = str(Path(sys.executable).parent / "trainyard")
    done = subprocess.run([trainyard, "reproduce", url, "--repo", str(lab["repo"]), "--json"], cwd=REPO,
                          capture_output=True, text=True, env=_env(lab), timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["status"] == "reproduced" and report["run_id"] == "good", report
    # A store copy whose bytes are not its record's is refused before anything runs.
    objstore.write_object(objstore.join(url, "__0_0.distcp"), b"not the checkpoint")
    done = subprocess.run([trainyard, "reproduce", url, "--repo", str(lab["repo"]), "--json"], cwd=REPO,
                          capture_output=True, text=True, env=_env(lab), timeout=600)
    assert done.returncode == 2 and "refused" in done.stderr, done.stdout[-2000:] + done.stderr[-2000:]
    assert json.loads(done.stdout)["kind"] == "record"


def test_a_rebuild_is_checked_byte_for_byte_and_never_writes_an_asset_revoked_since(demo_manifest, demo_validation,
                                                                                   tmp_path: Path):
    """The data step alone (ops/drills/replay.py ``_data``) on a published validated set: a gone set is rebuilt by
    the shard code into the data root's place for it; with an asset of it revoked since, it is refused and
    nothing is written."""
    import dataclasses

    from helpers import write_shards

    from ops.clips.plan import ShardConfig
    from ops.curation import manifest as manifest_ops, quarantine, rights
    from ops.drills.reproduce import Recorded, shard_set_problems, shard_set_record

    data = tmp_path / "data"
    manifest_ops.write_manifest(demo_manifest, manifest_ops.manifests_dir(data))
    ledger = quarantine.record(demo_validation, quarantine.ledger_path(data))
    quarantine.write_validated(demo_validation, ledger, quarantine.validated_dir(data, demo_validation.version), {
        "version": demo_validation.version, "manifest_version": demo_validation.manifest_version,
        "media_root": demo_validation.media_root, "config": dataclasses.asdict(demo_validation.config)})
    plan, _ = write_shards(demo_validation, ShardConfig(splits=("val", "test"), clips_per_shard=4), tmp_path / "set")
    canonical = data / "shards" / plan.version
    canonical.parent.mkdir(parents=True)
    (tmp_path / "set").rename(canonical)
    recorded = Recorded(checkpoint_dir=tmp_path, record={}, lineage={}, step=1, world_size=1,
                        shard_set=shard_set_record(canonical))
    options = replay.Options(repo=REPO, data_root=data, home=tmp_path, log=lambda line: None)

    shutil.rmtree(canonical)
    (tmp_path / "work1").mkdir()
    (tmp_path / "work2").mkdir()
    found = replay._data(recorded, sys.executable, REPO, tmp_path / "work1", options)
    assert found["how"] == "rebuilt" and found["path"] == str(canonical), found
    assert shard_set_problems(canonical, recorded.shard_set) == []

    asset_id = plan.table.column("asset_id")[0].as_py()
    rights.revoke(data, asset_id, reason="takedown", note="reproduction test")
    shutil.rmtree(canonical)
    with pytest.raises(ReproductionError) as refused:
        replay._data(recorded, sys.executable, REPO, tmp_path / "work2", options)
    assert refused.value.kind == "rights" and asset_id[:12] in str(refused.value)
    assert "never reintroduced" in str(refused.value) and not canonical.exists()
    assert not list((tmp_path / "work2").rglob("*.tar"))  # not even a copy beside it


def test_a_re_run_past_its_time_limit_is_stopped_with_its_ranks_and_refused(lab: dict):
    import time

    report = replay.reproduce(lab["good"], _options(lab, timeout_s=2.0, world_size=2))
    assert report["kind"] == "run" and "took over 2.0 s" in report["reason"], report
    log = Path(report["reproduction_dir"]) / "train.log"
    size = log.stat().st_size
    time.sleep(3)
    assert log.stat().st_size == size  # no rank lives on to write to it
