"""Embedded default locations: everything lives under ``.trainyard/`` in the checkout.

Each location can be moved with an environment variable (and, inside Dagster, with the
matching resource setting) so a team can point it at shared storage:

| variable | default | what |
| --- | --- | --- |
| ``TRAINYARD_HOME`` | ``<checkout>/.trainyard`` | parent of the defaults below |
| ``TRAINYARD_MEDIA_ROOT`` | ``$TRAINYARD_HOME/media`` | raw media and sidecars: a folder, or ``s3://bucket/prefix`` |
| ``TRAINYARD_DATA_ROOT`` | ``$TRAINYARD_HOME/data`` | manifests, validated sets, shards, runs (folder or URL) |
| ``TRAINYARD_DATA_WORKDIR`` | ``$TRAINYARD_HOME/data_work/<digest>`` | working copy of a data root URL |
| ``DAGSTER_HOME`` | ``$TRAINYARD_HOME/dagster_home`` | Dagster instance (SQLite storage) |
| ``MLFLOW_TRACKING_URI`` | ``sqlite:///$TRAINYARD_HOME/mlflow/mlflow.db`` | MLflow tracking store |
| ``TRAINYARD_CHECKPOINT_ROOT`` | ``<data URL>/checkpoints``, or unset (run folders) | checkpoints' store URL |
| ``TRAINYARD_SHARD_ROOT`` | ``<data URL>/shard_sets``, or unset (the data root) | shard sets' store URL |
| ``TRAINYARD_SHARD_CACHE`` | ``$TRAINYARD_HOME/shard_cache`` | local cache of shard sets read from a store |
| ``TRAINYARD_SHARD_CACHE_GB`` | ``50`` | most gigabytes of tars that cache holds (ops.clips.shard_cache) |
| ``TRAINYARD_MEDIA_CACHE`` | ``$TRAINYARD_HOME/media_cache`` | local cache of media read from a store (ops.media.roots) |
| ``TRAINYARD_MEDIA_CACHE_GB`` | ``50`` | most gigabytes of media that cache holds |

Where ``TRAINYARD_CHECKPOINT_ROOT`` is set, every committed checkpoint is also published there
(ops.checkpoints.mirror); where ``TRAINYARD_SHARD_ROOT`` is set, every shard set is published there
once its index is built (``<root>/<index version>/``, assets/clips.py). Both go through
ops.publish.objstore's protocol for stores without rename; `make cluster-up` sets both to its bucket.

The checkpoint signing key lives at ``$TRAINYARD_HOME/keys/checkpoint_hmac.key`` (mode 0600,
created on first use) unless ``TRAINYARD_CHECKPOINT_HMAC_KEY`` supplies it
(ops.checkpoints.keys).

A data root URL (``TRAINYARD_DATA_ROOT=s3://bucket/prefix``) is ops.publish.store_root's: every step
writes in this machine's working copy (`data_root`), every published version goes to the store,
and a version missing from the working copy is fetched from the store and verified.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def trainyard_home() -> Path:
    return Path(os.environ.get("TRAINYARD_HOME") or REPO_ROOT / ".trainyard")


def media_location() -> str:
    """The media root: a folder path, or an object-store URL (``s3://bucket/prefix``, ops.media.roots)."""
    return os.environ.get("TRAINYARD_MEDIA_ROOT") or str(trainyard_home() / "media")


def media_root() -> Path:
    """The media root as a folder; ValueError when it is an object-store URL (use media_location)."""
    location = media_location()
    if _is_url(location):
        raise ValueError(f"TRAINYARD_MEDIA_ROOT={location!r} is a URL, not a folder")
    return Path(location)


DATA_ROOT_VARIABLE = "TRAINYARD_DATA_ROOT"


def _is_url(location: str) -> bool:
    return "://" in location and not location.startswith("file://")


def data_location() -> str:
    """The data root as configured: a folder path, or an object-store URL (``s3://bucket/prefix``)."""
    return os.environ.get(DATA_ROOT_VARIABLE) or str(trainyard_home() / "data")


def data_store_url() -> str | None:
    """The data root's object-store URL, or None when the data root is a folder (ops.publish.store_root)."""
    location = data_location()
    return location.rstrip("/") if _is_url(location) else None


def data_root() -> Path:
    """The folder every step writes in: the data root itself, or this machine's working copy of a
    data root in an object store (ops.publish.store_root publishes each version from it and fetches back
    the versions it lacks)."""
    url = data_store_url()
    if url is None:
        location = data_location()
        return Path(location[len("file://"):] if location.startswith("file://") else location)
    if workdir := os.environ.get("TRAINYARD_DATA_WORKDIR"):
        return Path(workdir)
    import hashlib

    return trainyard_home() / "data_work" / hashlib.sha256(url.encode()).hexdigest()[:16]


SHARD_ROOT_VARIABLE = "TRAINYARD_SHARD_ROOT"
CHECKPOINT_ROOT_VARIABLE = "TRAINYARD_CHECKPOINT_ROOT"


def shard_store_root() -> str | None:
    """Where shard sets are published for other machines (an object-store URL or a folder), or None.
    A data root in a store keeps them beside its versions unless the variable says otherwise."""
    url = data_store_url()
    return os.environ.get(SHARD_ROOT_VARIABLE) or (f"{url}/shard_sets" if url else None)


def checkpoint_store_root() -> str | None:
    """Where committed checkpoints are mirrored (ops.checkpoints.mirror), or None; like `shard_store_root`."""
    url = data_store_url()
    return os.environ.get(CHECKPOINT_ROOT_VARIABLE) or (f"{url}/checkpoints" if url else None)


SHARD_CACHE_GB_VARIABLE = "TRAINYARD_SHARD_CACHE_GB"


def shard_cache_dir() -> Path:
    return Path(os.environ.get("TRAINYARD_SHARD_CACHE") or trainyard_home() / "shard_cache")


def shard_cache_max_bytes() -> int:
    return _gigabytes(SHARD_CACHE_GB_VARIABLE)


MEDIA_CACHE_GB_VARIABLE = "TRAINYARD_MEDIA_CACHE_GB"


def media_cache_dir() -> Path:
    return Path(os.environ.get("TRAINYARD_MEDIA_CACHE") or trainyard_home() / "media_cache")


def media_cache_max_bytes() -> int:
    return _gigabytes(MEDIA_CACHE_GB_VARIABLE)


def _gigabytes(variable: str, default: str = "50") -> int:
    raw = os.environ.get(variable) or default
    try:
        gigabytes = float(raw)
    except ValueError:
        gigabytes = float("nan")
    if not gigabytes > 0 or gigabytes == float("inf"):
        raise ValueError(f"{variable}={raw!r}: expected a positive number of gigabytes")
    return int(gigabytes * 1e9)


def dagster_home() -> Path:
    return Path(os.environ.get("DAGSTER_HOME") or trainyard_home() / "dagster_home")


def mlflow_tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{trainyard_home() / 'mlflow' / 'mlflow.db'}"


def checkpoint_key_file() -> Path:
    """The default checkpoint signing key (ops.checkpoints.store creates it, mode 0600)."""
    return trainyard_home() / "keys" / "checkpoint_hmac.key"
