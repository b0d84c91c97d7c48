"""The one Definitions load test: assets, checks, jobs, sensors and resources resolve."""

from __future__ import annotations

import importlib

import dagster as dg
import pytest

ASSET_KEYS = {"raw_media", "dataset_manifest", "validated_manifest", "quarantine"}
CHECKS = {("validated_manifest", name) for name in ("accepted_rows_conform", "no_duplicate_assets",
                                                    "no_split_leakage", "quarantine_rate", "train_split_nonempty",
                                                    "objects_unchanged")} | {("dataset_manifest",
                                                                              "manifest_covers_listing")}


@pytest.fixture(scope="module")
def defs() -> dg.Definitions:
    from pipelines.definitions import defs

    return defs


def test_definitions_load_and_validate(defs: dg.Definitions) -> None:
    dg.Definitions.validate_loadable(defs)
    graph = defs.resolve_asset_graph()
    assert ASSET_KEYS <= {key.to_user_string() for key in graph.get_all_asset_keys()}


def test_every_check_exists_and_blocks(defs: dg.Definitions) -> None:
    graph = defs.resolve_asset_graph()
    checks = {(key.asset_key.to_user_string(), key.name): key for key in graph.asset_check_keys}
    assert set(checks) >= CHECKS
    # Every check blocks, except the judgements for a person (assets/health.py): the evaluation's
    # regression warning, a stall, restarts and a throughput regression. A corrupted checkpoint blocks.
    advisory = {(f"evaluation/{stage}", "no_regression") for stage in ("pretrain", "finetune")}
    advisory |= {(stage, name) for stage in ("pretrain", "finetune")
                 for name in ("no_stall", "restarts_within_budget", "throughput_vs_step_profile")}
    assert advisory <= set(checks)
    assert {name: graph.get_check_spec(key).blocking for name, key in checks.items()} == {
        name: name not in advisory for name in checks}


def test_manifest_job_runs_the_assets_and_their_checks(defs: dg.Definitions) -> None:
    job = defs.resolve_job_def("manifest_job")
    assert {key.to_user_string() for key in job.asset_layer.selected_asset_keys} == ASSET_KEYS
    ops = {node.name for node in job.graph.node_defs}
    assert {f"{asset}_{check}" for asset, check in CHECKS} <= ops


def test_media_change_sensor_requests_the_manifest_job(defs: dg.Definitions) -> None:
    sensor = defs.resolve_sensor_def("media_change_sensor")
    assert sensor.job_name == "manifest_job"
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING


def test_local_resources_follow_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from pipelines.definitions import resources_for

    monkeypatch.setenv("TRAINYARD_MEDIA_ROOT", str(tmp_path / "m"))
    monkeypatch.setenv("TRAINYARD_DATA_ROOT", str(tmp_path / "d"))
    storage = resources_for("local")["storage"]
    assert (storage.media_root, storage.data_root) == (str(tmp_path / "m"), str(tmp_path / "d"))


def test_unknown_environment_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import pipelines.definitions as module

    with pytest.raises(ValueError, match="bogus"):
        module.resources_for("bogus")
    monkeypatch.setenv("TRAINYARD_ENV", "bogus")
    try:
        with pytest.raises(ValueError, match="TRAINYARD_ENV='bogus'"):
            importlib.reload(module)
    finally:
        monkeypatch.delenv("TRAINYARD_ENV")
        importlib.reload(module)
    assert isinstance(module.defs, dg.Definitions)


def test_the_demo_runs_everything_but_the_weekly_reproduction_and_skips_only_what_nothing_it_runs_needs(
        defs: dg.Definitions) -> None:
    from pipelines.demo import demo_selection

    _, after = demo_selection(defs)
    names = {key.to_user_string() for key in after}
    assert {"pretrain", "finetune", "restore_drill"} <= names and "reproduction" not in names
    assert ("reproduction", "reproduced") in {(key.asset_key.to_user_string(), key.name)
                                              for key in defs.resolve_asset_graph().asset_check_keys}
    # The team deployment's test skips finetune and its evaluation: the reproduction depending on it is not run.
    _, fewer = demo_selection(defs, ("finetune", "evaluation/finetune"))
    assert {key.to_user_string() for key in fewer} == names - {"finetune", "evaluation/finetune"}
    with pytest.raises(ValueError, match="--skip finetune: other assets need it"):
        demo_selection(defs, ("finetune",))
    with pytest.raises(ValueError, match="--skip reproduction: not one of"):
        demo_selection(defs, ("reproduction",))
    assert {job.name for job in defs.jobs} >= {"reproduction_job"}
    assert {schedule.name: schedule.cron_schedule for schedule in defs.schedules}["weekly_reproduction"] == "0 4 * * 0"
