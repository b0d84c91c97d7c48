"""The rights report: every asset whose rights are withdrawn, and everything downstream that holds it.

An asset is listed when the rights ledger revokes it (``trainyard rights revoke``, or a manifest that
stated ``consent: revoked``), when the newest manifest states its consent revoked, or when its license
is no longer admitted by the validation's allow-list. For each, the data lineage on disk is walked
(ops.curation.rights.where): clip plans, shards, shard indexes, training runs and their checkpoints. The same
answer for one asset: ``trainyard rights where ASSET_ID``.
"""


import json
from pathlib import Path

import dagster as dg

from assets.metadata import lineage_metadata, markdown_table
from ops.curation import manifest as manifest_ops
from ops.curation import quarantine as quarantine_ops
from ops.curation import rights
from ops.publish.hashing import digest_json
from ops.lineage import code_version_of
from ops.publish.storage import write_file_atomic
from resources import LineageResource, StorageResource

RIGHTS_CODE_VERSION = code_version_of("ops.curation.rights", "ops.curation.licenses")


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


@dg.asset(group_name="data", code_version=RIGHTS_CODE_VERSION,
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
