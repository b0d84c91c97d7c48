"""Asset tests: materialize the media lifecycle and its checks on a copy of the demo media."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import dagster as dg
import pytest
from helpers import DEMO_MAX_QUARANTINE_FRACTION, copy_media, write_clip

from assets import checks, data
from ops.curation import manifest as manifest_ops
from ops.curation import quarantine as quarantine_ops
from ops.publish.hashing import digest_json
from ops.curation.validation import ValidationConfig
from pipelines.sensors import manifest_job
from resources.launcher import LocalTorchrunLauncher
from resources import LineageResource, StorageResource

LINEAGE_FIELDS = ("git_commit", "git_dirty", "container_digest", "env_digest", "manifest_version", "config_hash",
                  "code_version")
ASSETS = [data.raw_media, data.dataset_manifest, data.validated_manifest_and_quarantine]
VALIDATION_OP = "validated_manifest_and_quarantine"


def _run_config(**validation: object) -> dict:
    config = {"max_quarantine_fraction": DEMO_MAX_QUARANTINE_FRACTION, **validation}
    return {"ops": {VALIDATION_OP: {"config": config}}}


def _resources(media_root: Path, data_root: Path) -> dict:
    return {"storage": StorageResource(media_root=str(media_root), data_root=str(data_root)),
            "lineage": LineageResource(), "launcher": LocalTorchrunLauncher()}


def _materializations(result: dg.ExecuteInProcessResult) -> dict[str, dg.AssetMaterialization]:
    return {event.asset_key.to_user_string(): event.materialization
            for event in result.get_asset_materialization_events()}


def _data_versions(result: dg.ExecuteInProcessResult) -> dict[str, str]:
    return {key: m.tags["dagster/data_version"] for key, m in _materializations(result).items()}


def _row_count(result: dg.ExecuteInProcessResult, key: str) -> int:
    return _materializations(result)[key].metadata["dagster/row_count"].value


def _checks(result: dg.ExecuteInProcessResult) -> dict[str, bool]:
    return {f"{e.asset_key.to_user_string()}:{e.check_name}": e.passed for e in result.get_asset_check_evaluations()}


@pytest.fixture(scope="module")
def first_run(demo, tmp_path_factory: pytest.TempPathFactory):
    """One materialization of every asset and check on a private copy of the demo media."""
    base = tmp_path_factory.mktemp("assets")
    media_root = copy_media(demo.out_dir, base / "media")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRAINYARD_CONTAINER_DIGEST", "sha256:test-image")
        result = dg.materialize([*ASSETS, *checks.all_checks], resources=_resources(media_root, base / "data"),
                                instance=dg.DagsterInstance.ephemeral(tempdir=str(base / "dagster")),
                                run_config=_run_config(), raise_on_error=False)
    return result, base / "data"


def test_materialize_succeeds_and_every_check_passes(first_run) -> None:
    result, _ = first_run
    assert result.success
    assert set(_materializations(result)) == {"raw_media", "dataset_manifest", "validated_manifest", "quarantine"}
    assert _checks(result) == dict.fromkeys([
        "dataset_manifest:manifest_covers_listing", "validated_manifest:accepted_rows_conform",
        "validated_manifest:no_duplicate_assets", "validated_manifest:no_split_leakage",
        "validated_manifest:objects_unchanged", "validated_manifest:quarantine_rate",
        "validated_manifest:train_split_nonempty"], True)


def test_every_materialization_carries_lineage(first_run) -> None:
    result, _ = first_run
    materializations = _materializations(result)
    versions = _data_versions(result)
    for key, materialization in materializations.items():
        values = {name: materialization.metadata[name].value for name in LINEAGE_FIELDS}
        assert isinstance(values["git_dirty"], bool), key
        assert all(isinstance(values[name], str) and values[name] for name in LINEAGE_FIELDS if name != "git_dirty")
        assert values["container_digest"] == "sha256:test-image"
        assert values["code_version"] == materialization.tags["dagster/code_version"], key
    assert materializations["raw_media"].metadata["manifest_version"].value == "none"
    for key in ("dataset_manifest", "validated_manifest", "quarantine"):
        assert materializations[key].metadata["manifest_version"].value == versions["dataset_manifest"], key
    ran_with = ValidationConfig(max_quarantine_fraction=DEMO_MAX_QUARANTINE_FRACTION)
    assert materializations["validated_manifest"].metadata["config_hash"].value == digest_json(asdict(ran_with))


def test_outputs_are_published_under_the_data_root(first_run, demo) -> None:
    result, data_root = first_run
    versions = _data_versions(result)
    manifest = manifest_ops.read_manifest(versions["dataset_manifest"], data_root)
    assert manifest.version == versions["dataset_manifest"]
    assert (data_root / "listings" / versions["raw_media"] / "listing.parquet").is_file()
    validated = quarantine_ops.validated_dir(data_root, versions["validated_manifest"])
    quarantined = quarantine_ops.read_quarantine(validated)
    # The reason codes the assets publish are the ones the demo set was built to trip.
    assert set(quarantined["reason"]) == set(demo.bad.values()) | {"split_leakage"}
    report = json.loads((validated / quarantine_ops.REPORT_FILE).read_text())
    assert report["num_quarantined"] == len(quarantined) == _row_count(result, "quarantine")
    assert quarantine_ops.ledger_path(data_root).is_file()
    assert _row_count(result, "validated_manifest") == report["num_accepted"]


def test_data_versions_follow_the_media(demo, tmp_path: Path) -> None:
    media_root = copy_media(demo.out_dir, tmp_path / "media")
    definitions = dg.Definitions(assets=ASSETS, asset_checks=checks.all_checks, jobs=[manifest_job],
                                 resources=_resources(media_root, tmp_path / "data"))
    job = definitions.resolve_job_def("manifest_job")
    instance = dg.DagsterInstance.ephemeral(tempdir=str(tmp_path / "dagster"))

    def run() -> dg.ExecuteInProcessResult:
        result = job.execute_in_process(instance=instance, run_config=_run_config(), raise_on_error=False)
        assert result.success and all(_checks(result).values()), _checks(result)
        return result

    first, unchanged = run(), run()
    assert _data_versions(unchanged) == _data_versions(first)

    clip = write_clip(media_root / "clips" / "clip_new.mp4", width=128, height=96, num_frames=25, seed=7)
    Path(f"{clip}.json").write_text(json.dumps({"caption": "new", "license": "CC0-1.0", "consent": "granted",
                                                "source_group": "group_new", "split": "train"}))
    added = run()
    for key in ("raw_media", "dataset_manifest", "validated_manifest"):
        assert _data_versions(added)[key] != _data_versions(first)[key], key
    assert _row_count(added, "validated_manifest") == _row_count(first, "validated_manifest") + 1
    assert _data_versions(added)["quarantine"] != _data_versions(first)["quarantine"], (
        "quarantine rows name the manifest version they were seen in")


def test_failing_blocking_check_blocks_downstream(demo, tmp_path: Path) -> None:
    @dg.asset(deps=["validated_manifest"])
    def downstream_of_validated() -> None:
        """Stands in for clip_shards: must not run on a set that failed a blocking check."""

    media_root = copy_media(demo.out_dir, tmp_path / "media")
    result = dg.materialize([*ASSETS, *checks.all_checks, downstream_of_validated],
                            resources=_resources(media_root, tmp_path / "data"),
                            instance=dg.DagsterInstance.ephemeral(tempdir=str(tmp_path / "dagster")),
                            run_config=_run_config(max_quarantine_fraction=0.0), raise_on_error=False)
    assert not result.success
    evaluations = _checks(result)
    assert evaluations.pop("validated_manifest:quarantine_rate") is False
    assert all(evaluations.values()), evaluations
    assert "validated_manifest" in _materializations(result)
    assert "downstream_of_validated" not in _materializations(result)
    failed_steps = {event.step_key for event in result.all_events if event.is_step_failure}
    assert failed_steps == {"validated_manifest_quarantine_rate"}
    (failure,) = [event for event in result.all_events if event.is_step_failure]
    assert "quarantine_rate" in failure.event_specific_data.error.message
