"""The team deployment (issue 13) against the real services of ``make cluster-up``
(deploy/cluster/up.sh: PostgreSQL, SeaweedFS's S3 gateway, the MLflow server, dagster-daemon and
the webserver), which .ci/run starts.

Without the services these tests are skipped, unless TRAINYARD_REQUIRE_CLUSTER=1 (as .ci/run sets
it), where missing services fail them.

Run: make cluster-up && python -m pytest tests/test_cluster.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import boto3
import dagster as dg
import mlflow
import psycopg2
import pytest
from helpers import copy_media

from assets.training import TRAINING_POOL
from ops.paths import REPO_ROOT
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


@pytest.fixture
def cluster(monkeypatch, tmp_path: Path) -> Path:
    """TRAINYARD_ENV=cluster on the running services, with this test's own media and data roots."""
    monkeypatch.setenv("TRAINYARD_ENV", "cluster")
    monkeypatch.setenv("TRAINYARD_CLUSTER_HOME", str(CLUSTER_HOME))
    for name in ("DAGSTER_HOME", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRAINYARD_MEDIA_ROOT", str(tmp_path / "media"))
    monkeypatch.setenv("TRAINYARD_DATA_ROOT", str(tmp_path / "data"))
    environment.load_cluster_env()
    for name in environment.CLUSTER_VARIABLES:
        monkeypatch.setenv(name, os.environ[name])  # undone after the test, like the rest
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
    time.sleep(seconds)
    print("window", started, time.time(), flush=True)

ensure_dagster_home()
with dg.DagsterInstance.get() as instance:
    assert dg.materialize([stage], instance=instance).success
"""


def test_two_stages_in_the_training_pool_run_one_at_a_time(cluster) -> None:
    """The pool's one slot: the second run's step waits for the first's (they never overlap)."""
    instance = _instance()
    # make cluster-up stores the pool's limit before any run claims it (a pool's first claims race).
    assert instance.event_log_storage.get_concurrency_info(TRAINING_POOL).slot_count == 1
    runs = [subprocess.Popen([sys.executable, "-c", _POOLED_RUN, f"stage_{index}", TRAINING_POOL, "3"],
                             cwd=REPO_ROOT,
                             env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for index in range(2)]
    outputs = [run.communicate(timeout=180) for run in runs]
    assert all(run.returncode == 0 for run in runs), [err[-2000:] for _, err in outputs]
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
    ("TRAINYARD_BUCKET", "no-such-bucket", "TRAINYARD_BUCKET='no-such-bucket' does not exist"),
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
