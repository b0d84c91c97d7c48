"""DCP's ``.metadata`` file, read without running code: an allowlist unpickler.

torch.distributed.checkpoint writes ``.metadata`` with ``pickle.dump`` and its FileSystemReader
reads it back with ``pickle.load``, so a checkpoint folder whose ``.metadata`` was replaced can
run any code in the process that resumes from it (or merely inspects it). Hashing the file
against COMMITTED.json is not enough on its own: whoever can rewrite ``.metadata`` can often
rewrite the record too. So every reader in Trainyard (``checkpoint_store.verify`` and the
trainer's DCP reader) loads it with `load_metadata`, which resolves only the classes DCP
metadata is made of and refuses anything else by name, whatever the record says.

The allowlist is what torch 2.x writes (checked by tests/test_checkpoint_forgery.py against a
real DCP save): DCP's metadata dataclasses, ``torch.Size``, dtypes and layouts, and the path
DCP records as the checkpoint id. Resolving a name imports nothing outside these modules.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from typing import Any

DCP_METADATA_NAME = ".metadata"

_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, frozenset[str]] = {
    _DCP_METADATA_MODULE: frozenset({
        "Metadata", "StorageMeta", "TensorProperties", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "MetadataIndex", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    # copyreg reduces torch.layout to torch.serialization._get_layout("torch.strided"): a dict lookup.
    "torch.serialization": frozenset({"_get_layout"}),
    # StorageMeta.checkpoint_id is the path DCP wrote to.
    "pathlib": frozenset({"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"}),
    # torch.Size, and dtypes (checked to be torch.dtype instances after lookup, see find_class).
    "torch": frozenset({"Size"}),
}


class MetadataRefused(ValueError):
    """A ``.metadata`` file is not plain DCP metadata (or not the bytes the record names); not loaded."""


def is_dcp_metadata_name(name: str) -> bool:
    """``.metadata``, or a per-rank ``__<rank>.metadata`` (DCP without collectives)."""
    if name == DCP_METADATA_NAME:
        return True
    prefix, _, rank = name.removesuffix(DCP_METADATA_NAME).partition("__")
    return name.endswith(DCP_METADATA_NAME) and prefix == "" and rank.isdigit()


class _AllowlistUnpickler(pickle.Unpickler):
    """Resolves only DCP metadata classes; every other global is refused before it is imported."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name not in _ALLOWED["torch"]:
            import torch  # already imported by whoever holds a DCP checkpoint

            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                return value
            raise MetadataRefused(f"it names torch.{name}, which is not a dtype; DCP metadata never does")
        if name not in _ALLOWED.get(module, frozenset()):
            raise MetadataRefused(f"it names {module}.{name}, which DCP metadata is not made of "
                                  "(a forged or foreign pickle); nothing in it was run")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise MetadataRefused("it holds a persistent reference, which DCP metadata never does")


def load_metadata(data: bytes, *, expected_sha256: str | None = None) -> Any:
    """The DCP ``Metadata`` in ``data``; MetadataRefused if it is anything else.

    ``expected_sha256`` (the record's digest) is checked first, so bytes swapped after
    verification are refused without being unpickled at all.
    """
    if expected_sha256 is not None and hashlib.sha256(data).hexdigest() != expected_sha256:
        raise MetadataRefused("sha256 differs from the commit record (changed after verification?)")
    try:
        metadata = _AllowlistUnpickler(io.BytesIO(data)).load()
    except MetadataRefused:
        raise
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError,
            IndexError, KeyError) as error:  # what a truncated or malformed pickle raises
        raise MetadataRefused(f"not a readable pickle ({type(error).__name__}: {error})") from error
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        raise MetadataRefused(f"it holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


def metadata_problem(data: bytes) -> str:
    """Why ``data`` is not loadable DCP metadata (empty when it is)."""
    try:
        load_metadata(data)
    except MetadataRefused as error:
        return f"refused: {error}"
    return ""
