"""DCP's ``.metadata`` file, read without running code: an allowlist unpickler.

torch.distributed.checkpoint writes ``.metadata`` with ``pickle.dump`` and its FileSystemReader
reads it back with ``pickle.load``, so a checkpoint folder whose ``.metadata`` was replaced can
run any code in the process that resumes from it (or merely inspects it). Hashing the file
against COMMITTED.json is not enough on its own: whoever can rewrite ``.metadata`` can often
rewrite the record too. So every reader in Trainyard (``checkpoint_store.verify`` and
`RecordedMetadataReader` below) loads it with `load_metadata`, which resolves only the classes DCP
metadata is made of and refuses anything else by name, whatever the record says.

The allowlist is what torch 2.x writes (checked by tests/test_checkpoint_forgery.py against a
real DCP save): DCP's metadata dataclasses, ``torch.Size``, dtypes and layouts, and the path
DCP records as the checkpoint id. Resolving a name imports nothing outside these modules.

`RecordedMetadataReader` is the one DCP storage reader Trainyard loads checkpoints with (the
trainer's resume and the restore drill): DCP's FileSystemReader, except that ``.metadata`` is
read only when the commit record lists it, only with the record's sha256, and only through the
allowlist.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

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


class RecordedMetadataReader(FileSystemReader):
    """DCP's reader, except ``.metadata``: read only if the commit record lists it and its bytes
    have the record's sha256, and unpickled only through the allowlist (DCP's own read_metadata
    is ``pickle.load``). Tensor data is read by DCP as usual.

    Checking the hash again here, not only in ``checkpoint_store.verify``, closes the window
    between verifying and loading in which the file could be swapped. It overrides only the
    public StorageReader method and reads the file with plain ``open`` under ``checkpoint_id``,
    so no private torch API is involved (DCP's own version uses its private ``_get_metadata_path``
    and ``fs``). DCP turns a failed read into an AssertionError message (after trying a per-rank
    ``__<rank>.metadata``), so refusals are also kept in ``refusals`` for the caller to report.
    """

    def __init__(self, path: str | Path, record_files: Mapping[str, Any]) -> None:
        super().__init__(str(path))
        self._record_files = dict(record_files)
        self.refusals: list[MetadataRefused] = []

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = DCP_METADATA_NAME if rank is None else f"__{rank}{DCP_METADATA_NAME}"
        try:
            return self._read_recorded(name)
        except MetadataRefused as refused:
            self.refusals.append(refused)
            raise

    def _read_recorded(self, name: str) -> Metadata:
        entry = self._record_files.get(name)
        if not isinstance(entry, Mapping) or not isinstance(entry.get("sha256"), str):
            raise MetadataRefused(f"{name} is not listed in the commit record")
        data = (Path(self.checkpoint_id) / name).read_bytes()
        metadata = load_metadata(data, expected_sha256=entry["sha256"])
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # what DCP's reader sets; the planner reads it
        return metadata
