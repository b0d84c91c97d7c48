"""Tests of media_change_sensor: a run when media change, silence otherwise."""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg
import pytest

from pipelines.sensors import media_change_sensor
from resources import StorageResource


@pytest.fixture
def storage(tmp_path: Path) -> StorageResource:
    media = tmp_path / "media"
    media.mkdir()
    (media / "clip.mp4").write_bytes(b"first")
    return StorageResource(media_root=str(media), data_root=str(tmp_path / "data"))


def _evaluate(storage: StorageResource, cursor: str | None):
    context = dg.build_sensor_context(cursor=cursor, resources={"storage": storage})
    return media_change_sensor(context), context.cursor


def test_first_evaluation_requests_a_run(storage: StorageResource) -> None:
    result, cursor = _evaluate(storage, None)
    assert isinstance(result, dg.RunRequest)
    assert cursor and result.run_key == f"media-{cursor}"
    assert result.tags["trainyard/media_fingerprint"] == cursor


def test_unchanged_media_are_skipped(storage: StorageResource) -> None:
    _, cursor = _evaluate(storage, None)
    result, same_cursor = _evaluate(storage, cursor)
    assert isinstance(result, dg.SkipReason) and "unchanged" in result.skip_message
    assert same_cursor == cursor


@pytest.mark.parametrize("change", ["add", "edit", "remove", "hidden"])
def test_changed_media_request_a_new_run(storage: StorageResource, change: str) -> None:
    _, cursor = _evaluate(storage, None)
    clip = storage.media / "clip.mp4"
    if change == "add":
        (storage.media / "sub").mkdir()
        (storage.media / "sub" / "new.mp4").write_bytes(b"new")
    elif change == "edit":
        clip.write_bytes(b"changed, and longer")
    elif change == "remove":
        clip.unlink()
    else:
        (storage.media / ".partial.mp4").write_bytes(b"being uploaded")
    result, new_cursor = _evaluate(storage, cursor)
    if change == "hidden":  # hidden names (uploads in progress) are not media
        assert isinstance(result, dg.SkipReason) and new_cursor == cursor
        return
    assert isinstance(result, dg.RunRequest)
    assert new_cursor != cursor and result.run_key == f"media-{new_cursor}"


def test_touched_file_requests_a_run(storage: StorageResource) -> None:
    _, cursor = _evaluate(storage, None)
    clip = storage.media / "clip.mp4"
    stat = clip.stat()
    os.utime(clip, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    result, _ = _evaluate(storage, cursor)
    assert isinstance(result, dg.RunRequest)


def test_missing_media_root_is_skipped(tmp_path: Path) -> None:
    result, cursor = _evaluate(StorageResource(media_root=str(tmp_path / "nowhere"), data_root=str(tmp_path)), None)
    assert isinstance(result, dg.SkipReason) and "does not exist" in result.skip_message
    assert cursor is None


def test_changed_media_wait_while_a_run_scans_them(storage: StorageResource) -> None:
    from pipelines.definitions import defs

    with dg.DagsterInstance.ephemeral() as instance:
        running = instance.create_run_for_job(defs.resolve_implicit_global_asset_job_def(), status=dg.DagsterRunStatus.STARTED,
                                              asset_selection=frozenset({dg.AssetKey("raw_media")}))
        context = dg.build_sensor_context(instance=instance, resources={"storage": storage})
        result = media_change_sensor(context)
        assert isinstance(result, dg.SkipReason) and running.run_id in result.skip_message
        assert context.cursor is None  # not consumed: the next tick compares again
        instance.report_run_failed(running)
        assert isinstance(media_change_sensor(dg.build_sensor_context(instance=instance, resources={"storage": storage})),
                          dg.RunRequest)
