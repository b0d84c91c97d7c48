"""TRAINYARD_ENV and the cluster's settings (pipelines/environment.py, pipelines/instance.py), without services.

tests/test_cluster.py checks the same against the real services of `make cluster-up`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from pipelines import environment

SETTINGS = {"TRAINYARD_PG_HOST": "db.example", "TRAINYARD_PG_PORT": "5432", "TRAINYARD_PG_USER": "dagster",
            "TRAINYARD_PG_PASSWORD": "s3cret-pw", "TRAINYARD_PG_DB": "dagster",
            "MLFLOW_TRACKING_URI": "http://mlflow.example:5000", "TRAINYARD_S3_ENDPOINT_URL": "http://s3.example",
            "AWS_ACCESS_KEY_ID": "key", "AWS_SECRET_ACCESS_KEY": "secret", "TRAINYARD_BUCKET": "team",
            "MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": "mlflow-pw",
            "TRAINYARD_S3_TRAINING_ACCESS_KEY_ID": "train-key", "TRAINYARD_S3_TRAINING_SECRET_ACCESS_KEY": "train-secret"}


@pytest.fixture
def cluster_env(monkeypatch, tmp_path: Path):
    """TRAINYARD_ENV=cluster with a cluster.env file (as `make cluster-up` writes) and no variables set."""
    home = tmp_path / "cluster"
    home.mkdir()
    lines = ["# written by a test", "", *(f"{key}={value}" for key, value in SETTINGS.items()),
             f"DAGSTER_HOME={tmp_path / 'cluster_dagster_home'}"]
    (home / "cluster.env").write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("TRAINYARD_ENV", "cluster")
    monkeypatch.setenv("TRAINYARD_CLUSTER_HOME", str(home))
    for name in [*environment.CLUSTER_VARIABLES, "DAGSTER_HOME"]:
        monkeypatch.delenv(name, raising=False)
    saved = dict(os.environ)
    yield home
    # load_cluster_env sets variables itself: put the environment back for the tests after this one.
    os.environ.clear()
    os.environ.update(saved)


def test_the_file_fills_in_only_what_the_environment_does_not_set(cluster_env, monkeypatch) -> None:
    monkeypatch.setenv("TRAINYARD_PG_HOST", "mine.example")
    taken = environment.load_cluster_env()
    assert os.environ["TRAINYARD_PG_HOST"] == "mine.example" and "TRAINYARD_PG_HOST" not in taken
    assert os.environ["TRAINYARD_BUCKET"] == "team" and "TRAINYARD_BUCKET" in taken


def test_every_missing_variable_is_named(cluster_env) -> None:
    (cluster_env / "cluster.env").write_text("TRAINYARD_PG_HOST=db\n")
    with pytest.raises(environment.DeploymentConfigError) as raised:
        environment.load_cluster_env()
    for name in ("TRAINYARD_PG_PASSWORD", "MLFLOW_TRACKING_URI", "AWS_SECRET_ACCESS_KEY", "TRAINYARD_BUCKET",
                 "MLFLOW_TRACKING_PASSWORD", "TRAINYARD_S3_TRAINING_SECRET_ACCESS_KEY"):
        assert name in str(raised.value)
    assert "TRAINYARD_PG_HOST " not in str(raised.value)


def test_a_malformed_env_file_names_its_line(cluster_env) -> None:
    (cluster_env / "cluster.env").write_text("TRAINYARD_PG_HOST=db\nnot a setting\n")
    with pytest.raises(environment.DeploymentConfigError, match=r"cluster.env:2: not a KEY=VALUE line"):
        environment.load_cluster_env()


@pytest.mark.parametrize("name", ["bogus", "cluster+local", "SLURM"])
def test_an_unknown_environment_is_refused(monkeypatch, name) -> None:
    monkeypatch.setenv("TRAINYARD_ENV", name)
    with pytest.raises(environment.DeploymentConfigError, match="is not one of"):
        environment.current()


def test_the_cluster_instance_file_is_postgres_and_holds_no_secret(cluster_env) -> None:
    from pipelines.instance import ensure_dagster_home

    home = ensure_dagster_home()
    text = (home / "dagster.yaml").read_text()
    config = yaml.safe_load(text)
    db = config["storage"]["postgres"]["postgres_db"]
    assert db["password"] == {"env": "TRAINYARD_PG_PASSWORD"} and db["scheme"] == "postgresql+psycopg2"
    assert config["concurrency"]["pools"]["default_limit"] == 1
    assert config["run_monitoring"]["enabled"] is True
    assert "s3cret-pw" not in text
    (home / "dagster.yaml").write_text("storage: {}\n")  # an edit is put back: the file is Trainyard's
    ensure_dagster_home()
    assert (home / "dagster.yaml").read_text() == text


def test_cluster_resources_read_the_server_through_envvar(cluster_env) -> None:
    import dagster as dg

    from pipelines.definitions import resources_for

    resources = resources_for("cluster")
    launcher = resources["launcher"]
    # Resolved when a run starts, from the variable: the Definitions hold its name, not the address.
    assert isinstance(launcher.mlflow_tracking_uri, dg.EnvVar)
    assert launcher.mlflow_tracking_uri.env_var_name == "MLFLOW_TRACKING_URI"
    assert "s3cret-pw" not in repr(resources)
