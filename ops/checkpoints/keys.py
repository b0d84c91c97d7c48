"""The checkpoint signing key: where it comes from, created on first use, never logged.

Every commit record is signed by default (ops.checkpoints.store). The key comes from
$TRAINYARD_CHECKPOINT_HMAC_KEY (a deployment's secret, set in the environment of the Dagster
process, which the launcher passes on to every rank; no resource field holds it), else from the
key file under the Trainyard home (ops.publish.paths.checkpoint_key_file), created with mode 0600 on the
first signing. The Dagster process and the trainer it launches
share the environment and the home, so they resolve the same key.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from ops.publish.paths import checkpoint_key_file
from ops.publish.durable import fsync_path

HMAC_KEY_ENV = "TRAINYARD_CHECKPOINT_HMAC_KEY"
"""Where deployments put the signing key; the trainer's redaction scrubs its value (name has KEY)."""


class SigningKeyError(RuntimeError):
    """The signing key file exists but cannot be used (unreadable, empty, or readable by others)."""


def _read_key_file(path: Path) -> bytes | None:
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return None
    if os.name == "posix" and mode & 0o077:
        raise SigningKeyError(f"{path} is readable by other users (mode {oct(mode & 0o777)}); "
                              f"run `chmod 600 {path}` so only its owner can sign checkpoints")
    key = path.read_bytes().strip()
    if not key:
        raise SigningKeyError(f"{path} is empty; delete it (a new key is created on the next save) "
                              f"or set {HMAC_KEY_ENV}")
    return key


def _create_key_file(path: Path) -> bytes:
    """Write a new random key at ``path`` (0600), unless another process just did; return the key."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex}"
    descriptor = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(os.urandom(32).hex().encode())
        handle.flush()
        os.fsync(handle.fileno())
    try:
        os.link(tmp, path)  # fails if it exists: ranks racing on first use all end up with one key
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    fsync_path(path.parent)
    key = _read_key_file(path)
    assert key is not None, f"{path} vanished right after it was created"
    return key


def configured_key(name: str = HMAC_KEY_ENV) -> bytes | None:
    """The signing key to check records with: ``$name``, else the key file; None when neither exists.

    Never creates a key (a reader without one refuses signed records by name). Never log the result.
    """
    value = os.environ.get(name, "")
    return value.encode() if value else _read_key_file(checkpoint_key_file())


def signing_key() -> bytes:
    """The key to sign new records with: the configured key, created on first use. Never log it."""
    return configured_key() or _create_key_file(checkpoint_key_file())

