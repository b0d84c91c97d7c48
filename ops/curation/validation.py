"""Validate a manifest: accept rows that are safe to train on, quarantine the rest with a reason.

Three layers, each a plain function:

1. Ingest errors already recorded in the manifest (``probe_error``, ``sidecar_error``).
2. Row rules as a pandera schema; each check is named by the reason code it raises.
3. Set rules across rows: objects missing or changed since the manifest, duplicate content
   under two names, and a source group or content placed in two splits.

Every rejected row gets one primary reason (the first in ``REASON_PRIORITY``) and a detail
listing every reason found, so a rerun on the same manifest rejects the same files for the
same reason. ``gates()`` are the set-level properties that block downstream use; the Dagster
asset checks and ``trainyard manifest validate`` both call them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import pandas as pd
import pandera.pandas as pa
import pyarrow as pyarrow_lib

from ops.curation import manifest as manifest_ops
from ops.curation import licenses
from ops.media import probe, scan
from ops.publish.hashing import digest_json, table_digest
from ops.media.roots import MediaRoot, open_root
from ops.curation.reason_codes import CHECKSUM_MISMATCH, MISSING_OBJECT
from ops.curation.rights import RIGHTS_REVOKED, describe
from ops.media.sidecar import MALFORMED_SIDECAR
from ops.curation.splits import SplitConfig, assign_split

DUPLICATE_CONTENT = "duplicate_content"
SPLIT_LEAKAGE = "split_leakage"
CONSENT_REVOKED = "consent_revoked"
MISSING_CONSENT = "missing_consent"
MISSING_LICENSE = licenses.MISSING_LICENSE
UNKNOWN_LICENSE = licenses.UNKNOWN_LICENSE
LICENSE_NOT_ALLOWED = licenses.LICENSE_NOT_ALLOWED
INVALID_DURATION = "invalid_duration"
UNEXPECTED_DIMENSIONS = "unexpected_dimensions"
INVALID_FRAME_RATE = "invalid_frame_rate"
UNSUPPORTED_CODEC = "unsupported_codec"

# Most fundamental first: a file that cannot be read is reported as such, not as unlicensed.
REASON_PRIORITY = (
    manifest_ops.PATH_ESCAPE, MISSING_OBJECT, scan.SYMLINK_LOOP, scan.INVALID_FILENAME, scan.UNREADABLE_PATH,
    probe.EMPTY_FILE, probe.NOT_MEDIA,
    probe.UNRECOGNIZED_FORMAT, probe.TRUNCATED_FILE, probe.UNREADABLE_MEDIA, probe.PROBE_TIMEOUT,
    probe.PROBE_CRASHED, probe.EXCEEDS_LIMITS, probe.NO_VIDEO_STREAM, probe.DECODE_ERROR,
    manifest_ops.UNSUPPORTED_EXTENSION, MALFORMED_SIDECAR, manifest_ops.MISSING_SIDECAR,
    manifest_ops.SIDECAR_CONFLICT, manifest_ops.MALFORMED_METADATA_ROW, manifest_ops.DUPLICATE_METADATA_ROW,
    manifest_ops.MISSING_METADATA_ROW, manifest_ops.METADATA_CONFLICT, manifest_ops.INVALID_DATASET_CARD,
    CHECKSUM_MISMATCH, DUPLICATE_CONTENT, CONSENT_REVOKED, RIGHTS_REVOKED,
    MISSING_CONSENT, MISSING_LICENSE, UNKNOWN_LICENSE, LICENSE_NOT_ALLOWED,
    INVALID_DURATION, UNEXPECTED_DIMENSIONS, INVALID_FRAME_RATE, UNSUPPORTED_CODEC, SPLIT_LEAKAGE,
)
_RANK = {code: rank for rank, code in enumerate(REASON_PRIORITY)}

VERIFY_MODES = ("off", "stat", "hash")


def _default_codecs() -> tuple[str, ...]:
    return ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4")


@dataclass(kw_only=True, slots=True, frozen=True)
class ValidationConfig:
    min_duration_s: float = 0.5
    max_duration_s: float = 600.0
    min_side: int = 32
    """Smallest accepted width or height in pixels."""
    max_side: int = 4096
    max_aspect_ratio: float = 4.0
    """Largest accepted long side / short side."""
    min_fps: float = 1.0
    max_fps: float = 240.0
    allowed_video_codecs: tuple[str, ...] = field(default_factory=_default_codecs)
    granted_consent: str = "granted"
    allowed_licenses: tuple[str, ...] = licenses.DEFAULT_ALLOWED_LICENSES
    """SPDX identifiers a row's license expression must be satisfiable with (ops.curation.licenses)."""
    verify_objects: str = "stat"
    """Recheck each object at validation: "off", "stat" (exists, same size) or "hash" (re-read)."""
    max_quarantine_fraction: float = 0.5
    """Gate: above this share of rows quarantined, the whole set is suspect."""

    def __post_init__(self) -> None:
        if not 0 < self.min_duration_s < self.max_duration_s:
            raise ValueError(f"need 0 < min_duration_s < max_duration_s, got {self.min_duration_s}, {self.max_duration_s}")
        if not 0 < self.min_side <= self.max_side:
            raise ValueError(f"need 0 < min_side <= max_side, got {self.min_side}, {self.max_side}")
        if self.max_aspect_ratio < 1:
            raise ValueError(f"max_aspect_ratio is long side / short side, so >= 1; got {self.max_aspect_ratio}")
        if not 0 < self.min_fps < self.max_fps:
            raise ValueError(f"need 0 < min_fps < max_fps, got {self.min_fps}, {self.max_fps}")
        # Canonical spelling, and a typo refused here: an allow-list entry that is no SPDX identifier
        # would silently refuse (or admit) data.
        object.__setattr__(self, "allowed_licenses", licenses.check_allow_list(self.allowed_licenses))
        if not self.allowed_licenses:
            raise ValueError("allowed_licenses must name at least one SPDX license identifier")
        if not self.allowed_video_codecs:
            raise ValueError("allowed_video_codecs must name at least one codec")
        if self.verify_objects not in VERIFY_MODES:
            raise ValueError(f"verify_objects must be one of {VERIFY_MODES}, got {self.verify_objects!r}")
        if not 0 <= self.max_quarantine_fraction <= 1:
            raise ValueError(f"max_quarantine_fraction must be in [0, 1], got {self.max_quarantine_fraction}")


def row_schema(config: ValidationConfig) -> pa.DataFrameSchema:
    """Row rules; each check's name is the reason code its failures get."""
    def check(fn, name: str, *, ignore_na: bool = True) -> pa.Check:
        return pa.Check(fn, name=name, ignore_na=ignore_na)

    sides = check(lambda s: s.between(config.min_side, config.max_side), UNEXPECTED_DIMENSIONS)

    def license_code(value) -> str:
        return licenses.judge(value, config.allowed_licenses).code
    return pa.DataFrameSchema(
        {
            "license": pa.Column(nullable=True, checks=[
                check(lambda s: s.map(lambda v: license_code(v) != MISSING_LICENSE), MISSING_LICENSE, ignore_na=False),
                check(lambda s: s.map(lambda v: license_code(v) != UNKNOWN_LICENSE), UNKNOWN_LICENSE, ignore_na=False),
                check(lambda s: s.map(lambda v: license_code(v) != LICENSE_NOT_ALLOWED), LICENSE_NOT_ALLOWED,
                      ignore_na=False)]),
            "consent": pa.Column(nullable=True, checks=[
                check(lambda s: s != "revoked", CONSENT_REVOKED),
                check(lambda s: s.isin([config.granted_consent, "revoked"]), MISSING_CONSENT, ignore_na=False),
            ]),
            "duration_s": pa.Column(nullable=True, checks=check(
                lambda s: s.between(config.min_duration_s, config.max_duration_s), INVALID_DURATION)),
            "width": pa.Column(nullable=True, checks=sides),
            "height": pa.Column(nullable=True, checks=sides),
            "fps": pa.Column(nullable=True, checks=check(
                lambda s: s.between(config.min_fps, config.max_fps), INVALID_FRAME_RATE)),
            "video_codec": pa.Column(nullable=True, checks=check(
                lambda s: s.isin(config.allowed_video_codecs), UNSUPPORTED_CODEC)),
        },
        checks=[
            pa.Check(lambda df: df["expected_sha256"].isna() | (df["expected_sha256"] == df["sha256"]),
                     name=CHECKSUM_MISMATCH),
            pa.Check(lambda df: ~(df[["width", "height"]].max(axis=1)
                                  > config.max_aspect_ratio * df[["width", "height"]].min(axis=1)),
                     name=UNEXPECTED_DIMENSIONS),
        ],
        strict=False,
    )


_DETAIL = {
    MISSING_LICENSE: lambda row, c: "no license is stated (sidecar, table or dataset card)",
    UNKNOWN_LICENSE: lambda row, c: licenses.judge(row["license"], c.allowed_licenses).detail,
    LICENSE_NOT_ALLOWED: lambda row, c: licenses.judge(row["license"], c.allowed_licenses).detail,
    CONSENT_REVOKED: lambda row, c: "consent is revoked",
    MISSING_CONSENT: lambda row, c: f"consent is {row['consent']!r}, need {c.granted_consent!r}",
    INVALID_DURATION: lambda row, c: f"duration {row['duration_s']:.3f} s outside [{c.min_duration_s}, {c.max_duration_s}]",
    UNEXPECTED_DIMENSIONS: lambda row, c: (f"{int(row['width'])}x{int(row['height'])} outside sides [{c.min_side}, {c.max_side}]"
                                           f" or aspect > {c.max_aspect_ratio}"),
    INVALID_FRAME_RATE: lambda row, c: f"{row['fps']} fps outside [{c.min_fps}, {c.max_fps}]",
    UNSUPPORTED_CODEC: lambda row, c: f"codec {row['video_codec']!r} not in {list(c.allowed_video_codecs)}",
    CHECKSUM_MISMATCH: lambda row, c: f"sidecar sha256 {row['expected_sha256'][:12]}... != content {row['sha256'][:12]}...",
}


def _ingest_reasons(frame: pd.DataFrame, found: dict) -> None:
    for code_column, detail_column in (("probe_error", "probe_error_detail"), ("sidecar_error", "sidecar_error_detail")):
        flagged = frame[frame[code_column].notna()]
        for index, code, detail in zip(flagged.index, flagged[code_column], flagged[detail_column]):
            # Missing details come back from pandas as NaN, which is truthy.
            found[index][code] = detail if isinstance(detail, str) and detail else code


def _row_rule_reasons(frame: pd.DataFrame, config: ValidationConfig, found: dict) -> None:
    # Rows that failed at ingest have no probed fields to judge; rules apply to the rest.
    candidates = frame[[index not in found for index in frame.index]] if found else frame
    try:
        row_schema(config).validate(candidates, lazy=True)
    except pa.errors.SchemaErrors as errors:
        cases = errors.failure_cases.dropna(subset=["index"]).drop_duplicates(["index", "check"])
        for index, check_name in zip(cases["index"], cases["check"]):
            index = int(index)
            found[index][check_name] = _DETAIL[check_name](frame.loc[index], config)


def _object_reasons(frame: pd.DataFrame, media: MediaRoot, config: ValidationConfig, found: dict) -> None:
    """Objects that vanished or changed after the manifest was built."""
    if config.verify_objects == "off":
        return
    for index, uri, size_bytes, sha256 in zip(frame.index, frame["uri"], frame["size_bytes"], frame["sha256"]):
        if not sha256 or index in found:
            continue
        problem = media.check(uri, size_bytes, sha256, rehash=config.verify_objects == "hash")
        if problem is not None:
            code, detail = problem
            found[index][code] = detail


def _revoked_reasons(frame: pd.DataFrame, revoked: Mapping[str, Mapping], found: dict) -> None:
    """Assets the rights ledger revokes (ops.curation.rights): whatever their sidecar says now."""
    if not revoked:
        return
    for index, asset_id in zip(frame.index, frame["asset_id"]):
        if asset_id in revoked:
            found[index][RIGHTS_REVOKED] = f"revoked in the rights ledger: {describe(revoked[asset_id])}"


def _duplicate_reasons(frame: pd.DataFrame, found: dict) -> None:
    """Same content under several names: the first uri is the original, the rest are rejected.

    Judged over every row, rejected ones included: content whose first copy was refused (say,
    revoked consent) must not come back in under another name.
    """
    has_content = frame[(frame["sha256"] != "") & (frame["size_bytes"] > 0)]
    duplicated = has_content["sha256"].duplicated(keep="first")
    originals = has_content[~duplicated].set_index("sha256")["uri"]
    originals_split = has_content[~duplicated].set_index("sha256")["split"]
    for index, sha256, split in zip(has_content.index[duplicated], has_content["sha256"][duplicated],
                                    has_content["split"][duplicated]):
        across = f"; across splits {originals_split[sha256]}/{split}" if originals_split[sha256] != split else ""
        found[index][DUPLICATE_CONTENT] = f"same content as {originals[sha256]}{across}"


def _leakage_reasons(frame: pd.DataFrame, splits: SplitConfig, found: dict) -> None:
    """A source group in several splits keeps its most common split; ties go to the hash split."""
    clean = frame[[index not in found for index in frame.index]] if found else frame
    clean = clean[clean["source_group"].notna()]
    num_splits = clean.groupby("source_group")["split"].nunique()
    leaky = clean[clean["source_group"].isin(num_splits.index[num_splits > 1])]
    for group, rows in leaky.groupby("source_group", sort=True):
        counts = rows["split"].value_counts()
        tied = sorted(counts[counts == counts.max()].index)
        hashed = assign_split(group, splits)
        keep = hashed if hashed in tied else tied[0]
        for index, split, source in zip(rows.index, rows["split"], rows["split_source"]):
            if split != keep:
                how = {"sidecar": "pinned by its sidecar", "table": "pinned by its metadata table row"}.get(
                    source, "assigned by group hash")
                found[index][SPLIT_LEAKAGE] = f"source group {group!r} is in split {keep!r}; this clip is in {split!r} ({how})"


@dataclass(kw_only=True, slots=True)
class Validation:
    accepted: pyarrow_lib.Table
    rejected: pd.DataFrame
    """Columns: asset_id, uri, reason, detail (every reason found, primary first)."""
    version: str
    manifest_version: str
    config: ValidationConfig
    media_root: str
    code_version: str = ""
    """The validation code's version: part of ``version`` (`decisions_digest`, `validation_version`)."""

    def reason_counts(self) -> dict[str, int]:
        return {str(k): int(v) for k, v in self.rejected["reason"].value_counts().sort_index().items()}

    def split_counts(self) -> dict[str, int]:
        splits = self.accepted.column("split").to_pylist()
        return {name: splits.count(name) for name in sorted(set(splits))}


def validation_version(manifest_version: str, config: ValidationConfig | dict, code_version: str,
                       decisions: str) -> str:
    """Manifest, rules, code, and the decisions themselves: with object checks on, the same
    manifest can be judged differently once files vanish, and that must be a new version.
    ``config`` as a dict: a published report's, which names only the rules of its day."""
    rules = config if isinstance(config, dict) else asdict(config)
    return digest_json({"manifest": manifest_version, "config": rules, "code": code_version,
                        "decisions": decisions})[:20]


def decisions_digest(rejected: pd.DataFrame) -> str:
    """sha256 of the decisions: each rejected row (asset id, uri, primary reason and the detail that
    lists every reason), in manifest (uri) order: every column of the rejected rows, so none of
    what `trainyard quarantine` shows can be rewritten under this version."""
    return table_digest(pyarrow_lib.Table.from_pandas(rejected[list(DECISION_COLUMNS)], schema=_DECISIONS_SCHEMA,
                                                      preserve_index=False))


DECISION_COLUMNS = ("asset_id", "uri", "reason", "detail")
"""The columns of `Validation.rejected`; all of them are in the validation version."""
_DECISIONS_SCHEMA = pyarrow_lib.schema([(name, pyarrow_lib.string()) for name in DECISION_COLUMNS])


def validate(manifest: manifest_ops.Manifest, config: ValidationConfig, *, code_version: str = "",
             revoked: Mapping[str, Mapping] | None = None) -> Validation:
    """Split ``manifest`` into accepted rows and rejected rows with reasons; ``revoked``: the rights
    ledger's revocations (ops.curation.rights.revoked), asset id -> event."""
    frame = manifest.table.to_pandas()
    found: dict[int, dict[str, str]] = defaultdict(dict)
    _ingest_reasons(frame, found)
    _row_rule_reasons(frame, config, found)
    _object_reasons(frame, open_root(manifest.media_root), config, found)
    _revoked_reasons(frame, revoked or {}, found)
    _duplicate_reasons(frame, found)
    _leakage_reasons(frame, SplitConfig(**manifest.config["splits"]) if "splits" in manifest.config else SplitConfig(),
                     found)
    rejected_index = sorted(found)
    reasons = [sorted(found[index].items(), key=lambda item: _RANK.get(item[0], len(_RANK))) for index in rejected_index]
    rejected = pd.DataFrame({
        "asset_id": frame.loc[rejected_index, "asset_id"].to_list(),
        "uri": frame.loc[rejected_index, "uri"].to_list(),
        "reason": [items[0][0] for items in reasons],
        "detail": ["; ".join(f"{code}: {detail}" for code, detail in items) for items in reasons],
    })
    keep = pyarrow_lib.array([index not in found for index in range(len(frame))])
    return Validation(
        accepted=manifest.table.filter(keep), rejected=rejected,
        version=validation_version(manifest.version, config, code_version, decisions_digest(rejected)),
        manifest_version=manifest.version, config=config, media_root=manifest.media_root, code_version=code_version,
    )


@dataclass(kw_only=True, slots=True)
class GateResult:
    """One blocking property of a validated set, with the numbers that explain it."""
    name: str
    passed: bool
    description: str
    metadata: dict


def accepted_rows_conform(validation: Validation) -> GateResult:
    frame = validation.accepted.to_pandas()
    try:
        row_schema(validation.config).validate(frame, lazy=True)
        failures = 0
    except pa.errors.SchemaErrors as errors:
        failures = int(errors.failure_cases["index"].nunique())
    return GateResult(name="accepted_rows_conform", passed=failures == 0,
                      description="every accepted row passes the pandera row schema",
                      metadata={"num_accepted": len(frame), "num_failing_rows": failures})


def no_duplicate_assets(validation: Validation) -> GateResult:
    ids = validation.accepted.column("asset_id").to_pandas()
    duplicates = int(ids.duplicated().sum())
    return GateResult(name="no_duplicate_assets", passed=duplicates == 0,
                      description="no content appears twice among accepted rows",
                      metadata={"num_accepted": len(ids), "num_duplicates": duplicates})


def no_split_leakage(validation: Validation) -> GateResult:
    frame = validation.accepted.select(["source_group", "asset_id", "split"]).to_pandas()
    leaky_groups = int((frame.dropna(subset=["source_group"]).groupby("source_group")["split"].nunique() > 1).sum())
    leaky_assets = int((frame.groupby("asset_id")["split"].nunique() > 1).sum())
    return GateResult(name="no_split_leakage", passed=leaky_groups == 0 and leaky_assets == 0,
                      description="no source group and no content is in two splits",
                      metadata={"num_groups_in_two_splits": leaky_groups, "num_assets_in_two_splits": leaky_assets})


def quarantine_rate(validation: Validation) -> GateResult:
    total = validation.accepted.num_rows + len(validation.rejected)
    fraction = len(validation.rejected) / total if total else 1.0
    limit = validation.config.max_quarantine_fraction
    return GateResult(name="quarantine_rate", passed=total > 0 and fraction <= limit,
                      description=f"at most {limit:.0%} of rows quarantined",
                      metadata={"num_rows": total, "num_quarantined": len(validation.rejected),
                                "quarantine_fraction": round(fraction, 6), "max_quarantine_fraction": limit,
                                **{f"reason_{k}": v for k, v in validation.reason_counts().items()}})


def train_split_nonempty(validation: Validation) -> GateResult:
    counts = validation.split_counts()
    return GateResult(name="train_split_nonempty", passed=counts.get("train", 0) > 0,
                      description="the train split has at least one accepted clip",
                      metadata={f"num_{name}": count for name, count in counts.items()} or {"num_train": 0})


def objects_unchanged(validation: Validation) -> GateResult:
    """Accepted objects still exist with the size they were validated at (data changed under us?)."""
    media = open_root(validation.media_root)
    table = validation.accepted.select(["uri", "size_bytes", "sha256"]).to_pylist()
    problems = {row["uri"]: media.check(row["uri"], row["size_bytes"], row["sha256"], rehash=False) for row in table}
    missing = [uri for uri, problem in problems.items() if problem and problem[0] == MISSING_OBJECT]
    changed = [uri for uri, problem in problems.items() if problem and problem[0] != MISSING_OBJECT]
    return GateResult(name="objects_unchanged", passed=not missing and not changed,
                      description="every accepted object is still present with its validated size",
                      metadata={"num_checked": len(table), "num_missing": len(missing), "num_changed": len(changed),
                                "examples": ", ".join((missing + changed)[:5])})


GATES = (accepted_rows_conform, no_duplicate_assets, no_split_leakage, quarantine_rate, train_split_nonempty)


def gates(validation: Validation) -> list[GateResult]:
    """Every blocking gate; the object recheck only when the config asks to verify objects."""
    chosen = GATES if validation.config.verify_objects == "off" else (*GATES, objects_unchanged)
    return [gate(validation) for gate in chosen]
