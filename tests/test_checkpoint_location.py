"""The checkpoint location (trainer.checkpointing.location) and the one writer that hashes while writing
(ops.checkpoints.digesting), without DCP: a run folder placed, written, committed and chosen by hand."""

from __future__ import annotations

import errno
import io
import pickle
from contextlib import nullcontext
from pathlib import Path

import pytest

from ops.checkpoints import store as store
from ops.checkpoints.digesting import WrittenFiles
from trainer.checkpointing.location import CheckpointLocation, ObjectStore, RunFolder, Staging, open_location

RUN_ID = "run-location"
RECORD = {"step": 3, "world_size": 1, "lineage": {"run_id": RUN_ID}, "model_fingerprint": "fp", "content": {}}


def test_written_files_records_the_digest_of_what_was_written(tmp_path: Path) -> None:
    written = WrittenFiles()
    with written.hashing("__0_0.distcp", open(tmp_path / "__0_0.distcp", "wb")) as stream:
        stream.write(b"x" * (2 << 20))  # hashed on the helper thread
        stream.write(b"tail")
    assert written.files == {"__0_0.distcp": store.file_digest(tmp_path / "__0_0.distcp")}
    assert written.errors == []


def test_written_files_records_a_failed_write_and_no_digest() -> None:
    class FullDisk(io.BytesIO):
        def write(self, data) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    written = WrittenFiles()
    with pytest.raises(OSError, match="No space"):
        with written.hashing("__0_0.distcp", nullcontext(FullDisk())) as stream:
            stream.write(b"data")
    assert written.files == {}
    assert [error.errno for error in written.errors] == [errno.ENOSPC]


@pytest.mark.parametrize("store_url", [None, "s3://bucket/ckpt/run"])
def test_both_locations_implement_the_whole_protocol(tmp_path: Path, store_url) -> None:
    location = open_location(tmp_path, store_url=store_url, hmac_key="k", keep_last_k=1, keep_every_m=0)
    wanted = {name for name in vars(CheckpointLocation) if not name.startswith("_")} | {"root", "mirror"}
    assert {name for name in wanted if not hasattr(location, name)} == set()
    assert all(callable(getattr(location, name)) for name in wanted - {"root", "mirror"})


def test_open_location_picks_the_store_only_with_a_url(tmp_path: Path) -> None:
    folder = open_location(tmp_path, store_url=None, hmac_key="k", keep_last_k=1, keep_every_m=0)
    in_store = open_location(tmp_path, store_url="s3://bucket/ckpt/run/", hmac_key="k", keep_last_k=1, keep_every_m=0)
    assert isinstance(folder, RunFolder) and isinstance(in_store, ObjectStore)
    assert in_store.where(7) == "s3://bucket/ckpt/run/step_000007" and in_store.folder(7) is None
    with pytest.raises(ValueError, match="keep_last_k"):
        open_location(tmp_path, store_url=None, hmac_key="k", keep_last_k=0, keep_every_m=0)


def test_a_run_folder_stages_commits_retains_and_chooses(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path, hmac_key="key", keep_last_k=1, keep_every_m=0)
    for step in (3, 4):
        staging = pickle.loads(pickle.dumps(folder.stage(step)))  # broadcast from rank 0 to every rank
        assert isinstance(staging, Staging) and Path(staging.target).parent == store.checkpoints_dir(tmp_path)
        written = WrittenFiles()
        name = "__0_0.distcp"
        with written.hashing(name, open(Path(staging.target) / name, "wb")) as stream:
            stream.write(f"weights {step}".encode())
        assert not folder.has_committed() or step == 4
        folder.commit(staging, {**RECORD, "step": step}, written.files)
    folder.close()  # waits for retention's background delete of step 3
    assert folder.has_committed() and folder.latest_name() == "step_000004"
    assert [info.name for info in store.list_checkpoints(tmp_path)] == ["step_000004"]
    assert folder.folder(4) == store.checkpoints_dir(tmp_path) / "step_000004" == Path(folder.where(4))
    choice = folder.choose(RUN_ID)
    assert (choice.chosen, choice.problems, choice.none_verified) == (folder.where(4), [], False)
    with pytest.raises(FileExistsError, match="already committed"):
        folder.stage(4)


def test_a_failed_save_leaves_nothing_in_the_run_folder(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path, hmac_key="key", keep_last_k=1, keep_every_m=0)
    staging = folder.stage(5)
    (Path(staging.target) / "__0_0.distcp").write_bytes(b"half")
    folder.abandon(staging)
    folder.close()
    assert not Path(staging.target).exists() and folder.latest_name() is None and not folder.has_committed()
