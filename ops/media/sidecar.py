"""Sidecar JSON files: the human facts about a media object (caption, licence, consent).

Format (one ``<media name>.json`` beside each media file, or anywhere with a ``uri``)::

    {"uri": "clips/clip_000.mp4",     # relative to the media root; default: this file minus ".json"
     "caption": "...", "license": "CC-BY-4.0", "consent": "granted" | "revoked",
     "source_group": "group_07",       # clips from one source never straddle splits
     "sha256": "<hex>",                # optional: expected content checksum
     "split": "train" | "val" | "test",  # optional: pinned split
     "provenance": "..."}              # optional: where the media came from

A sidecar is read as bytes once (ops.media.scan.read_regular: no symlink followed, regular files only,
at most ``MAX_SIDECAR_BYTES``), and those same bytes are hashed and parsed. What cannot be trusted
is ``malformed_sidecar``, never an exception: not UTF-8 JSON, nested past Python's recursion limit,
a key stated twice (``"consent": "revoked", "consent": "granted"`` is ambiguous: JSON parsers
disagree on which wins), a known field that is not text, or a caption over ``MAX_CAPTION_BYTES``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import PurePosixPath

MALFORMED_SIDECAR = "malformed_sidecar"
KNOWN_KEYS = frozenset({"uri", "caption", "license", "consent", "source_group", "sha256", "split", "provenance"})
MAX_CAPTION_BYTES = 64 * 1024
"""Longest caption accepted (UTF-8 bytes), in a sidecar or a metadata table: a caption is a few
sentences; megabytes of it are a mistake or an attack on every reader downstream."""
MAX_SIDECAR_BYTES = 1 << 20
"""Largest sidecar file read at all (a caption at its bound plus the other fields fits many times)."""


class _AmbiguousKey(ValueError):
    """A JSON object states one key twice."""


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise _AmbiguousKey(f"key {key!r} is stated twice: ambiguous (which one holds?)")
        seen[key] = value
    return seen


@dataclass(kw_only=True, slots=True)
class Sidecar:
    path: str
    """Sidecar's own path relative to the media root."""
    sha256: str
    """Checksum of the sidecar bytes that were parsed (provenance)."""
    target_uri: str
    """Media object the sidecar describes, relative to the root (may escape: checked later)."""
    fields: dict = field(default_factory=dict)
    error: str | None = None
    error_detail: str | None = None


def default_target(sidecar_uri: str) -> str:
    return sidecar_uri[: -len(".json")] if sidecar_uri.endswith(".json") else sidecar_uri


def parse_sidecar(data: bytes, uri: str) -> Sidecar:
    """The sidecar ``uri`` from its bytes (hashed here, so the record's sha256 is of what was parsed);
    a malformed one is returned with ``error`` set, never raised."""
    sidecar = Sidecar(path=uri, sha256=hashlib.sha256(data).hexdigest(), target_uri=default_target(uri))
    if len(data) > MAX_SIDECAR_BYTES:
        sidecar.error, sidecar.error_detail = MALFORMED_SIDECAR, f"{len(data)} bytes: a sidecar is at most {MAX_SIDECAR_BYTES}"
        return sidecar
    try:
        payload = json.loads(data.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, json.JSONDecodeError, _AmbiguousKey) as error:
        sidecar.error, sidecar.error_detail = MALFORMED_SIDECAR, f"{type(error).__name__.lstrip('_')}: {error}"
        return sidecar
    except RecursionError:  # json's C scanner recurses once per level of nesting
        sidecar.error, sidecar.error_detail = MALFORMED_SIDECAR, "nested deeper than a sidecar's flat object can be"
        return sidecar
    if not isinstance(payload, dict):
        sidecar.error, sidecar.error_detail = MALFORMED_SIDECAR, f"top level is {type(payload).__name__}, not an object"
        return sidecar
    bad_types = sorted(key for key in KNOWN_KEYS if key in payload and not isinstance(payload[key], (str, type(None))))
    if bad_types:
        sidecar.error, sidecar.error_detail = MALFORMED_SIDECAR, f"non-string values for {bad_types}"
        return sidecar
    if (caption_bytes := len((payload.get("caption") or "").encode("utf-8", "surrogatepass"))) > MAX_CAPTION_BYTES:
        sidecar.error, sidecar.error_detail = MALFORMED_SIDECAR, (f"caption is {caption_bytes} bytes; at most "
                                                                  f"{MAX_CAPTION_BYTES} are accepted")
        return sidecar
    if isinstance(payload.get("uri"), str) and payload["uri"]:
        # Normalise separators only; '..' stays so the escape check sees it.
        sidecar.target_uri = PurePosixPath(payload["uri"]).as_posix()
    sidecar.fields = {key: payload.get(key) for key in KNOWN_KEYS}
    return sidecar
