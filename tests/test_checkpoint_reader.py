"""One restricted DCP ``.metadata`` reader for every load path (review finding 10).

ops.checkpoints.dcp_metadata.RecordedMetadataReader is what the trainer's resume and the restore drill's
``checkpoint_params`` read checkpoints with. Each test uses a real DCP checkpoint written by the
Checkpointer and attacks the reader itself, behind a verification that let the attack through
(defence in depth): a ``.metadata`` the record does not list, bytes swapped after verification,
and a forged pickle that runs code when unpickled plainly.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import test_checkpoint_toy as toy
from ops.checkpoints import store as store
from ops.checkpoints import dcp_metadata
from ops.drills import restore
from test_checkpoint_forgery import TouchOnUnpickle, forge, forged_metadata, save_one_checkpoint
from trainer.checkpointing.checkpointer import CheckpointCorrupt

KEY = b"r" * 16


def _files_without_metadata(checkpoint_dir: Path) -> dict:
    files = dict(store.read_record(checkpoint_dir)["files"])
    del files[dcp_metadata.DCP_METADATA_NAME]
    return files


def test_the_reader_refuses_a_metadata_file_the_record_does_not_list(tmp_path: Path) -> None:
    checkpoint = save_one_checkpoint(tmp_path / "run", KEY)
    reader = dcp_metadata.RecordedMetadataReader(checkpoint, _files_without_metadata(checkpoint))
    with pytest.raises(dcp_metadata.MetadataRefused, match=r"\.metadata is not listed in the commit record"):
        reader.read_metadata()
    assert len(reader.refusals) == 1


def test_the_reader_loads_the_genuine_metadata(tmp_path: Path) -> None:
    checkpoint = save_one_checkpoint(tmp_path / "run", KEY)
    reader = dcp_metadata.RecordedMetadataReader(checkpoint, store.read_record(checkpoint)["files"])
    metadata = reader.read_metadata()
    assert any(key.startswith("model.") for key in metadata.state_dict_metadata)
    assert metadata.storage_meta.load_id == reader.load_id and not reader.refusals


def _verify_passing_with(record_files: dict):
    """A verification that passes and hands the reader ``record_files`` (an attack that got past it)."""
    def verify(checkpoint_dir, *args, **kwargs):
        report = store.VerifyReport(Path(checkpoint_dir), dict(store.read_record(checkpoint_dir)))
        report.record["files"] = record_files
        return report
    return verify


def test_the_drill_refuses_a_metadata_file_the_record_does_not_list(tmp_path: Path, monkeypatch) -> None:
    """Before: the drill's own reader looked up the sha256 and crashed with a KeyError."""
    checkpoint = save_one_checkpoint(tmp_path / "run", KEY)
    monkeypatch.setattr(store, "verify", _verify_passing_with(_files_without_metadata(checkpoint)))
    with pytest.raises(restore.DrillError, match=r"\.metadata refused: \.metadata is not listed in the commit record"):
        restore.checkpoint_params(checkpoint, hmac_key=KEY)


def test_the_drill_refuses_metadata_swapped_after_verification(tmp_path: Path, monkeypatch) -> None:
    marker = tmp_path / "PWNED"
    checkpoint = save_one_checkpoint(tmp_path / "run", KEY)
    verify = store.verify

    def verify_then_swap(*args, **kwargs):
        report = verify(*args, **kwargs)
        path = checkpoint / dcp_metadata.DCP_METADATA_NAME
        path.write_bytes(forged_metadata(path.read_bytes(), TouchOnUnpickle(marker)))
        return report

    monkeypatch.setattr(store, "verify", verify_then_swap)
    with pytest.raises(restore.DrillError, match="sha256 differs from the commit record"):
        restore.checkpoint_params(checkpoint, hmac_key=KEY)
    assert not marker.exists()


@pytest.mark.parametrize("path", ["drill", "resume"])
def test_a_forged_pickle_is_refused_on_both_load_paths_even_if_verification_let_it_through(
        tmp_path: Path, monkeypatch, path: str) -> None:
    marker = tmp_path / "PWNED"
    run_dir = tmp_path / "run"
    checkpoint = save_one_checkpoint(run_dir, KEY)
    forge(checkpoint, TouchOnUnpickle(marker), signing="resign", key=KEY)
    monkeypatch.setattr(dcp_metadata, "metadata_problem", lambda data: "")  # a verify that skips .metadata
    assert store.verify(checkpoint, KEY).ok
    if path == "drill":
        with pytest.raises(restore.DrillError, match=r"refused: it names pathlib.Path.touch"):
            restore.checkpoint_params(checkpoint, hmac_key=KEY)
    else:
        with pytest.raises(CheckpointCorrupt, match=r"\.metadata: refused: it names pathlib.Path.touch"):
            toy.checkpointer(run_dir, hmac_key=KEY).load(toy.build("none"))
    assert not marker.exists()
