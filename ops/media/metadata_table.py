"""Metadata tables: one Parquet or CSV table describing many media objects, instead of a sidecar each.

A video2dataset-style export, a lab's spreadsheet or a vendor's delivery note names each object
once per row. ``MetadataTableSpec`` says where the table is (a path, or an object-store URL read
through fsspec) and which column holds each field::

    MetadataTableSpec(location="s3://bucket/meta.parquet",
                      columns={"key": "key", "caption": "caption", "license": "license"},
                      key_template="videos/{key}.mp4")

``key`` (the object's relative path under the media root, or a key the template turns into one)
is required; ``caption``, ``license``, ``consent``, ``source_group``, ``split`` and ``sha256``
(expected content checksum) are optional. Rows are numbered from 1, counting data rows only
(a CSV's header is not a row), and every problem names its row number.

A table that cannot be used at all (missing, unreadable, neither Parquet nor CSV, a mapped column
absent) raises ``MetadataTableError`` before anything is probed. A bad row is never an exception:
``load_table`` records what is wrong with it and ``join`` turns it into a reason on the object it
names, or into an orphan row of its own (ops.curation.manifest quarantines both).

Reading and checking are vectorised (Arrow compute, pandas' hash join): a million rows join in
seconds (``python -m benchmarks.metadata_table``). CSV columns are read as bytes and decoded per
value, so one caption that is not UTF-8 makes its row malformed instead of failing the read.
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
import posixpath
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv
import pyarrow.parquet as pq

from ops.publish import objstore
from ops.curation.reason_codes import MISSING_OBJECT
from ops.media.sidecar import MAX_CAPTION_BYTES

MISSING_METADATA_ROW = "missing_metadata_row"
DUPLICATE_METADATA_ROW = "duplicate_metadata_row"
MALFORMED_METADATA_ROW = "malformed_metadata_row"
METADATA_CONFLICT = "metadata_conflict"
# Row problems that also use shared codes: MISSING_OBJECT (ops.curation.reason_codes) and path_escape, defined in
# ops.curation.manifest (which imports this module, so the text is spelled here; ops.curation.manifest asserts they agree).
PATH_ESCAPE = "path_escape"

KEY_FIELD = "key"
FACT_FIELDS = ("caption", "license", "consent", "source_group", "split", "sha256")
"""The facts a row may state about its object: the sidecar's fields, under the same names."""
FIELDS = (KEY_FIELD, *FACT_FIELDS)
_MAX_BLOCK_BYTES = (1 << 31) - 1  # Arrow's block size is a 32-bit int
_SHA256_PATTERN = r"^[0-9a-fA-F]{64}$"
# A key that needs posixpath.normpath to be judged: absolute, '.'/'..' parts, empty parts, backslashes.
_NEEDS_NORMALISING = r"^/|(^|/)\.{1,2}(/|$)|//|\\"


class MetadataTableError(ValueError):
    """The table cannot be used at all: missing, unreadable, not Parquet or CSV, or a mapped column absent."""


@dataclass(kw_only=True, slots=True, frozen=True)
class MetadataTableSpec:
    location: str
    """Path or object-store URL of a ``.parquet`` / ``.csv`` / ``.tsv`` file."""
    columns: Mapping[str, str]
    """Field (``key``, ``caption``, ``license``, ``consent``, ``source_group``, ``split``, ``sha256``)
    -> the table's column name. ``key`` is required."""
    key_template: str = "{key}"
    """How a key becomes a relative path under the media root, e.g. ``videos/{key}.mp4``."""
    card: str | Mapping | None = None
    """A dataset card (ops.curation.dataset_card) for every object the table describes: its path or URL, or
    the card itself as a mapping. None: folder cards only."""

    def __post_init__(self) -> None:
        if not isinstance(self.location, str) or not self.location:
            raise ValueError(f"metadata table location must be a path or URL, got {self.location!r}")
        unknown = sorted(set(self.columns) - set(FIELDS))
        if unknown:
            raise ValueError(f"metadata table columns map unknown fields {unknown}; known: {list(FIELDS)}")
        if KEY_FIELD not in self.columns:
            raise ValueError(f"metadata table columns must map {KEY_FIELD!r} (the object's key or relative "
                             f"path), got {dict(self.columns)}")
        bad = sorted(name for name, column in self.columns.items() if not isinstance(column, str) or not column)
        if bad:
            raise ValueError(f"metadata table columns for {bad} must be non-empty column names")
        if self.key_template.count("{key}") != 1 or self.key_template.replace("{key}", "").count("{") \
                or self.key_template.replace("{key}", "").count("}"):
            raise ValueError(f"key_template must contain '{{key}}' exactly once and no other braces, "
                             f"got {self.key_template!r}")
        object.__setattr__(self, "columns", dict(sorted(self.columns.items())))

    @property
    def name(self) -> str:
        """The table's file name: orphan rows are named ``<name>#row=<n>``."""
        return PurePosixPath(self.location.rstrip("/")).name or self.location


@dataclass(kw_only=True, slots=True)
class MetadataTable:
    """A table read and checked: decoded columns, each row's uri, and what is wrong with which row."""
    spec: MetadataTableSpec
    sha256: str
    """sha256 of the table's bytes: part of the manifest version."""
    num_rows: int
    uris: list[str | None]
    """Per row: the relative path its key names (None when the key is unusable)."""
    values: dict[str, list]
    """Field -> per-row decoded value (str or None); fields the spec does not map are absent."""
    key_problems: dict[int, tuple[str, str]] = field(default_factory=dict)
    """Row index -> (code, detail) for a row whose key cannot name an object (empty, not text, escaping)."""
    value_problems: dict[int, str] = field(default_factory=dict)
    """Row index -> what is wrong with its values (the key is fine; the object it names is quarantined)."""

    def facts(self, index: int) -> dict[str, str | None]:
        """The facts row ``index`` states (fields the spec maps; None where the row leaves one empty)."""
        return {name: self.values[name][index] for name in FACT_FIELDS if name in self.values}

    def transform_config(self) -> dict:
        card = self.spec.card
        return {"location": self.spec.location, "sha256": self.sha256, "columns": dict(self.spec.columns),
                "key_template": self.spec.key_template,
                **({"card": card if isinstance(card, str) else dict(card)} if card is not None else {})}


# ---- reading ----

class FileOverLimit(MetadataTableError):
    """The file holds more bytes than its reader accepts (found before reading it whole)."""

    def __init__(self, message: str, *, size_bytes: int) -> None:
        super().__init__(message)
        self.size_bytes = size_bytes


def read_bytes(location: str, what: str = "metadata table", *, max_bytes: int | None = None) -> bytes:
    """The whole file at a path or URL; MetadataTableError when there is none, it is not a regular file,
    or it holds more than ``max_bytes`` (found from its size, before it is read whole)."""
    if objstore.is_remote(location):
        return _read_remote(location, what, max_bytes)
    try:
        # O_NONBLOCK: a FIFO named as a table opens at once and is refused below, never waited on.
        descriptor = os.open(location, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError as error:
        raise MetadataTableError(f"{what} {location} does not exist") from error
    except OSError as error:
        raise MetadataTableError(f"{what} {location} cannot be read: {type(error).__name__}: {error}") from error
    with os.fdopen(descriptor, "rb") as handle:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise MetadataTableError(f"{what} {location} is not a regular file (a folder, FIFO or device)")
        if max_bytes is not None and info.st_size > max_bytes:
            raise FileOverLimit(f"{what} {location} is {info.st_size} bytes; at most {max_bytes} are read",
                                size_bytes=info.st_size)
        try:
            data = handle.read() if max_bytes is None else handle.read(max_bytes + 1)
        except OSError as error:
            raise MetadataTableError(f"{what} {location} cannot be read: {type(error).__name__}: {error}") from error
    if max_bytes is not None and len(data) > max_bytes:  # grew since its size was read
        raise FileOverLimit(f"{what} {location} is over {max_bytes} bytes; at most {max_bytes} are read",
                            size_bytes=len(data))
    return data


def _read_remote(location: str, what: str, max_bytes: int | None) -> bytes:
    if max_bytes is None:
        data = objstore.read_object(location)  # an unreachable store raises ObjectStoreError, naming the URL
    else:
        fs, path = objstore.filesystem(location)
        with objstore.store_errors("read", location):
            try:
                data = fs.cat_file(path, start=0, end=max_bytes + 1)
            except FileNotFoundError:
                data = None
        if data is not None and len(data) > max_bytes:
            raise FileOverLimit(f"{what} {location} is over {max_bytes} bytes; at most {max_bytes} are read",
                                size_bytes=len(data))
    if data is None:
        raise MetadataTableError(f"{what} {location} does not exist")
    return data


def _format(location: str, data: bytes) -> str:
    suffix = PurePosixPath(location).suffix.lower()
    if suffix in (".parquet", ".pq") or (not suffix and data[:4] == b"PAR1"):
        return "parquet"
    if suffix in (".csv", ".tsv"):
        return suffix[1:]
    raise MetadataTableError(f"metadata table {location} is not Parquet (.parquet) or CSV (.csv, .tsv)")


def _require_columns(spec: MetadataTableSpec, present: list[str]) -> None:
    doubled = sorted({column for column in spec.columns.values() if present.count(column) > 1})
    if doubled:
        raise MetadataTableError(f"metadata table {spec.location} has more than one column named {doubled}: "
                                 "ambiguous (which one holds the value?); rename or drop the extra column")
    missing = sorted({column for column in spec.columns.values() if column not in present})
    if missing:
        mapped = {name: column for name, column in spec.columns.items() if column in missing}
        raise MetadataTableError(f"metadata table {spec.location} lacks the mapped column(s) {missing} "
                                 f"(for {sorted(mapped)}); its columns are {present}")


def _read_parquet(spec: MetadataTableSpec, data: bytes) -> pa.Table:
    try:
        schema = pq.read_schema(pa.BufferReader(data))
        _require_columns(spec, schema.names)
        return pq.read_table(pa.BufferReader(data), columns=sorted(set(spec.columns.values())))
    except (pa.ArrowException, OSError) as error:
        raise MetadataTableError(f"metadata table {spec.location} is not readable Parquet: {error}") from error


def _read_csv(spec: MetadataTableSpec, data: bytes, delimiter: str) -> pa.Table:
    if data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark (Excel's "CSV UTF-8"): not part of the first name
        data = data[3:]
    header_line = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="replace", newline="")
    header = next(csv.reader(header_line, delimiter=delimiter), [])
    _require_columns(spec, header)
    wanted = sorted(set(spec.columns.values()))
    # Bytes, not text: one value that is not UTF-8 would otherwise fail the whole read. Only an
    # empty cell is null ("NA" is a caption, not a missing value).
    convert = pyarrow.csv.ConvertOptions(include_columns=wanted, column_types=dict.fromkeys(wanted, pa.binary()),
                                         null_values=[""], strings_can_be_null=True, quoted_strings_can_be_null=False)
    try:
        # newlines_in_values: a quoted caption may span lines (Arrow's chunked reader loses sync otherwise)
        parse = pyarrow.csv.ParseOptions(delimiter=delimiter, newlines_in_values=True)
        # One block for the whole table (already in memory): a row longer than a block (1 MiB by default,
        # e.g. a 4 MB caption) would otherwise fail the whole read; measured no slower on a million rows.
        read = pyarrow.csv.ReadOptions(block_size=min(max(len(data) + 1, 1 << 20), _MAX_BLOCK_BYTES))
        return pyarrow.csv.read_csv(pa.BufferReader(data), read_options=read, parse_options=parse,
                                    convert_options=convert)
    except pa.ArrowException as error:
        raise MetadataTableError(f"metadata table {spec.location} is not readable CSV: {error}") from error


def _decode(column: pa.ChunkedArray, field_name: str, column_name: str,
            value_problems: dict[int, list[str]]) -> list[str | None]:
    """Per-row text of one column; a value that is not text (or not UTF-8) is None plus a row problem."""
    if pa.types.is_dictionary(column.type):  # pandas' category columns: the values are what the rows hold
        column = column.cast(column.type.value_type)
    if pa.types.is_string_view(column.type) or pa.types.is_binary_view(column.type):
        column = column.cast(pa.large_string() if pa.types.is_string_view(column.type) else pa.large_binary())
    kind = column.type
    if pa.types.is_null(kind):
        return [None] * len(column)
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return column.to_pylist()
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        try:  # the common case: every value is UTF-8, checked by Arrow in one pass
            return column.cast(pa.large_string() if pa.types.is_large_binary(kind) else pa.string()).to_pylist()
        except pa.ArrowInvalid:
            pass
        values: list[str | None] = []
        for index, raw in enumerate(column.to_pylist()):
            try:
                values.append(None if raw is None else raw.decode("utf-8"))
            except UnicodeDecodeError as error:
                value_problems.setdefault(index, []).append(
                    f"{field_name} (column {column_name!r}) is not UTF-8 text ({error.reason} at byte {error.start})")
                values.append(None)
        return values
    for index in np.flatnonzero(column.is_valid().to_numpy(zero_copy_only=False)):
        value_problems.setdefault(int(index), []).append(
            f"{field_name} (column {column_name!r}) holds a {kind} value, not text")
    return [None] * len(column)


def load_table(spec: MetadataTableSpec, split_names: tuple[str, ...] | frozenset[str]) -> MetadataTable:
    """Read and check the table; raises MetadataTableError only when it cannot be used at all."""
    data = read_bytes(spec.location)
    kind = _format(spec.location, data)
    table = _read_parquet(spec, data) if kind == "parquet" else _read_csv(spec, data, "\t" if kind == "tsv" else ",")
    problems: dict[int, list[str]] = {}
    values = {name: _decode(table.column(column), name, column, problems) for name, column in spec.columns.items()}
    result = MetadataTable(spec=spec, sha256=hashlib.sha256(data).hexdigest(), num_rows=table.num_rows,
                           uris=[], values=values)
    _check_values(result, split_names, problems)
    _resolve_keys(result, problems)
    result.value_problems = {index: "; ".join(found) for index, found in problems.items()
                             if index not in result.key_problems}
    return result


def _check_values(table: MetadataTable, split_names, problems: dict[int, list[str]]) -> None:
    """Row checks on the decoded values, vectorised: caption length, checksum shape and split name."""
    columns = table.spec.columns
    if "caption" in table.values:
        lengths = pc.binary_length(pa.array(table.values["caption"], pa.large_string()))
        long = pc.fill_null(pc.greater(lengths, MAX_CAPTION_BYTES), False).to_numpy(zero_copy_only=False)
        for index in np.flatnonzero(long):
            index = int(index)
            problems.setdefault(index, []).append(
                f"caption (column {columns['caption']!r}) is {lengths[index].as_py()} bytes; at most "
                f"{MAX_CAPTION_BYTES} are accepted")
            table.values["caption"][index] = None  # never carried further, even as a detail
    if "sha256" in table.values:
        shas = pa.array(table.values["sha256"], pa.string())
        bad = pc.and_(shas.is_valid(), pc.invert(pc.match_substring_regex(shas, _SHA256_PATTERN)))
        for index in np.flatnonzero(bad.to_numpy(zero_copy_only=False)):
            problems.setdefault(int(index), []).append(
                f"sha256 (column {columns['sha256']!r}) {shas[int(index)].as_py()!r} is not 64 hex digits")
        table.values["sha256"] = pc.utf8_lower(shas).to_pylist()
    if "split" in table.values:
        splits = pa.array(table.values["split"], pa.string())
        bad = pc.and_(splits.is_valid(), pc.invert(pc.is_in(splits, value_set=pa.array(sorted(split_names)))))
        for index in np.flatnonzero(bad.to_numpy(zero_copy_only=False)):
            problems.setdefault(int(index), []).append(
                f"split (column {columns['split']!r}) {splits[int(index)].as_py()!r} is not one of "
                f"{sorted(split_names)}")


def _resolve_keys(table: MetadataTable, problems: dict[int, list[str]]) -> None:
    """Each row's uri from its key and the template; unusable keys become key problems."""
    column = table.spec.columns[KEY_FIELD]
    keys = pa.array(table.values[KEY_FIELD], pa.string())
    prefix, suffix = table.spec.key_template.split("{key}")
    uris = pc.binary_join_element_wise(prefix, keys, suffix, "")
    table.uris = uris.to_pylist()
    empty = pc.fill_null(pc.equal(keys, ""), True).to_numpy(zero_copy_only=False)  # null or ""
    for index in np.flatnonzero(empty):
        index = int(index)
        table.key_problems[index] = (MALFORMED_METADATA_ROW, "; ".join(
            [f"row {index + 1}: key (column {column!r}) is empty or not text", *problems.get(index, [])]))
        table.uris[index] = None
    odd = pc.fill_null(pc.match_substring_regex(uris, _NEEDS_NORMALISING), False).to_numpy(zero_copy_only=False)
    for index in np.flatnonzero(odd & ~empty):
        index = int(index)
        normal = posixpath.normpath(table.uris[index].replace("\\", "/"))
        if posixpath.isabs(normal) or normal == ".." or normal.startswith("../"):
            table.key_problems[index] = (PATH_ESCAPE, f"row {index + 1}: key {table.values[KEY_FIELD][index]!r} "
                                                      f"names {table.uris[index]!r}, outside the media root")
            table.uris[index] = None
        else:
            table.uris[index] = normal


# ---- joining ----

@dataclass(kw_only=True, slots=True)
class TableJoin:
    """Rows matched to listed objects."""
    row_of: dict[str, int]
    """uri -> index of the one row that describes it."""
    object_problems: dict[str, tuple[str, str, int | None]]
    """uri -> (code, detail, row number or None) for an object whose rows cannot be used: duplicate or malformed."""
    orphans: list[tuple[str, str, str, int]]
    """(uri, code, detail, row number) for each row that describes no listed object."""


def join(table: MetadataTable, objects: set[str] | frozenset[str]) -> TableJoin:
    """Match rows to the listed objects' uris; each row and each object ends up accounted for once."""
    uris = pd.Series(table.uris, dtype=object)
    joinable = uris.notna().to_numpy()
    has_object = (uris.isin(objects).to_numpy() if objects else np.zeros(len(uris), bool)) & joinable
    repeated = uris.duplicated(keep=False).to_numpy() & has_object
    orphans = [(f"{table.spec.name}#row={index + 1}", code, detail, index + 1)
               for index, (code, detail) in sorted(table.key_problems.items())]
    for index in np.flatnonzero(joinable & ~has_object):
        index = int(index)
        extra = f"; the row is also malformed: {table.value_problems[index]}" if index in table.value_problems else ""
        orphans.append((f"{table.spec.name}#row={index + 1}", MISSING_OBJECT,
                        f"row {index + 1} names {table.uris[index]!r} (key {table.values[KEY_FIELD][index]!r}), "
                        f"which is not a media object under the media root{extra}", index + 1))
    single = np.flatnonzero(has_object & ~repeated)
    row_of = dict(zip(uris.to_numpy()[single].tolist(), single.tolist()))
    object_problems: dict[str, tuple[str, str, int | None]] = {}
    groups: dict[str, list[int]] = {}
    for index in np.flatnonzero(repeated):
        groups.setdefault(table.uris[int(index)], []).append(int(index) + 1)
    for uri, numbers in groups.items():
        object_problems[uri] = (DUPLICATE_METADATA_ROW, f"{len(numbers)} rows of {table.spec.name} describe it: "
                                                        f"rows {numbers}", None)
    for index, detail in table.value_problems.items():
        uri = table.uris[index]
        if uri in row_of:
            object_problems[uri] = (MALFORMED_METADATA_ROW, f"row {index + 1} of {table.spec.name}: {detail}",
                                    index + 1)
            del row_of[uri]
    return TableJoin(row_of=row_of, object_problems=object_problems, orphans=orphans)
