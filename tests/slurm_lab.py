"""What the SLURM tests share (tests/test_slurm.py on one node, tests/test_slurm_nodes.py on the
namespace nodes of ``make slurm-up NODES=3``): a lab with published shards and a Dagster instance,
pretrain materialized through a SlurmLauncher, and readers for what the runs left.

Without a cluster the importing module is skipped, unless TRAINYARD_REQUIRE_SLURM=1 (as .ci/run
sets it), where a missing cluster fails it (``require_cluster``).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import pytest
from helpers import captured_fds, write_shards

from assets import training, training_faults
from ops.checkpoints import store
from ops.clips.shard_ref import ShardIndexRef
from ops.clips.shards import ShardConfig
from ops.curation import manifest as manifest_ops
from resources import LineageResource, StorageResource
from resources.slurm import SlurmLauncher, run_slurm
from trainer.launch.stage_launch import StageLaunch

CONFIG = "configs/test_tiny.yaml"
QUIET = {"console": {"config": {"log_level": "WARNING"}}}


def cluster_up() -> bool:
    try:
        return "is UP" in subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False


def require_cluster(what: str = "a SLURM controller", *, ready: bool | None = None) -> None:
    """Skip the calling module when the cluster is not here, or fail it under TRAINYARD_REQUIRE_SLURM=1."""
    if ready is None:
        ready = cluster_up()
    if not ready:
        if os.environ.get("TRAINYARD_REQUIRE_SLURM") == "1":
            raise RuntimeError(f"TRAINYARD_REQUIRE_SLURM=1 but {what} is not here: run `make slurm-up NODES=3` "
                               f"(as root)")
        pytest.skip(f"{what} is not here (make slurm-up NODES=3 starts it)", allow_module_level=True)


@dataclasses.dataclass
class SlurmLab:
    base: Path
    instance: dg.DagsterInstance
    storage: StorageResource
    launcher: SlurmLauncher
    shard_index: dict
    output: Path
    reference: Path | None = None
    """The uninterrupted run's folder (test_a_two_rank_pretrain...): the requeued run must match it."""

    def materialize(self, run_config: dict, *, ok: bool = True, launcher: SlurmLauncher | None = None,
                    run_id: str | None = None) -> dg.ExecuteInProcessResult:
        shard_index = self.shard_index

        @dg.asset(name="shard_index")
        def fixed_shard_index() -> dict:
            return shard_index

        resources = {"storage": self.storage, "launcher": launcher or self.launcher, "lineage": LineageResource()}
        job = dg.Definitions(assets=[fixed_shard_index, training.pretrain],
                             resources=resources).resolve_implicit_global_asset_job_def()
        with captured_fds(self.output, append=True):
            result = job.execute_in_process(instance=self.instance, run_config=run_config, raise_on_error=False,
                                            run_id=run_id)
        if ok:
            assert result.success, [event.message for event in result.all_events if event.is_failure]
        return result

    def drill(self, parent: dict, *, launcher: SlurmLauncher, other_world_size: int) -> dg.ExecuteInProcessResult:
        """restore_drill of ``parent`` (a pretrain materialization's metadata), its continuations
        submitted by ``launcher``: ``parent`` is reported as pretrain's latest materialization first,
        since the drill drills the latest one."""
        self.instance.report_runless_asset_event(dg.AssetMaterialization("pretrain", metadata=parent))
        shard_index = self.shard_index

        @dg.asset(name="shard_index")
        def fixed_shard_index() -> dict:
            return shard_index

        resources = {"storage": self.storage, "launcher": launcher, "lineage": LineageResource()}
        job = dg.Definitions(assets=[fixed_shard_index, training.pretrain, training.restore_drill],
                             resources=resources).resolve_implicit_global_asset_job_def()
        run_config = {"loggers": QUIET, "ops": {"restore_drill": {"config": {"other_world_size": other_world_size}}}}
        with captured_fds(self.output, append=True):
            return job.execute_in_process(instance=self.instance, run_config=run_config, raise_on_error=False,
                                          asset_selection=[dg.AssetKey("restore_drill")])

    def fault_drill(self, config: dict, *, launcher: SlurmLauncher | None = None,
                    ok: bool = True) -> dg.ExecuteInProcessResult:
        """fault_drill (assets/training_faults.py) with ``config``, its runs submitted by ``launcher``."""
        shard_index = self.shard_index

        @dg.asset(name="shard_index")
        def fixed_shard_index() -> dict:
            return shard_index

        resources = {"storage": self.storage, "launcher": launcher or self.launcher, "lineage": LineageResource()}
        job = dg.Definitions(assets=[fixed_shard_index, training.pretrain, training_faults.fault_drill],
                             resources=resources).resolve_implicit_global_asset_job_def()
        run_config = {"loggers": QUIET, "ops": {"fault_drill": {"config": config}}}
        with captured_fds(self.output, append=True):
            result = job.execute_in_process(instance=self.instance, run_config=run_config, raise_on_error=False,
                                            asset_selection=[dg.AssetKey("shard_index"), dg.AssetKey("fault_drill")])
        if ok:
            assert result.success, [event.message for event in result.all_events if event.is_failure]
        return result

    def launch(self, **fields) -> StageLaunch:
        return StageLaunch(stage="pretrain", config_path=str(Path(CONFIG).resolve()),
                           data=ShardIndexRef.of(self.shard_index), steps=6,
                           world_size=fields.pop("world_size", 2), run_dir=str(self.base / "data" / "runs" / "x"),
                           **fields)

    def job_ids(self, run_id: str) -> list[str]:
        """The SLURM jobs a Dagster run submitted, in order (from its log); [] before it is stored."""
        try:
            logs = [entry.message or "" for entry in self.instance.all_logs(run_id)]
        except Exception:  # noqa: BLE001 - the run may not be in storage yet
            return []
        return [message.split("submitted SLURM job ")[1].split()[0] for message in logs
                if "submitted SLURM job " in message]

    def logged(self, run_id: str, *prefixes: str) -> bool:
        try:
            return any((entry.message or "").startswith(prefixes) for entry in self.instance.all_logs(run_id))
        except Exception:  # noqa: BLE001 - the run may not be in storage yet
            return False


@contextmanager
def slurm_lab(demo_manifest, demo_validation, base: Path, launcher: SlurmLauncher, *, key: str):
    """A SlurmLab in ``base``: the demo manifest and train shards published under HMAC ``key``."""
    data = base / "data"
    mlflow_uri = f"sqlite:///{base / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRAINYARD_HOME", str(base / "home"))
        patch.setenv("TRAINYARD_DATA_ROOT", str(data))
        patch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
        patch.setenv(store.HMAC_KEY_ENV, key)  # one key for the jobs and the checks
        # Published under that key: the digest records of the manifest, plan and index are signed
        # (ops.publish.storage), and the jobs and checks read them with it.
        manifest_ops.write_manifest(demo_manifest, manifest_ops.manifests_dir(data))
        _, index = write_shards(demo_validation, ShardConfig(splits=("train",), clips_per_shard=8), data / "shards")
        (base / "dagster").mkdir()
        with dg.DagsterInstance.local_temp(tempdir=str(base / "dagster")) as instance:
            yield SlurmLab(base=base, instance=instance,
                           storage=StorageResource(media_root=str(base / "media"), data_root=str(data)),
                           launcher=SlurmLauncher(**{**launcher.model_dump(), "mlflow_tracking_uri": mlflow_uri}),
                           shard_index={"path": str(data / "shards"), "manifest_version": index.manifest_version,
                                        "version": index.version},
                           output=base / "output.log")


def pretrain_config(nproc: int = 2, **config) -> dict:
    return {"loggers": QUIET, "ops": {"pretrain": {"config": {"config_path": CONFIG, "nproc": nproc, "steps": 6,
                                                              **config}}}}


def materialization(result: dg.ExecuteInProcessResult, asset: str = "pretrain") -> dict:
    (event,) = [e for e in result.get_asset_materialization_events() if e.asset_key.to_user_string() == asset]
    return {name: getattr(value, "value", value) for name, value in event.materialization.metadata.items()}


def failure_of(result: dg.ExecuteInProcessResult):
    """The step failure's user data (description, metadata as plain values)."""
    failure = [e.step_failure_data for e in result.all_events if e.is_step_failure][0].user_failure_data
    return failure, {key: getattr(value, "value", value) for key, value in failure.metadata.items()}


def sacct_state(job_id: str) -> str:
    state = ""
    for _ in range(60):  # slurmdbd records a job's end a moment after the controller
        state = run_slurm("sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State").strip()
        if state and state.split()[0] not in ("RUNNING", "PENDING", "COMPLETING"):
            return state.split()[0]
        time.sleep(0.5)
    return state


def processes_of_job(job_id: str) -> list[str]:
    """Live processes SLURM started for ``job_id`` (``SLURM_JOB_ID`` in their environment), as "pid: cmdline"."""
    needle = f"\0SLURM_JOB_ID={job_id}\0".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = b"\0" + (proc / "environ").read_bytes() + b"\0"
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # exited while we looked, or not readable: not a live process of ours
            continue
        if needle in environ and state != "Z":
            found.append(f"{proc.name}: {cmdline.strip()}")
    return found
