"""Which deployment this process runs in (``TRAINYARD_ENV``), and the settings the ``cluster`` one needs.

| ``TRAINYARD_ENV`` | Dagster storage | MLflow | training stages |
| --- | --- | --- | --- |
| ``local`` (default) | SQLite in ``DAGSTER_HOME`` | SQLite file | local torchrun |
| ``slurm`` | SQLite in ``DAGSTER_HOME`` | SQLite file | SLURM (resources/slurm.py) |
| ``cluster`` | PostgreSQL, run queue, pools | tracking server, artifacts in the bucket | local torchrun |
| ``cluster+slurm`` | as ``cluster`` | as ``cluster`` | SLURM |

The cluster's settings are environment variables (`CLUSTER_VARIABLES`); credentials are read
through them only (``dg.EnvVar`` in resources, ``env:`` in dagster.yaml), never written into
Definitions or run config. ``make cluster-up`` writes them for the services it starts to
``$TRAINYARD_CLUSTER_HOME/cluster.env`` (default .trainyard/cluster); `load_cluster_env` fills in
from that file whatever the environment does not already set, so a team's own variables win.

Object-store identities (docs/cluster.md): this process acts as the data pipeline
(``AWS_ACCESS_KEY_ID``); the launchers give the training ranks the training identity
(``TRAINYARD_S3_TRAINING_*``, ops.publish.objstore.role_credentials), which writes checkpoints only.
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass
from pathlib import Path

from ops.publish import paths

ENVIRONMENTS = ("local", "slurm", "cluster", "cluster+slurm")

# name -> what it is; every one must be set (by the environment or cluster.env) in a cluster deployment.
CLUSTER_VARIABLES = {
    "TRAINYARD_PG_HOST": "PostgreSQL host of Dagster's storage",
    "TRAINYARD_PG_PORT": "PostgreSQL port",
    "TRAINYARD_PG_USER": "PostgreSQL user",
    "TRAINYARD_PG_PASSWORD": "PostgreSQL password",
    "TRAINYARD_PG_DB": "PostgreSQL database of Dagster's storage",
    "DAGSTER_HOME": "folder of the cluster's dagster.yaml",
    "MLFLOW_TRACKING_URI": "the MLflow tracking server (http://...)",
    "MLFLOW_TRACKING_USERNAME": "a user of the tracking server's basic-auth app",
    "MLFLOW_TRACKING_PASSWORD": "that user's password",
    "TRAINYARD_S3_ENDPOINT_URL": "the S3-compatible endpoint (http://host:port)",
    "AWS_ACCESS_KEY_ID": "the data pipeline's access key to the object store (Dagster, the command line)",
    "AWS_SECRET_ACCESS_KEY": "the data pipeline's secret key",
    "TRAINYARD_S3_TRAINING_ACCESS_KEY_ID": "the training ranks' access key (reads data, writes checkpoints)",
    "TRAINYARD_S3_TRAINING_SECRET_ACCESS_KEY": "the training ranks' secret key",
    "TRAINYARD_BUCKET": "the deployment's bucket (MLflow's artifacts live in it)",
}


class DeploymentConfigError(ValueError):
    """A deployment setting is missing or wrong; the message names the variable to set."""


@dataclass(frozen=True, slots=True)
class Environment:
    name: str

    @property
    def cluster(self) -> bool:
        return self.name.startswith("cluster")

    @property
    def slurm(self) -> bool:
        return self.name.endswith("slurm")


def parse(name: str) -> Environment:
    if name not in ENVIRONMENTS:
        raise DeploymentConfigError(f"TRAINYARD_ENV={name!r} is not one of {ENVIRONMENTS}")
    return Environment(name)


def current() -> Environment:
    return parse(os.environ.get("TRAINYARD_ENV") or "local")


def cluster_home() -> Path:
    return Path(os.environ.get("TRAINYARD_CLUSTER_HOME") or paths.trainyard_home() / "cluster")


def cluster_env_file() -> Path:
    return cluster_home() / "cluster.env"


def read_env_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines (``#`` comments and blank lines skipped), as deploy/cluster/up.sh writes them."""
    values: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip().isidentifier():
            raise DeploymentConfigError(f"{path}:{number}: not a KEY=VALUE line")
        values[key.strip()] = value.strip()
    return values


def load_cluster_env() -> list[str]:
    """Fill the cluster's variables from cluster.env where unset; raise naming any still missing.

    Returns the names taken from the file.
    """
    taken: list[str] = []
    env_file = cluster_env_file()
    if env_file.exists():
        for key, value in read_env_file(env_file).items():
            if not os.environ.get(key):
                os.environ[key] = value
                taken.append(key)
    missing = [name for name in CLUSTER_VARIABLES if not os.environ.get(name)]
    if missing:
        listed = "; ".join(f"{name} ({CLUSTER_VARIABLES[name]})" for name in missing)
        raise DeploymentConfigError(
            f"TRAINYARD_ENV={current().name} needs {listed}: set them, or run `make cluster-up`, which writes "
            f"{env_file}")
    return taken


def check_cluster() -> list[str]:
    """Reach each service of the cluster deployment with its configured credentials, before any run.

    Returns one line per service that answered; raises `DeploymentConfigError` naming the variable
    to fix for the first one that does not (a wrong password, an unknown database, a bucket that
    does not exist, nothing listening).
    """
    load_cluster_env()
    checked = [_check_postgres(), _check_mlflow(), _check_bucket(os.environ["TRAINYARD_BUCKET"], "TRAINYARD_BUCKET")]
    # Media read from the store (ops.media.roots), the data root's versions (ops.publish.store_root), checkpoints
    # mirrored (ops/checkpoints/mirror.py) and shard sets published (assets/clips.py) to it.
    for variable in ("TRAINYARD_MEDIA_ROOT", "TRAINYARD_DATA_ROOT", "TRAINYARD_CHECKPOINT_ROOT", "TRAINYARD_SHARD_ROOT"):
        root = os.environ.get(variable, "")
        if root.startswith("s3://"):
            checked.append(_check_bucket(root[len("s3://"):].split("/", 1)[0], variable))
    # The training ranks' own identity (the launchers hand it to them) reaches the checkpoints' bucket too.
    root = os.environ.get("TRAINYARD_CHECKPOINT_ROOT", "")
    bucket = root[len("s3://"):].split("/", 1)[0] if root.startswith("s3://") else os.environ["TRAINYARD_BUCKET"]
    checked.append(_check_bucket(bucket, "TRAINYARD_CHECKPOINT_ROOT", identity="TRAINYARD_S3_TRAINING"))
    checked.append(_check_capacity())
    return checked


def _check_capacity() -> str:
    """The object store's room left, from its master (`make cluster-up`'s SeaweedFS; ops.publish.objstore)."""
    from ops.publish import objstore

    try:
        capacity = objstore.store_capacity()
    except objstore.ObjectStoreError as error:
        raise DeploymentConfigError(str(error)) from None
    if capacity is None:
        return ("S3 capacity: not known here (TRAINYARD_S3_MASTER_URL names no SeaweedFS master; "
                "a full store then fails as storage_error, not store_full)")
    return f"S3 capacity: {capacity.describe()}"


def _check_postgres() -> str:
    import psycopg2

    env = os.environ
    where = f"{env['TRAINYARD_PG_HOST']}:{env['TRAINYARD_PG_PORT']}"
    try:
        psycopg2.connect(host=env["TRAINYARD_PG_HOST"], port=env["TRAINYARD_PG_PORT"], user=env["TRAINYARD_PG_USER"],
                         password=env["TRAINYARD_PG_PASSWORD"], dbname=env["TRAINYARD_PG_DB"],
                         connect_timeout=5).close()
    except psycopg2.OperationalError as error:
        text = str(error).strip().splitlines()[-1] if str(error).strip() else repr(error)
        if "password authentication failed" in text or "no password supplied" in text:
            fix = f"PostgreSQL at {where} refused TRAINYARD_PG_USER={env['TRAINYARD_PG_USER']!r} with the password " \
                  f"in TRAINYARD_PG_PASSWORD"
        elif "does not exist" in text and "database" in text:
            fix = f"PostgreSQL at {where} has no database TRAINYARD_PG_DB={env['TRAINYARD_PG_DB']!r}"
        else:
            fix = (f"PostgreSQL does not answer at TRAINYARD_PG_HOST:TRAINYARD_PG_PORT = {where} "
                   f"(is it running? `make cluster-up` starts the local one)")
        raise DeploymentConfigError(f"{fix}: {text}") from None
    return f"PostgreSQL {where}/{env['TRAINYARD_PG_DB']} as {env['TRAINYARD_PG_USER']}"


def _check_mlflow() -> str:
    import urllib.error
    import urllib.request

    uri = os.environ["MLFLOW_TRACKING_URI"].rstrip("/")
    if not uri.startswith(("http://", "https://")):
        raise DeploymentConfigError(f"MLFLOW_TRACKING_URI={uri!r} is not a tracking server (http://host:port)")
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=5) as response:
            response.read()
    except (urllib.error.URLError, OSError) as error:
        raise DeploymentConfigError(f"the MLflow server at MLFLOW_TRACKING_URI={uri} does not answer: {error}") from None
    # /health answers anyone; an API call proves the credentials (the server runs MLflow's basic-auth app).
    user = os.environ["MLFLOW_TRACKING_USERNAME"]
    token = base64.b64encode(f"{user}:{os.environ['MLFLOW_TRACKING_PASSWORD']}".encode()).decode()
    request = urllib.request.Request(f"{uri}/api/2.0/mlflow/experiments/search?max_results=1",
                                     headers={"Authorization": f"Basic {token}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()
    except urllib.error.HTTPError as error:
        if error.code in (401, 403):
            raise DeploymentConfigError(f"the MLflow server at MLFLOW_TRACKING_URI={uri} refused "
                                        f"MLFLOW_TRACKING_USERNAME={user!r} with the password in "
                                        f"MLFLOW_TRACKING_PASSWORD (HTTP {error.code})") from None
        raise DeploymentConfigError(f"the MLflow server at MLFLOW_TRACKING_URI={uri} answered HTTP {error.code} "
                                    f"to a search of experiments") from None
    except (urllib.error.URLError, OSError) as error:
        raise DeploymentConfigError(f"the MLflow server at MLFLOW_TRACKING_URI={uri} does not answer: {error}") from None
    return f"MLflow {uri} as {user}"


def _check_bucket(bucket: str, variable: str, identity: str = "AWS") -> str:
    """``identity``: the prefix of the key variables, ``AWS`` (the data pipeline's) or ``TRAINYARD_S3_TRAINING``."""
    import boto3
    import botocore.config
    import botocore.exceptions

    env = os.environ
    endpoint = env["TRAINYARD_S3_ENDPOINT_URL"]
    key_name, secret_name = f"{identity}_ACCESS_KEY_ID", f"{identity}_SECRET_ACCESS_KEY"
    # A session of its own with the keys as they are now (boto3's default session caches what it read first).
    session = boto3.session.Session(aws_access_key_id=env[key_name], aws_secret_access_key=env[secret_name])
    client = session.client("s3", endpoint_url=endpoint, region_name=env.get("AWS_DEFAULT_REGION") or "us-east-1",
                          config=botocore.config.Config(connect_timeout=5, read_timeout=10,
                                                        retries={"max_attempts": 1}))
    try:
        # A listing, not HEAD: its error names the cause (a HEAD answer has no body, only "403").
        client.list_objects_v2(Bucket=bucket, MaxKeys=1)
    except botocore.exceptions.ClientError as error:
        code = str(error.response.get("Error", {}).get("Code", ""))
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "403"):
            fix = (f"the object store at TRAINYARD_S3_ENDPOINT_URL={endpoint} refused the credentials in "
                   f"{key_name} / {secret_name} for bucket {bucket!r}")
        elif code in ("404", "NoSuchBucket", "NotFound"):
            fix = f"bucket {bucket!r} of {variable} does not exist at {endpoint}: create it, or name another"
        elif code == "AccessDenied":  # an identity scoped to other buckets cannot tell a missing one from a barred one
            fix = (f"bucket {bucket!r} of {variable} does not exist at {endpoint}, or the identity of {key_name} "
                   f"may not list it: create it, name another, or grant that identity its use")
        else:
            fix = f"the object store at {endpoint} answered {code or 'an error'} for bucket {bucket!r}"
        raise DeploymentConfigError(f"{fix} ({error})") from None
    except botocore.exceptions.BotoCoreError as error:
        raise DeploymentConfigError(
            f"the object store does not answer at TRAINYARD_S3_ENDPOINT_URL={endpoint}: {error}") from None
    return f"S3 {endpoint} bucket {bucket}" + (" (training identity)" if identity != "AWS" else "")
