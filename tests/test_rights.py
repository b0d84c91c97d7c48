"""Rights after validation (ops/curation/rights.py, ops/curation/licenses.py, cli/rights.py): the SPDX allow-list, the
revocation ledger and its tamper evidence, validation of revoked assets, and the walk from an asset
to the plans, shards, indexes, runs and checkpoints that hold it, on real shards of the demo media.
The same walk over real training runs and checkpoints, and the refusal of the next pretrain, are in
tests/test_training_assets.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from helpers import manifest_row, write_launch_record as _launch, write_shards

from cli.main import main
from ops.curation import ledger_anchor, licenses, rights
from ops.curation import manifest as manifest_ops
from ops.curation import validation as validation_ops
from ops.clips.plan import ShardConfig
from ops.clips.shards import shard_dir

ASSET = "ab" * 32


# ---------------------------------------------------------------------------------------------
# Licenses

@pytest.mark.parametrize(("value", "code"), [
    ("CC-BY-4.0", ""), ("cc0-1.0", ""), ("MIT OR CC-BY-NC-4.0", ""),
    ("MIT AND CC-BY-NC-4.0", licenses.LICENSE_NOT_ALLOWED), ("CC-BY-NC-4.0", licenses.LICENSE_NOT_ALLOWED),
    ("LicenseRef-acme-research", licenses.LICENSE_NOT_ALLOWED),
    ("free for research", licenses.UNKNOWN_LICENSE), ("Foo-1.0", licenses.UNKNOWN_LICENSE),
    ("MIT OR", licenses.UNKNOWN_LICENSE), ("", licenses.MISSING_LICENSE), ("  ", licenses.MISSING_LICENSE),
    (None, licenses.MISSING_LICENSE),
])
def test_a_license_is_an_spdx_expression_the_allow_list_can_satisfy(value, code) -> None:
    assert licenses.judge(value).code == code


def test_a_lab_admits_its_own_terms_by_naming_them() -> None:
    allowed = licenses.check_allow_list(["LicenseRef-acme-research", "cc-by-4.0"])
    assert allowed == ("CC-BY-4.0", "LicenseRef-acme-research")
    assert licenses.judge("LicenseRef-acme-research", allowed).code == ""


@pytest.mark.parametrize("allow_list", [["MIT", "Apache2"], "MIT", [""], [], ["MIT OR Apache-2.0"]])
def test_an_allow_list_entry_that_is_no_spdx_identifier_is_refused(allow_list) -> None:
    with pytest.raises(ValueError, match="SPDX|at least one|expression"):
        validation_ops.ValidationConfig(allowed_licenses=tuple(allow_list) if isinstance(allow_list, list)
                                        else allow_list)


def test_validation_quarantines_unknown_and_disallowed_licenses_with_their_reason() -> None:
    rows = [manifest_row("ok.mp4"), manifest_row("unknown.mp4", license="any non-empty string"),
            manifest_row("nc.mp4", license="CC-BY-NC-4.0"), manifest_row("none.mp4", license="")]
    manifest = manifest_ops.manifest_from_rows(rows, config={}, media_root="/nowhere")
    result = validation_ops.validate(manifest, validation_ops.ValidationConfig(verify_objects="off",
                                                                               max_quarantine_fraction=1.0))
    reasons = dict(zip(result.rejected["uri"], result.rejected["reason"]))
    assert reasons == {"unknown.mp4": "unknown_license", "nc.mp4": "license_not_allowed",
                       "none.mp4": "missing_license"}
    detail = result.rejected.set_index("uri")["detail"]
    assert "not an SPDX license identifier" in detail["unknown.mp4"] and "CC-BY-NC-4.0" in detail["nc.mp4"]
    wider = validation_ops.validate(manifest, validation_ops.ValidationConfig(
        verify_objects="off", max_quarantine_fraction=1.0, allowed_licenses=("CC-BY-4.0", "CC-BY-NC-4.0")))
    assert "nc.mp4" not in set(wider.rejected["uri"]) and wider.version != result.version


def test_a_stated_license_the_allow_list_drops_or_revoked_consent_withdraws_an_asset() -> None:
    rows = [manifest_row("ok.mp4"), manifest_row("none.mp4", license=""),
            manifest_row("nc.mp4", license="CC-BY-NC-4.0"), manifest_row("revoked.mp4", consent="revoked")]
    manifest = manifest_ops.manifest_from_rows(rows, config={}, media_root="/nowhere")
    ids = {row["uri"]: row["asset_id"] for row in rows}
    found = rights.withdrawn(manifest, licenses.DEFAULT_ALLOWED_LICENSES)
    assert set(found) == {ids["nc.mp4"], ids["revoked.mp4"]}, "stating no license is validation's business"
    assert "license_not_allowed" in found[ids["nc.mp4"]] and "consent: revoked" in found[ids["revoked.mp4"]]
    wider = rights.withdrawn(manifest, ("CC-BY-4.0", "CC-BY-NC-4.0"))
    assert set(wider) == {ids["revoked.mp4"]}


def test_the_license_judged_is_that_of_the_copy_validation_keeps() -> None:
    """Validation keeps the first uri of duplicate content (duplicate_content for the rest): a rejected
    copy's disallowed license must not block, forever, an index that holds the kept copy."""
    sha = "ef" * 32
    rows = [manifest_row("lab/a.mp4", sha256=sha), manifest_row("vendor/a_copy.mp4", sha256=sha, license="CC-BY-NC-4.0")]
    manifest = manifest_ops.manifest_from_rows(rows, config={}, media_root="/nowhere")
    assert rights.withdrawn(manifest, licenses.DEFAULT_ALLOWED_LICENSES) == {}
    validated = validation_ops.validate(manifest, validation_ops.ValidationConfig(verify_objects="off",
                                                                                  max_quarantine_fraction=1.0))
    assert validated.accepted.column("uri").to_pylist() == ["lab/a.mp4"]


# ---------------------------------------------------------------------------------------------
# The ledger

def test_revoking_twice_records_once_and_reinstating_ends_it(tmp_path: Path) -> None:
    first, recorded = rights.revoke(tmp_path, ASSET, reason="consent_revoked", note="ticket 7", by="alice")
    assert recorded and first["by"] == "alice" and first["note"] == "ticket 7"
    again, recorded = rights.revoke(tmp_path, ASSET.upper(), reason="takedown", by="bob")
    assert not recorded and again == first, "the revocation in force, not a second one"
    assert len(rights.read_events(tmp_path)) == 1
    assert rights.reinstate(tmp_path, ASSET, note="consent given again", by="alice")["event"] == rights.REINSTATED
    assert rights.revoked(tmp_path) == {} and rights.reinstate(tmp_path, ASSET) is None
    rights.revoke(tmp_path, ASSET, reason="consent_revoked")
    assert list(rights.revoked(tmp_path)) == [ASSET] and len(rights.read_events(tmp_path)) == 3


@pytest.mark.parametrize(("asset_id", "reason"), [("abc", "consent_revoked"), ("zz" * 32, "consent_revoked"),
                                                  (ASSET, "because")])
def test_a_malformed_revocation_is_refused(tmp_path: Path, asset_id: str, reason: str) -> None:
    with pytest.raises(ValueError):
        rights.revoke(tmp_path, asset_id, reason=reason)
    assert not rights.ledger_path(tmp_path).exists()


def _edit_line(path: Path, number: int, edit) -> None:
    lines = path.read_text().splitlines(keepends=True)
    lines[number] = edit(lines[number])
    path.write_text("".join(lines))


@pytest.mark.parametrize("attack", ["edit", "drop", "drop_newest", "reorder", "garbage", "no_seal", "other_key",
                                    "deleted", "binary"])
def test_a_ledger_edited_removed_or_reordered_is_refused_not_read_as_not_revoked(tmp_path: Path, attack: str,
                                                                                 monkeypatch) -> None:
    for number in range(3):
        rights.revoke(tmp_path, f"{number:064x}", reason="consent_revoked")
    path = rights.ledger_path(tmp_path)
    lines = path.read_text().splitlines(keepends=True)
    assert len(lines) == 4 and '"seal"' in lines[-1]
    if attack == "edit":  # a revocation turned into a reinstatement, its own chain value kept
        _edit_line(path, 1, lambda line: line.replace('"revoked"', '"reinstated"'))
    elif attack == "drop":
        path.write_text(lines[0] + lines[2] + lines[3])
    elif attack == "drop_newest":  # the newest revocation undone by deleting its line: chain and sequence hold
        path.write_text(lines[0] + lines[1] + lines[3])
    elif attack == "reorder":
        path.write_text(lines[1] + lines[0] + lines[2] + lines[3])
    elif attack == "garbage":
        path.write_text("".join(lines) + "{not json\n")
    elif attack == "no_seal":
        path.write_text("".join(lines[:3]))
    elif attack == "deleted":  # every revocation undone at once, were a missing ledger read as empty
        path.unlink()
    elif attack == "binary":
        path.write_bytes(path.read_bytes()[:40] + b"\xff\xfe" + path.read_bytes()[42:])
    else:  # resealed by someone holding another key
        monkeypatch.setenv("TRAINYARD_CHECKPOINT_HMAC_KEY", "another-key")
    with pytest.raises(rights.RightsLedgerError, match="restore the ledger|another key|is missing"):
        rights.revoked(tmp_path)
    with pytest.raises(rights.RightsLedgerError):
        rights.revoke(tmp_path, ASSET, reason="takedown")  # nothing is appended to a broken history


def test_a_manifest_stating_revoked_consent_is_recorded_once(demo_manifest, tmp_path: Path) -> None:
    revoked_rows = [row for row in demo_manifest.table.to_pylist() if row["consent"] == "revoked" and row["asset_id"]]
    assert revoked_rows, "the demo media has a clip whose sidecar revokes consent"
    added = rights.record_manifest_revocations(tmp_path, demo_manifest)
    assert {event["asset_id"] for event in added} == {row["asset_id"] for row in revoked_rows}
    assert all(event["source"] == f"manifest {demo_manifest.version}" for event in added)
    assert rights.record_manifest_revocations(tmp_path, demo_manifest) == []


def test_validation_quarantines_a_revoked_asset_whatever_its_sidecar_says(demo_manifest, demo_validation,
                                                                          tmp_path: Path) -> None:
    asset_id = demo_validation.accepted.column("asset_id")[0].as_py()
    uri = demo_validation.accepted.column("uri")[0].as_py()
    rights.revoke(tmp_path, asset_id, reason="consent_revoked", note="request 12")
    result = validation_ops.validate(demo_manifest, demo_validation.config, revoked=rights.revoked(tmp_path))
    rejected = result.rejected.set_index("uri")
    assert rejected.loc[uri, "reason"] == rights.RIGHTS_REVOKED and "request 12" in rejected.loc[uri, "detail"]
    assert asset_id not in result.accepted.column("asset_id").to_pylist()
    assert result.version != demo_validation.version


# ---------------------------------------------------------------------------------------------
# Where an asset went

@pytest.fixture(scope="module")
def small_set(demo_validation, tmp_path_factory):
    """Three sources of the demo, planned and sharded under a data root (real shards, one index)."""
    data = tmp_path_factory.mktemp("rights_data")
    validation = dataclasses.replace(demo_validation, accepted=demo_validation.accepted.slice(0, 3))
    config = ShardConfig(clips_per_shard=2, max_clips_per_source=2, splits=("train", "val", "test"))
    plan, _ = write_shards(validation, config, shard_dir(data, "pending"))
    final = shard_dir(data, plan.version)
    shard_dir(data, "pending").rename(final)
    return data, final


def test_where_follows_an_asset_to_its_plan_shards_index_runs_and_checkpoints(small_set, tmp_path: Path) -> None:
    source, plan_dir = small_set
    data = tmp_path / "data"
    (data / "shards").mkdir(parents=True)
    (data / "shards" / plan_dir.name).symlink_to(plan_dir)
    index = json.loads((plan_dir / "index.json").read_text())["version"]
    held = sorted(rights.index_asset_ids(plan_dir))
    inside, outside = held[0], "cd" * 32
    pretrain = _launch(data, "pretrain-a", index=index)
    _launch(data, "finetune-a", index="another-index", stage="finetune", parent="pretrain-a")
    _launch(data, "pretrain-other", index="another-index")
    drill_copy = data / "drills" / "d-1" / "original_records"
    drill_copy.mkdir(parents=True)
    (drill_copy / "launch.json").write_text((pretrain / "launch.json").read_text())  # the original run again
    (data / "runs" / "broken").mkdir()
    (data / "runs" / "broken" / "launch.json").write_text("{truncated")
    lineage = rights.where(data, [inside, outside])
    reach = lineage.reach[inside]
    assert [plan["path"] for plan in reach.plans] == [str(data / "shards" / plan_dir.name)]
    assert reach.shards and all(shard["written"] and shard["sample_keys"] for shard in reach.shards)
    assert [entry["version"] for entry in reach.shard_indexes] == [index]
    runs = {run["run_id"]: run["how"] for run in reach.runs}
    assert runs == {"pretrain-a": f"trained on shard index {index}",
                    "finetune-a": "initialised from run pretrain-a's checkpoint"}, "derived runs count, others do not"
    assert {Path(point["path"]).parent.parent.name for point in reach.checkpoints} == {"pretrain-a", "finetune-a"}
    assert not lineage.reach[outside].plans and not lineage.reach[outside].runs
    assert any("broken/launch.json" in problem for problem in lineage.problems), "an unreadable record is named"
    assert pretrain.exists()


def test_where_names_a_plan_it_cannot_verify_instead_of_skipping_it(small_set, tmp_path: Path) -> None:
    _, plan_dir = small_set
    data = tmp_path / "data"
    copy = data / "shards" / plan_dir.name
    copy.mkdir(parents=True)
    for path in plan_dir.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    held = sorted(rights.index_asset_ids(copy))
    (copy / "plan.parquet").write_bytes((copy / "plan.parquet").read_bytes()[:-40])  # truncated
    lineage = rights.where(data, held)
    assert not any(reach.plans for reach in lineage.reach.values())
    assert any("clip plan cannot be read or verified" in problem for problem in lineage.problems)


def test_refusals_name_what_the_ledger_revokes_in_an_index(small_set, tmp_path: Path) -> None:
    _, plan_dir = small_set
    held = rights.index_asset_ids(plan_dir)
    assert rights.refusals(tmp_path, held) == {}
    revoked = sorted(held)[1]
    rights.revoke(tmp_path, revoked, reason="license_withdrawn", note="vendor ended the deal")
    found = rights.refusals(tmp_path, held)
    assert list(found) == [revoked] and "license_withdrawn" in found[revoked] and "vendor" in found[revoked]


# ---------------------------------------------------------------------------------------------
# The command line

def test_rights_cli_revokes_by_uri_once_and_reports_where(small_set, demo_manifest, tmp_path: Path, capsys) -> None:
    _, plan_dir = small_set
    data = tmp_path / "data"
    manifest_ops.write_manifest(demo_manifest, manifest_ops.manifests_dir(data))
    (data / "shards").mkdir()
    (data / "shards" / plan_dir.name).symlink_to(plan_dir)
    held = sorted(rights.index_asset_ids(plan_dir))[0]
    uri = next(row["uri"] for row in demo_manifest.table.to_pylist() if row["asset_id"] == held)
    assert main(["rights", "revoke", uri, "--reason", "consent_revoked", "--note", "t-1", "--data-root", str(data)]) == 0
    out = capsys.readouterr().out
    assert f"revoked {held}" in out and "clip plan" in out and "shard index" in out and "next: validate again" in out
    assert main(["rights", "revoke", held[:10], "--reason", "takedown", "--data-root", str(data)]) == 0
    assert "was already revoked" in capsys.readouterr().out
    assert len(rights.read_events(data)) == 1
    assert main(["rights", "where", held, "--json", "--data-root", str(data)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["revocation"]["note"] == f"t-1 (given as {uri})" and report["plans"] and report["shards"] and not report["runs"]
    assert main(["rights", "list", "--data-root", str(data)]) == 0
    assert held in capsys.readouterr().out


def test_rights_cli_refuses_an_unknown_asset_unless_told(demo_manifest, tmp_path: Path, capsys) -> None:
    data = tmp_path / "data"
    manifest_ops.write_manifest(demo_manifest, manifest_ops.manifests_dir(data))
    assert main(["rights", "revoke", "ef" * 32, "--reason", "takedown", "--data-root", str(data)]) == 2
    assert "no asset id, id prefix or uri" in capsys.readouterr().err and not rights.ledger_path(data).exists()
    assert main(["rights", "revoke", "nothing/here.mp4", "--reason", "takedown", "--data-root", str(data)]) == 2
    assert main(["rights", "revoke", "ef" * 32, "--reason", "takedown", "--allow-unknown",
                 "--data-root", str(data)]) == 0
    out = capsys.readouterr().out
    assert "in no clip plan, shard, shard index, training run or checkpoint" in out, "never trained on: said so"
    assert main(["rights", "where", "ef" * 32, "--data-root", str(data)]) == 0
    assert "REVOKED" in capsys.readouterr().out


def test_rights_cli_names_a_tampered_ledger(tmp_path: Path, capsys) -> None:
    rights.revoke(tmp_path, ASSET, reason="takedown")
    rights.revoke(tmp_path, "cd" * 32, reason="takedown")
    path = rights.ledger_path(tmp_path)
    path.write_text("".join(path.read_text().splitlines(keepends=True)[1:]))
    assert main(["rights", "list", "--data-root", str(tmp_path)]) == 2
    assert "restore the ledger from a backup" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Rollback: the ledger's newest state is anchored outside the data root (ops/curation/ledger_anchor.py)

def _snapshot(data: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in rights.rights_dir(data).glob("*.json*")}


def _restore(data: Path, files: dict[str, bytes]) -> None:
    for path in rights.rights_dir(data).glob("*.json*"):
        path.unlink()
    for name, content in files.items():
        (rights.rights_dir(data) / name).write_bytes(content)


@pytest.mark.parametrize("attack", ["older_copy_with_its_seal", "older_copy_without_head", "deleted_with_head",
                                    "emptied_with_head", "another_history"])
def test_a_rolled_back_ledger_is_refused_by_name_not_read_as_not_revoked(tmp_path: Path, attack: str) -> None:
    """Whoever can write the data root can restore an older, validly sealed ledger (and its head.json), or
    delete both: the revocations made since must not silently come undone."""
    data = tmp_path / "data"
    rights.revoke(data, ASSET, reason="consent_revoked")
    older = _snapshot(data)
    rights.revoke(data, "cd" * 32, reason="takedown")
    rights.reinstate(data, ASSET, note="consent given again")  # the newest state: only cd.. revoked
    assert list(rights.revoked(data)) == ["cd" * 32]
    if attack == "older_copy_with_its_seal":  # a replay of an older signed head with its ledger
        _restore(data, older)
    elif attack == "older_copy_without_head":
        _restore(data, {rights.LEDGER_FILE: older[rights.LEDGER_FILE]})
    elif attack == "deleted_with_head":
        _restore(data, {})
    elif attack == "emptied_with_head":
        _restore(data, {rights.LEDGER_FILE: b""})
    else:  # as many events, sealed with the same key, but another history
        other = tmp_path / "other"
        for number in range(4):
            rights.revoke(other, f"{number:064x}", reason="other")
        _restore(data, _snapshot(other))
    # An emptied file has no seal either: refused as cut short, before its anchor is compared.
    expected = rights.RightsLedgerError if attack == "emptied_with_head" else rights.RightsLedgerRolledBack
    with pytest.raises(expected, match="anchor|no seal") as refused:
        rights.revoked(data)
    assert str(rights.ledger_path(data)) in str(refused.value)
    with pytest.raises(expected):
        rights.revoke(data, "ef" * 32, reason="takedown")  # nothing is appended to a rolled-back history
    with pytest.raises(rights.IndexNotTrainable, match="cannot be trusted"):
        rights.refuse_revoked_index(data / "shards" / "any", "v", data_root=data)  # what the trainer checks


@pytest.mark.parametrize("version", ["v1", None])
def test_an_index_whose_assets_cannot_be_read_is_refused_while_anything_is_revoked(tmp_path: Path, version) -> None:
    """With a revocation in the ledger, an index whose plan (or info) cannot be read cannot be checked
    against it: refused by name, never launched unchecked."""
    data = tmp_path / "data"
    rights.revoke(data, "ab" * 32, reason="takedown")
    with pytest.raises(rights.IndexNotTrainable, match="cannot be read to check them"):
        rights.refuse_revoked_index(data / "shards" / "gone", version, data_root=data)


def test_a_ledger_ahead_of_its_anchor_is_accepted_and_the_anchor_advanced(tmp_path: Path) -> None:
    """Writers write the ledger, then its anchor: a crash between the two (or an append from a machine with
    another home) leaves the ledger ahead, which extends the anchored history and is accepted."""
    data = tmp_path / "data"
    anchor = ledger_anchor.anchor_file(rights.ledger_path(data))
    rights.revoke(data, ASSET, reason="consent_revoked")
    older_anchor = anchor.read_bytes()
    older = _snapshot(data)
    rights.revoke(data, "cd" * 32, reason="takedown")
    anchor.write_bytes(older_anchor)  # the anchor write of the second append was lost
    assert set(rights.revoked(data)) == {ASSET, "cd" * 32}
    assert ledger_anchor.load(rights.ledger_path(data)).count == 2, "advanced to what the ledger holds"
    _restore(data, older)
    with pytest.raises(rights.RightsLedgerRolledBack):
        rights.revoked(data)


def test_a_ledger_write_that_fails_leaves_the_anchor_behind_it(tmp_path: Path, monkeypatch) -> None:
    """The safe order: the ledger first, then its anchor. An anchor written first and a ledger write that then
    fails (disk full, a crash) would refuse the intact ledger forever as rolled back."""
    data = tmp_path / "data"
    rights.revoke(data, ASSET, reason="consent_revoked")
    real_write = rights.write_file_atomic

    def disk_full(path: Path, content: bytes) -> None:
        if path == rights.ledger_path(data):
            raise OSError(28, "No space left on device")
        real_write(path, content)

    monkeypatch.setattr(rights, "write_file_atomic", disk_full)
    with pytest.raises(OSError, match="No space"):
        rights.revoke(data, "cd" * 32, reason="takedown")
    monkeypatch.setattr(rights, "write_file_atomic", real_write)
    assert list(rights.revoked(data)) == [ASSET] and ledger_anchor.load(rights.ledger_path(data)).count == 1


def test_first_use_anchors_the_ledger_and_a_forged_anchor_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    assert rights.revoked(data) == {} and not ledger_anchor.anchor_file(rights.ledger_path(data)).exists()
    rights.revoke(data, ASSET, reason="consent_revoked")
    anchor = ledger_anchor.anchor_file(rights.ledger_path(data))
    anchor.unlink()  # a ledger from before anchors: trusted as it stands, then anchored
    assert list(rights.revoked(data)) == [ASSET] and ledger_anchor.load(rights.ledger_path(data)).count == 1
    edited = json.loads(anchor.read_text())
    anchor.write_text(json.dumps({**edited, "count": 0}))
    with pytest.raises(rights.RightsAnchorError, match="signature"):
        rights.revoked(data)
    other = tmp_path / "other"
    rights.revoke(other, "cd" * 32, reason="takedown")  # another ledger's valid anchor, copied over this one's
    anchor.write_bytes(ledger_anchor.anchor_file(rights.ledger_path(other)).read_bytes())
    with pytest.raises(rights.RightsAnchorError, match="not for"):
        rights.revoked(data)


# ---------------------------------------------------------------------------------------------
# The command line and the trainer run by hand apply the ledger as the stages do

def test_manifest_validate_quarantines_what_the_ledger_revokes(tmp_path: Path, capsys) -> None:
    rows = [manifest_row("kept.mp4"), manifest_row("taken_down.mp4")]
    manifest = manifest_ops.manifest_from_rows(rows, config={}, media_root="/nowhere")
    data = tmp_path / "data"
    folder = manifest_ops.write_manifest(manifest, manifest_ops.manifests_dir(data))
    rights.revoke(data, rows[1]["asset_id"], reason="takedown", note="notice 9")
    args = ["manifest", "validate", str(folder), "--verify", "off", "--max-quarantine-fraction", "1", "--json"]
    assert main(args) == 0
    quarantined = {row["uri"]: row for row in json.loads(capsys.readouterr().out)["quarantine"]}
    assert quarantined["taken_down.mp4"]["reason"] == rights.RIGHTS_REVOKED, "revoked: never accepted"
    assert "notice 9" in quarantined["taken_down.mp4"]["detail"] and "kept.mp4" not in quarantined
    elsewhere = tmp_path / "copy" / Path(folder).name  # outside any data root: the ledger named by --data-root
    elsewhere.mkdir(parents=True)
    for path in Path(folder).iterdir():
        (elsewhere / path.name).write_bytes(path.read_bytes())
    assert main([*args[:2], str(elsewhere), *args[3:], "--data-root", str(data)]) == 0
    assert {row["uri"] for row in json.loads(capsys.readouterr().out)["quarantine"]} == {"taken_down.mp4"}
    rights.ledger_path(data).unlink()
    rights.head_path(data).unlink()
    assert main(args) == 2, "a deleted ledger is refused, not read as nothing revoked"
    assert "is missing" in capsys.readouterr().err


def test_the_trainer_run_by_hand_refuses_an_index_holding_a_revoked_asset(small_set, tmp_path: Path) -> None:
    """torchrun -m trainer.train outside Dagster: the refusal the stages make before launch, with exit 2,
    naming the asset and the ledger, before a step is taken."""
    from trainer.train import main as train_main

    _, plan_dir = small_set
    data = tmp_path / "data"
    (data / "shards").mkdir(parents=True)
    index = data / "shards" / plan_dir.name
    index.symlink_to(plan_dir)
    revoked = sorted(rights.index_asset_ids(plan_dir))[0]
    rights.revoke(data, revoked, reason="takedown", note="notice 12")
    run_dir = tmp_path / "run"
    config = tmp_path / "tiny.yaml"
    config.write_text("preset: tiny_cpu\n")
    code = train_main(["--config", str(config), "--set", f"train.run_dir={run_dir}", "--set", "data.source=shards",
                       "--set", f"data.shard_index={index}", "--set", "data.manifest_version=m"])
    assert code == 2
    final = json.loads((run_dir / "final.json").read_text())
    assert final["status"] == "failed" and final["final_step"] == 0 and final["failure_class"] == "config_error"
    assert revoked in final["error"] and str(rights.ledger_path(data)) in final["error"] and "notice 12" in final["error"]
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
