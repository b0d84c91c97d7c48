"""Sidecar JSON files: the human facts about a media object (caption, licence, consent).

Format (one ``<media name>.json`` beside each media file, or anywhere with a ``uri``)::

    {"uri": "clips/clip_000.mp4",     # relative to the media root; default: this file minus ".json"
     "caption": "...", "license": "CC-BY-4.0", "consent": "granted" | "revoked",
     "source_group": "group_07",       # clips from one source never straddle splits
     "sha256": "<hex>",                # optional: expected content checksum
     "split": "train" | "val" | "test",  # optional: pinned split
     "provenance": "..."}              # optional: where the media came from
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

MALFORMED_SIDECAR = "malformed_sidecar"
KNOWN_KEYS = frozenset({"uri", "caption", "license", "consent", "source_group", "sha256", "split", "provenance"})


@dataclass(kw_only=True, slots=True)
class Sidecar:
    path: str
    """Sidecar's own path relative to the media root."""
    sha256: str
    """Checksum of the sidecar bytes (provenance)."""
    target_uri: str
    """Media object the sidecar describes, relative to the root (may escape: checked later)."""
    fields: dict = field(default_factory=dict)
    error: str | None = None
    error_detail: str | None = None


def default_target(sidecar_uri: str) -> str:
    return sidecar_uri[: -len(".json")] if sidecar_uri.endswith(".json") else sidecar_uri


def parse_sidecar(path: Path, uri: str, sha256: str) -> Sidecar:
    """Read the sidecar ``uri`` from the local file ``path`` (the file itself, or a store's verified copy);
    a malformed one is returned with ``error`` set, never raised."""
    sidecar = Sidecar(path=uri, sha256=sha256, target_uri=default_target(uri))
    try:
        payload = json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        sidecar.error, sidecar.error_detail = MALFORMED_SIDECAR, f"{type(error).__name__}: {error}"
        return sidecar
    if not isinstance(payload, dict):
        sidecar.error, sidecar.error_detail = MALFORMED_SIDECAR, f"top level is {type(payload).__name__}, not an object"
        return sidecar
    bad_types = sorted(key for key in KNOWN_KEYS if key in payload and not isinstance(payload[key], (str, type(None))))
    if bad_types:
        sidecar.error, sidecar.error_detail = MALFORMED_SIDECAR, f"non-string values for {bad_types}"
        return sidecar
    if isinstance(payload.get("uri"), str) and payload["uri"]:
        # Normalise separators only; '..' stays so the escape check sees it.
        sidecar.target_uri = PurePosixPath(payload["uri"]).as_posix()
    sidecar.fields = {key: payload.get(key) for key in KNOWN_KEYS}
    return sidecar
