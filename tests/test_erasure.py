"""Erasure (issue 37, ops/curation/erasure.py): a revoked asset's copies deleted, successors that readers
follow, tainted runs, the signed certificate, and the faults (a kill at each step, a reader mid-shard,
erasing twice, an ambiguous prefix), on real shards of the demo media. The whole demo path, with the
byte scan, the Dagster job and finetune's refusal of a tainted parent, is in tests/test_end_to_end.py."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest
from erasure_scan import clip_frame_hashes, scan
from helpers import write_launch_record as _launch, write_shards

from cli.main import main
from ops.checkpoints import store
from ops.clips import shards
from ops.clips.plan import ShardConfig, read_plan
from ops.clips.shards import shard_dir
from ops.curation import erasure, rights
from ops.publish.storage import PublishedFileError
from trainer.launch.config import load_config
from trainer.launch.preflight import check_parent
from trainer.launch.refusal import Refusal

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sharded(demo_manifest, demo_validation, tmp_path_factory):
    """Eight demo sources planned and sharded (three clips a shard, two a source: shards mix assets), under a
    data root holding the demo manifest (which resolves ids, prefixes and uris)."""
    from ops.curation import manifest as manifest_ops

    data = tmp_path_factory.mktemp("erasure_data")
    manifest_ops.write_manifest(demo_manifest, manifest_ops.manifests_dir(data))
    validation = dataclasses.replace(demo_validation, accepted=demo_validation.accepted.slice(0, 8))
    config = ShardConfig(clips_per_shard=3, max_clips_per_source=2, splits=("train", "val", "test"))
    plan, _ = write_shards(validation, config, shard_dir(data, "pending"))
    shard_dir(data, "pending").rename(shard_dir(data, plan.version))
    return data, plan.version, validation


@pytest.fixture
def lab(sharded, tmp_path: Path, monkeypatch):
    """A fresh copy of the sharded data root, its own Trainyard home and caches, and a revoked asset that
    shares a shard with another (so its shard is rewritten, not dropped)."""
    source, plan_version, validation = sharded
    data = tmp_path / "data"
    shutil.copytree(source, data)
    home = tmp_path / "home"
    monkeypatch.setenv("TRAINYARD_HOME", str(home))
    monkeypatch.setenv("TRAINYARD_DATA_ROOT", str(data))
    media = tmp_path / "media"  # a copy: --delete-source deletes from it
    shutil.copytree(validation.media_root, media, symlinks=True)
    monkeypatch.setenv("TRAINYARD_MEDIA_ROOT", str(media))
    plan = read_plan(shard_dir(data, plan_version))
    rows = plan.table.to_pylist()
    shared = [shard for shard in plan.shards if len({row["asset_id"] for row in rows if row["shard"] == shard}) > 1]
    asset_id = next(row["asset_id"] for row in rows if row["shard"] == shared[0])
    rights.revoke(data, asset_id, reason="takedown", note="legal 7", by="tester")
    return {"data": data, "plan": plan, "asset_id": asset_id, "home": home, "validation": validation, "media": media}


def test_erasure_rewrites_the_holding_shards_and_deletes_the_old_ones(lab, tmp_path: Path) -> None:
    data, plan, asset_id = lab["data"], lab["plan"], lab["asset_id"]
    old_dir = shard_dir(data, plan.version)
    old_index = shards.read_index(old_dir)
    held = sorted({row["shard"] for row in plan.table.to_pylist() if row["asset_id"] == asset_id})
    targets = set().union(*(clip_frame_hashes(old_dir / f"{shard}.tar").get(asset_id[:16], set()) for shard in held))
    others = set().union(*(hashes for shard in plan.shards for key, hashes in
                           clip_frame_hashes(old_dir / f"{shard}.tar").items() if key != asset_id[:16]))
    targets -= others  # frames only this asset holds
    assert targets and scan([data], targets, asset_id), "the scan must find the asset before the erasure"
    done = erasure.erase(data, asset_id, reason="takedown", note="legal 7")
    assert done.recorded and not scan([data], targets, asset_id)
    (successor,) = done.successors
    assert successor["from_index"] == old_index.version
    new_dir = data / successor["path"]
    index = shards.read_index(new_dir)
    index.verify()
    new_plan = read_plan(new_dir)
    assert asset_id not in set(new_plan.table.column("asset_id").to_pylist())
    assert new_plan.erased == {"from_plan": plan.version, "from_index": old_index.version, "assets": [asset_id],
                               "erasure_id": done.erasure_id}
    assert new_plan.table.num_rows == plan.table.num_rows - sum(r["asset_id"] == asset_id for r in plan.table.to_pylist())
    # A rewritten shard is, byte for byte, what the shard writer makes of the old plan's rows less the erased
    # ones (each sample's meta.json names the plan that cut it: the old one, as for the untouched shards).
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    reduced = dataclasses.replace(plan, table=new_plan.table)
    for shard in new_plan.shards:
        shards.write_shard(reduced, shard, lab["media"], fresh)
        assert (fresh / f"{shard}.tar").read_bytes() == (new_dir / f"{shard}.tar").read_bytes(), shard
        if shard not in held:
            assert os.path.samefile(new_dir / f"{shard}.tar", old_dir / f"{shard}.tar"), "untouched: one file"
    for shard in held:
        assert not (old_dir / f"{shard}.tar").exists()
    # The successor is what readers follow; the old index stays as a record.
    assert erasure.follow(data, old_index.version)["index"] == index.version
    assert rights.index_asset_ids(old_dir) >= {asset_id}, "the old plan keeps its rows (a record)"
    certificate = erasure.read_certificate(data, done.erasure_id)
    deleted = {entry["location"]: entry for entry in certificate["deleted"]}
    for shard in held:
        entry = deleted[str(old_dir / f"{shard}.tar")]
        assert entry["sha256"] == old_index.table.filter(pc.equal(old_index.table.column("shard"), shard)) \
            .column("shard_sha256")[0].as_py()
    kinds = {entry["kind"] for entry in certificate["kept"]}
    assert {"source", "record", "ledger"} <= kinds and certificate["complete"]
    assert any(entry["kind"] == "exports" for entry in certificate["unreachable"])
    # The certificate is signed: an edit is refused.
    path = erasure.certificate_path(data, done.erasure_id)
    path.write_text(path.read_text().replace("legal 7", "legal 8"))
    with pytest.raises(PublishedFileError):
        erasure.read_certificate(data, done.erasure_id)


def test_a_non_revoked_asset_an_ambiguous_prefix_and_a_second_erasure(lab, capsys) -> None:
    data, plan, asset_id = lab["data"], lab["plan"], lab["asset_id"]
    other = next(row["asset_id"] for row in plan.table.to_pylist() if row["asset_id"] != asset_id)
    assert main(["rights", "erase", other, "--reason", "takedown", "--data-root", str(data)]) == 2
    assert "is not revoked" in capsys.readouterr().err and not erasure.erasures_dir(data).exists()
    assert main(["rights", "erase", asset_id[:12], "--reason", "takedown", "--note", "n", "--delete-source",
                 "--data-root", str(data)]) == 0
    out = capsys.readouterr().out
    assert "certificate" in out and "successor" in out
    source = lab["media"] / next(iter(rights.where(data, [asset_id]).reach[asset_id].uris))
    assert not source.exists(), "--delete-source deletes the source media"
    events = rights.read_events(data)
    assert main(["rights", "erase", asset_id[:12], "--reason", "takedown", "--data-root", str(data)]) == 0
    assert "already erased" in capsys.readouterr().out and rights.read_events(data) == events, "nothing recorded"
    assert main(["rights", "where", asset_id, "--json", "--data-root", str(data)]) == 0
    reach = json.loads(capsys.readouterr().out)
    assert [event["erasure_id"] for event in reach["erasures"]] and not any(s["written"] for s in reach["shards"])


def test_an_ambiguous_prefix_is_refused_listing_the_candidates(lab, monkeypatch) -> None:
    """Two demo ids never share 8 hex characters, so the resolver gets a known-id table where they do."""
    from cli import rights as cli_rights

    ids = ["abcdef01" + "1" * 56, "abcdef01" + "2" * 56]
    monkeypatch.setattr(cli_rights, "_known", lambda root: ({asset: {f"clips/{n}.mp4"} for n, asset in enumerate(ids)},
                                                             []))
    with pytest.raises(ValueError, match="prefix of 2 asset ids") as refused:
        cli_rights.resolve(lab["data"], "abcdef01")
    assert all(asset in str(refused.value) for asset in ids)


_KILLED = """
import sys
from ops.curation import erasure
erasure.erase(sys.argv[1], sys.argv[2], reason="takedown", note="killed", kill_after=sys.argv[3])
"""


@pytest.mark.parametrize("step", ["successors", "recorded", "shards"])
def test_a_killed_erasure_completes_when_run_again(lab, step: str) -> None:
    data, plan, asset_id = lab["data"], lab["plan"], lab["asset_id"]
    old_dir = shard_dir(data, plan.version)
    held = sorted({row["shard"] for row in plan.table.to_pylist() if row["asset_id"] == asset_id})
    shas = {shard: shards.read_index(old_dir).table.filter(pc.equal(shards.read_index(old_dir).table.column("shard"),
                                                                    shard)).column("shard_sha256")[0].as_py()
            for shard in held}
    killed = subprocess.run([sys.executable, "-c", _KILLED, str(data), asset_id, step], cwd=REPO,
                            env={**os.environ}, capture_output=True, text=True, timeout=120)
    assert killed.returncode == 137, killed.stderr[-2000:]
    # Whatever readers follow names no deleted tar: the successor when the ledger has it, else the old index.
    followed = erasure.follow(data, shards.read_index(old_dir).version)
    current = shards.read_index(data / followed["path"]) if followed else shards.read_index(old_dir)
    current.verify()
    done = erasure.erase(data, asset_id, reason="takedown", note="again")
    assert done.recorded
    assert len(rights.erasures(rights.read_events(data), asset_id)) == 1, "resumed under its own id, not a second"
    certificate = erasure.read_certificate(data, done.erasure_id)
    deleted = {entry["location"]: entry["sha256"] for entry in certificate["deleted"]}
    for shard in held:  # deleted by the killed run or by this one: certified with its former digest either way
        assert deleted[str(old_dir / f"{shard}.tar")] == shas[shard]
    shards.read_index(data / certificate["successors"][0]["path"]).verify()
    assert not list((data / "shards").glob(".*erasing*")), "no half-made successor left"


def test_a_reader_keeps_its_open_shard_and_names_a_shard_erased_under_it(lab) -> None:
    data, plan, asset_id = lab["data"], lab["plan"], lab["asset_id"]
    old = shards.read_index(shard_dir(data, plan.version))
    held = sorted({row["shard"] for row in plan.table.to_pylist() if row["asset_id"] == asset_id})
    rows = old.table.filter(pc.equal(old.table.column("shard"), held[0])).to_pylist()
    handle = old.open_shard(held[0])
    erasure.erase(data, asset_id, reason="takedown")
    with handle:  # opened before the erasure: POSIX keeps the bytes for it
        members = shards.read_members(handle, rows[-1]["offset"], rows[-1]["length"])
    assert "meta.json" in members
    with pytest.raises(shards.ShardIntegrityError, match="gone while shard index .* is read: erased"):
        old.open_shard(held[0])


def test_runs_on_an_erased_index_are_tainted_and_refused_as_parents_without_a_recorded_decision(lab) -> None:
    data, plan, asset_id = lab["data"], lab["plan"], lab["asset_id"]
    old_index = shards.read_index(shard_dir(data, plan.version)).version
    _launch(data, "pretrain-a", index=old_index)
    child = _launch(data, "finetune-a", index="elsewhere", parent="pretrain-a", stage="finetune")
    done = erasure.erase(data, asset_id, reason="takedown")
    clean = _launch(data, "pretrain-b", index=done.successors[0]["index"])
    taint = erasure.run_taint(data, child)
    assert taint["state"] == "tainted" and taint["assets"] == [asset_id] and "initialised from run pretrain-a" in \
        taint["how"]
    assert erasure.run_taint(data, clean) is None
    parent = data / "runs" / "pretrain-a" / "checkpoints" / store.step_dir_name(3)
    overrides = [f"stage.init_from={parent}", "stage.init_from_run_id=pretrain-a", "stage.checkpoint=true"]
    with pytest.raises(Refusal) as refused:
        check_parent(load_config(REPO / "configs" / "demo.yaml", overrides), data)
    assert refused.value.category == "rights" and "tainted" in str(refused.value)
    accepted = check_parent(load_config(REPO / "configs" / "demo.yaml", [
        *overrides, "rights.accept_tainted.reason=unlearning study 3", "rights.accept_tainted.approver=dr. m"]), data)
    assert accepted["accepted"] == {"reason": "unlearning study 3", "approver": "dr. m"}
    listed = subprocess.run([sys.executable, "-m", "cli.main", "checkpoint", "list", str(data / "runs" / "pretrain-a"),
                             "--json"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert json.loads(listed.stdout)["rights"]["state"] == "tainted", listed.stderr[-2000:]


def test_samples_conditioned_on_the_asset_are_deleted_here_and_in_mlflow(lab, tmp_path: Path, monkeypatch) -> None:
    from mlflow.tracking import MlflowClient

    from trainer.heldout import write_mp4

    data, plan, asset_id = lab["data"], lab["plan"], lab["asset_id"]
    other = next(row for row in plan.table.to_pylist() if row["asset_id"] != asset_id)
    mine = next(row for row in plan.table.to_pylist() if row["asset_id"] == asset_id)
    run_dir = _launch(data, "pretrain-g", index=shards.read_index(shard_dir(data, plan.version)).version)
    gallery = run_dir / "eval" / "step_00000004"
    gallery.mkdir(parents=True)
    frames = np.zeros((4, 16, 16, 3), np.uint8)
    for number in range(2):
        write_mp4(gallery / f"sample_{number:02d}.mp4", frames + 60 * number, audio=None, fps=4, audio_rate=16000)
    from ops.media.gallery import contact_sheet, mp4_frames

    (gallery / "contact_sheet.png").write_bytes(contact_sheet([frames, frames]))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("erasure", artifact_location=(tmp_path / "artifacts").as_uri())
    mlflow_run = client.create_run(experiment).info.run_id
    client.log_artifacts(mlflow_run, str(gallery), artifact_path="samples/step_4")
    (run_dir / "ranks").mkdir()
    (run_dir / "ranks" / "mlflow.json").write_text(json.dumps({"run_id": mlflow_run, "tracking_uri": uri}))
    (run_dir / "final.json").write_text(json.dumps({"generated": {
        "step": 4, "dir": str(gallery), "contact_sheet": "contact_sheet.png",
        "samples": [{"key": mine["sample_key"], "path": "sample_00.mp4", "status": "ok"},
                    {"key": other["sample_key"], "path": "sample_01.mp4", "status": "ok"}]}}))
    before = (gallery / "contact_sheet.png").read_bytes()
    done = erasure.erase(data, asset_id, reason="takedown")
    assert not (gallery / "sample_00.mp4").exists() and (gallery / "sample_01.mp4").exists()
    assert (gallery / "contact_sheet.png").read_bytes() not in (before, b"")
    assert len(mp4_frames(gallery / "sample_01.mp4")) == 4
    logged = sorted(item.path for item in client.list_artifacts(mlflow_run, "samples/step_4"))
    assert logged == ["samples/step_4/contact_sheet.png", "samples/step_4/sample_01.mp4"]
    certificate = erasure.read_certificate(data, done.erasure_id)
    kinds = [entry["kind"] for entry in certificate["deleted"]]
    assert {"sample", "contact_sheet", "mlflow_artifact", "shard"} <= set(kinds) and certificate["complete"]


def test_a_shard_edited_since_its_index_is_never_cut_into_a_successor(lab) -> None:
    """A holding tar whose bytes are not the ones its index names (edited, swapped): refused before the ledger
    records anything or any copy is deleted."""
    data, plan, asset_id = lab["data"], lab["plan"], lab["asset_id"]
    old_dir = shard_dir(data, plan.version)
    held = sorted({row["shard"] for row in plan.table.to_pylist() if row["asset_id"] == asset_id})
    tar = old_dir / f"{held[0]}.tar"
    raw = bytearray(tar.read_bytes())
    raw[700] ^= 0xFF
    tar.write_bytes(bytes(raw))
    events = rights.read_events(data)
    with pytest.raises(erasure.ErasureRefused, match="is not the shard index"):
        erasure.erase(data, asset_id, reason="takedown")
    assert rights.read_events(data) == events and tar.exists()
    assert not [path for path in (data / "shards").iterdir() if path.name != plan.version]
