"""Sweeps as declared objects (issue 38, trainer/launch/sweep.py, cli/sweep.py): the file is read and checked
before anything runs, each bad input refused naming its key; the plan's trials come from the grid or the
sampler's seed, the same every time; the study lives in Optuna's RDB storage, resumed under the same
declaration and refused under another; an unreachable storage is named without its password."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from cli.main import main
from trainer.launch.refusal import Refusal
from trainer.launch.sweep import load_sweep, open_study, plan_trials

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "configs" / "sweeps" / "demo_lr.yaml"


def _write(tmp_path: Path, **changes) -> Path:
    raw = yaml.safe_load(DEMO.read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_the_demo_sweep_plans_its_grid_in_order_with_run_identities(capsys, tmp_path: Path) -> None:
    spec = load_sweep(DEMO)
    trials = plan_trials(spec)
    assert [trial.trial_id for trial in trials] == [f"demo_lr-{n:03d}" for n in range(6)]
    assert trials[0].params == {"optim.lr": 3e-4, "optim.warmup_steps": 0}
    assert {tuple(t.params.values()) for t in trials} == {(lr, w) for lr in (3e-4, 1e-3, 3e-3) for w in (0, 2)}
    assert main(["sweep", "plan", str(DEMO), "--json", "--shard-index", str(tmp_path / "none")]) == 2
    capsys.readouterr()


def test_a_random_sweep_draws_the_same_trials_from_the_same_seed(tmp_path: Path) -> None:
    path = _write(tmp_path, space={"optim.lr": {"loguniform": [1e-4, 1e-2]}, "optim.warmup_steps": {"int": [0, 4]}},
                  sampler={"kind": "random", "seed": 7}, budget=5)
    first, again = plan_trials(load_sweep(path)), plan_trials(load_sweep(path))
    assert [t.params for t in first] == [t.params for t in again]
    assert all(1e-4 <= t.params["optim.lr"] <= 1e-2 and 0 <= t.params["optim.warmup_steps"] <= 4 for t in first)
    other = plan_trials(load_sweep(_write(tmp_path, space={"optim.lr": {"loguniform": [1e-4, 1e-2]},
                                                          "optim.warmup_steps": {"int": [0, 4]}},
                                          sampler={"kind": "random", "seed": 8}, budget=5)))
    assert [t.params for t in other] != [t.params for t in first]


@pytest.mark.parametrize(("changes", "key", "words"), [
    ({"space": {"optim.lrr": {"grid": [1e-3]}}, "budget": 1}, "sweep.space.optim.lrr", "optim.lr"),
    ({"space": {}}, "sweep.space", "empty"),
    ({"budget": 7}, "sweep.budget", "larger than the grid's 6"),
    ({"concurrency": 0}, "sweep.concurrency", ">= 1"),
    ({"overrides": ["train.eval_every=0"]}, "sweep.objective.step", "needs an evaluation"),
    ({"overrides": ["train.eval_every=3"]}, "sweep.objective.step", "not an evaluation step"),
    ({"overrides": ["train.eval_every=8"]}, "sweep.pruner", "first one is at step 8"),
    ({"objective": {"metric": "val/loss", "step": 9}}, "sweep.objective.step", "after the trials' last step"),
    ({"space": {"optim.lr": {"gird": [1e-3]}}}, "sweep.space.optim.lr", "did you mean grid"),
    ({"space": {"optim.lr": {"loguniform": [0, 1e-2]}}}, "sweep.space.optim.lr", "low > 0"),
    ({"space": {"optim.lr": {"grid": [1e-3, 1e-3]}}}, "sweep.space.optim.lr", "twice"),
    ({"sampler": {"kind": "grid"}, "space": {"optim.lr": {"uniform": [1e-4, 1e-3]}}}, "sweep.sampler", "distribution"),
    ({"concurency": 2}, "sweep.concurency", "rename concurency to concurrency"),
    ({"name": "Demo LR"}, "sweep.name", "a-z"),
    ({"pruner": {"kind": "hyperband"}}, "sweep.pruner", "median"),
])
def test_a_bad_sweep_is_refused_before_anything_runs_naming_its_key(tmp_path: Path, capsys, changes, key,
                                                                     words) -> None:
    path = _write(tmp_path, **changes)
    with pytest.raises(Refusal) as refused:
        load_sweep(path)
    assert refused.value.key == key and words in str(refused.value), str(refused.value)
    assert main(["sweep", "plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trainyard: refused (config)") and len(err.strip().splitlines()) == 1, err


def test_a_study_resumes_under_its_declaration_and_refuses_another(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    spec = load_sweep(DEMO)
    study = open_study(spec, url)
    study.enqueue_trial({"optim.lr": 3e-4, "optim.warmup_steps": 0})
    again = open_study(spec, url)
    assert again._study_id == study._study_id and again.user_attrs["spec_digest"] == spec.digest
    other = load_sweep(_write(tmp_path, budget=4))
    with pytest.raises(Refusal, match="declared otherwise") as refused:
        open_study(other, url)
    assert refused.value.key == "sweep.name"


def test_an_unreachable_study_storage_is_named_without_its_password() -> None:
    with pytest.raises(Refusal) as refused:
        open_study(load_sweep(DEMO), "postgresql+psycopg2://sweeper:s3cret-pw@127.0.0.1:1/optuna")
    text = str(refused.value)
    assert "127.0.0.1:1/optuna" in text and "s3cret-pw" not in text and refused.value.key == "TRAINYARD_OPTUNA_STORAGE"


def test_the_plan_names_each_trials_run_folder_on_the_given_data(sharded_index, capsys) -> None:
    assert main(["sweep", "plan", str(DEMO), "--json", "--shard-index", str(sharded_index)]) == 0
    plan = json.loads(capsys.readouterr().out)
    names = [trial["run_name"] for trial in plan["trials"]]
    assert all(name.startswith("pretrain-") for name in names) and len(set(names)) == 6
    assert main(["sweep", "plan", str(DEMO), "--json", "--shard-index", str(sharded_index)]) == 0
    assert [t["run_name"] for t in json.loads(capsys.readouterr().out)["trials"]] == names


@pytest.fixture(scope="module")
def sharded_index(demo_validation, tmp_path_factory) -> Path:
    import dataclasses

    from helpers import write_shards

    from ops.clips.plan import ShardConfig
    from ops.clips.shards import shard_dir

    data = tmp_path_factory.mktemp("sweep_data")
    validation = dataclasses.replace(demo_validation, accepted=demo_validation.accepted.slice(0, 6))
    plan, _ = write_shards(validation, ShardConfig(clips_per_shard=4, max_clips_per_source=2), shard_dir(data, "p"))
    return shard_dir(data, "p")
