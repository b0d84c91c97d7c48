"""Blocking asset checks: one property each, with the numbers that explain it in metadata.

A manifest that fails any of these never reaches sharding: downstream assets in the same
run are skipped. The properties are the plain ``ops.curation.validation`` gates, so the CLI's
``trainyard manifest validate`` applies exactly the same rules. ``no_revoked_assets`` keeps a
shard index that holds an asset whose rights were withdrawn from the training stages after it.
"""


from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq

from assets.metadata import markdown_table
from ops.curation import manifest as manifest_ops
from ops.curation import quarantine as quarantine_ops
from ops.curation import rights
from ops.media import scan
from ops.curation import validation as validation_ops
from ops.clips.shard_ref import ShardIndexRef
from ops.publish.storage import verify_published
from resources import StorageResource


def _gate_check(gate):
    @dg.asset_check(asset="validated_manifest", name=gate.__name__, blocking=True,
                    description=(gate.__doc__ or "").strip() or None)
    def _check(validated_manifest: dict) -> dg.AssetCheckResult:
        result = gate(quarantine_ops.load_validation(Path(validated_manifest["path"])))
        return dg.AssetCheckResult(passed=result.passed, description=result.description, metadata=result.metadata)
    return _check


validated_manifest_checks = [_gate_check(gate) for gate in (*validation_ops.GATES, validation_ops.objects_unchanged)]


@dg.asset_check(asset="dataset_manifest", blocking=True, additional_ins={"raw_media": dg.AssetIn()},
                description="Every media or unsupported object in the listing has exactly one manifest row.")
def manifest_covers_listing(dataset_manifest: dict, raw_media: dict) -> dg.AssetCheckResult:
    verify_published(Path(raw_media["path"]))  # PublishedFileError: the listing is not the one published
    listing = pq.read_table(Path(raw_media["path"]) / "listing.parquet").to_pylist()
    expected = {row["uri"] for row in listing if row["kind"] in (scan.KIND_MEDIA, scan.KIND_UNSUPPORTED)}
    uris = manifest_ops.read_manifest(dataset_manifest["path"]).table.column("uri").to_pylist()
    missing, repeated = sorted(expected - set(uris)), len(uris) - len(set(uris))
    return dg.AssetCheckResult(passed=not missing and repeated == 0,
                               metadata={"num_listed_objects": len(expected), "num_rows": len(uris),
                                         "num_missing": len(missing), "num_repeated": repeated,
                                         "missing_examples": ", ".join(missing[:5])})



@dg.asset_check(asset="shard_index", blocking=True,
                additional_ins={"dataset_manifest": dg.AssetIn(), "validated_manifest": dg.AssetIn()},
                description=("No clip of the shard index comes from an asset whose rights are withdrawn: revoked "
                             "in the rights ledger, stated as consent: revoked by the newest manifest, or under a "
                             "license the allow-list no longer admits (docs/rights.md)."))
def no_revoked_assets(shard_index, dataset_manifest: dict, validated_manifest: dict,
                      storage: StorageResource) -> dg.AssetCheckResult:
    ref = ShardIndexRef.of(shard_index)
    held = rights.index_assets(storage.data, ref.path, ref.version)
    allowed = quarantine_ops.load_validation(Path(validated_manifest["path"])).config.allowed_licenses
    found = rights.refusals(storage.data, held, manifest=manifest_ops.read_manifest(dataset_manifest["path"]),
                            allowed=allowed)
    return dg.AssetCheckResult(
        passed=not found,
        description=(f"{len(found)} asset(s) of shard index {ref.version} may not be trained on; validate and "
                     "plan again (the retrain sensor does) so the next index leaves them out" if found else
                     f"every one of the {len(held)} assets of shard index {ref.version} may be trained on"),
        metadata={"shard_index_version": ref.version, "num_assets": len(held), "num_refused": len(found),
                  "refused": markdown_table([{"asset_id": key, "why": why} for key, why in found.items()],
                                            ["asset_id", "why"])})


all_checks = [*validated_manifest_checks, manifest_covers_listing, no_revoked_assets]
