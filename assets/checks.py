"""Blocking asset checks: one property each, with the numbers that explain it in metadata.

A manifest that fails any of these never reaches sharding: downstream assets in the same
run are skipped. The properties are the plain ``ops.validation`` gates, so the CLI's
``trainyard manifest validate`` applies exactly the same rules.
"""


from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq

from ops import manifest as manifest_ops
from ops import quarantine as quarantine_ops
from ops import scan
from ops import validation as validation_ops
from ops.storage import verify_published


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


all_checks = [*validated_manifest_checks, manifest_covers_listing]
