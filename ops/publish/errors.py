"""Why a published file cannot be trusted: the errors every reader of a published version raises.

A leaf module (it imports nothing of the project), so the data root in a store (ops.publish.store_root)
and the local publication (ops.publish.storage) can both raise them without importing each other.
"""

from __future__ import annotations


class PublishedFileError(ValueError):
    """A published file cannot be trusted as the version it claims to be."""


class PublishedFileCorrupt(PublishedFileError):
    """A published file differs from the sha256 / size recorded when its version was published."""


class PublishedRecordMissing(PublishedFileError):
    """A published folder has no digest record (written before records existed, or damaged)."""


class PublishedRecordUnsigned(PublishedRecordMissing):
    """A digest record carries no signature: published before records were signed, or stripped
    (as good as no record: a rebuild repairs it)."""


class PublishedSignatureInvalid(PublishedFileCorrupt):
    """A digest record's signature does not check: signed with another key, or the record was
    rewritten (with the files it lists); or it is signed and this reader has no key to check it."""
