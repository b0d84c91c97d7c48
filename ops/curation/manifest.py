"""Build the dataset manifest: one probed, described row per object under the media root.

The manifest is Parquet, stored immutably under ``<data_root>/manifests/<version>/`` where
the version is a content hash of the rows plus the transform config (probe limits, split
rule, media root). The same inputs always give the same version; a version is never
overwritten. Rows for unusable objects are kept with ``probe_error`` / ``sidecar_error`` set:
validation turns them into quarantine decisions, so nothing is dropped silently.

Run it outside Dagster with ``trainyard manifest build MEDIA_DIR --out PATH``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import posixpath
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ops.curation import dataset_card
from ops.media import metadata_table, probe, scan
from ops import progress
from ops.curation.dataset_card import INVALID_DATASET_CARD, DatasetCard
from ops.publish.hashing import canonical_json, digest_json, table_digest
from ops.media.roots import LocalFiles, LocalMediaRoot, MediaRoot, open_root
from ops.curation.reason_codes import CHECKSUM_MISMATCH, MISSING_OBJECT
from ops.media.sidecar import MALFORMED_SIDECAR, MAX_SIDECAR_BYTES, Sidecar, default_target, parse_sidecar
from ops.curation.splits import SplitConfig, assign_split
from ops.publish.storage import DIGESTS_FILE, PublishedFileCorrupt, ensure_local, publish_dir, read_verified

# Reason codes found while building (probe codes live in ops.media.probe).
PATH_ESCAPE = "path_escape"
# MISSING_OBJECT comes from ops.curation.reason_codes (one definition, shared with ops.media.scan and ops.media.probe).
MISSING_SIDECAR = "missing_sidecar"
SIDECAR_CONFLICT = "sidecar_conflict"
UNSUPPORTED_EXTENSION = "unsupported_extension"
# Metadata-table and dataset-card codes (ops.media.metadata_table, ops.curation.dataset_card), named here beside the others.
MISSING_METADATA_ROW = metadata_table.MISSING_METADATA_ROW
DUPLICATE_METADATA_ROW = metadata_table.DUPLICATE_METADATA_ROW
MALFORMED_METADATA_ROW = metadata_table.MALFORMED_METADATA_ROW
METADATA_CONFLICT = metadata_table.METADATA_CONFLICT
assert metadata_table.PATH_ESCAPE == PATH_ESCAPE  # spelled there too: it cannot import this module

MANIFEST_FILE = "manifest.parquet"
INFO_FILE = "manifest.json"

MANIFEST_SCHEMA = pa.schema([
    ("asset_id", pa.string()),        # content sha256 ("" when there is no content)
    ("uri", pa.string()),             # relative to the media root
    ("size_bytes", pa.int64()),
    ("sha256", pa.string()),
    ("expected_sha256", pa.string()),  # from the sidecar, when it states one
    ("container", pa.string()),
    ("video_codec", pa.string()),
    ("width", pa.int32()),
    ("height", pa.int32()),
    ("fps", pa.float64()),
    ("num_frames", pa.int64()),
    ("duration_s", pa.float64()),      # declared by the headers
    ("measured_duration_s", pa.float64()),  # end of the last video packet: what the bytes hold
    ("audio_codec", pa.string()),
    ("sample_rate", pa.int32()),
    ("channels", pa.int32()),
    ("num_streams", pa.int32()),
    ("caption", pa.string()),
    ("license", pa.string()),
    ("consent", pa.string()),
    ("source_group", pa.string()),
    ("split", pa.string()),
    ("split_source", pa.string()),     # "sidecar" (pinned) or "group_hash"
    ("provenance", pa.string()),       # JSON: sidecar path and checksum, stated source, prober
    ("probe_error", pa.string()),
    ("probe_error_detail", pa.string()),
    ("probe_attempts", pa.int32()),    # 2 when the first probe timed out (retryable) and was retried
    ("sidecar_error", pa.string()),
    ("sidecar_error_detail", pa.string()),
    ("license_source", pa.string()),   # where license came from: "sidecar", "table", "card" or null
    ("consent_source", pa.string()),   # likewise for consent
    ("metadata_row", pa.int64()),      # 1-based data row of the metadata table that describes it, else null
])
# Columns added after manifests were first published: a manifest without them reads with nulls (read_manifest).
LATER_COLUMNS = ("license_source", "consent_source", "metadata_row")


@dataclass(kw_only=True, slots=True, frozen=True)
class ManifestConfig:
    limits: probe.ProbeLimits = field(default_factory=probe.ProbeLimits)
    splits: SplitConfig = field(default_factory=SplitConfig)
    num_probe_workers: int = 2
    """Probing processes at once; does not change the result, so not part of the version."""
    table: metadata_table.MetadataTableSpec | None = None
    """A metadata table describing the objects (ops.media.metadata_table); None: sidecars only."""

    def __post_init__(self) -> None:
        if self.num_probe_workers < 1:
            raise ValueError(f"num_probe_workers must be >= 1, got {self.num_probe_workers}")

    def transform_config(self, table: metadata_table.MetadataTable | None = None) -> dict:
        """The settings that decide the rows (and so the version); with a table, its bytes' sha256 too."""
        config = {"limits": asdict(self.limits), "splits": asdict(self.splits)}
        if self.table is not None:
            if table is None or table.spec != self.table:
                raise ValueError("a manifest config with a metadata table needs the loaded table for its version")
            config["metadata_table"] = table.transform_config()
        return config


@dataclass(kw_only=True, slots=True)
class Manifest:
    table: pa.Table
    version: str
    media_root: str
    config: dict

    def reason_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for column in ("probe_error", "sidecar_error"):
            for value in self.table.column(column).to_pylist():
                if value:
                    counts[value] = counts.get(value, 0) + 1
        return dict(sorted(counts.items()))


def _prober() -> str:
    import av  # only a build reads PyAV's version; reading a manifest (the Definitions' path) needs no codecs
    return f"pyav {av.__version__} libavformat {'.'.join(map(str, av.library_versions['libavformat']))}"


def _empty_row(uri: str) -> dict:
    row = dict.fromkeys(MANIFEST_SCHEMA.names)
    row.update(uri=uri, asset_id="", sha256="", size_bytes=0)
    return row


@dataclass(kw_only=True, slots=True)
class _Sources:
    """Everything that describes one object: its sidecars, its table row, the card that covers it."""
    sidecars: list[Sidecar]
    table: metadata_table.MetadataTable | None = None
    row_index: int | None = None
    """The one table row that describes it (None: no usable row)."""
    row_problem: tuple[str, str, int | None] | None = None
    """Why its rows cannot be used (duplicate or malformed): (code, detail, row number)."""
    card: DatasetCard | None = None

    @property
    def row_number(self) -> int | None:
        return self.row_index + 1 if self.row_index is not None else (self.row_problem[2] if self.row_problem else None)


def _source_problem(sources: _Sources) -> tuple[str, str] | None:
    """The sidecar or table problem of an object, if any (which source is missing, doubled or malformed)."""
    sidecars = sources.sidecars
    if sidecars and sidecars[0].error:
        return sidecars[0].error, sidecars[0].error_detail
    if len(sidecars) > 1:
        return SIDECAR_CONFLICT, f"described by {len(sidecars)} sidecars: {[s.path for s in sidecars]}"
    if sources.row_problem:
        return sources.row_problem[:2]
    if not sidecars and sources.row_index is None:
        if sources.table is None:
            return MISSING_SIDECAR, "no sidecar JSON describes this object"
        return metadata_table.MISSING_METADATA_ROW, (f"no row of {sources.table.spec.name} and no sidecar JSON "
                                                     "describes this object")
    return None


def _merged_facts(sources: _Sources) -> tuple[dict, dict, tuple[str, str] | None]:
    """(facts, field -> where each came from, conflict) from the sidecar and the table row."""
    sidecar = sources.sidecars[0] if sources.sidecars and not sources.sidecars[0].error else None
    stated = {"sidecar": {k: v for k, v in (sidecar.fields if sidecar else {}).items()
                          if k in metadata_table.FACT_FIELDS and v is not None},
              "table": {k: v for k, v in (sources.table.facts(sources.row_index).items()
                                          if sources.row_index is not None else ()) if v is not None}}
    differ = sorted(k for k in stated["sidecar"].keys() & stated["table"].keys()
                    if stated["sidecar"][k] != stated["table"][k])
    conflict = None
    if differ:
        conflict = (metadata_table.METADATA_CONFLICT, f"{differ} differ: sidecar {sidecar.path} says "
                    f"{[stated['sidecar'][k] for k in differ]}, row {sources.row_number} of "
                    f"{sources.table.spec.name} says {[stated['table'][k] for k in differ]}")
    facts = {**stated["table"], **stated["sidecar"]}
    origin = {**dict.fromkeys(stated["table"], "table"), **dict.fromkeys(stated["sidecar"], "sidecar")}
    return facts, origin, conflict


def _describe(row: dict, sources: _Sources, splits: SplitConfig) -> None:
    """Copy sidecar, table and card facts into ``row`` and decide its split."""
    problem = _source_problem(sources)
    facts, origin, conflict = _merged_facts(sources)
    problem = problem or conflict
    card = sources.card
    for name in ("license", "consent"):
        if name not in facts and card is not None:
            if card.error:
                problem = problem or (INVALID_DATASET_CARD, f"dataset card {card.path}: {card.error}")
            elif getattr(card, name) is not None:
                facts[name], origin[name] = getattr(card, name), "card"
    row.update(caption=facts.get("caption"), license=facts.get("license"), consent=facts.get("consent"),
               source_group=facts.get("source_group"), expected_sha256=facts.get("sha256"),
               license_source=origin.get("license"), consent_source=origin.get("consent"),
               metadata_row=sources.row_number)
    group = row["source_group"] or f"asset:{row['asset_id'] or row['uri']}"
    pinned = facts.get("split")
    if pinned and pinned not in splits.ratios:  # a table row's split is checked when the table is read
        problem = (MALFORMED_SIDECAR, f"split {pinned!r} is not one of {sorted(splits.ratios)}")
        pinned = None
    if problem:
        row.update(sidecar_error=problem[0], sidecar_error_detail=problem[1])
    row.update(split=pinned or assign_split(group, splits), split_source=origin["split"] if pinned else "group_hash")
    row["provenance"] = canonical_json(_provenance(sources, card if "card" in origin.values() or
                                                   (card is not None and card.error) else None))


def _provenance(sources: _Sources, card: DatasetCard | None) -> dict:
    sidecar = sources.sidecars[0] if sources.sidecars else None
    record = {
        "sidecar": sidecar.path if sidecar else None,
        "sidecar_sha256": sidecar.sha256 if sidecar else None,
        "source": sidecar.fields.get("provenance") if sidecar else None,
        "prober": _prober(),
    }
    # Keys only where a table or card is involved: a sidecar-only row keeps its provenance text.
    if sources.table is not None and sources.row_number is not None:
        record["table"] = {"location": sources.table.spec.location, "sha256": sources.table.sha256,
                           "row": sources.row_number}
    if card is not None:
        record["card"] = card.provenance()
    return record


def _attach_probe(row: dict, result: probe.ProbeResult) -> None:
    for name in ("container", "video_codec", "width", "height", "fps", "num_frames", "duration_s",
                 "measured_duration_s", "audio_codec", "sample_rate", "channels", "num_streams", "probe_attempts"):
        row[name] = getattr(result, name)
    row.update(probe_error=result.error, probe_error_detail=result.error_detail)


def _orphan_row(uri: str, code: str, detail: str, *, metadata_row: int | None = None) -> dict:
    row = _empty_row(uri)
    row.update(sidecar_error=code, sidecar_error_detail=detail, metadata_row=metadata_row)
    return row


def _route_sidecars(media: MediaRoot, items: list[scan.ListedFile]) -> tuple[dict[str, list[Sidecar]], list[dict]]:
    """Map each sidecar to the object it describes; rows for sidecars that point nowhere valid."""
    described: dict[str, list[Sidecar]] = {}
    orphan_rows: list[dict] = []
    listed = {item.uri: item for item in items}  # lookups only: iterating ``items`` keeps every entry
    objects = {item.uri for item in items if item.kind in (scan.KIND_MEDIA, scan.KIND_UNSUPPORTED)}
    readable = [(item.uri, item.sha256) for item in items
                if item.kind == scan.KIND_SIDECAR and not item.scan_error and not item.escapes_root and item.sha256]
    with media.local_files(readable) as copies:
        for item in items:
            if item.kind == scan.KIND_SIDECAR:
                _route_one(media, item, copies, listed, objects, described, orphan_rows)
    return described, orphan_rows


def _read_listed(media: MediaRoot, copies: LocalFiles, item: scan.ListedFile, *, max_bytes: int, what: str) -> bytes:
    """The bytes of a listed sidecar or card, read once and checked against the listing's sha256.

    No symlink is followed (a link inside the root is listed with its target: that target is opened),
    only a regular file is read, its size is checked before reading (scan.FileTooLarge), and the bytes
    returned are the ones that hash to the listing's sha256, else scan.FileChanged: what is parsed is
    always what the manifest records the hash of, whatever happened to the file since the scan.
    """
    if isinstance(media, LocalMediaRoot):
        root, relative = media.root, item.uri
        if item.link_target:
            try:
                target = scan.resolve_inside(root, item.uri)
            except (OSError, RuntimeError) as error:  # RuntimeError: a symlink loop, Python < 3.13
                raise scan.FileChanged(errno.ELOOP, f"its link no longer resolves: {error}") from error
            if target is None:
                raise scan.FileChanged(errno.EXDEV, "its link now resolves outside the media root (never followed)")
            relative = target.relative_to(root.resolve()).as_posix()
    else:  # a store's object: the verified copy that ops.media.roots pinned for this block
        root, relative = copies.paths[item.uri].parent, copies.paths[item.uri].name
    data = scan.read_regular(root, relative, max_bytes=max_bytes, what=f"{what} {item.uri}")
    if hashlib.sha256(data).hexdigest() != item.sha256:
        raise scan.FileChanged(errno.EAGAIN, f"its bytes no longer hash to the listed {item.sha256[:12]}...")
    return data


def _unread_reason(error: OSError, what: str) -> tuple[str, str]:
    """(reason code, detail) for a listed sidecar or card that ``_read_listed`` could not read as listed."""
    if isinstance(error, (scan.FileChanged, scan.NotRegularFile)):
        return CHECKSUM_MISMATCH, f"{what} changed after it was listed: {error.strerror}; scan again"
    if isinstance(error, FileNotFoundError):
        return MISSING_OBJECT, f"{what} vanished after it was listed: {error}"
    return scan.UNREADABLE_PATH, f"{what} cannot be read: {type(error).__name__}: {error}"


def _route_one(media: MediaRoot, item: scan.ListedFile, copies: LocalFiles, listed: dict, objects: set,
               described: dict[str, list[Sidecar]], orphan_rows: list[dict]) -> None:
    # A sidecar that is an escaping or dangling link (empty checksum: never read) gets a row
    # of its own; opening it would leave the root or raise and sink the whole build.
    if item.scan_error:
        orphan_rows.append(_orphan_row(item.uri, item.scan_error, item.scan_error_detail))
        return
    if item.escapes_root:
        orphan_rows.append(_orphan_row(item.uri, PATH_ESCAPE,
                                       f"symlink to {item.link_target!r} resolves outside the media root"))
        return
    if not item.sha256:
        orphan_rows.append(_orphan_row(item.uri, MISSING_OBJECT,
                                       f"dangling link to {item.link_target!r} or not a regular file"))
        return
    if item.uri in copies.problems:  # an object store's copy that vanished or changed since the scan
        code, detail = copies.problems[item.uri]
        orphan_rows.append(_orphan_row(item.uri, code, f"sidecar cannot be read: {detail}"))
        return
    try:
        sidecar = parse_sidecar(_read_listed(media, copies, item, max_bytes=MAX_SIDECAR_BYTES, what="sidecar"),
                                item.uri)
    except scan.FileTooLarge as error:  # never read: the object it would describe relies on it, so is quarantined
        sidecar = Sidecar(path=item.uri, sha256=item.sha256, target_uri=default_target(item.uri),
                          error=MALFORMED_SIDECAR, error_detail=str(error))
    except OSError as error:  # vanished, replaced or edited after the scan hashed it
        orphan_rows.append(_orphan_row(item.uri, *_unread_reason(error, "sidecar")))
        return
    # Lexical check: an escaping symlink *inside* the root is the object's own problem
    # (recorded on its row); here only the uri text may not leave the root.
    target = posixpath.normpath(sidecar.target_uri)
    if posixpath.isabs(target) or target == ".." or target.startswith("../"):
        orphan_rows.append(_orphan_row(item.uri, PATH_ESCAPE,
                                       f"sidecar uri {sidecar.target_uri!r} resolves outside the media root"))
    elif target not in listed:
        orphan_rows.append(_orphan_row(item.uri, MISSING_OBJECT,
                                       f"sidecar names {target!r}, which does not exist under the media root"))
    elif target not in objects:
        # A doc or another sidecar never gets a row of its own, so this sidecar would vanish.
        orphan_rows.append(_orphan_row(item.uri, MISSING_OBJECT,
                                       f"sidecar names {target!r}, a {listed[target].kind}, not a media object"))
    else:
        described.setdefault(target, []).append(sidecar)


Prober = Callable[[MediaRoot, list[scan.ListedFile], "ManifestConfig"], dict[str, probe.ProbeResult]]
"""How a build probes its targets: ``probe_targets`` here, or array tasks on a cluster
(resources/slurm_array.py) that run ``probe_listed`` on chunks of them."""


def build_manifest(media_root: str | Path, config: ManifestConfig, *, prober: Prober | None = None) -> Manifest:
    """Scan, probe and describe everything under ``media_root`` (a folder or an object-store URL).

    ``prober`` probes the media targets (uri -> result); every other step stays here, in listing
    order, so any prober that returns the same results gives the same rows and manifest version."""
    media = open_root(media_root)
    # Read before the scan and any probe: a table that cannot be used at all stops the build here.
    table = metadata_table.load_table(config.table, tuple(config.splits.ratios)) if config.table else None
    table_card = _table_card(config.table)
    # A list, never a dict keyed by uri: every listed object gets its row, even should two share a uri.
    listed = media.scan()
    described, rows = _route_sidecars(media, listed)
    folder_cards = _read_cards(media, listed)
    objects = [item for item in listed if item.kind in (scan.KIND_MEDIA, scan.KIND_UNSUPPORTED)]
    joined = metadata_table.join(table, {item.uri for item in objects}) if table else None
    if joined:
        rows.extend(_orphan_row(uri, code, detail, metadata_row=number) for uri, code, detail, number in joined.orphans)
    targets = [item for item in objects
               if item.kind == scan.KIND_MEDIA and not item.escapes_root and item.sha256 and not item.scan_error]
    results = (prober or probe_targets)(media, targets, config)
    missing = [item.uri for item in targets if item.uri not in results]
    if missing:  # a chunk lost on the way: never a row built as if it had not been listed
        raise RuntimeError(f"the prober returned no result for {len(missing)} object(s), e.g. {missing[:3]}")
    for item in objects:
        row = _empty_row(item.uri)
        row.update(asset_id=item.sha256, sha256=item.sha256, size_bytes=item.size_bytes)
        if item.scan_error:  # a loop, an unreadable or vanished path, a non-UTF-8 name: never opened
            row.update(probe_error=item.scan_error, probe_error_detail=item.scan_error_detail)
        elif item.escapes_root:
            row.update(probe_error=PATH_ESCAPE,
                       probe_error_detail=f"symlink to {item.link_target!r} resolves outside the media root")
        elif item.uri in results:
            _attach_probe(row, results[item.uri])
        elif item.kind == scan.KIND_UNSUPPORTED:
            row.update(probe_error=UNSUPPORTED_EXTENSION,
                       probe_error_detail=f"extension not in {sorted(scan.MEDIA_EXTENSIONS)}")
        else:
            row.update(probe_error=MISSING_OBJECT, probe_error_detail=f"dangling link to {item.link_target!r}")
        row_index = joined.row_of.get(item.uri) if joined else None
        has_row = row_index is not None or (joined is not None and item.uri in joined.object_problems)
        sources = _Sources(sidecars=described.get(item.uri, []), table=table, row_index=row_index,
                           row_problem=joined.object_problems.get(item.uri) if joined else None,
                           card=(table_card if has_row and table_card else None)
                           or dataset_card.nearest_card(item.uri, folder_cards))
        _describe(row, sources, config.splits)
        rows.append(row)
    return manifest_from_rows(rows, config=config.transform_config(table), media_root=media.location)


def _table_card(spec: metadata_table.MetadataTableSpec | None) -> DatasetCard | None:
    """The card a table spec names: read from its path or URL (missing: MetadataTableError), or given inline."""
    if spec is None or spec.card is None:
        return None
    if isinstance(spec.card, str):
        try:
            data = metadata_table.read_bytes(spec.card, "dataset card", max_bytes=dataset_card.MAX_CARD_BYTES)
        except metadata_table.FileOverLimit as error:
            return DatasetCard(path=spec.card, sha256="", error=dataset_card.too_large(error.size_bytes))
        return dataset_card.parse_card(data, spec.card)
    return dataset_card.card_from_mapping(spec.card)


def _read_cards(media: MediaRoot, listed: list[scan.ListedFile]) -> dict[str, DatasetCard]:
    """Folder -> card for every dataset card under the root (one that cannot be read: with its error set)."""
    cards: dict[str, DatasetCard] = {}
    found = [item for item in listed if item.kind == scan.KIND_CARD]
    readable = [(item.uri, item.sha256) for item in found if not item.scan_error and not item.escapes_root
                and item.sha256]
    with media.local_files(readable) as copies:
        for item in found:
            cards[dataset_card.card_folder(item.uri)] = _read_card(media, copies, item)
    return cards


def _read_card(media: MediaRoot, copies: LocalFiles, item: scan.ListedFile) -> DatasetCard:
    """One listed card; one that cannot be read as listed comes back with its error set.

    Its folder's objects must not fall back to a card further up: they rely on this one.
    """
    if item.uri not in copies.paths:
        code, detail = copies.problems.get(item.uri, (item.scan_error or MISSING_OBJECT,
                                                      item.scan_error_detail or "link that is never read"))
        return DatasetCard(path=item.uri, sha256=item.sha256, error=f"cannot be read ({code}): {detail}")
    try:
        data = _read_listed(media, copies, item, max_bytes=dataset_card.MAX_CARD_BYTES, what="dataset card")
    except scan.FileTooLarge as error:
        return DatasetCard(path=item.uri, sha256=item.sha256, error=dataset_card.too_large(error.size_bytes))
    except OSError as error:
        code, detail = _unread_reason(error, "dataset card")
        return DatasetCard(path=item.uri, sha256=item.sha256, error=f"cannot be read ({code}): {detail}")
    return dataset_card.parse_card(data, item.uri)


# Objects of a store probed per batch: each batch's local copies are pinned (ops.media.roots) while
# it is probed, so the media cache's bound holds however many objects the root has.
_PROBE_BATCH = 64


def probe_targets(media: MediaRoot, targets: list[scan.ListedFile],
                  config: ManifestConfig) -> dict[str, probe.ProbeResult]:
    """uri -> probe result of each target, on this machine (the default Prober)."""
    return probe_listed(media, targets, config.limits, num_workers=config.num_probe_workers)


def probe_listed(media: MediaRoot, targets: list[scan.ListedFile], limits: probe.ProbeLimits, *,
                 num_workers: int) -> dict[str, probe.ProbeResult]:
    """uri -> probe result of each target; an object a store no longer holds as listed gets its reason."""
    results: dict[str, probe.ProbeResult] = {}
    batch = len(targets) if isinstance(media, LocalMediaRoot) else _PROBE_BATCH
    with progress.task("probing", len(targets), unit="objects") as bar:
        for start in range(0, len(targets), max(batch, 1)):
            chunk = targets[start:start + batch]
            with media.local_files([(item.uri, item.sha256) for item in chunk]) as copies:
                ready = [item for item in chunk if item.uri in copies.paths]
                results.update(zip([item.uri for item in ready], probe.probe_many(
                    [_probe_path(media, copies, item) for item in ready], limits,
                    identities=[list(item.identity) or None for item in ready],
                    num_workers=num_workers,
                    on_progress=lambda done, start=start: bar.update(start + done))))
            for uri, (code, detail) in copies.problems.items():
                results[uri] = probe.ProbeResult().failed(code, detail)
            bar.update(start + len(chunk))
    return results


def _probe_path(media: MediaRoot, copies: LocalFiles, item: scan.ListedFile) -> Path:
    """What the probe opens (never following a link): a link inside a folder root is probed at its target,
    and the probe checks it opened the very file the scan hashed (``item.identity``)."""
    if isinstance(media, LocalMediaRoot) and item.link_target:
        try:
            target = scan.resolve_inside(media.root, item.uri)
        except (OSError, RuntimeError):  # the link changed since the scan: the probe refuses the link itself
            target = None
        if target is not None:
            return target
    return copies.paths[item.uri]


def manifest_from_rows(rows: list[dict], *, config: dict, media_root: str) -> Manifest:
    """Manifest from row dicts (keys: MANIFEST_SCHEMA names)."""
    return manifest_from_table(pa.Table.from_pylist(rows, schema=MANIFEST_SCHEMA), config=config,
                               media_root=media_root)


def manifest_from_table(table: pa.Table, *, config: dict, media_root: str) -> Manifest:
    """Manifest from a table; rows are sorted by uri so listing order never changes the version."""
    table = table.cast(MANIFEST_SCHEMA).sort_by("uri")
    return Manifest(table=table, version=manifest_version(table, config=config, media_root=media_root),
                    media_root=media_root, config=config)


def manifest_version(table: pa.Table, *, config: dict, media_root: str) -> str:
    """Content hash of rows + transform config + media root; 20 hex chars is plenty to be unique."""
    return digest_json({"rows": table_digest(table), "config": config, "media_root": media_root})[:20]


def manifests_dir(data_root: str | Path) -> Path:
    return Path(data_root) / "manifests"


def write_manifest(manifest: Manifest, out_dir: str | Path) -> Path:
    """Publish ``manifest`` as ``<out_dir>/<version>/`` unless that version exists already."""
    actual = manifest_version(manifest.table, config=manifest.config, media_root=manifest.media_root)
    if actual != manifest.version:  # compare=True below would otherwise replace a good folder with these rows
        raise ValueError(f"manifest rows, config and media root hash to {actual}, not to its version "
                         f"{manifest.version}; build it with manifest_from_table instead of editing its table")
    final = Path(out_dir) / manifest.version
    # Deterministic content: a rebuild compares, so a folder forged with its record rewritten is replaced.
    with publish_dir(final, compare=True) as staging:
        pq.write_table(manifest.table, staging / MANIFEST_FILE)
        info = {"version": manifest.version, "media_root": manifest.media_root,
                "config": manifest.config, "num_rows": manifest.table.num_rows,
                "reason_counts": manifest.reason_counts()}
        (staging / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True))
    return final


class ManifestNotFound(FileNotFoundError):
    """The requested manifest version does not exist under the data root."""


def read_manifest(path_or_version: str | Path, data_root: str | Path | None = None) -> Manifest:
    """Load a manifest from its directory, or by version from ``data_root``, verified against its version.

    Raises ManifestNotFound when there is none, and ops.publish.storage.PublishedFileError when its files
    differ from what was published as that version (or its rows do not hash to it).
    """
    directory = Path(path_or_version)
    if not _published_here(directory) and data_root is not None:
        directory = manifests_dir(data_root) / str(path_or_version)
    if not _published_here(directory):
        raise ManifestNotFound(f"no manifest at {directory} (expected {MANIFEST_FILE} and {INFO_FILE})")
    version, files = read_verified(directory, version=directory.name, complete=True)  # read once, parsed below
    info = json.loads(files[INFO_FILE])
    stored = pq.read_table(pa.BufferReader(files[MANIFEST_FILE]))
    # A manifest published before LATER_COLUMNS existed hashes as it was written, then reads with nulls there.
    absent = [name for name in LATER_COLUMNS if name not in stored.schema.names]
    as_written = stored.cast(pa.schema([column for column in MANIFEST_SCHEMA if column.name not in absent]))
    actual = manifest_version(as_written, config=info["config"], media_root=info["media_root"])
    table = as_written
    for name in absent:
        table = table.append_column(MANIFEST_SCHEMA.field(name), pa.nulls(table.num_rows, MANIFEST_SCHEMA.field(name).type))
    table = table.select(MANIFEST_SCHEMA.names).cast(MANIFEST_SCHEMA)
    manifest = Manifest(table=table, version=info["version"], media_root=info["media_root"], config=info["config"])
    # The record binds the bytes; the version binds the meaning: rows, config and media root must hash to it.
    if manifest.version != version or actual != version:
        raise PublishedFileCorrupt(f"{directory}: manifest {version}'s rows, config and media root hash to "
                                   f"{actual} ({INFO_FILE} says {manifest.version}); rebuild this version")
    # The rest of manifest.json is derived from the rows: where it states them (manifests published before
    # these fields carry neither; readers take both from the rows), it must say what they say.
    derived = {"num_rows": as_written.num_rows, "reason_counts": manifest.reason_counts()}
    if any(name in info and info[name] != value for name, value in derived.items()):
        raise PublishedFileCorrupt(f"{directory / INFO_FILE}: its num_rows / reason_counts are not those of manifest "
                                   f"{version}'s rows {derived}; rebuild this version")
    return manifest


def _published_here(directory: Path) -> bool:
    """The directory holds a manifest, or the digest record of one (whose files are then checked);
    fetched first where the data root is an object store and this machine lacks it (ops.publish.store_root)."""
    ensure_local(directory)
    return (directory / MANIFEST_FILE).exists() or (directory / DIGESTS_FILE).exists()
