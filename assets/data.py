"""Data group assets: raw_media -> dataset_manifest -> validated_manifest + quarantine, and rights_report.

Each asset reads its config and resources, calls ``ops/``, and returns its output reference
with a ``DataVersion`` (the content version) and metadata including lineage. Outputs are small
references (version and path); the data itself lives in immutable version directories.

``rights_report`` lists every asset whose rights are withdrawn, and everything downstream that
holds it. An asset is listed when the rights ledger revokes it (``trainyard rights revoke``, or a
manifest that stated ``consent: revoked``), when the newest manifest states its consent revoked,
or when its license is no longer admitted by the validation's allow-list. For each, the data
lineage on disk is walked (ops.curation.rights.where): clip plans, shards, shard indexes, training
runs and their checkpoints. The same answer for one asset: ``trainyard rights where ASSET_ID``.
"""


import json
from dataclasses import asdict
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq

from assets import backfill
from assets.metadata import counts_table, lineage_metadata, markdown_table
from ops.curation import manifest as manifest_ops
from ops.curation import quarantine as quarantine_ops
from ops.media import roots, metadata_table, scan
from ops import progress
from ops.curation import rights, validation
from ops.publish.hashing import digest_json
from ops.lineage import code_version_of
from ops.media.probe import ProbeLimits
from ops.curation.splits import SplitConfig
from ops.publish.durable import write_file_atomic
from ops.publish.storage import publish_dir
from resources import LineageResource, StorageResource
from resources.launcher import TorchrunLauncher

# Each version covers the named ops modules and everything they import in the repository (ops.lineage).
RAW_CODE_VERSION = code_version_of("ops.media.scan", "ops.media.roots")
MANIFEST_CODE_VERSION = code_version_of("ops.media.scan", "ops.curation.manifest")
VALIDATION_CODE_VERSION = code_version_of("ops.curation.validation", "ops.curation.quarantine")
RIGHTS_CODE_VERSION = code_version_of("ops.curation.rights", "ops.curation.licenses")
_PROBE_DEFAULTS = ProbeLimits()
_VALIDATION_DEFAULTS = validation.ValidationConfig()
GROUP = "data"


class ManifestBuildConfig(dg.Config):
    """Probe limits and split rule (defaults: ops.media.probe.ProbeLimits, ops.curation.splits.SplitConfig)."""

    max_pixels: int = _PROBE_DEFAULTS.max_pixels
    max_duration_s: float = _PROBE_DEFAULTS.max_duration_s
    max_streams: int = _PROBE_DEFAULTS.max_streams
    probe_timeout_s: float = _PROBE_DEFAULTS.timeout_s
    probe_retry_timeout_s: float | None = None
    """Limit of the one retry after a probe timeout (at least probe_timeout_s); None: derived from
    probe_timeout_s (ops.media.probe.default_retry_timeout_s), so raising only the timeout is valid."""
    num_probe_workers: int = 2
    split_ratios: dict[str, float] = {"train": 0.8, "val": 0.1, "test": 0.1}
    split_seed: int = 0
    metadata_table: str | None = None
    """A metadata table (Parquet or CSV, a path or s3:// URL) describing the objects; None: sidecars only."""
    metadata_columns: dict[str, str] = {}
    """Field -> the table's column: key (required with a table), caption, license, consent, source_group,
    split, sha256 (ops.media.metadata_table)."""
    metadata_key_template: str = "{key}"
    """How a key becomes a relative path under the media root, e.g. 'videos/{key}.mp4'."""
    metadata_card: str | None = None
    """A dataset card (YAML, path or URL) covering every object the table describes (ops.curation.dataset_card)."""

    def to_ops(self) -> manifest_ops.ManifestConfig:
        table = None
        if self.metadata_table is not None:
            table = metadata_table.MetadataTableSpec(location=self.metadata_table, columns=self.metadata_columns,
                                                     key_template=self.metadata_key_template, card=self.metadata_card)
        elif self.metadata_columns or self.metadata_card:
            raise ValueError("metadata_columns and metadata_card describe a metadata table: set metadata_table")
        return manifest_ops.ManifestConfig(
            table=table,
            limits=ProbeLimits(max_pixels=self.max_pixels, max_duration_s=self.max_duration_s,
                               max_streams=self.max_streams, timeout_s=self.probe_timeout_s,
                               retry_timeout_s=self.probe_retry_timeout_s),
            splits=SplitConfig(ratios=dict(self.split_ratios), seed=self.split_seed),
            num_probe_workers=self.num_probe_workers,
        )


class ValidationRunConfig(dg.Config):
    """Row and set rules (defaults: ops.curation.validation.ValidationConfig)."""

    min_duration_s: float = _VALIDATION_DEFAULTS.min_duration_s
    max_duration_s: float = _VALIDATION_DEFAULTS.max_duration_s
    min_side: int = _VALIDATION_DEFAULTS.min_side
    max_side: int = _VALIDATION_DEFAULTS.max_side
    max_aspect_ratio: float = _VALIDATION_DEFAULTS.max_aspect_ratio
    verify_objects: str = _VALIDATION_DEFAULTS.verify_objects
    max_quarantine_fraction: float = _VALIDATION_DEFAULTS.max_quarantine_fraction
    allowed_licenses: list[str] = list(_VALIDATION_DEFAULTS.allowed_licenses)
    """SPDX license identifiers training may use (ops.curation.licenses); a row's license expression must be
    satisfiable with them, else it is quarantined as unknown_license or license_not_allowed."""

    def to_ops(self) -> validation.ValidationConfig:
        values = self.model_dump()
        return validation.ValidationConfig(**{**values, "allowed_licenses": tuple(values["allowed_licenses"])})


@dg.asset(group_name=GROUP, code_version=RAW_CODE_VERSION,
          description="Listing of the media root (path, size, sha256); its data version is the listing digest.")
def raw_media(context: dg.AssetExecutionContext, storage: StorageResource,
              lineage: LineageResource) -> dg.Output[dict]:
    media = roots.open_root(storage.media_root)
    with progress.reporting(log=context.log.info):  # hashing a large root: a line every 10 s
        listed = media.scan()
    version = scan.listing_version(listed)
    path = storage.data / "listings" / version
    with publish_dir(path) as staging:
        if staging is not None:
            pq.write_table(scan.listing_table(listed), staging / "listing.parquet")
    kinds: dict[str, int] = {}
    for item in listed:
        kinds[item.kind] = kinds.get(item.kind, 0) + 1
    record = lineage.collect(manifest_version="none", config={"media_root": storage.media_root},
                             code_version=RAW_CODE_VERSION)
    context.log.info(f"media root {storage.media_root}: {len(listed)} files, listing version {version}")
    return dg.Output(
        {"version": version, "path": str(path), "media_root": media.location},
        data_version=dg.DataVersion(version),
        metadata={"listing_version": version, "data_path": str(path), "media_root": storage.media_root,
                  "num_files": len(listed), "total_bytes": sum(item.size_bytes for item in listed),
                  "kinds": counts_table(kinds, "kind"), **lineage_metadata(record)},
    )


@dg.asset(group_name=GROUP, code_version=MANIFEST_CODE_VERSION,
          description="Probed, described Parquet manifest, stored immutably under manifests/<version>/.")
def dataset_manifest(context: dg.AssetExecutionContext, config: ManifestBuildConfig, raw_media: dict,
                     storage: StorageResource, lineage: LineageResource,
                     launcher: TorchrunLauncher) -> dg.Output[dict]:
    ops_config = config.to_ops()
    # Where the launcher runs data work on SLURM, a listing larger than one task's share is probed by
    # array tasks (assets/backfill.py); the rows are built here either way, in listing order.
    prober = backfill.cluster_prober(context, launcher, storage.data) if launcher.runs_data_on_cluster else None
    with progress.reporting(log=context.log.info):  # scanning and probing: a line every 10 s
        manifest = manifest_ops.build_manifest(raw_media["media_root"], ops_config, prober=prober)
    path = manifest_ops.write_manifest(manifest, manifest_ops.manifests_dir(storage.data))
    record = lineage.collect(manifest_version=manifest.version, config=manifest.config,
                             code_version=MANIFEST_CODE_VERSION)
    flagged = [row for row in manifest.table.to_pylist() if row["probe_error"] or row["sidecar_error"]]
    context.log.info(f"manifest {manifest.version}: {manifest.table.num_rows} rows, {len(flagged)} flagged")
    return dg.Output(
        {"version": manifest.version, "path": str(path), "listing_version": raw_media["version"]},
        data_version=dg.DataVersion(manifest.version),
        metadata={"manifest_version": manifest.version, "data_path": str(path),
                  "dagster/row_count": manifest.table.num_rows, "num_flagged_at_ingest": len(flagged),
                  "ingest_errors": counts_table(manifest.reason_counts()),
                  "flagged_rows": markdown_table(flagged, ["uri", "probe_error", "sidecar_error"]),
                  **lineage_metadata(record)},
    )


@dg.multi_asset(
    group_name=GROUP,
    outs={
        "validated_manifest": dg.AssetOut(code_version=VALIDATION_CODE_VERSION,
                                          description="Rows accepted by the row schema and set checks."),
        "quarantine": dg.AssetOut(code_version=VALIDATION_CODE_VERSION,
                                  description="Rejected rows: asset_id, uri, reason code, detail, first_seen_version."),
    },
    ins={"dataset_manifest": dg.AssetIn()},
)
def validated_manifest_and_quarantine(context: dg.AssetExecutionContext, config: ValidationRunConfig,
                                      dataset_manifest: dict, storage: StorageResource,
                                      lineage: LineageResource):
    ops_config = config.to_ops()
    manifest = manifest_ops.read_manifest(dataset_manifest["path"])
    # The rights ledger's revocations, whatever the sidecars say now (ops.curation.rights; docs/rights.md); a
    # manifest stating consent: revoked is recorded there first, so it stays revoked until reinstated.
    added = rights.record_manifest_revocations(storage.data, manifest)
    if added:
        context.log.info(f"rights ledger: {len(added)} asset(s) stated as consent: revoked by manifest "
                         f"{manifest.version} recorded as revoked")
    revoked = rights.revoked(storage.data)
    result = validation.validate(manifest, ops_config, code_version=VALIDATION_CODE_VERSION, revoked=revoked)
    quarantine = quarantine_ops.record(result, quarantine_ops.ledger_path(storage.data))
    path = quarantine_ops.validated_dir(storage.data, result.version)
    report = {"version": result.version, "manifest_version": manifest.version, "media_root": manifest.media_root,
              "config": asdict(ops_config), "reason_counts": result.reason_counts(),
              "split_counts": result.split_counts(), "num_accepted": result.accepted.num_rows,
              "num_quarantined": len(quarantine)}
    quarantine_ops.write_validated(result, quarantine, path, report)
    record = lineage.collect(manifest_version=manifest.version, config=asdict(ops_config),
                             code_version=VALIDATION_CODE_VERSION)
    context.log.info(f"validated {result.version}: {result.accepted.num_rows} accepted, {len(quarantine)} quarantined")
    yield dg.Output(
        {"version": result.version, "path": str(path), "manifest_version": manifest.version},
        output_name="validated_manifest", data_version=dg.DataVersion(result.version),
        metadata={"validated_version": result.version, "data_path": str(path),
                  "dagster/row_count": result.accepted.num_rows,
                  "split_counts": counts_table(result.split_counts(), "split"), **lineage_metadata(record)},
    )
    rows = quarantine.to_dict("records")
    yield dg.Output(
        {"version": result.version, "path": str(path / quarantine_ops.QUARANTINE_FILE)},
        output_name="quarantine", data_version=dg.DataVersion(digest_json(rows)[:20]),
        metadata={"dagster/row_count": len(rows), "reason_counts": counts_table(result.reason_counts()),
                  "quarantined": markdown_table(rows, ["uri", "reason", "first_seen_version", "detail"]),
                  **lineage_metadata(record)},
    )



def build_report(data_root: Path, manifest: manifest_ops.Manifest, allowed: tuple[str, ...]) -> dict:
    """The report as a plain dict (also what ``trainyard rights report`` prints)."""
    ledger = rights.revoked(data_root)
    why = {asset_id: f"revoked in the rights ledger: {rights.describe(event)}" for asset_id, event in ledger.items()}
    for asset_id, reason in rights.withdrawn(manifest, allowed).items():
        why.setdefault(asset_id, reason)
    lineage = rights.where(data_root, why)
    assets = [{**lineage.reach[asset_id].as_dict(), "why": why[asset_id],
               "in_ledger": asset_id in ledger} for asset_id in sorted(why)]
    return {"manifest_version": manifest.version, "allowed_licenses": list(allowed), "assets": assets,
            "problems": lineage.problems}


@dg.asset(group_name=GROUP, code_version=RIGHTS_CODE_VERSION,
          description=("Every asset whose consent is revoked or whose license left the allow-list, with every clip "
                       "plan, shard, shard index, training run and checkpoint that holds it (docs/rights.md)."))
def rights_report(context: dg.AssetExecutionContext, dataset_manifest: dict, validated_manifest: dict,
                  storage: StorageResource, lineage: LineageResource) -> dg.Output[dict]:
    manifest = manifest_ops.read_manifest(dataset_manifest["path"])
    allowed = quarantine_ops.load_validation(Path(validated_manifest["path"])).config.allowed_licenses
    report = build_report(storage.data, manifest, allowed)
    version = digest_json(report)[:20]
    path = rights.rights_dir(storage.data) / "reports" / f"{version}.json"
    write_file_atomic(path, json.dumps(report, indent=2, sort_keys=True).encode())
    assets = report["assets"]
    reaching = [entry for entry in assets if entry["runs"]]
    for problem in report["problems"]:
        context.log.warning(f"rights_report: {problem}")
    context.log.info(f"rights_report: {len(assets)} asset(s) with withdrawn rights, {len(reaching)} of them "
                     "trained on")
    record = lineage.collect(manifest_version=manifest.version, config={"allowed_licenses": list(allowed)},
                             code_version=RIGHTS_CODE_VERSION)
    rows = [{"asset_id": entry["asset_id"][:16], "uris": ", ".join(entry["uris"]) or "-",
             "plans": len(entry["plans"]), "shards": len(entry["shards"]), "indexes": len(entry["shard_indexes"]),
             "runs": ", ".join(sorted({run["run_dir"].rsplit("/", 1)[-1] for run in entry["runs"]})) or "-",
             "checkpoints": len(entry["checkpoints"]), "why": entry["why"]} for entry in assets]
    return dg.Output(
        {"version": version, "path": str(path)},
        data_version=dg.DataVersion(version),
        metadata={"report_path": str(path), "num_withdrawn": len(assets),
                  "num_in_ledger": sum(entry["in_ledger"] for entry in assets),
                  "num_in_shards": sum(bool(entry["shards"]) for entry in assets),
                  "num_trained_on": len(reaching),
                  "num_runs_affected": len({run["run_dir"] for entry in assets for run in entry["runs"]}),
                  "num_checkpoints_affected": len({point["path"] for entry in assets for point in entry["checkpoints"]}),
                  "num_problems": len(report["problems"]),
                  "withdrawn": markdown_table(rows, ["asset_id", "uris", "plans", "shards", "indexes", "runs",
                                                     "checkpoints", "why"]),
                  **lineage_metadata(record)},
    )


TAINTABLE_STAGES = ("step_profile", "pretrain", "finetune", "restore_drill", "fault_drill")


def taint_observations(certificate: dict) -> list[dg.AssetObservation]:
    """One observation per training stage whose runs an erasure's certificate lists as tainted: the
    stage's page then says so beside its materializations (which were clean when they were made)."""
    runs: dict[str, list[dict]] = {}
    for entry in certificate["kept"]:
        if entry["kind"] == "run" and entry.get("stage") in TAINTABLE_STAGES:
            runs.setdefault(entry["stage"], []).append(entry)
    return [dg.AssetObservation(asset_key=stage, metadata={
        "rights_state": "tainted", "erasure_id": certificate["erasure_id"], "erased_asset": certificate["asset_id"],
        "tainted_runs": markdown_table([{"run_id": entry["run_id"], "run_dir": entry["location"]} for entry in entries],
                                       ["run_id", "run_dir"]),
        "what_now": "a tainted checkpoint is refused as a parent without rights.accept_tainted (docs/rights.md)"})
        for stage, entries in sorted(runs.items())]


class ErasureConfig(dg.Config):
    """Which revoked asset to erase (docs/rights.md, Erasure); the same as ``trainyard rights erase``."""

    asset: str
    """Asset id, a unique id prefix (8+ hex characters) or a media uri as the manifests name it."""
    reason: str = "takedown"
    """consent_revoked, license_withdrawn, takedown or other."""
    note: str = ""
    """The ticket or request behind it."""
    delete_source: bool = False
    """Delete the source media too (by default listed as kept: the lab may not own the source store)."""


@dg.op(description=("Erase a revoked asset: every shard holding it rewritten without it (a successor index the "
                    "stages follow), the old tars, caches, galleries and MLflow artifacts deleted, tainted checkpoints "
                    "marked; a signed certificate lists every copy deleted, kept or unreachable (docs/rights.md)."))
def erasure(context: dg.OpExecutionContext, config: ErasureConfig, storage: StorageResource,
            lineage: LineageResource) -> dg.Output[dict]:
    """An op, not an asset: an erasure is an action on the data, run when a takedown asks for it (erasure_job);
    its certificate is the record, and the run page shows it as this op's output metadata."""
    from ops.curation import erasure as erasure_ops
    from trainer.launch.redact import redact_uri
    from trainer.observe.tracking import connect_uri, resolve_tracking_uri

    if config.reason not in rights.REASONS:
        raise dg.Failure(f"erasure: reason must be one of {list(rights.REASONS)}, got {config.reason!r}",
                         allow_retries=False)
    try:
        asset_id, uris = rights.resolve_asset(storage.data, config.asset, allow_unknown=True)
        hooks = erasure_ops.TrackingHooks(connect=lambda recorded: resolve_tracking_uri(connect_uri(recorded)),
                                          redact=redact_uri)
        done = erasure_ops.erase(storage.data, asset_id, reason=config.reason, note=config.note,
                                 delete_source=config.delete_source, uris=uris, hooks=hooks, log=context.log.info)
    except (ValueError, rights.RightsLedgerError) as error:  # refused (not revoked, ambiguous): nothing deleted
        raise dg.Failure(f"erasure: {error}", allow_retries=False) from None
    if not done.recorded:
        last = done.previous[-1]
        context.log.info(f"erasure: {asset_id} was already erased ({last['erasure_id']}); nothing left, nothing "
                         "recorded")
        return dg.Output({"asset_id": asset_id, "recorded": False, "erasure_id": last["erasure_id"]},
                         metadata={"asset_id": asset_id, "recorded": False, "erasure_id": last["erasure_id"]})
    certificate = erasure_ops.read_certificate(storage.data, done.erasure_id)
    if not certificate["complete"]:
        raise dg.Failure(f"erasure {done.erasure_id}: incomplete, unreachable: "
                         f"{[entry for entry in certificate['unreachable'] if entry.get('error')]}; run it again",
                         allow_retries=False)
    record = lineage.collect(manifest_version="", config={"asset_id": asset_id, "reason": config.reason},
                             code_version=RIGHTS_CODE_VERSION)
    rows = [{"kind": entry["kind"], "location": entry["location"], "sha256": (entry.get("sha256") or "-")[:16]}
            for entry in certificate["deleted"]]
    path = erasure_ops.certificate_path(storage.data, done.erasure_id)
    for event in taint_observations(certificate):  # the stage pages show which of their runs are tainted now
        context.log_event(event)
    return dg.Output(
        {"asset_id": asset_id, "recorded": True, "erasure_id": done.erasure_id, "certificate": str(path)},
        metadata={"asset_id": asset_id, "erasure_id": done.erasure_id, "recorded": True,
                  "certificate": dg.MetadataValue.path(str(path)),
                  "num_deleted": len(certificate["deleted"]), "num_kept": len(certificate["kept"]),
                  "num_unreachable": len(certificate["unreachable"]),
                  "successors": markdown_table(certificate["successors"], ["from_index", "index", "path"]),
                  "deleted": markdown_table(rows, ["kind", "location", "sha256"]),
                  "tainted_checkpoints": markdown_table(
                      [entry for entry in certificate["kept"] if entry["kind"] == "checkpoint"],
                      ["location", "step", "state"]),
                  **lineage_metadata(record)})
