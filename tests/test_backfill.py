"""Data work as array tasks (issue 36), the parts that need no cluster: the task runner, the array
script, the checks before submission, a source changed between probe and shard writing, and a
backfill run of several partitions on the local path (one materialization per partition, the failed
ones named). The same pieces on the real multi-node cluster: tests/test_slurm_nodes.py.

Run: .venv/bin/python -m pytest -q tests/test_backfill.py
"""

from __future__ import annotations

import io
import json
import os
import random
from pathlib import Path

import dagster as dg
import pytest
from helpers import DEMO_MAX_QUARANTINE_FRACTION

from assets import backfill, clips as clip_assets
from ops import array_tasks
from ops.clips import plan as plan_ops, shards
from ops.curation import manifest as manifest_ops, validation as validation_ops
from resources import LineageResource, StorageResource
from resources.launcher import LocalTorchrunLauncher
from resources.sbatch_script import SbatchSettingError
from resources.slurm import SlurmLauncher
from resources.slurm_array import render


@pytest.fixture(scope="module")
def planned(demo, tmp_path_factory: pytest.TempPathFactory):
    """A private copy of the demo media, its plan of 4 clips per shard, written to its shard folder."""
    from helpers import copy_media

    base = tmp_path_factory.mktemp("backfill")
    media = copy_media(demo.out_dir, base / "media")
    manifest = manifest_ops.build_manifest(media, manifest_ops.ManifestConfig())
    validation = validation_ops.validate(manifest, validation_ops.ValidationConfig(
        max_quarantine_fraction=DEMO_MAX_QUARANTINE_FRACTION))
    plan = plan_ops.plan_clips(validation.accepted, clip_assets.ShardBuildConfig(clips_per_shard=4).to_ops(),
                               manifest_version=manifest.version, validated_version=validation.version)
    plan_dir = base / "data" / "shards" / plan.version
    plan_ops.write_plan(plan, plan_dir)
    return base, media, plan, plan_dir


def test_the_tar_writer_writes_what_webdatasets_own_writer_writes(tmp_path: Path) -> None:
    import webdataset

    rng = random.Random(0)
    samples = [{"__key__": f"sample-{n:04d}", "meta.json": json.dumps({"n": n}).encode(),
                "clip.mkv": rng.randbytes(rng.randrange(0, 3000)), "audio.npy": rng.randbytes(700)}
               for n in range(5)]
    theirs, ours = io.BytesIO(), io.BytesIO()
    with webdataset.TarWriter(theirs, user="", group="", mtime=0, encoder=False) as writer:
        for sample in samples:
            writer.write(sample)
    with shards._SampleTarWriter(ours) as writer:
        for sample in samples:
            writer.write(sample)
    assert ours.getvalue() == theirs.getvalue()


def test_a_source_changed_after_it_was_probed_is_refused_by_checksum_and_named(planned, tmp_path: Path) -> None:
    base, media, plan, _ = planned
    shard = plan.shards[0]
    rows = plan.rows_for(shard)
    uri = rows[0]["uri"]
    before = shards.write_shard(plan, shard, media, tmp_path / "before")
    assert not before.failures
    changed = tmp_path / "media"
    import shutil

    shutil.copytree(media, changed, symlinks=True)
    data = bytearray((changed / uri).read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte edited in place: the size and the container still look right
    (changed / uri).write_bytes(bytes(data))
    after = shards.write_shard(plan, shard, changed, tmp_path / "after")
    refused = [failure for failure in after.failures if failure["uri"] == uri]
    assert refused and len(refused) == sum(row["uri"] == uri for row in rows), "every clip of that source"
    assert all(failure["reason"].startswith("checksum_mismatch: ") and uri in failure["reason"] for failure in refused)
    assert after.num_samples == before.num_samples - len(refused), "the other sources are still cut"
    # Swapped for another file by rename (a new inode under the same name): refused the same way.
    other = next(row["uri"] for row in plan.table.to_pylist() if row["uri"] != uri)
    os.replace(changed / other, changed / uri)
    swapped = shards.write_shard(plan, shard, changed, tmp_path / "swapped")
    assert any(failure["uri"] == uri and failure["reason"].startswith("checksum_mismatch") for failure in swapped.failures)
    # Swapped for a symlink: never followed.
    (changed / uri).unlink()
    (changed / uri).symlink_to(media / uri)
    linked = shards.write_shard(plan, shard, changed, tmp_path / "linked")
    assert any(failure["uri"] == uri and "regular file" in failure["reason"] for failure in linked.failures)


def test_a_task_writes_the_shard_a_step_writes_and_a_task_missing_a_setting_is_refused_by_name(planned,
                                                                                             tmp_path: Path) -> None:
    _, media, plan, plan_dir = planned
    work = tmp_path / "work"
    shard = plan.shards[1]
    spec = array_tasks.write_spec(work / "round-1" / "spec.json", {
        "kind": "shards", "work_dir": str(work), "tasks": [[shard]], "plan_dir": str(plan_dir),
        "media_root": str(media), "out_dir": str(tmp_path / "out"), "round": 1,
        "needs": backfill.task_needs(media_root=str(media), plan_dir=str(plan_dir), out_dir=str(tmp_path / "out"))})
    assert array_tasks.main(["--spec", str(spec), "--task", "0"]) == 0
    record = json.loads(array_tasks.partition_result_path(work, shard).read_text())
    local = shards.write_shard(plan, shard, media, tmp_path / "local")
    assert record["class"] == "ok" and record["sha256"] == local.sha256 and record["round"] == 1
    assert record["bytes_read"] > 0 and record["decode_s"] > 0 and record["num_frames"] > 0
    # A task whose node lacks the media root or the store's credentials does no work: every one of
    # its partitions is refused, naming the setting.
    missing = array_tasks.write_spec(work / "round-2" / "spec.json", {
        "kind": "shards", "work_dir": str(work), "tasks": [[plan.shards[2], plan.shards[3]]],
        "plan_dir": str(plan_dir), "media_root": "s3://bucket/media", "out_dir": str(tmp_path / "out"), "round": 2,
        "needs": backfill.task_needs(media_root="s3://bucket/media", plan_dir=str(tmp_path / "gone"),
                                     out_dir=str(tmp_path / "out"))})
    env = {key: value for key, value in os.environ.items() if not key.startswith(("AWS_", "TRAINYARD_S3"))}
    with pytest.MonkeyPatch.context() as patch:
        for key in set(os.environ) - set(env):
            patch.delenv(key)
        assert array_tasks.main(["--spec", str(missing), "--task", "0"]) == 2
    for partition in plan.shards[2:4]:
        refused = json.loads(array_tasks.partition_result_path(work, partition).read_text())
        assert refused["class"] == "refused"
        for name in ("AWS_ACCESS_KEY_ID", "TRAINYARD_S3_ENDPOINT_URL", "the clip plan (TRAINYARD_DATA_ROOT)"):
            assert name in refused["reason"], (name, refused["reason"])
    assert array_tasks.main(["--spec", str(spec), "--task", "5"]) == 2, "a task id past the spec's tasks"


def _array_launcher(**fields) -> SlurmLauncher:
    return SlurmLauncher(**{"partition": "nodes", "array_parallel": 3, "array_task_time": "00:10:00", **fields})


def test_the_array_script_caps_running_tasks_and_starts_at_its_offset(tmp_path: Path) -> None:
    script = render(_array_launcher(exclude=["node3"]), name="clip_shards", spec_path=tmp_path / "spec.json",
                    offset=1000, count=7, log_dir=tmp_path / "logs")
    assert "#SBATCH --array=0-6%3\n" in script and "#SBATCH --time=00:10:00\n" in script
    assert "#SBATCH --no-requeue\n" in script and "#SBATCH --exclude=node3\n" in script
    assert '--task "$SLURM_ARRAY_TASK_ID" --offset 1000' in script
    assert script.rstrip().splitlines()[-1].startswith("exec "), "the task gets scancel's SIGTERM itself"
    uncapped = render(_array_launcher(array_parallel=0), name="x", spec_path=tmp_path / "s.json", offset=0, count=1,
                      log_dir=tmp_path)
    assert "#SBATCH --array=0-0\n" in uncapped


@pytest.mark.parametrize("field, value", [("name", "clip_shards\n#SBATCH --uid=0"), ("spec", "a\nb.json"),
                                          ("array_task_time", "1:00\nrm -rf /"), ("exclude", ["node1\nnode2"]),
                                          ("array_parallel", -1), ("partition", "nodes;rm -rf /"),
                                          ("account", "a b"), ("mem", "1G\n#SBATCH --uid=0")])
def test_a_value_that_would_break_out_of_the_array_script_is_refused(field: str, value, tmp_path: Path) -> None:
    launcher = _array_launcher(**({field: value} if field not in ("name", "spec") else {}))
    with pytest.raises((SbatchSettingError, ValueError)):
        render(launcher, name=value if field == "name" else "clip_shards",
               spec_path=Path(value) if field == "spec" else tmp_path / "spec.json", offset=0, count=2,
               log_dir=tmp_path)


def test_the_backfill_policy_groups_partitions_only_where_data_work_runs_on_slurm(monkeypatch) -> None:
    monkeypatch.delenv("TRAINYARD_ENV", raising=False)
    assert backfill.backfill_policy() is None
    monkeypatch.setenv("TRAINYARD_ENV", "cluster+slurm")
    assert backfill.backfill_policy().max_partitions_per_run == 64
    monkeypatch.setenv(backfill.PARTITIONS_PER_RUN_ENV, "8")
    assert backfill.backfill_policy().max_partitions_per_run == 8
    for bad in ("0", "eight", "-1", "8\n"):
        monkeypatch.setenv(backfill.PARTITIONS_PER_RUN_ENV, bad)
        with pytest.raises(ValueError, match=backfill.PARTITIONS_PER_RUN_ENV):
            backfill.backfill_policy()


def test_check_needs_names_each_missing_piece(tmp_path: Path) -> None:
    needs = {"paths": {"the media root (TRAINYARD_MEDIA_ROOT)": str(tmp_path / "absent"),
                       "the store": "s3://bucket/x"},
             "env": {"TRAINYARD_HMAC_KEY": "the key the digest records are signed with"}}
    problems = array_tasks.check_needs(needs, environ={})
    assert len(problems) == 3
    assert "TRAINYARD_MEDIA_ROOT" in problems[0] and "AWS_SECRET_ACCESS_KEY" in problems[1]
    assert "TRAINYARD_HMAC_KEY" in problems[2]
    assert array_tasks.check_needs({"paths": {"x": str(tmp_path)}}, environ={}) == []


def _local_job(base: Path, media: Path, plan, plan_dir: Path) -> dg.JobDefinition:
    @dg.asset(name="clip_plan")
    def fixed_plan() -> dict:
        return {"version": plan.version, "path": str(plan_dir), "media_root": str(media), "shards": plan.shards}

    resources = {"storage": StorageResource(media_root=str(media), data_root=str(base / "data")),
                 "lineage": LineageResource(), "launcher": LocalTorchrunLauncher()}
    return dg.Definitions(assets=[fixed_plan, clip_assets.clip_shards],
                          resources=resources).resolve_implicit_global_asset_job_def()


def test_a_run_of_several_partitions_materializes_each_and_names_the_one_that_failed(planned, tmp_path: Path) -> None:
    base, media, plan, plan_dir = planned
    keys = plan.shards[:4]
    broken = keys[2]
    (plan_dir / f"{broken}.index.parquet").mkdir(parents=True)  # its index cannot be published
    try:
        with dg.DagsterInstance.ephemeral() as instance:
            instance.add_dynamic_partitions("clip_shards", plan.shards)
            job = _local_job(base, media, plan, plan_dir)
            job.execute_in_process(instance=instance, asset_selection=[dg.AssetKey("clip_plan")])
            result = job.execute_in_process(
                instance=instance, raise_on_error=False, asset_selection=[dg.AssetKey("clip_shards")],
                tags={"dagster/asset_partition_range_start": keys[0], "dagster/asset_partition_range_end": keys[-1]})
            assert not result.success
            failure = [event for event in result.all_events if event.is_step_failure][0]
            description = failure.step_failure_data.user_failure_data.description
            assert "1 of 4 partition(s) failed" in description and broken in description
            assert "IsADirectoryError" in description or "Errno" in description, description
            materialized = {event.materialization.partition: event.materialization
                            for event in result.get_asset_materialization_events()}
            assert sorted(materialized) == sorted(set(keys) - {broken})
            assert instance.get_materialized_partitions(dg.AssetKey("clip_shards")) == set(keys) - {broken}
            for key, event in materialized.items():
                sha = shards.sha256_file(plan_dir / f"{key}.tar")
                assert event.metadata["sha256"].value == sha and event.tags["dagster/data_version"] == sha[:20]
                assert event.metadata["node"].value and event.metadata["slurm_job"].value == "none"
            report = json.loads(Path(materialized[keys[0]].metadata["backfill_report"].value).read_text())
            assert report["where"] == "local" and report["num_written"] == 3
            assert report["partitions"][broken]["class"] == "error"
            # data_profile's view: the plan's backfills summed per node.
            summary = backfill.plan_backfills(base / "data", plan.version)
            assert summary["runs"] >= 1
            (node, stats), = summary["nodes"].items()
            assert stats["partitions_written"] >= 3 and stats["failures"] >= 1 and stats["bytes_read"] > 0
    finally:
        (plan_dir / f"{broken}.index.parquet").rmdir()


def test_a_shard_changed_after_its_writer_recorded_it_is_not_materialized(planned, tmp_path: Path) -> None:
    _, media, plan, _ = planned
    shard = plan.shards[0]
    out = tmp_path / "out"
    result = shards.write_shard(plan, shard, media, out)
    record = {"partition": shard, **array_tasks.shard_record(result)}
    assert backfill.verify_published(record, out) == ""
    assert "changed after it was published" in backfill.verify_published({**record, "sha256": "0" * 64}, out)
    with open(out / f"{shard}.tar", "r+b") as handle:
        handle.truncate(result.size_bytes - 512)
    assert "changed after it was published" in backfill.verify_published(record, out)
    (out / f"{shard}.index.parquet").unlink()
    assert "cannot be read" in backfill.verify_published(record, out)


def test_a_prober_that_loses_an_objects_result_fails_the_build_never_a_row_left_out(planned) -> None:
    _, media, _, _ = planned

    def losing(media_root, targets, config):
        results = manifest_ops.probe_targets(media_root, targets, config)
        results.pop(targets[3].uri)  # a chunk whose task died, merged as if it had not been listed
        return results

    with pytest.raises(RuntimeError, match="no result for 1 object"):
        manifest_ops.build_manifest(media, manifest_ops.ManifestConfig(), prober=losing)
    # The same prober returning every result builds the one-machine manifest.
    assert manifest_ops.build_manifest(media, manifest_ops.ManifestConfig(),
                                       prober=manifest_ops.probe_targets).version == \
        manifest_ops.build_manifest(media, manifest_ops.ManifestConfig()).version


def test_only_the_staging_files_of_the_runs_own_jobs_are_swept(tmp_path: Path) -> None:
    from resources.slurm_array import _sweep

    ours = tmp_path / ".train-00001.tar.tmp-j123-5f0c"  # a task of job 123 SIGKILLed mid-shard
    theirs = tmp_path / ".train-00001.tar.tmp-j1234-9a1b"  # another backfill's job, still writing
    local = tmp_path / ".train-00001.tar.tmp-77aa"  # a step on this machine, still writing
    shard = tmp_path / "train-00001.tar"
    for path in (ours, theirs, local, shard):
        path.write_bytes(b"x")
    _sweep(dg.build_asset_context(), {"123": (0, 1, 0.0)}, [tmp_path])
    assert not ours.exists() and theirs.exists() and local.exists() and shard.exists()
