"""The team deployment (issue 13) against the real services of ``make cluster-up``
(deploy/cluster/up.sh: PostgreSQL, SeaweedFS's S3 gateway, the MLflow server, dagster-daemon and
the webserver), which .ci/run starts.

Without the services these tests are skipped, unless TRAINYARD_REQUIRE_CLUSTER=1 (as .ci/run sets
it), where missing services fail them.

Run: make cluster-up && python -m pytest tests/test_cluster.py -q
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import boto3
import dagster as dg
import mlflow
import psycopg2
import pytest
from helpers import DEMO_MAX_QUARANTINE_FRACTION, copy_media

from assets.stage_runs import TRAINING_POOL
from ops.publish.hashing import sha256_file
from ops.publish.paths import REPO_ROOT
from pipelines import environment

# Read before conftest's per-test homes: the services' own folder, as `make cluster-up` made it.
CLUSTER_HOME = Path(os.environ.get("TRAINYARD_CLUSTER_HOME") or REPO_ROOT / ".trainyard" / "cluster")
CLUSTER_ENV = CLUSTER_HOME / "cluster.env"
TRAINYARD = Path(sys.executable).parent / "trainyard"


def _services() -> dict[str, str] | None:
    if not CLUSTER_ENV.exists():
        return None
    values = environment.read_env_file(CLUSTER_ENV)
    saved = dict(os.environ)
    try:
        os.environ.update(values)
        os.environ["TRAINYARD_CLUSTER_HOME"] = str(CLUSTER_HOME)
        environment.check_cluster()
    except environment.DeploymentConfigError:
        return None
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return values


SERVICES = _services()
if SERVICES is None:
    if os.environ.get("TRAINYARD_REQUIRE_CLUSTER") == "1":
        raise RuntimeError(f"TRAINYARD_REQUIRE_CLUSTER=1 but the services of {CLUSTER_ENV} do not answer: "
                           "run `make cluster-up`")
    pytest.skip("no cluster deployment here (make cluster-up starts one)", allow_module_level=True)


@pytest.fixture(scope="module")
def test_database() -> str:
    """A Dagster database of this module's own on the cluster's PostgreSQL server.

    The daemon of `make cluster-up` watches the ``dagster`` database: its sensors would take the
    tests' materializations as new data and retrain on them. Tests write elsewhere, like every test
    writes under its own tmp_path; the server, the protocol and dagster-postgres are the same.
    """
    name = f"dagster_test_{uuid.uuid4().hex[:10]}"
    _admin(f"create database {name}")
    yield name
    # A fresh connection: a test restarts the server, which ends every connection open before.
    _admin("select pg_terminate_backend(pid) from pg_stat_activity where datname = %s", (name,))
    _admin(f"drop database if exists {name}")


def _admin(statement: str, parameters: tuple = ()) -> None:
    connection = psycopg2.connect(host=SERVICES["TRAINYARD_PG_HOST"], port=SERVICES["TRAINYARD_PG_PORT"],
                                  user=SERVICES["TRAINYARD_PG_USER"], password=SERVICES["TRAINYARD_PG_PASSWORD"],
                                  dbname="postgres")
    try:
        connection.autocommit = True
        with connection.cursor() as cursor:
            cursor.execute(statement, parameters)
    finally:
        connection.close()


@pytest.fixture
def cluster(monkeypatch, tmp_path: Path, test_database: str) -> Path:
    """TRAINYARD_ENV=cluster on the running services, with this test's own media, data and Dagster home."""
    monkeypatch.setenv("TRAINYARD_ENV", "cluster")
    monkeypatch.setenv("TRAINYARD_CLUSTER_HOME", str(CLUSTER_HOME))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster_home"))
    monkeypatch.setenv("TRAINYARD_PG_DB", test_database)
    monkeypatch.setenv("TRAINYARD_MEDIA_ROOT", str(tmp_path / "media"))
    monkeypatch.setenv("TRAINYARD_DATA_ROOT", str(tmp_path / "data"))
    for name in environment.load_cluster_env():
        # Recorded as unset, so undone after the test: cluster.env's settings (the checkpoint root
        # among them) must not reach later tests.
        monkeypatch.setenv(name, os.environ.pop(name))
    instance = _instance()
    instance.event_log_storage.set_concurrency_slots(TRAINING_POOL, 1)  # what make cluster-up stores
    return tmp_path


def _pg():
    env = os.environ
    return psycopg2.connect(host=env["TRAINYARD_PG_HOST"], port=env["TRAINYARD_PG_PORT"],
                            user=env["TRAINYARD_PG_USER"], password=env["TRAINYARD_PG_PASSWORD"],
                            dbname=env["TRAINYARD_PG_DB"])


def _event_count(run_id: str) -> int:
    with _pg() as connection, connection.cursor() as cursor:
        cursor.execute("select count(*) from event_logs where run_id = %s", (run_id,))
        return cursor.fetchone()[0]


def _instance() -> dg.DagsterInstance:
    from pipelines.instance import ensure_dagster_home

    ensure_dagster_home()
    return dg.DagsterInstance.get()


# ---- Dagster on PostgreSQL ----

def test_the_cluster_instance_is_postgres_with_a_run_queue_and_one_training_slot(cluster) -> None:
    from dagster_postgres import PostgresEventLogStorage, PostgresRunStorage

    instance = _instance()
    assert isinstance(instance.run_storage, PostgresRunStorage)
    assert isinstance(instance.event_log_storage, PostgresEventLogStorage)
    assert type(instance.run_coordinator).__name__ == "QueuedRunCoordinator"
    assert instance.get_concurrency_config().pool_config.default_pool_limit == 1
    # make cluster-up stored the training pool's one slot in the deployment's own database.
    with psycopg2.connect(host=SERVICES["TRAINYARD_PG_HOST"], port=SERVICES["TRAINYARD_PG_PORT"],
                          user=SERVICES["TRAINYARD_PG_USER"], password=SERVICES["TRAINYARD_PG_PASSWORD"],
                          dbname=SERVICES["TRAINYARD_PG_DB"]) as connection, connection.cursor() as cursor:
        cursor.execute('select "limit" from concurrency_limits where concurrency_key = %s', (TRAINING_POOL,))
        assert cursor.fetchone() == (1,)
    # The password is read from the environment when the instance loads; the file names the variable.
    text = (Path(os.environ["DAGSTER_HOME"]) / "dagster.yaml").read_text()
    assert os.environ["TRAINYARD_PG_PASSWORD"] not in text and "env: TRAINYARD_PG_PASSWORD" in text


def test_a_run_through_the_cluster_lands_its_events_in_postgres(cluster, demo) -> None:
    from pipelines.definitions import all_assets
    from resources import LineageResource, StorageResource

    copy_media(demo.out_dir, cluster / "media")
    instance = _instance()
    result = dg.materialize([a for a in all_assets if dg.AssetKey("raw_media") in a.keys], instance=instance,
                            resources={"storage": StorageResource.from_env(), "lineage": LineageResource()})
    assert result.success
    assert _event_count(result.run_id) >= 5  # run start, step start, materialization, step success, run success
    # Another process (the webserver, a colleague's `dagster` CLI) reads the same record.
    script = ("import dagster as dg, sys; from pipelines.instance import ensure_dagster_home; ensure_dagster_home();"
              "i = dg.DagsterInstance.get(); print(i.get_run_by_id(sys.argv[1]).status.value)")
    seen = subprocess.run([sys.executable, "-c", script, result.run_id], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, env=os.environ.copy())
    assert seen.stdout.strip() == "SUCCESS", seen.stderr[-2000:]


# One Dagster run in its own process (as two researchers' runs are): an asset in ``pool`` that sleeps,
# then prints when its step held the slot.
_POOLED_RUN = """
import sys, time
import dagster as dg
from pipelines.instance import ensure_dagster_home

name, pool, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])

@dg.asset(name=name, pool=pool)
def stage() -> None:
    started = time.time()
    print("holding", flush=True)
    time.sleep(seconds)
    print("window", started, time.time(), flush=True)

ensure_dagster_home()
with dg.DagsterInstance.get() as instance:
    assert dg.materialize([stage], instance=instance).success
"""


def test_two_stages_in_the_training_pool_run_one_at_a_time(cluster) -> None:
    """The pool's one slot: the second run's step waits for the first's (they never overlap)."""
    instance = _instance()
    # Stored before any run claims it (make cluster-up does; a pool's first claims race).
    assert instance.event_log_storage.get_concurrency_info(TRAINING_POOL).slot_count == 1

    def start(index: int) -> subprocess.Popen:  # Dagster's log goes to a file: a full pipe would stall the run
        return subprocess.Popen([sys.executable, "-c", _POOLED_RUN, f"stage_{index}", TRAINING_POOL, "3"],
                                cwd=REPO_ROOT, env=os.environ.copy(), stdout=subprocess.PIPE,
                                stderr=(cluster / f"stage_{index}.log").open("w"), text=True)

    # The second run starts once the first holds the slot. (Two claims in the same millisecond were
    # both granted once in five tries here: dagster-postgres' claim is not airtight; docs/cluster.md.)
    first = start(0)
    assert first.stdout.readline().strip() == "holding", (cluster / "stage_0.log").read_text()[-2000:]
    runs = [first, start(1)]
    outputs = [run.communicate(timeout=180) for run in runs]
    assert all(run.returncode == 0 for run in runs), [(cluster / f"stage_{i}.log").read_text()[-2000:] for i in (0, 1)]
    windows = sorted(tuple(map(float, line.split()[1:])) for out, _ in outputs
                     for line in out.splitlines() if line.startswith("window"))
    assert len(windows) == 2
    (_, first_end), (second_start, _) = windows
    assert second_start >= first_end, windows


# ---- MLflow on the tracking server, artifacts in the bucket ----

def test_mlflow_runs_go_to_the_server_and_artifacts_into_the_bucket(cluster, tmp_path: Path) -> None:
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    experiment = mlflow.set_experiment(f"test-cluster-{uuid.uuid4().hex[:8]}")
    artifact = tmp_path / "note.txt"
    artifact.write_text("from the cluster test\n")
    with mlflow.start_run() as run:
        mlflow.log_metric("loss", 0.5)
        mlflow.log_artifact(str(artifact))
    # The run is in the server's PostgreSQL store, the file in the bucket under mlflow/.
    with psycopg2.connect(host=os.environ["TRAINYARD_PG_HOST"], port=os.environ["TRAINYARD_PG_PORT"],
                          user=os.environ["TRAINYARD_PG_USER"], password=os.environ["TRAINYARD_PG_PASSWORD"],
                          dbname="mlflow") as connection, connection.cursor() as cursor:
        cursor.execute("select experiment_id from runs where run_uuid = %s", (run.info.run_id,))
        assert cursor.fetchone()[0] == int(experiment.experiment_id)
    s3 = boto3.client("s3", endpoint_url=os.environ["TRAINYARD_S3_ENDPOINT_URL"], region_name="us-east-1")
    keys = [item["Key"] for item in s3.list_objects_v2(Bucket=os.environ["TRAINYARD_BUCKET"],
                                                       Prefix="mlflow/").get("Contents", [])]
    assert any(key.endswith(f"{run.info.run_id}/artifacts/note.txt") for key in keys), keys[-5:]


# ---- bad settings name the variable ----

@pytest.mark.parametrize(("variable", "value", "names"), [
    ("TRAINYARD_PG_PASSWORD", "wrong-password", "TRAINYARD_PG_PASSWORD"),
    ("TRAINYARD_PG_DB", "no_such_db", "TRAINYARD_PG_DB"),
    ("TRAINYARD_PG_PORT", "1", "TRAINYARD_PG_PORT"),
    ("AWS_SECRET_ACCESS_KEY", "wrong-secret", "AWS_SECRET_ACCESS_KEY"),
    ("AWS_ACCESS_KEY_ID", "nobody", "AWS_ACCESS_KEY_ID"),
    ("TRAINYARD_S3_TRAINING_SECRET_ACCESS_KEY", "wrong-secret", "TRAINYARD_S3_TRAINING_SECRET_ACCESS_KEY"),
    ("MLFLOW_TRACKING_PASSWORD", "wrong-password", "MLFLOW_TRACKING_PASSWORD"),
    ("TRAINYARD_BUCKET", "no-such-bucket", "'no-such-bucket' of TRAINYARD_BUCKET does not exist"),
    ("TRAINYARD_CHECKPOINT_ROOT", "s3://no-such-bucket/ckpt", "'no-such-bucket' of TRAINYARD_CHECKPOINT_ROOT does not exist"),
    ("TRAINYARD_SHARD_ROOT", "s3://no-such-bucket/shards", "'no-such-bucket' of TRAINYARD_SHARD_ROOT does not exist"),
    ("TRAINYARD_MEDIA_ROOT", "s3://no-such-bucket/media", "'no-such-bucket' of TRAINYARD_MEDIA_ROOT does not exist"),
    ("MLFLOW_TRACKING_URI", "http://127.0.0.1:1", "MLFLOW_TRACKING_URI"),
    ("MLFLOW_TRACKING_URI", "sqlite:///x.db", "is not a tracking server"),
])
def test_a_wrong_setting_is_refused_naming_the_variable(cluster, monkeypatch, variable, value, names) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(environment.DeploymentConfigError, match=names) as raised:
        environment.check_cluster()
    assert os.environ["TRAINYARD_PG_PASSWORD"] not in str(raised.value)


def test_a_missing_variable_is_named_with_where_it_comes_from(cluster, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TRAINYARD_CLUSTER_HOME", str(tmp_path / "elsewhere"))  # no cluster.env there
    monkeypatch.delenv("TRAINYARD_BUCKET")
    with pytest.raises(environment.DeploymentConfigError, match=r"needs TRAINYARD_BUCKET .*make cluster-up"):
        environment.load_cluster_env()


def test_the_demo_refuses_wrong_credentials_before_any_run(cluster) -> None:
    env = {**os.environ, "TRAINYARD_PG_PASSWORD": "wrong-password"}
    completed = subprocess.run([str(TRAINYARD), "demo"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                               timeout=120)
    assert completed.returncode == 2, completed.stdout[-2000:] + completed.stderr[-2000:]
    assert "TRAINYARD_PG_PASSWORD" in completed.stderr and "Traceback" not in completed.stderr
    assert not (cluster / "media").exists()  # refused before generating or materializing anything


# ---- the demo graph end to end on the services ----

CLUSTER_DEMO_ASSETS = ("raw_media", "dataset_manifest", "validated_manifest", "quarantine", "clip_plan", "clip_shards",
                       "shard_index", "loader_benchmark", "step_profile", "pretrain", "restore_drill")


@pytest.fixture(scope="module")
def cluster_demo(tmp_path_factory, test_database: str) -> dict:
    """`TRAINYARD_ENV=cluster trainyard demo` in a subprocess, as `TRAINYARD_ENV=cluster make demo` runs it.

    The fault drill, finetune (and its evaluation) and the data profile are left out (--skip): they go through the same
    launcher, checkpointer and shard reads as pretrain and the loader benchmark, and are walked by
    tests/test_end_to_end.py; here they would only add minutes.
    """
    base = tmp_path_factory.mktemp("cluster_demo")
    bucket = environment.read_env_file(CLUSTER_ENV)["TRAINYARD_BUCKET"]
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("TRAINYARD_", "DAGSTER_", "MLFLOW_"))}
    env.update(TRAINYARD_ENV="cluster", TRAINYARD_HOME=str(base / "home"), TRAINYARD_CLUSTER_HOME=str(CLUSTER_HOME),
               TRAINYARD_MEDIA_ROOT=f"s3://{bucket}/{test_database}/media",
               # The data root in the bucket, as make cluster-up sets it; its working copy where the test sees it.
               TRAINYARD_DATA_ROOT=f"s3://{bucket}/{test_database}/data", TRAINYARD_DATA_WORKDIR=str(base / "data"),
               DAGSTER_HOME=str(base / "dagster_home"), TRAINYARD_PG_DB=test_database,
               # Checkpoints and shards under a prefix of this test's own: a run id repeats across test sessions.
               # Under checkpoints/: the one prefix the training identity may write (deploy/cluster/up.sh).
               TRAINYARD_CHECKPOINT_ROOT=f"s3://{bucket}/checkpoints/{test_database}",
               TRAINYARD_SHARD_ROOT=f"s3://{bucket}/{test_database}/shards",
               # The deployment's one signing key (conftest's): the tests below read what the demo signed.
               TRAINYARD_CHECKPOINT_HMAC_KEY=os.environ["TRAINYARD_CHECKPOINT_HMAC_KEY"])
    started = datetime.datetime.now(datetime.UTC)
    # Reports measure this machine, not the deployment: tests/test_reports.py and the embedded demo cover them.
    skipped = ("fault_drill", "evaluation/finetune", "finetune", "data_profile", "comm_benchmark", "scaling_report",
               "cost_report", "canary")
    completed = subprocess.run([str(TRAINYARD), "demo", *(arg for name in skipped for arg in ("--skip", name))],
                               cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    return {"started": started, "stdout": completed.stdout, "env": env}


def test_the_cluster_demo_materializes_the_graph_into_postgres(cluster, cluster_demo) -> None:
    instance = _instance()
    runs = instance.get_runs(dg.RunsFilter(tags={"trainyard/source": "make demo"},
                                           created_after=cluster_demo["started"]))
    assert runs and all(run.status == dg.DagsterRunStatus.SUCCESS for run in runs)
    run_ids = {run.run_id for run in runs}
    for key in CLUSTER_DEMO_ASSETS:
        event = instance.get_latest_materialization_event(dg.AssetKey(key))
        assert event is not None and event.run_id in run_ids, key
    assert all(_event_count(run_id) > 0 for run_id in run_ids)  # the rows are in PostgreSQL itself
    assert "cluster: PostgreSQL" in cluster_demo["stdout"] and "webserver of `make cluster-up`" in cluster_demo["stdout"]


def test_the_cluster_demo_tracks_its_stages_on_the_mlflow_server(cluster, cluster_demo) -> None:
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    since = int(cluster_demo["started"].timestamp() * 1000)
    runs = mlflow.search_runs(search_all_experiments=True, filter_string=f"attributes.start_time > {since}",
                              output_format="list")
    stages = {run.info.run_name.split("/")[0] for run in runs if run.info.status == "FINISHED"}
    assert "pretrain" in stages, stages
    assert all(run.info.artifact_uri.startswith("mlflow-artifacts:") for run in runs)  # proxied into the bucket


def test_the_cluster_demo_checkpoints_are_committed_in_the_bucket(cluster, cluster_demo) -> None:
    from ops.publish import objstore

    root = cluster_demo["env"]["TRAINYARD_CHECKPOINT_ROOT"]
    fs, path = objstore.filesystem(root)
    runs = [entry.rsplit("/", 1)[-1] for entry in fs.ls(path)]
    local = {run.name for run in (Path(cluster_demo["env"]["TRAINYARD_DATA_WORKDIR"]) / "runs").glob("*")
             if (run / "checkpoints" / "latest").exists()}
    assert local and local <= set(runs), (local, runs)  # every run that checkpointed is in the bucket
    for run in local:
        listing = objstore.list_versions(objstore.join(root, run))
        assert listing.committed and not listing.ignored, (run, listing)
        objstore.verify(objstore.join(root, run, listing.latest))  # re-hashed against its commit record


def test_the_cluster_demo_shard_set_is_committed_in_the_bucket(cluster, cluster_demo) -> None:
    from ops.publish import objstore

    event = _instance().get_latest_materialization_event(dg.AssetKey("shard_index"))
    metadata = {key: value.value for key, value in event.asset_materialization.metadata.items()}
    root = cluster_demo["env"]["TRAINYARD_SHARD_ROOT"]
    assert metadata["published_to"] == f"{root}/{metadata['shard_index_version']}"
    record = objstore.verify(metadata["published_to"])  # every object re-hashed against the commit record
    tars = sorted(path.name for path in Path(metadata["data_path"]).glob("*.tar"))
    assert tars and set(tars) <= set(record["files"])
    assert objstore.list_versions(root).latest == metadata["shard_index_version"]
    # pretrain read it from there (through the shard cache), not from the orchestrator's folder.
    (launch,) = (Path(cluster_demo["env"]["TRAINYARD_DATA_WORKDIR"]) / "runs").glob("pretrain-*/launch.json")
    assert json.loads(launch.read_text())["shard_index"]["path"] == metadata["published_to"]
    cached = Path(cluster_demo["env"]["TRAINYARD_HOME"]) / "shard_cache" / "tars"
    names = {path.name for path in cached.glob("*.tar")}
    assert names and names <= {f"{sha}.tar" for sha in _shard_shas(metadata["data_path"])}


def test_the_cluster_demo_reads_its_media_from_the_bucket(cluster, cluster_demo) -> None:
    from ops.curation import manifest as manifest_ops
    from ops.media import roots

    root = cluster_demo["env"]["TRAINYARD_MEDIA_ROOT"]
    assert f"objects uploaded to {root}" in cluster_demo["stdout"]
    event = _instance().get_latest_materialization_event(dg.AssetKey("raw_media"))
    assert event.asset_materialization.metadata["media_root"].value == root
    event = _instance().get_latest_materialization_event(dg.AssetKey("dataset_manifest"))
    manifest = manifest_ops.read_manifest(event.asset_materialization.metadata["data_path"].value)
    assert manifest.media_root == root
    good = [row for row in manifest.table.to_pylist() if not row["probe_error"] and not row["sidecar_error"]]
    in_bucket = {item.uri for item in roots.open_root(root).scan(with_checksums=False)}
    assert len(good) >= 8 and {row["uri"] for row in good} <= in_bucket
    # Probed and cut from the media cache: files named by the content sha256 the manifest records.
    cached = {path.name.split(".")[0] for path in
              (Path(cluster_demo["env"]["TRAINYARD_HOME"]) / "media_cache").glob("[!.]*")}
    assert {row["sha256"] for row in good} <= cached


def _shard_shas(directory: str) -> set[str]:
    from ops.clips.shards import read_index

    return set(read_index(directory).table.column("shard_sha256").to_pylist())


def test_the_cluster_demo_restore_drill_restores_from_the_bucket(cluster, cluster_demo) -> None:
    from ops.checkpoints import mirror

    event = _instance().get_latest_materialization_event(dg.AssetKey("restore_drill"))
    metadata = {key: value.value for key, value in event.asset_materialization.metadata.items()}
    root = cluster_demo["env"]["TRAINYARD_CHECKPOINT_ROOT"]
    assert metadata["passed"] is True, metadata["reason"]
    assert metadata["checkpoint_source"].startswith(f"{root}/pretrain-"), metadata["checkpoint_source"]
    assert metadata["checkpoint"] == f"{metadata['checkpoint_source']}/step_{metadata['checkpoint_step']:06d}"
    pin = mirror.CheckpointMirror(metadata["checkpoint_source"], keep_last_k=1, keep_every_m=0).read_known_good()
    assert pin["step"] == metadata["checkpoint_step"]  # pinned in the bucket, where retention keeps it


def _metadata(key: str) -> dict:
    event = _instance().get_latest_materialization_event(dg.AssetKey(key))
    return {name: value.value for name, value in event.asset_materialization.metadata.items()}


def test_the_cluster_demo_data_root_versions_are_committed_in_the_bucket(cluster, cluster_demo) -> None:
    from ops.publish import objstore

    url, work = cluster_demo["env"]["TRAINYARD_DATA_ROOT"], Path(cluster_demo["env"]["TRAINYARD_DATA_WORKDIR"])
    assert f"data: {url} (working copy {work})" in cluster_demo["stdout"]
    published = {
        "listings": _metadata("raw_media")["listing_version"],
        "manifests": _metadata("dataset_manifest")["manifest_version"],
        "validated": _metadata("validated_manifest")["validated_version"],
    }
    for kind, version in published.items():
        record = objstore.verify(objstore.join(url, kind, version))  # every object re-hashed
        assert set(record["files"]) == {path.name for path in (work / kind / version).iterdir()}, kind
    ledger = objstore.list_versions(objstore.join(url, "quarantine", "ledger"))
    assert ledger.latest and not ledger.ignored
    pretrain = _metadata("pretrain")
    assert pretrain["run_store_url"] == objstore.join(url, "runs", Path(pretrain["run_dir"]).name)
    records = objstore.list_versions(objstore.join(pretrain["run_store_url"], "records"))
    files = objstore.verify(objstore.join(pretrain["run_store_url"], "records", records.latest))["files"]
    assert {"launch.json", "final.json", "samples/rank_0.json"} <= set(files)
    assert not any(name.startswith("checkpoints/") for name in files)  # those are the checkpoint root's


def test_a_restore_drill_after_the_working_copy_is_lost_reads_everything_from_the_bucket(cluster,
                                                                                        cluster_demo) -> None:
    """The machine that ran pretrain lost its data: the drill reads the run's records, its
    checkpoints and its shard set from the bucket, and still proves the recovery."""
    import shutil

    work = Path(cluster_demo["env"]["TRAINYARD_DATA_WORKDIR"])
    lost = work.with_name("data.lost")
    work.rename(lost)
    try:
        completed = subprocess.run([sys.executable, "-c", _GRAPH_RUN, "restore_drill"], cwd=REPO_ROOT,
                                   env=cluster_demo["env"], capture_output=True, text=True, timeout=900)
        assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
        metadata = _metadata("restore_drill")
        assert metadata["passed"] is True, metadata["reason"]
        assert metadata["records_source"].startswith(str(work / "drills")), metadata["records_source"]
        assert metadata["records_source"].endswith("original_records")
        assert metadata["checkpoint_source"].startswith(cluster_demo["env"]["TRAINYARD_CHECKPOINT_ROOT"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
        lost.rename(work)


_STAGES_RUN = """
import json
import sys
import dagster as dg
from pipelines.definitions import defs
from pipelines.instance import ensure_dagster_home

ensure_dagster_home()
with dg.DagsterInstance.get() as instance:
    job = defs.resolve_implicit_global_asset_job_def()
    result = job.execute_in_process(instance=instance, asset_selection=[dg.AssetKey(n) for n in sys.argv[1].split(",")],
                                    run_config=json.loads(sys.argv[2]), raise_on_error=False)
    sys.exit(0 if result.success else 1)
"""


def test_pretrain_with_its_checkpoints_straight_in_the_bucket_feeds_finetune(cluster, cluster_demo) -> None:
    """stage.checkpoint_io=store: DCP writes pretrain's checkpoints to the bucket through its fsspec
    writer (nothing in the run folder), the blocking checks verify them there, and finetune starts
    from one through the fsspec reader. (The restore drill reads these versions as it reads
    mirrored ones, the same layout: test_the_cluster_demo_restore_drill_restores_from_the_bucket.)"""
    env = cluster_demo["env"]
    # A short pretrain (one checkpoint at step 4, no evaluation) and finetune: the path is what is tested.
    config = {"ops": {"pretrain": {"config": {"steps": 4, "overrides": ["stage.checkpoint_io=store",
                                                                        "train.checkpoint_every=4",
                                                                        "train.eval_every=0"]}},
                      "finetune": {"config": {"steps": 2, "overrides": ["train.eval_every=0"]}}}}
    completed = subprocess.run([sys.executable, "-c", _STAGES_RUN, "pretrain,finetune", json.dumps(config)],
                               cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    pretrain = _metadata("pretrain")
    run_url = f"{env['TRAINYARD_CHECKPOINT_ROOT']}/{Path(pretrain['run_dir']).name}"
    assert pretrain["checkpoint"] == f"{run_url}/step_{pretrain['checkpoint_step']:06d}"
    assert not (Path(pretrain["run_dir"]) / "checkpoints").exists()  # nothing on the orchestrator's disk
    assert _metadata("finetune")["parent_checkpoint"] == pretrain["checkpoint"]
    assert _metadata("finetune")["status"] == "completed"



_ERASE_IN_THE_BUCKET = """
import json, os, sys, tempfile
from pathlib import Path
sys.path.insert(0, "tests")
import dagster as dg
from erasure_scan import clip_frame_hashes, scan
from mlflow.tracking import MlflowClient
from cli.main import main
from ops.clips import shard_cache, shards
from ops.clips.plan import read_plan
from ops.curation import erasure, rights
from ops.publish import objstore, paths
from pipelines.definitions import defs
from pipelines.instance import ensure_dagster_home

ensure_dagster_home()
instance = dg.DagsterInstance.get()
data = paths.data_root()
event = instance.get_latest_materialization_event(dg.AssetKey("shard_index")).asset_materialization
plan_dir, published = Path(event.metadata["data_path"].value), event.metadata["published_to"].value
plan = read_plan(plan_dir)
evaluation = json.loads(next((data / "evaluations" / "pretrain").glob("*/evaluation.json")).read_text())
asset_id = next(row["asset_id"] for row in plan.table.to_pylist()
                if row["sample_key"] == evaluation["samples"]["samples"][0]["key"])
frames = {}
for shard in plan.shards:
    for prefix, hashes in clip_frame_hashes(plan_dir / f"{shard}.tar").items():
        frames.setdefault(prefix, set()).update(hashes)
targets = frames[asset_id[:16]] - set().union(*(h for p, h in frames.items() if p != asset_id[:16]))
runs = {json.loads(p.read_text())["run_id"] for p in data.glob("runs/*/ranks/mlflow.json")}
client = MlflowClient()
prefixes = [os.environ[v] for v in ("TRAINYARD_DATA_ROOT", "TRAINYARD_MEDIA_ROOT", "TRAINYARD_SHARD_ROOT",
                                    "TRAINYARD_CHECKPOINT_ROOT")]
prefixes += [client.get_run(run).info.artifact_uri for run in sorted(runs)]

def bucket_scan(prefixes):
    with tempfile.TemporaryDirectory() as mirror:
        for number, prefix in enumerate(prefixes):
            fs, root = objstore.filesystem(prefix)
            if fs.find(root):  # one batched download per prefix (s3fs fetches concurrently)
                fs.get(f"{root}/", f"{mirror}/{number}/", recursive=True)
        local = [root for root in (data, paths.shard_cache_dir(), paths.media_cache_dir()) if root.exists()]
        return scan([Path(mirror), *local], targets, asset_id)

# Before: where the clip is known to be (the scan must find it, or it proves nothing); after: everything.
before = bucket_scan([os.environ["TRAINYARD_SHARD_ROOT"], os.environ["TRAINYARD_MEDIA_ROOT"]])
assert main(["rights", "revoke", asset_id[:16], "--reason", "takedown", "--note", "legal 9"]) == 0
erased = main(["rights", "erase", asset_id[:16], "--reason", "takedown", "--note", "legal 9", "--delete-source"])
after = bucket_scan(prefixes)
ledger = rights.read_events(data)
(certificate_id,) = [e["erasure_id"] for e in rights.erasures(ledger, asset_id)]
certificate = erasure.read_certificate(data, certificate_id)
successor = certificate["successors"][0]
index = shard_cache.open_index(successor["published_to"])
index.verify()
listing = objstore.list_versions(objstore.join(os.environ["TRAINYARD_DATA_ROOT"], "rights", "ledger"))
print(json.dumps({"before": before, "after": after, "erased": erased, "certificate": certificate,
                  "old_set_gone": not erasure.exists(published),
                  "successor": successor, "ledger_snapshots": listing.committed, "ledger_events": len(ledger),
                  "certificate_in_bucket": objstore.read_object(objstore.join(
                      os.environ["TRAINYARD_DATA_ROOT"], "rights", "erasures", certificate_id, objstore.COMMIT_NAME))
                  is not None}))
"""


def test_an_erasure_in_the_team_deployment_leaves_nothing_in_the_bucket_or_on_the_mlflow_server(
        cluster, cluster_demo) -> None:
    """Issue 37 against the bucket and the MLflow server: the demo clip that conditions the evaluation's first
    sample, revoked and erased with its source; every object under the test's prefixes (data root, media,
    shard sets, checkpoints) and the stages' MLflow artifacts is downloaded and scanned, with the working copy
    and the caches: its frames are found before and nowhere after. The successor set is published and
    verifies, the old one is gone, the ledger snapshot and the certificate are in the bucket, and finetune
    refuses the tainted pretrain without a recorded decision. (Changes the demo's data: last of its tests.)"""
    env = cluster_demo["env"]
    completed = subprocess.run([sys.executable, "-c", _ERASE_IN_THE_BUCKET], cwd=REPO_ROOT, env=env,
                               capture_output=True, text=True, timeout=900)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    out = json.loads(completed.stdout.strip().splitlines()[-1])
    assert out["before"] and out["after"] == [], out["after"]
    assert out["erased"] == 0 and out["old_set_gone"] and out["certificate_in_bucket"]
    assert out["successor"]["published_to"].startswith(env["TRAINYARD_SHARD_ROOT"])
    assert out["certificate"]["complete"]
    recorded = json.dumps(out["certificate"])
    for variable in ("MLFLOW_TRACKING_PASSWORD", "AWS_SECRET_ACCESS_KEY", "TRAINYARD_PG_PASSWORD"):
        assert SERVICES[variable] not in recorded, f"{variable}'s value is in the certificate"
    deleted = {entry["kind"] for entry in out["certificate"]["deleted"]}
    assert {"shard", "store_shard_set", "sample", "mlflow_artifact", "source", "store_run_records"} <= deleted, deleted
    # The ledger's newest snapshot in the bucket holds every event, the erasure's last: other machines see it.
    assert max(int(name.split("-")[0]) for name in out["ledger_snapshots"]) == out["ledger_events"]
    config = {"ops": {"finetune": {"config": {"steps": 2, "overrides": ["train.eval_every=0"]}}}}
    refused = subprocess.run([sys.executable, "-c", _STAGES_RUN, "finetune", json.dumps(config)], cwd=REPO_ROOT,
                             env=env, capture_output=True, text=True, timeout=900)
    assert refused.returncode == 1 and "refused (rights)" in refused.stdout + refused.stderr

# ---- faults: two runs on one partition, PostgreSQL restarted mid-run ----

_GRAPH_RUN = """
import sys
import time
import dagster as dg
from pipelines.definitions import defs
from pipelines.instance import ensure_dagster_home

ensure_dagster_home()
selection = [dg.AssetKey(name) for name in sys.argv[1].split(",")]
partition = sys.argv[2] if len(sys.argv) > 2 else None
with dg.DagsterInstance.get() as instance:
    job = defs.resolve_implicit_global_asset_job_def()
    result = job.execute_in_process(instance=instance, asset_selection=selection, partition_key=partition,
                                    raise_on_error=False, run_config=RUN_CONFIG)
    print("run", result.run_id, result.success, flush=True)
    sys.exit(0 if result.success else 1)
""".replace("RUN_CONFIG", repr({"ops": {"validated_manifest_and_quarantine": {"config": {
    "max_quarantine_fraction": DEMO_MAX_QUARANTINE_FRACTION}}}}))


def _graph_run(selection: list[str], partition: str | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _GRAPH_RUN, ",".join(selection), *([partition] if partition else [])],
                            cwd=REPO_ROOT, env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_two_runs_materializing_the_same_partition_at_once_publish_one_intact_shard(cluster, demo) -> None:
    copy_media(demo.out_dir, cluster / "media")
    upstream = _graph_run(["raw_media", "dataset_manifest", "validated_manifest", "quarantine", "clip_plan"])
    out, err = upstream.communicate(timeout=300)
    assert upstream.returncode == 0, err[-3000:]
    instance = _instance()
    partition = sorted(instance.get_dynamic_partitions("clip_shards"))[0]
    runs = [_graph_run(["clip_shards"], partition) for _ in range(2)]
    outputs = [run.communicate(timeout=300) for run in runs]
    assert all(run.returncode == 0 for run in runs), [err[-3000:] for _, err in outputs]
    run_ids = [line.split()[1] for out, _ in outputs for line in out.splitlines() if line.startswith("run ")]
    events = [event for run_id in run_ids
              for event in instance.all_logs(run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION)]
    assert len(events) == 2
    versions = {event.dagster_event.event_specific_data.materialization.tags["dagster/data_version"]
                for event in events}
    assert len(versions) == 1, versions  # the same bytes, whichever run published them
    metadata = events[0].dagster_event.event_specific_data.materialization.metadata
    shard = Path(metadata["data_path"].value)
    assert sha256_file(shard) == metadata["sha256"].value
    assert not [path for path in shard.parent.iterdir() if ".tmp" in path.name]  # no half-written leftovers


_LOGGING_RUN = """
import sys, time
import dagster as dg
from pipelines.instance import ensure_dagster_home

@dg.asset
def long_stage(context: dg.AssetExecutionContext) -> None:
    print("run", context.run_id, flush=True)
    for beat in range(int(sys.argv[1])):
        context.log.info(f"beat {beat}")
        time.sleep(0.5)

ensure_dagster_home()
with dg.DagsterInstance.get() as instance:
    result = dg.materialize([long_stage], instance=instance, raise_on_error=False)
    sys.exit(0 if result.success else 1)
"""


def _restart_postgres() -> None:
    pg_bin = sorted(Path("/usr/lib/postgresql").glob("*/bin"))[-1]
    command = [str(pg_bin / "pg_ctl"), "-D", str(CLUSTER_HOME / "pgdata"), "-m", "fast", "-w", "-t", "60",
               "-o", f"-p {os.environ['TRAINYARD_PG_PORT']} -k {CLUSTER_HOME / 'run'} -c listen_addresses=127.0.0.1 "
                     "-c max_connections=200", "-l", str(CLUSTER_HOME / "logs" / "postgres.log"), "restart"]
    if os.getuid() == 0:
        command = ["runuser", "-u", "postgres", "--", *command]
    subprocess.run(command, check=True, capture_output=True, timeout=90)


def test_postgres_restarted_during_a_run_ends_the_run_visibly_and_keeps_its_events(cluster) -> None:
    _instance()
    run = subprocess.Popen([sys.executable, "-c", _LOGGING_RUN, "20"], cwd=REPO_ROOT, env=os.environ.copy(),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_id = run.stdout.readline().split()[1]
    time.sleep(2)
    before = _event_count(run_id)
    _restart_postgres()
    out, err = run.communicate(timeout=180)
    instance = _instance()
    record = instance.get_run_by_id(run_id)
    # Visible: the run's record ends SUCCESS (its writes retried past the restart) or FAILURE with
    # the reason; never left STARTED by a worker that is gone.
    assert record.status in (dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE), (record.status, err[-3000:])
    assert (run.returncode == 0) == (record.status == dg.DagsterRunStatus.SUCCESS)
    logged = [event.user_message for event in instance.all_logs(run_id) if event.user_message.startswith("beat ")]
    print(f"run {record.status.value} after the restart, {len(logged)} beats logged")
    assert _event_count(run_id) >= before > 0
    assert logged == [f"beat {index}" for index in range(len(logged))]  # no gap: nothing lost before the end
    if record.status == dg.DagsterRunStatus.SUCCESS:
        assert len(logged) == 20


def test_no_secret_reaches_a_command_line_a_log_or_a_world_readable_file(cluster) -> None:
    """`ps` shows every user each process's arguments: the store URL with the password must not be there."""
    secrets = [SERVICES[name] for name in ("TRAINYARD_PG_PASSWORD", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_PASSWORD",
                                            "TRAINYARD_S3_TRAINING_SECRET_ACCESS_KEY",
                                            "TRAINYARD_S3_READER_SECRET_ACCESS_KEY", "TRAINYARD_DAGSTER_UI_PASSWORD")]
    exposed = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            arguments = cmdline.read_bytes().decode(errors="replace")
        except OSError:
            continue  # the process ended
        exposed += [f"pid {cmdline.parent.name}" for secret in secrets if secret in arguments]
    for path in [*(CLUSTER_HOME / "logs").iterdir(), CLUSTER_HOME / "dagster_home" / "dagster.yaml"]:
        text = path.read_text(errors="replace") if path.is_file() else ""
        exposed += [str(path) for secret in secrets if secret in text]
    assert not exposed, exposed
    # The files that hold them, or their hashes and signing keys: the owner's alone.
    for name in ("cluster.env", "secrets", "s3.json", "seaweed-conf/security.toml", "mlflow_auth.ini", "mlflow_auth.db",
                 "nginx/htpasswd"):
        assert (CLUSTER_HOME / name).stat().st_mode & 0o077 == 0, name


# ---- the doors: every service refuses an anonymous request and a wrong identity (issue 32, item 8) ----

# deploy/cluster/up.sh's loopback-only ports: SeaweedFS's master, volume and filer servers, the webserver itself.
MASTER_PORT, VOLUME_PORT, FILER_PORT = 9334, 8084, 8889
WEB_INTERNAL_PORT = int(os.environ.get("TRAINYARD_CLUSTER_WEB_INTERNAL_PORT") or 3031)


def _http(method: str, url: str, *, user: str | None = None, password: str = "", body: bytes | None = None,
          headers: dict[str, str] | None = None) -> int:
    """The HTTP status of one request (0: nothing listens there)."""
    import base64
    import urllib.error
    import urllib.request

    headers = dict(headers or {})
    if user is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except (urllib.error.URLError, ConnectionError):
        return 0


def _listening(port: int) -> set[str]:
    """The addresses a TCP socket listens on at ``port`` (from /proc/net/tcp and tcp6)."""
    import ipaddress

    found = set()
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(address)
            # The kernel writes each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.add(str(ipaddress.ip_address(raw) if width == 4 else ipaddress.IPv6Address(raw)))
    return found


def _s3(key: str | None, secret: str | None = None):
    import botocore
    import botocore.config

    config = botocore.config.Config(retries={"max_attempts": 1}, connect_timeout=5, read_timeout=10,
                                    **({} if key else {"signature_version": botocore.UNSIGNED}))
    session = boto3.session.Session(aws_access_key_id=key, aws_secret_access_key=secret)
    return session.client("s3", endpoint_url=SERVICES["TRAINYARD_S3_ENDPOINT_URL"], region_name="us-east-1",
                          config=config)


def _refused(call, **arguments) -> str:
    """The error code the store answered ``call(**arguments)`` with (AssertionError when it was accepted)."""
    import botocore.exceptions

    try:
        call(**arguments)
    except botocore.exceptions.ClientError as error:
        return str(error.response["Error"]["Code"])
    raise AssertionError("the store accepted it")


IDENTITIES = {"pipeline": ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"),
              "training": ("TRAINYARD_S3_TRAINING_ACCESS_KEY_ID", "TRAINYARD_S3_TRAINING_SECRET_ACCESS_KEY"),
              "reader": ("TRAINYARD_S3_READER_ACCESS_KEY_ID", "TRAINYARD_S3_READER_SECRET_ACCESS_KEY")}


def _as(identity: str):
    key, secret = IDENTITIES[identity]
    return _s3(SERVICES[key], SERVICES[secret])


@pytest.fixture
def shard_key() -> str:
    """A shard the data pipeline wrote (its own prefix per test), removed afterwards."""
    bucket, key = SERVICES["TRAINYARD_BUCKET"], f"shards/doors-{uuid.uuid4().hex[:8]}/shard-000000.tar"
    _as("pipeline").put_object(Bucket=bucket, Key=key, Body=b"the real shard")
    yield key
    _as("pipeline").delete_object(Bucket=bucket, Key=key)


def test_the_object_store_refuses_anonymous_requests_and_wrong_identities(shard_key) -> None:
    bucket = SERVICES["TRAINYARD_BUCKET"]
    anonymous = _s3(None)
    assert _refused(anonymous.get_object, Bucket=bucket, Key=shard_key) == "AccessDenied"
    assert _refused(anonymous.put_object, Bucket=bucket, Key=shard_key, Body=b"forged") == "AccessDenied"
    assert _refused(anonymous.list_objects_v2, Bucket=bucket) == "AccessDenied"
    for identity, (key, _) in IDENTITIES.items():
        wrong = _s3(SERVICES[key], "wrong-secret")
        assert _refused(wrong.get_object, Bucket=bucket, Key=shard_key) == "SignatureDoesNotMatch", identity
    assert _refused(_s3("nobody", "x").get_object, Bucket=bucket, Key=shard_key) == "InvalidAccessKeyId"
    assert _as("pipeline").get_object(Bucket=bucket, Key=shard_key)["Body"].read() == b"the real shard"


def test_a_training_job_cannot_overwrite_a_shard_and_the_reader_writes_nothing(shard_key) -> None:
    """Least privilege: training reads data and writes checkpoints (and run records) only; the reader reads."""
    bucket, tag = SERVICES["TRAINYARD_BUCKET"], uuid.uuid4().hex[:8]
    training, reader = _as("training"), _as("reader")
    assert _refused(training.put_object, Bucket=bucket, Key=shard_key, Body=b"forged") == "AccessDenied"
    assert _refused(training.delete_object, Bucket=bucket, Key=shard_key) == "AccessDenied"
    for key in (f"data/manifests/{tag}/manifest.parquet", f"media/{tag}/clip.mp4", f"mlflow/{tag}/x"):
        assert _refused(training.put_object, Bucket=bucket, Key=key, Body=b"x") == "AccessDenied", key
    assert training.get_object(Bucket=bucket, Key=shard_key)["Body"].read() == b"the real shard"
    for key in (f"checkpoints/{tag}/step_000001/x.distcp", f"data/runs/{tag}/records/x.json"):
        training.put_object(Bucket=bucket, Key=key, Body=b"ok")
        training.delete_object(Bucket=bucket, Key=key)
    for key in (shard_key, f"checkpoints/{tag}/x"):
        assert _refused(reader.put_object, Bucket=bucket, Key=key, Body=b"forged") == "AccessDenied", key
    assert _refused(reader.delete_object, Bucket=bucket, Key=shard_key) == "AccessDenied"
    assert reader.get_object(Bucket=bucket, Key=shard_key)["Body"].read() == b"the real shard"
    assert _as("pipeline").get_object(Bucket=bucket, Key=shard_key)["Body"].read() == b"the real shard"


def test_the_filer_and_volume_servers_refuse_unsigned_requests_and_listen_on_loopback_only(shard_key) -> None:
    """The attack: overwrite a shard through the filer's HTTP API, then read the forgery through S3."""
    bucket = SERVICES["TRAINYARD_BUCKET"]
    filer = f"http://127.0.0.1:{FILER_PORT}/buckets/{bucket}/{shard_key}"
    assert _http("GET", filer) in (0, 401)
    assert _http("PUT", filer, body=b"forged") in (0, 401)
    assert _http("POST", filer, body=b"forged") in (0, 401)
    assert _http("DELETE", filer) in (0, 401)
    # A volume server takes no read or write without the master's signed token (any file id).
    assert _http("GET", f"http://127.0.0.1:{VOLUME_PORT}/1,01deadbeef") in (0, 401)
    assert _http("POST", f"http://127.0.0.1:{VOLUME_PORT}/1,01deadbeef", body=b"forged") in (0, 401)
    assert _as("reader").get_object(Bucket=bucket, Key=shard_key)["Body"].read() == b"the real shard"
    # Only S3 (and MLflow, and the Dagster proxy) may listen beyond loopback.
    internal = {"SeaweedFS master": MASTER_PORT, "volume server": VOLUME_PORT, "filer": FILER_PORT,
                "Dagster webserver": WEB_INTERNAL_PORT, "PostgreSQL": int(SERVICES["TRAINYARD_PG_PORT"])}
    for name, port in internal.items():
        addresses = _listening(port)
        assert addresses and addresses <= {"127.0.0.1", "::1"}, (name, port, addresses)


def test_mlflow_refuses_anonymous_requests_and_a_wrong_password() -> None:
    uri, user = SERVICES["MLFLOW_TRACKING_URI"], SERVICES["MLFLOW_TRACKING_USERNAME"]
    search = f"{uri}/api/2.0/mlflow/experiments/search?max_results=1"
    name = f"forged-{uuid.uuid4().hex[:8]}"
    create = (f"{uri}/api/2.0/mlflow/experiments/create", json.dumps({"name": name}).encode())
    delete = (f"{uri}/api/2.0/mlflow/experiments/delete", json.dumps({"experiment_id": "0"}).encode())
    headers = {"Content-Type": "application/json"}
    assert _http("GET", search) == 401
    assert _http("GET", search, user=user, password="wrong-password") == 401
    assert _http("GET", search, user="nobody", password=SERVICES["MLFLOW_TRACKING_PASSWORD"]) == 401
    for url, body in (create, delete):
        assert _http("POST", url, body=body, headers=headers) == 401, url
        assert _http("POST", url, body=body, headers=headers, user=user, password="wrong-password") == 401, url
    assert _http("GET", search, user=user, password=SERVICES["MLFLOW_TRACKING_PASSWORD"]) == 200
    found = _http("GET", f"{uri}/api/2.0/mlflow/experiments/get-by-name?experiment_name={name}", user=user,
                  password=SERVICES["MLFLOW_TRACKING_PASSWORD"])
    assert found == 404  # never created


def test_the_dagster_ui_answers_only_through_the_authenticating_proxy() -> None:
    ui, user = SERVICES["TRAINYARD_DAGSTER_UI_URL"], SERVICES["TRAINYARD_DAGSTER_UI_USER"]
    graphql = (f"{ui}/graphql", json.dumps({"query": "{ version }"}).encode())
    headers = {"Content-Type": "application/json"}
    assert _http("GET", f"{ui}/server_info") == 401
    assert _http("GET", f"{ui}/server_info", user=user, password="wrong-password") == 401
    assert _http("POST", graphql[0], body=graphql[1], headers=headers) == 401
    assert _http("GET", f"{ui}/server_info", user=user, password=SERVICES["TRAINYARD_DAGSTER_UI_PASSWORD"]) == 200
    assert _http("POST", graphql[0], body=graphql[1], headers=headers, user=user,
                 password=SERVICES["TRAINYARD_DAGSTER_UI_PASSWORD"]) == 200
    # The webserver itself (no authentication of its own) listens on loopback only, behind nginx.
    assert _listening(WEB_INTERNAL_PORT) <= {"127.0.0.1", "::1"}
    assert _listening(WEB_INTERNAL_PORT)


def test_cluster_check_states_the_capacity_left(cluster) -> None:
    import shutil

    from ops.publish import objstore

    lines = environment.check_cluster()
    (line,) = [line for line in lines if line.startswith("S3 capacity:")]
    capacity = objstore.store_capacity()
    assert f"left of {capacity.describe().split(' left of ')[1].split(' (')[0]}" in line
    # Sized from the disk it runs on (not a fixed 64 volumes of 256 MB): no more than that disk holds.
    disk = shutil.disk_usage(CLUSTER_HOME / "seaweed")
    assert capacity.volumes_max * capacity.volume_bytes <= disk.total
    assert capacity.volume_bytes == int(SERVICES["TRAINYARD_S3_VOLUME_MB"]) << 20
    assert any(line.endswith("(training identity)") for line in lines)


def test_the_initdb_password_file_is_never_world_readable() -> None:
    """It exists for a moment only, so the script is read: made under umask 077, handed to postgres, never chmod'ed."""
    script = (REPO_ROOT / "deploy" / "cluster" / "up.sh").read_text()
    (made,) = [line for line in script.splitlines() if line.strip().startswith("pwfile=")]
    assert "umask 077" in made and "mktemp" in made
    assert not [line for line in script.splitlines() if "chmod" in line and "pwfile" in line]


# ---- Sweeps in the team deployment (issue 38) ----

def test_a_sweep_registers_its_study_in_postgresql_its_pool_limit_and_its_mlflow_parent(cluster, monkeypatch) -> None:
    """The study in the deployment's PostgreSQL (its own database: Optuna's tables beside Dagster's would share
    alembic's), the `sweep` pool limited in Dagster's PostgreSQL, the parent run on the MLflow server; another
    declaration under the same name is refused; a wrong password is named without the password."""
    import yaml

    from pipelines.sweeps import register_sweep
    from trainer.launch.refusal import Refusal
    from trainer.launch.sweep import load_sweep, open_study, study_storage_url, trial_states

    name = f"optuna_test_{uuid.uuid4().hex[:10]}"
    _admin(f"create database {name}")
    try:
        monkeypatch.setenv("TRAINYARD_OPTUNA_DB", name)
        monkeypatch.delenv("TRAINYARD_OPTUNA_STORAGE", raising=False)
        url = study_storage_url()
        assert url.startswith("postgresql+psycopg2://") and url.endswith(f"/{name}")
        spec = load_sweep(REPO_ROOT / "configs" / "sweeps" / "demo_lr.yaml")
        instance = _instance()
        study = register_sweep(spec, instance, log=lambda line: None)
        assert set(trial_states(study).values()) == {"WAITING"} and len(trial_states(study)) == spec.budget
        assert instance.event_log_storage.get_concurrency_info("sweep").slot_count == spec.concurrency
        assert instance.get_dynamic_partitions("sweep_trials") == [f"demo_lr-{n:03d}" for n in range(6)]
        from mlflow.tracking import MlflowClient

        parent = MlflowClient().get_run(study.user_attrs["mlflow_parent_run"])
        assert parent.data.tags["trainyard.sweep.id"] == spec.digest
        with _pg_database(name) as connection, connection.cursor() as cursor:
            cursor.execute("select study_name from studies")
            assert cursor.fetchall() == [("demo_lr",)]
        raw = yaml.safe_load((REPO_ROOT / "configs" / "sweeps" / "demo_lr.yaml").read_text()) | {"budget": 2}
        other = Path(os.environ["TRAINYARD_DATA_ROOT"]).parent / "other.yaml"
        other.write_text(yaml.safe_dump(raw))
        with pytest.raises(Refusal, match="declared otherwise"):
            open_study(load_sweep(other), url)
        password = os.environ["TRAINYARD_PG_PASSWORD"]
        monkeypatch.setenv("TRAINYARD_PG_PASSWORD", "not-" + password)
        with pytest.raises(Refusal) as refused:
            open_study(spec, study_storage_url())
        assert "cannot be reached" in str(refused.value) and password not in str(refused.value)
    finally:
        _admin("select pg_terminate_backend(pid) from pg_stat_activity where datname = %s", (name,))
        _admin(f"drop database if exists {name}")


@contextlib.contextmanager
def _pg_database(name: str):
    env = os.environ
    connection = psycopg2.connect(host=env["TRAINYARD_PG_HOST"], port=env["TRAINYARD_PG_PORT"],
                                  user=env["TRAINYARD_PG_USER"], password=env["TRAINYARD_PG_PASSWORD"], dbname=name)
    try:
        yield connection
    finally:
        connection.close()
