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
    assert trials[0].params == {"optim.lr": 1e-3, "optim.warmup_steps": 0}
    assert {tuple(t.params.values()) for t in trials} == {(lr, w) for lr in (1e-3, 3e-3, 1e-5) for w in (0, 2)}
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
    # A bad value in the middle of a grid (every point of a small grid is checked, not only its ends).
    ({"space": {"optim.lr": {"grid": [1e-3, -1.0, 3e-3]}}, "budget": 3}, "sweep.space.optim.lr", "lr"),
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


# ---------------------------------------------------------------------------------------------
# Early stopping inside the trainer (trainer/launch/pruning.py): a real study in SQLite, the tiny model


def _study_with_finished_trials(url: str, value_at_every_step: float, *, name: str = "unit"):
    """A study whose trials 0 and 1 completed with ``value_at_every_step`` at steps 2, 4 and 6, and whose
    trial 2 is RUNNING: the one the trainer under test is."""
    import optuna
    from optuna.trial import TrialState

    study = optuna.create_study(study_name=name, storage=url)
    storage = study._storage
    for number in range(3):
        study.enqueue_trial({"x": number}, user_attrs={"trial_id": f"{name}-{number:03d}"})
        trial_id = storage.get_trial_id_from_study_id_trial_number(study._study_id, number)
        storage.set_trial_state_values(trial_id, TrialState.RUNNING)
        if number < 2:
            for step in (2, 4, 6):
                storage.set_trial_intermediate_value(trial_id, step, value_at_every_step)
                # Asked at each step, as the trainer asks: successive halving records its rungs as it is asked.
                optuna.pruners.SuccessiveHalvingPruner(min_resource=2, reduction_factor=2).prune(
                    study, storage.get_trial(trial_id))
            study.tell(number, value_at_every_step)
    return study


def _trial_config(run_dir: Path, url: str, *extra: str):
    from trainer.launch.config import load_config

    return load_config(None, ["preset=tiny_cpu", "train.steps=6", "train.eval_every=2", "eval.samples=0",
                              f"train.run_dir={run_dir}", "stage.checkpoint=true", "train.checkpoint_every=3",
                              "train.dump_final_params=true", "sweep.study=unit", "sweep.trial=2",
                              f"sweep.storage={url}", "sweep.pruner=median", "sweep.min_trials=2", *extra])


@pytest.mark.parametrize("rule", ["median", "successive_halving"])
def test_a_trial_worse_than_the_median_stops_at_that_step_with_a_committed_checkpoint(tmp_path: Path, rule) -> None:
    """Both of Optuna's rules: the median of the completed trials, and successive halving's first rung (step 2:
    min_resource 2, keep the best half of the three trials there) both stop a trial worse than the others."""
    from helpers import train_wired

    from ops.checkpoints import store

    url = f"sqlite:///{tmp_path / 'studies.db'}"
    study = _study_with_finished_trials(url, 0.0)  # no real loss is below 0: the rule stops it at step 2
    run_dir = tmp_path / "trial"
    train_wired(_trial_config(run_dir, url, f"sweep.pruner={rule}", "sweep.min_resource=2"))
    final = json.loads((run_dir / "final.json").read_text())
    assert final["status"] == "pruned" and final["final_step"] == 2 and final["failure_class"] == "pruned"
    pruning = final["pruning"]
    assert pruning["rule"] == rule and pruning["step"] == 2 and pruning["trial"] == 2
    assert pruning["compared"] == {"0": 0.0, "1": 0.0} and pruning["completed_median"] == 0.0
    assert pruning["value"] == final["evaluations"][0]["loss"] > 0
    # Stopped at a step boundary with that step's checkpoint committed (checkpoint_every=3 would not save 2).
    assert store.step_dir_name(2) in [path.name for path in store.checkpoints_dir(run_dir).iterdir()]
    assert store.read_latest(run_dir) == store.step_dir_name(2)
    trial = study.trials[2]
    assert trial.intermediate_values == {2: pruning["value"]}
    assert trial.user_attrs["pruning"]["step"] == 2
    ending = json.loads((run_dir / "ranks" / "rank_0.json").read_text())
    assert ending["failure_class"] == "pruned"


def test_a_pruned_trial_resumes_later_to_the_uninterrupted_runs_bits(tmp_path: Path) -> None:
    """The decision can be undone: the pruned trial, resumed without the rule, ends where a trial never
    stopped ends (the same losses and parameters, bit for bit)."""
    import torch
    from helpers import train_wired

    url = f"sqlite:///{tmp_path / 'studies.db'}"
    _study_with_finished_trials(url, 0.0)
    resumed, straight = tmp_path / "resumed", tmp_path / "straight"
    train_wired(_trial_config(resumed, url))
    assert json.loads((resumed / "final.json").read_text())["status"] == "pruned"
    train_wired(_trial_config(resumed, url, "sweep.pruner=none"))
    _study_with_finished_trials(f"sqlite:///{tmp_path / 'other.db'}", 1e9)  # the rule never stops this one
    train_wired(_trial_config(straight, f"sqlite:///{tmp_path / 'other.db'}"))
    after, reference = (json.loads((folder / "final.json").read_text()) for folder in (resumed, straight))
    assert after["status"] == reference["status"] == "completed" and after["final_step"] == 6
    assert after["losses"] == reference["losses"] and len(after["losses"]) == 6  # carried through the checkpoint
    first = json.loads((resumed / "final.json").read_text())
    assert [e["loss"] for e in first["evaluations"]] == [e["loss"] for e in reference["evaluations"]]
    params, expected = torch.load(resumed / "final_params.pt"), torch.load(straight / "final_params.pt")
    assert params.keys() == expected.keys() and all(torch.equal(params[k], expected[k]) for k in params)


def test_a_trial_better_than_the_median_trains_on_and_reports_every_evaluation(tmp_path: Path) -> None:
    from helpers import train_wired

    url = f"sqlite:///{tmp_path / 'studies.db'}"
    study = _study_with_finished_trials(url, 1e9)
    run_dir = tmp_path / "trial"
    train_wired(_trial_config(run_dir, url))
    final = json.loads((run_dir / "final.json").read_text())
    assert final["status"] == "completed" and final["final_step"] == 6 and final["pruning"] is None
    assert study.trials[2].intermediate_values == {e["step"]: e["loss"] for e in final["evaluations"]}
    assert sorted(study.trials[2].intermediate_values) == [2, 4, 6]


def test_a_study_lost_mid_run_never_ends_the_trial(tmp_path: Path, caplog) -> None:
    """Pruning saves time; it must not cost a run: a storage that stops answering is logged, training goes on."""
    from trainer.launch.config import load_config
    from trainer.launch.pruning import PruningJudge

    database = tmp_path / "studies.db"
    _study_with_finished_trials(f"sqlite:///{database}", 0.0)
    config = load_config(None, ["preset=tiny_cpu", "sweep.study=unit", "sweep.trial=2", f"sweep.storage=sqlite:///{database}",
                                "sweep.pruner=median"])
    judge = PruningJudge(config.sweep, eval_every=2)
    assert judge.judge(2, 5.0, may_stop=True) is not None  # worse than the completed trials' 0.0
    database.unlink()  # the storage is gone under the running trial
    with caplog.at_level("WARNING", logger="trainer"):
        assert judge.judge(4, 5.0, may_stop=True) is None
    assert "training on without early stopping" in caplog.text


def test_a_study_that_cannot_be_opened_leaves_the_trial_training_without_early_stopping(tmp_path: Path,
                                                                                       caplog) -> None:
    from helpers import train_wired

    url = f"sqlite:///{tmp_path / 'none.db'}"  # no study of that name there
    run_dir = tmp_path / "trial"
    with caplog.at_level("WARNING", logger="trainer"):
        train_wired(_trial_config(run_dir, url))
    assert json.loads((run_dir / "final.json").read_text())["status"] == "completed"
    assert "cannot be opened" in caplog.text and "training without early stopping" in caplog.text


def test_pruned_is_an_agreed_ending_never_retried_and_exits_0() -> None:
    from trainer.endings import FAILURE_CLASSES, RETRYABLE, classify
    from trainer.supervisor.elastic import decide
    from trainer.train import EXIT_CODES

    assert classify("pruned", None) == "pruned" and EXIT_CODES["pruned"] == 0
    assert "pruned" not in FAILURE_CLASSES and "pruned" not in RETRYABLE
    assert decide({"failure_class": "pruned"}, run_dir=".", restarts_left=3, max_bad_samples=0)[0] == "done"


def test_registering_twice_enqueues_each_planned_trial_once_in_plan_order(tmp_path: Path) -> None:
    from trainer.launch.sweep import register, trial_states

    spec, url = load_sweep(DEMO), f"sqlite:///{tmp_path / 'studies.db'}"
    register(spec, url)
    study = register(spec, url)  # a resumed sweep: nothing enqueued twice
    trials = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
    assert [(t.user_attrs["trial_id"], t.user_attrs["params"]) for t in trials] == \
        [(trial.trial_id, trial.params) for trial in plan_trials(spec)]
    assert set(trial_states(study).values()) == {"WAITING"}


def test_the_report_ranks_completed_trials_marks_pruned_ones_and_diffs_the_best_against_the_base(tmp_path: Path) -> None:
    from optuna.trial import TrialState

    from trainer.launch.sweep import register, sweep_report

    spec, url = load_sweep(DEMO), f"sqlite:///{tmp_path / 'studies.db'}"
    study = register(spec, url)
    storage = study._storage
    objectives = {0: 1.30, 1: 1.10, 2: 1.20}
    for number in range(6):
        trial_id = storage.get_trial_id_from_study_id_trial_number(study._study_id, number)
        storage.set_trial_state_values(trial_id, TrialState.RUNNING)
        storage.set_trial_intermediate_value(trial_id, 4, 1.5 - number / 100)
        storage.set_trial_user_attr(trial_id, "result", {"curve": [[32, 4, 1.5 - number / 100]], "run_id": f"r{number}",
                                                         "checkpoint": f"/c/{number}"})
        if number in objectives:
            study.tell(number, objectives[number])
        elif number == 3:
            storage.set_trial_user_attr(trial_id, "pruning", {"rule": "median", "step": 4})
            study.tell(number, state=TrialState.PRUNED)
    report = sweep_report(spec, study)
    assert [row["state"] for row in report["trials"]] == ["complete", "complete", "complete", "pruned", "running",
                                                          "running"]
    assert report["best"]["trial_id"] == "demo_lr-001" and report["best"]["objective"] == 1.10
    assert report["best"]["checkpoint"] == "/c/1"
    # Only the searched keys whose value differs from the base config (configs/demo.yaml with the overrides).
    from trainer.launch.config import load_config

    base = load_config(REPO / spec.base, list(spec.overrides))
    expected = {key: {"base": value, "trial": report["best"]["params"][key]} for key, value in
                (("optim.lr", base.optim.lr), ("optim.warmup_steps", base.optim.warmup_steps))
                if value != report["best"]["params"][key]}
    assert report["best"]["config_diff"] == expected
    assert report["counts"] == {"complete": 3, "pruned": 1, "diverged": 0, "fail": 0, "running": 2, "waiting": 0}


def test_a_server_storage_and_its_password_never_reach_a_trials_config() -> None:
    """The trial finds a server's study from its environment; only the embedded SQLite path goes in the config
    (and so in launch.json, final.json, the config hash and MLflow's params)."""
    from trainer.launch.sweep import trial_overrides

    spec = load_sweep(DEMO)
    trial = plan_trials(spec)[0]
    served = trial_overrides(spec, trial, storage_url="postgresql+psycopg2://sweeper:hunter2@db:5432/optuna")
    assert not any("hunter2" in item or "postgresql" in item or item.startswith("sweep.storage=") for item in served)
    embedded = trial_overrides(spec, trial, storage_url="sqlite:////home/x/optuna/studies.db")
    assert "sweep.storage=sqlite:////home/x/optuna/studies.db" in embedded
    assert f"sweep.trial={trial.number}" in served and f"sweep.sweep_id={spec.digest}" in served
