"""Reason codes that more than one stage records, defined once (docs/quarantine.md has the table).

Stage-specific codes live next to the code that finds them (ops.media.scan, ops.media.probe, ops.curation.manifest,
ops.media.sidecar, ops.curation.validation). This module imports nothing, so the probe worker, which may load
only ``ops.media.probe`` and PyAV, can use it too.
"""

MISSING_OBJECT = "missing_object"
"""The object is not there: a sidecar names nothing, a link dangles, or the file vanished during
the scan, before its probe, or after the manifest was built."""

CHECKSUM_MISMATCH = "checksum_mismatch"
"""The object's bytes are not the ones recorded: a sidecar's stated sha256 differs from the
content, or the object changed after it was listed (an object store's copy fetched for its
probe) or after the manifest was built."""
