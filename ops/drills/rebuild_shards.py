"""Rebuild a recorded shard set from its validated manifest, with the shard code of the recorded commit.

A reproduction (ops/drills/replay.py) copies this file into its own folder and runs it as a script from
the recorded commit's worktree (``PYTHONPATH=<worktree>``), so ``ops.clips`` below is that commit's code:
the shard bytes come from the code that wrote them first, not from today's. Reads a JSON spec, prints
one JSON line:

    python rebuild_shards.py SPEC.json
    spec: {"validated_dir", "exclude": [asset ids], "config": {...}, "code_version", "plan_version", "out_dir"}
    out:  {"ok": true, "index_version", "plan_version", "shards": {name: sha256}}
          {"ok": false, "kind": "plan" | "error", "message"}

``exclude`` holds the assets the rights ledger revokes now: a revoked clip is never written again.
The rebuilt plan must have the recorded plan version (the same clips from the same sources), or
nothing is written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rebuild(spec: dict) -> dict:
    import pyarrow as pa
    import pyarrow.compute as pc

    from ops.clips import plan as clips, shards
    from ops.curation.quarantine import load_validation

    validation = load_validation(Path(spec["validated_dir"]))
    accepted = validation.accepted
    if spec["exclude"]:
        accepted = accepted.filter(pc.invert(pc.is_in(accepted.column("asset_id"), value_set=pa.array(spec["exclude"]))))
    config = clips.ShardConfig.from_dict(spec["config"])
    plan = clips.plan_clips(accepted, config, manifest_version=validation.manifest_version,
                            validated_version=validation.version, code_version=spec["code_version"])
    if plan.version != spec["plan_version"]:
        return {"ok": False, "kind": "plan",
                "message": f"the clip plan rebuilt from validated set {validation.version} is version {plan.version}, "
                           f"not the recorded {spec['plan_version']}"
                           + (f" (without the {len(spec['exclude'])} asset(s) revoked since)" if spec["exclude"] else "")}
    out = Path(spec["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    clips.write_plan(plan, out)
    for shard in plan.shards:
        shards.write_shard(plan, shard, validation.media_root, out)
    index = shards.build_index(plan, out)
    shas = dict(zip(index.table.column("shard").to_pylist(), index.table.column("shard_sha256").to_pylist()))
    return {"ok": True, "index_version": index.version, "plan_version": plan.version, "shards": shas}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    try:
        result = rebuild(spec)
    except Exception as error:  # noqa: BLE001 - any failure of the recorded commit's code is reported, not raised
        result = {"ok": False, "kind": "error", "message": f"{type(error).__name__}: {error}"}
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
