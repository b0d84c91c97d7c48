"""Health of training runs (ops/drills/health.py) and its asset checks (assets/health.py), on the folder of
one real tiny run with a 1.2 s stall injected into one step's data fetch and three committed
checkpoints. Each check is shown to pass on it and to fail on a broken copy.

Run: .venv/bin/python -m pytest tests/test_health.py -q
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
from helpers import train_wired

from assets import health as health_assets
from assets.checkpoint_checks import CHECKPOINT_CHECKS
from assets.training import finetune, pretrain
from ops.checkpoints import store as store
from ops.drills import health
from ops.checkpoints.keys import HMAC_KEY_ENV
from resources.launcher import read_attempts
from trainer.launch.config import load_config

STALL_S = 1.2
STALL_STEP = 4
# One signing key for the module's run and every test that verifies it (each test has its own home).
TEST_KEY = "health-test-signing-key"


@pytest.fixture(autouse=True)
def signing_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HMAC_KEY_ENV, TEST_KEY)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """pretrain-like run: 6 steps, a checkpoint every 2, step 4 stalls STALL_S in its data fetch."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(HMAC_KEY_ENV, TEST_KEY)
        yield train(tmp_path_factory.mktemp("runs") / "pretrain-health")


def train(run_dir: Path) -> Path:
    config = load_config(None, [
        "preset=tiny_cpu", f"train.run_dir={run_dir}", "train.steps=6", "stage.checkpoint=true",
        "train.checkpoint_every=2", "stage.mlflow=false", "faults.stall_rank=0", f"faults.stall_at_step={STALL_STEP}",
        f"faults.stall_s={STALL_S}", "faults.stall_in=data"])
    train_wired(config)
    return run_dir


@pytest.fixture()
def broken(run_dir: Path, tmp_path: Path) -> Path:
    """A copy of the run to break (named like it: the checkpoints' records name the run)."""
    return Path(shutil.copytree(run_dir, tmp_path / run_dir.name, symlinks=True))


def test_no_stall_measures_the_longest_step(run_dir: Path) -> None:
    outcome = health.no_stall(run_dir, max_step_gap_s=STALL_S * 4)
    assert outcome.passed and outcome.metadata["longest_step"] == STALL_STEP
    assert outcome.metadata["longest_step_s"] >= STALL_S
    stalled = health.no_stall(run_dir, max_step_gap_s=STALL_S * 0.8)
    assert not stalled.passed and f"step {STALL_STEP}" in stalled.description


def test_no_stall_of_a_run_that_has_not_ended_reads_the_metrics_files(broken: Path) -> None:
    (broken / "final.json").unlink()  # as while the run is still going
    (last,) = health.last_step_timestamps(broken).values()
    assert health.no_stall(broken, max_step_gap_s=60, now=last + 10).passed
    stale = health.no_stall(broken, max_step_gap_s=60, now=last + 61)
    assert not stale.passed and stale.metadata["stalest_rank"] == "0"
    shutil.rmtree(broken / "metrics")  # no record of any step: said, not passed
    nothing = health.no_stall(broken, max_step_gap_s=60)
    assert not nothing.passed and "no step recorded" in nothing.description


def test_a_completed_run_launched_again_is_no_stall(broken: Path) -> None:
    """Issue 32, item 9 (a second `make demo`): the attempt resumes at the run's last step and runs
    none; the metrics files are the first attempt's, hours old. The check judges this attempt."""
    train(broken)  # the real second attempt: resumes at step 6 of 6, nothing to do
    final = health.read_final(broken)
    assert (final["status"], final["final_step"], final["step_log"]) == ("completed", 6, [])
    (last,) = health.last_step_timestamps(broken).values()
    again = health.no_stall(broken, max_step_gap_s=300, now=last + 5679)  # the demo's 5,679 s
    assert again.passed and again.skipped and "already complete" in again.description
    # The same attempt failing before its first step ended too: not a stall (its failure is reported elsewhere).
    (broken / "final.json").write_text(json.dumps({**final, "status": "failed"}))
    assert health.no_stall(broken, max_step_gap_s=300, now=last + 5679).passed
    # A live run (no final.json) is still judged by its metrics files.
    (broken / "final.json").unlink()
    assert not health.no_stall(broken, max_step_gap_s=300, now=last + 5679).passed


@pytest.mark.parametrize("damage", [b'{"status": "comp', b"\xff\xfe", b"[" * 100_000, b"[]"])
def test_a_damaged_final_json_is_named_not_a_traceback(run_dir: Path, broken: Path, damage: bytes) -> None:
    (broken / "final.json").write_bytes(damage)
    with pytest.raises(health.RunRecordUnreadable, match=str(broken / "final.json")):
        health.no_stall(broken, max_step_gap_s=300)
    if damage != b"[]":
        return  # the asset checks once (a Dagster instance costs ~2 s)
    with dg.instance_for_test() as instance:
        materialize_record(instance, "pretrain", broken)
        for name in ("no_stall", "throughput_vs_step_profile"):
            result = checks_of("pretrain")[name](dg.build_asset_check_context(instance=instance))
            assert not result.passed and f"damaged run record: {broken / 'final.json'}" in result.description


def write_attempts(run_dir: Path, decisions: list[str]) -> None:
    """attempts.jsonl as trainer/supervisor/elastic.py appends it, one line per attempt."""
    with open(run_dir / "attempts.jsonl", "a") as handle:
        for attempt, decision in enumerate(decisions):
            handle.write(json.dumps({"attempt": attempt, "failure_class": "completed" if decision == "stop" else
                                     "rank_crash", "step": 2 * attempt, "restored_step": None, "decision": decision,
                                     "why": "test"}) + "\n")


def test_restarts_within_budget(run_dir: Path, broken: Path) -> None:
    clean = health.restarts_within_budget(read_attempts(run_dir), max_restarts=1)
    assert clean.passed and clean.metadata["num_attempts"] == 0
    write_attempts(broken, ["restart", "requeue", "stop"])
    flaky = health.restarts_within_budget(read_attempts(broken), max_restarts=1)
    assert not flaky.passed and flaky.metadata["num_restarts"] == 2 and flaky.metadata["num_attempts"] == 3
    assert health.restarts_within_budget(read_attempts(broken), max_restarts=2).passed
    # A launch that stopped for good and was started again by hand is no restart of the policy's.
    (broken / "attempts.jsonl").unlink()
    write_attempts(broken, ["restart", "stop", "stop"])
    relaunched = health.restarts_within_budget(read_attempts(broken), max_restarts=1)
    assert relaunched.passed and relaunched.metadata["num_restarts"] == 1


def test_every_kept_checkpoint_is_verified(run_dir: Path, broken: Path) -> None:
    clean = health.checkpoints_not_corrupted(run_dir, expected_run_id=run_dir.name)
    assert clean.passed and clean.metadata["checkpoints"] == "step_000002,step_000004,step_000006"
    # The oldest one, which the reported checkpoint's own check (checkpoint_integrity) never reads.
    oldest = store.checkpoints_dir(broken) / store.step_dir_name(2)
    data = max((path for path in oldest.iterdir() if path.name.endswith(".distcp")), key=lambda path: path.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    corrupted = health.checkpoints_not_corrupted(broken, expected_run_id=broken.name)
    assert not corrupted.passed and f"step_000002/{data.name}" in corrupted.metadata["problems"]
    assert health.checkpoints_not_corrupted(broken / "nowhere").skipped  # no checkpoint: nothing to verify, said so


def test_throughput_compares_like_with_like(run_dir: Path) -> None:
    measured = health.throughput_profile(health.read_final(run_dir))
    assert measured["samples_per_s"] > 0 and measured["world_size"] == 1
    same = health.throughput_vs_baseline(measured, dict(measured), max_regression=0.3)
    assert same.passed and not same.skipped and same.metadata["ratio"] == 1
    faster = {**measured, "samples_per_s": measured["samples_per_s"] * 10}
    regressed = health.throughput_vs_baseline(measured, faster, max_regression=0.3)
    assert not regressed.passed and regressed.metadata["ratio"] == pytest.approx(0.1)
    unlike = health.throughput_vs_baseline(measured, {**faster, "world_size": 2}, max_regression=0.3)
    assert unlike.passed and unlike.skipped and "world_size" in unlike.description
    missing = health.throughput_vs_baseline(measured, None, max_regression=0.3)
    assert missing.passed and missing.skipped and "no baseline" in missing.description


def test_thresholds_from_the_environment() -> None:
    assert health.Thresholds.from_env({}) == health.Thresholds()
    assert health.Thresholds.from_env({health.MAX_RESTARTS_ENV: "4"}).max_restarts == 4
    with pytest.raises(ValueError, match="out of range"):
        health.Thresholds.from_env({health.MAX_THROUGHPUT_REGRESSION_ENV: "1.5"})


def checks_of(stage: str) -> dict[str, dg.AssetChecksDefinition]:
    return {next(iter(check.check_keys)).name: check for check in health_assets.health_checks
            if next(iter(check.check_keys)).asset_key == dg.AssetKey(stage)}


def materialize_record(instance: dg.DagsterInstance, asset: str, run_dir: Path) -> None:
    checkpoint = store.checkpoints_dir(run_dir) / store.step_dir_name(6)
    instance.report_runless_asset_event(dg.AssetMaterialization(
        asset, metadata={"run_dir": str(run_dir), "run_id": run_dir.name, "checkpoint": str(checkpoint)}))


def test_the_asset_checks_read_the_stage_and_baseline_from_the_instance(run_dir: Path, broken: Path) -> None:
    for stage, asset in (("pretrain", pretrain), ("finetune", finetune)):  # four each, beside the stage's own
        own = {key.name for key in asset.check_keys}
        assert own == set(CHECKPOINT_CHECKS)
        assert set(checks_of(stage)) == {"no_stall", "restarts_within_budget", "checkpoint_not_corrupted",
                                         "throughput_vs_step_profile"}
    checks = checks_of("pretrain")
    assert checks["checkpoint_not_corrupted"].check_specs_by_output_name and \
        next(iter(checks["checkpoint_not_corrupted"].check_specs)).blocking
    assert not next(iter(checks["throughput_vs_step_profile"].check_specs)).blocking
    with dg.instance_for_test() as instance:
        context = dg.build_asset_check_context(instance=instance)
        never = checks["no_stall"](context)  # the stage never materialized: said, not raised
        assert not never.passed and "no materialization" in never.description
        materialize_record(instance, "pretrain", run_dir)
        results = {name: check(dg.build_asset_check_context(instance=instance)) for name, check in checks.items()}
        assert all(result.passed for result in results.values()), {n: r.description for n, r in results.items()}
        assert results["throughput_vs_step_profile"].metadata["skipped"].value  # no step_profile yet
        materialize_record(instance, "step_profile", run_dir)  # the same figures: compared, 100%
        compared = checks["throughput_vs_step_profile"](dg.build_asset_check_context(instance=instance))
        assert compared.passed and compared.metadata["ratio"].value == 1
        (store.checkpoints_dir(broken) / store.step_dir_name(4) / store.RECORD_NAME).write_text("{}")
        materialize_record(instance, "pretrain", broken)
        blocked = checks["checkpoint_not_corrupted"](dg.build_asset_check_context(instance=instance))
        assert not blocked.passed and blocked.severity == dg.AssetCheckSeverity.ERROR
