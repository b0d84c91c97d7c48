"""Reason codes: one definition each, one priority order, and docs/quarantine.md in that order."""

from __future__ import annotations

import re
from pathlib import Path

from ops.curation import dataset_card, manifest, reason_codes, validation
from ops.media import metadata_table, probe, scan, sidecar

DOC = Path(__file__).resolve().parent.parent / "docs" / "quarantine.md"
# Module constants that name reason codes (the rest of each module's UPPER_CASE names are not codes).
_CODE_MODULES = {
    reason_codes: {"MISSING_OBJECT"},
    scan: {"SYMLINK_LOOP", "UNREADABLE_PATH", "INVALID_FILENAME"},
    probe: {"EMPTY_FILE", "NOT_MEDIA", "UNRECOGNIZED_FORMAT", "TRUNCATED_FILE", "UNREADABLE_MEDIA", "EXCEEDS_LIMITS",
            "NO_VIDEO_STREAM", "DECODE_ERROR", "PROBE_TIMEOUT", "PROBE_CRASHED"},
    manifest: {"PATH_ESCAPE", "MISSING_SIDECAR", "SIDECAR_CONFLICT", "UNSUPPORTED_EXTENSION"},
    sidecar: {"MALFORMED_SIDECAR"},
    metadata_table: {"MALFORMED_METADATA_ROW", "DUPLICATE_METADATA_ROW", "MISSING_METADATA_ROW", "METADATA_CONFLICT"},
    dataset_card: {"INVALID_DATASET_CARD"},
    validation: {"CHECKSUM_MISMATCH", "DUPLICATE_CONTENT", "SPLIT_LEAKAGE", "CONSENT_REVOKED", "MISSING_CONSENT",
                 "MISSING_LICENSE", "INVALID_DURATION", "UNEXPECTED_DIMENSIONS", "INVALID_FRAME_RATE",
                 "UNSUPPORTED_CODEC", "UNKNOWN_LICENSE", "LICENSE_NOT_ALLOWED", "RIGHTS_REVOKED"},
}


def test_every_reason_code_is_ranked_once() -> None:
    codes = {getattr(module, name) for module, names in _CODE_MODULES.items() for name in names}
    assert sorted(validation.REASON_PRIORITY) == sorted(codes)
    assert len(set(validation.REASON_PRIORITY)) == len(validation.REASON_PRIORITY)


def test_missing_object_is_one_object_everywhere() -> None:
    # Defined once (ops.curation.reason_codes); the stages re-export that very string, not a copy of it.
    assert scan.MISSING_OBJECT is probe.MISSING_OBJECT is manifest.MISSING_OBJECT is reason_codes.MISSING_OBJECT
    for module in (scan, probe, manifest):
        assert not re.search(r'^MISSING_OBJECT\s*=', Path(module.__file__).read_text(), re.MULTILINE), module


def test_the_docs_table_lists_the_codes_in_priority_order() -> None:
    documented = re.findall(r"^\| `([a-z_]+)` \|", DOC.read_text(), re.MULTILINE)
    assert documented == list(validation.REASON_PRIORITY)
