"""The typed stage hand-off (trainer/launch/stage_launch.py, ops/clips/shard_ref.py): run folder names, the
trainer's overrides, and launch.json written, read back, refused when broken, and read in the
first format.

The run folder names below are pinned: a changed name would orphan every existing run's
checkpoints (its stage would start a new folder), so it may change only on purpose. They were
computed by assets/training.py before StageLaunch existed (issue 10 kept them), and moved once in
issue 18, on purpose: a run's identity is its whole redacted config, and the config gained
train.tf32, attention_backend, residual_dtype, sync_phases, data.pin_memory and
faults.end_stall_s, while train.precision and train.deterministic became 'auto' (a GPU run of
the same file now trains in bf16, a different run). The override lists are still the earlier
code's.

Run: python -m pytest tests/test_stage_launch.py -q
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from assets import stage_runs, training
from ops.publish.paths import REPO_ROOT
from ops.clips.shard_ref import ShardIndexRef
from trainer.launch.config import load_config
from trainer.launch.redact import Redactor, redacted_dict
from trainer.launch import run_identity
from trainer.launch.stage_launch import CheckpointRef, LaunchRecordError, StageLaunch, last_wins

CONFIG = str(REPO_ROOT / "configs" / "test_tiny.yaml")
DATA = ShardIndexRef(path="/pinned/shards", version="i" * 20, manifest_version="m" * 20)
TOKEN_ENV = "PIN_TOKEN_ENV"
V1_FILE = Path(__file__).parent / "data" / "launch_v1_finetune.json"
"""A launch.json written by the code before StageLaunch (a finetune with a repeated optim.lr)."""


def _launch(stage: str = "pretrain", **fields) -> StageLaunch:
    return StageLaunch(**{"stage": stage, "config_path": CONFIG, "data": DATA, "steps": 6, "world_size": 2, **fields})


# Stage inputs -> the run folder the code before StageLaunch named, and (where it repeated keys)
# the override list it passed the trainer.
PINNED = {
    "pretrain-28295b5417a4": _launch(defaults=training.PRETRAIN_DEFAULTS,
                                     user_overrides=(f"data.storage_token=${{env:{TOKEN_ENV}}}",)),
    "pretrain-4929ef8bdbb0": _launch(defaults=training.PRETRAIN_DEFAULTS, buckets=((8, 64, 64), (16, 64, 64)),
                                     user_overrides=("train.checkpoint_every=2",)),
    "step_profile-5f5a0ba7eeda": _launch("step_profile", world_size=1, defaults=training.STEP_PROFILE_DEFAULTS),
    "finetune-8031fb913363": _launch("finetune", steps=3, defaults=training.FINETUNE_DEFAULTS,
                                     init_from=CheckpointRef(path="/pinned/ckpt/step_000006", run_id="pretrain-abc"),
                                     user_overrides=("optim.lr=1e-3",)),
}
OLD_OVERRIDES = {
    "step_profile-5f5a0ba7eeda": [
        "data.source=shards", "data.shard_index=/pinned/shards", f"data.manifest_version={'m' * 20}", "train.steps=6",
        "stage.checkpoint=true", "stage.stage=step_profile", "train.parallelism=none", "train.profile=true",
        "stage.checkpoint=false", "stage.mlflow=true"],
    "finetune-8031fb913363": [
        "data.source=shards", "data.shard_index=/pinned/shards", f"data.manifest_version={'m' * 20}", "train.steps=3",
        "stage.checkpoint=true", "stage.stage=finetune", "stage.mlflow=true", "optim.lr=3e-4", "optim.warmup_steps=0",
        "stage.init_from=/pinned/ckpt/step_000006", "stage.init_from_run_id=pretrain-abc", "optim.lr=1e-3"],
}


@pytest.fixture(autouse=True)
def token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "x")


def _run_name(launch: StageLaunch) -> str:
    from ops.publish.hashing import digest_json

    identity = run_identity.run_identity(load_config(launch.config_path, launch.overrides()))
    return f"{launch.stage}-{digest_json(identity)[:12]}"


# ---------------------------------------------------------------------------------------------
# Run folder names and the trainer's overrides


@pytest.mark.parametrize("name", sorted(PINNED))
def test_run_folder_names_are_the_ones_the_earlier_code_gave(name: str) -> None:
    assert _run_name(PINNED[name]) == name


def test_secrets_from_run_config_name_the_same_folder_as_before() -> None:
    run = stage_runs.StageRunConfig(config_path=CONFIG, steps=4, nproc=2, secrets={"data.storage_token": TOKEN_ENV})
    launch = _launch(steps=4, defaults=training.PRETRAIN_DEFAULTS, user_overrides=tuple(stage_runs.secret_overrides(run)))
    assert _run_name(launch) == "pretrain-357612f56b39"


@pytest.mark.parametrize("name", sorted(OLD_OVERRIDES))
def test_overrides_name_each_key_once_and_resolve_as_the_full_list_did(name: str) -> None:
    overrides = PINNED[name].overrides()
    keys = [override.partition("=")[0] for override in overrides]
    assert len(keys) == len(set(keys)), overrides
    assert load_config(CONFIG, overrides) == load_config(CONFIG, OLD_OVERRIDES[name])


def test_a_user_override_of_a_stage_default_wins_and_appears_once() -> None:
    overrides = PINNED["finetune-8031fb913363"].overrides()
    assert [o for o in overrides if o.startswith("optim.lr=")] == ["optim.lr=1e-3"]
    assert [o for o in PINNED["step_profile-5f5a0ba7eeda"].overrides() if o.startswith("stage.checkpoint=")] == [
        "stage.checkpoint=false"]


def test_last_wins_keeps_the_last_value_of_each_key_at_its_last_place() -> None:
    assert last_wins(["a.x=1", "b.y=2", "a.x=3", " b.y =4", "c.z=5"]) == ["a.x=3", " b.y =4", "c.z=5"]


def test_a_named_launch_adds_its_run_fields_last_and_they_do_not_rename_the_folder() -> None:
    unnamed = PINNED["pretrain-28295b5417a4"]
    named = unnamed.named(run_dir="/data/runs/pretrain-28295b5417a4", dagster_run_id="d-1", retry_of="mlflow-7")
    assert named.overrides()[-3:] == ["train.run_dir=/data/runs/pretrain-28295b5417a4", "stage.dagster_run_id=d-1",
                                      "stage.retry_of=mlflow-7"]
    assert named.run_id == "pretrain-28295b5417a4"
    # The stage adds these fields to its one resolution instead of resolving the YAML again.
    resolved = load_config(CONFIG, unnamed.overrides())
    assert run_identity.with_run_fields(resolved, named) == load_config(CONFIG, named.overrides())


def test_the_drill_replays_model_data_and_optimizer_overrides_only() -> None:
    launch = PINNED["finetune-8031fb913363"]
    launch = dataclasses.replace(launch, user_overrides=(*launch.user_overrides, "train.steps=9", "stage.keep_last_k=5"))
    assert launch.replay_overrides() == ("optim.lr=3e-4", "optim.warmup_steps=0", "optim.lr=1e-3")


@pytest.mark.parametrize("fields, message", [
    ({"steps": 0}, "steps and world_size"), ({"world_size": "2"}, "steps and world_size"),
    ({"user_overrides": ("optim.lr",)}, "section.field=value"), ({"buckets": ((8, 64),)}, "frames, height, width"),
    # A line end in a field that reaches a command line, a job script or a log line (issue 32, item 6).
    ({"run_dir": "/runs/a\n#SBATCH --wrap=id"}, r"StageLaunch\.run_dir"), ({"stage": "pretrain\r"}, r"StageLaunch\.stage"),
    ({"config_path": "/c.yaml\x00"}, r"StageLaunch\.config_path"),
    ({"dagster_run_id": "a\u2028b"}, r"StageLaunch\.dagster_run_id"), ({"retry_of": "x\x85y"}, r"StageLaunch\.retry_of"),
])
def test_a_launch_with_bad_fields_is_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _launch(**fields)


# ---------------------------------------------------------------------------------------------
# launch.json


def _named(tmp_path: Path, launch: StageLaunch | None = None) -> StageLaunch:
    launch = (launch or PINNED["finetune-8031fb913363"]).named(
        run_dir=tmp_path / "runs" / "finetune-8031fb913363", dagster_run_id="dagster-run-1", retry_of=None)
    return dataclasses.replace(launch, config=redacted_dict(load_config(CONFIG, launch.overrides())))


def test_a_launch_round_trips_through_launch_json(tmp_path: Path) -> None:
    launch = _named(tmp_path, dataclasses.replace(PINNED["pretrain-4929ef8bdbb0"], stage="finetune"))
    path = Path(launch.run_dir) / "launch.json"
    launch.write(path, redactor=Redactor([]))
    assert StageLaunch.read(path) == launch
    copy = Path(launch.run_dir) / "launch" / "dagster-run-1.json"
    assert copy.read_bytes() == path.read_bytes()
    record = json.loads(path.read_text())  # what readers of the first format find, still there
    assert (record["run_id"], record["world_size"], record["precision"], record["seed"]) == (
        "finetune-8031fb913363", 2, "auto", 0)
    assert (record["manifest_version"], record["shard_index_version"]) == (DATA.manifest_version, DATA.version)
    assert record["overrides"] == launch.overrides() and record["retry_of"] is None


def test_launch_json_holds_no_secret(tmp_path: Path) -> None:
    secret = "tok-sekret-4411aa"
    launch = _named(tmp_path, dataclasses.replace(PINNED["pretrain-28295b5417a4"],
                                                  user_overrides=(f"name=exp-{secret}",)))
    path = Path(launch.run_dir) / "launch.json"
    launch.write(path, redactor=Redactor.for_config(None, environ={"STORE_TOKEN": secret}))
    assert secret in json.dumps(launch.record()), "the secret is not in the launch: no test"
    for written in (path, Path(launch.run_dir) / "launch" / "dagster-run-1.json"):
        assert secret not in written.read_text() and "name=exp-***" in written.read_text()
    assert StageLaunch.read(path).user_overrides == ("name=exp-***",)


def _broken(tmp_path: Path, edit) -> Path:
    launch = _named(tmp_path)
    path = Path(launch.run_dir) / "launch.json"
    launch.write(path, redactor=Redactor([]))
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record))
    return path


@pytest.mark.parametrize("edit, message", [
    (lambda r: r.pop("shard_index"), "missing field 'shard_index'"),
    (lambda r: r.update(steps="3"), "field 'steps' must be int, got str '3'"),
    (lambda r: r.update(world_size=True), "field 'world_size' must be int"),
    (lambda r: r.update(user_overrides=["optim.lr=1e-3", 7]), "field 'user_overrides' must be a list of strings"),
    (lambda r: r["shard_index"].update(version=""), "version must be a non-empty string"),
    (lambda r: r.update(format=3), "format 3"),
    (lambda r: r["overrides"].append("optim.lr=1.0"), "overrides disagree with the fields that make them"),
    (lambda r: r.update(run_dir="/elsewhere/pretrain-0"), "run_id, overrides disagree"),
    (lambda r: r.update(shard_index_version="other"), "shard_index_version disagree"),
])
def test_a_broken_launch_json_is_refused_by_name(tmp_path: Path, edit, message: str) -> None:
    path = _broken(tmp_path, edit)
    with pytest.raises(LaunchRecordError) as error:
        StageLaunch.read(path)
    assert str(error.value).startswith(f"{path}: ") and message in str(error.value), str(error.value)


def test_a_missing_or_unparsable_launch_json_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "launch.json"
    with pytest.raises(LaunchRecordError, match=f"^{path}: no launch record"):
        StageLaunch.read(path)
    path.write_text('{"stage": "pretrain",')
    with pytest.raises(LaunchRecordError, match=f"^{path}: not a JSON launch record"):
        StageLaunch.read(path)
    path.write_text("[1, 2]")
    with pytest.raises(LaunchRecordError, match=f"^{path}: a launch record is a JSON object, got list"):
        StageLaunch.read(path)


def test_a_first_format_launch_json_is_read() -> None:
    launch = StageLaunch.read(V1_FILE)
    recorded = json.loads(V1_FILE.read_text())
    assert (launch.stage, launch.run_id, launch.world_size, launch.steps) == ("finetune", "finetune-19a41daef57b", 2, 3)
    assert launch.data == DATA and launch.dagster_run_id == "dagster-run-0001" and launch.retry_of == ""
    assert launch.init_from == CheckpointRef(path="/pinned/ckpt/step_000006", run_id="pretrain-abc")
    assert launch.resume_from is None and launch.config == recorded["config"]
    # The overrides it makes resolve to the config the first-format launch recorded (in this checkout),
    # but for what issue 18 changed on purpose: new fields, and precision / deterministic now 'auto'.
    here = dataclasses.replace(launch, config_path=CONFIG)
    resolved = redacted_dict(load_config(CONFIG, here.overrides()))
    expected = copy.deepcopy(recorded["config"])
    assert (expected["train"]["precision"], expected["train"]["deterministic"]) == ("fp32", True)
    expected["train"] |= {"precision": "auto", "deterministic": None}
    assert {section: ({key: resolved[section][key] for key in value} if isinstance(value, dict) else resolved[section])
            for section, value in expected.items()} == expected
    assert launch.replay_overrides() == ("optim.lr=3e-4", "optim.warmup_steps=0", "optim.lr=1e-3")


def test_a_first_format_launch_json_missing_a_field_is_refused_by_name(tmp_path: Path) -> None:
    record = json.loads(V1_FILE.read_text())
    del record["shard_index_version"]
    path = tmp_path / "launch.json"
    path.write_text(json.dumps(record))
    with pytest.raises(LaunchRecordError, match=f"^{path}: missing field 'shard_index_version'"):
        StageLaunch.read(path)


# ---------------------------------------------------------------------------------------------
# ShardIndexRef


def test_a_shard_index_ref_reads_the_dict_the_asset_returned_before() -> None:
    old = {"version": DATA.version, "path": DATA.path, "manifest_version": DATA.manifest_version}
    assert ShardIndexRef.of(old) == DATA and ShardIndexRef.of(DATA) is DATA
    assert pickle.loads(pickle.dumps(DATA)) == DATA  # Dagster's IO manager pickles it
    with pytest.raises(ValueError, match="lacks manifest_version"):
        ShardIndexRef.of({"version": "v", "path": "/p"})
    with pytest.raises(TypeError, match="got str"):
        ShardIndexRef.of("/p")


def test_the_stage_launch_module_imports_without_torch() -> None:
    code = ("import sys, trainer.launch.stage_launch, ops.clips.shard_ref\n"
            "print(sorted(m for m in ('torch', 'av', 'webdataset', 'dagster') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
