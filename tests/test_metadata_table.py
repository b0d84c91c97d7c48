"""Metadata tables as a manifest source (ops.media.metadata_table, ops.curation.manifest): join, row checks, version."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.csv
import pyarrow.parquet as pq
import pytest
from helpers import write_clip

from cli.main import main
from ops.curation import manifest as manifest_ops
from ops.media import scan
from ops.curation import validation
from ops.publish.hashing import sha256_file
from ops.publish.storage import publish_dir
from ops.media.metadata_table import FileOverLimit, MetadataTableError, MetadataTableSpec, join, load_table, read_bytes
from ops.media.sidecar import MAX_CAPTION_BYTES

CLIPS = ("videos/000.mp4", "videos/001.mp4", "videos/002.mp4")
COLUMNS = {"key": "key", "caption": "caption", "license": "license", "consent": "consent"}
SPLITS = ("train", "val", "test")


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("table_media") / "media"
    for index, uri in enumerate(CLIPS):
        write_clip(root / uri, num_frames=20, seed=index)
    return root


@pytest.fixture
def media(clips: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(clips, tmp_path / "media"))


def _rows(keys=("000", "001", "002"), **overrides) -> dict[str, list]:
    rows = {"key": list(keys), "caption": [f"clip {key}" for key in keys],
            "license": ["CC-BY-4.0"] * len(keys), "consent": ["granted"] * len(keys)}
    rows.update(overrides)
    return rows


def _write(path: Path, rows: dict[str, list]) -> Path:
    table = pa.table(rows)
    if path.suffix == ".csv":
        pyarrow.csv.write_csv(table, path)
    else:
        pq.write_table(table, path)
    return path


def _build(media: Path, location: Path | str, **spec) -> manifest_ops.Manifest:
    spec = {"columns": COLUMNS, "key_template": "videos/{key}.mp4", **spec}
    config = manifest_ops.ManifestConfig(table=MetadataTableSpec(location=str(location), **spec))
    return manifest_ops.build_manifest(media, config)


def _by_uri(manifest: manifest_ops.Manifest) -> dict[str, dict]:
    return {row["uri"]: row for row in manifest.table.to_pylist()}


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_a_table_describes_every_object_and_they_pass_validation(media: Path, tmp_path: Path, suffix: str) -> None:
    table = _write(tmp_path / f"meta{suffix}", _rows())
    built = _build(media, table)
    rows = _by_uri(built)
    assert sorted(rows) == list(CLIPS)
    assert rows["videos/001.mp4"]["caption"] == "clip 001"
    assert rows["videos/001.mp4"]["metadata_row"] == 2  # 1-based data row: the CSV header is no row
    assert rows["videos/001.mp4"]["license_source"] == "table" and rows["videos/001.mp4"]["consent_source"] == "table"
    assert json.loads(rows["videos/002.mp4"]["provenance"])["table"] == {
        "location": str(table), "sha256": sha256_file(table), "row": 3}
    result = validation.validate(built, validation.ValidationConfig(max_quarantine_fraction=1.0))
    assert result.rejected.empty, result.rejected.to_dict("records")


def test_without_a_sidecar_or_row_an_object_is_missing_its_row(media: Path, tmp_path: Path) -> None:
    rows = _by_uri(_build(media, _write(tmp_path / "meta.parquet", _rows(keys=("000", "001")))))
    assert rows["videos/002.mp4"]["sidecar_error"] == "missing_metadata_row"
    no_table = _by_uri(manifest_ops.build_manifest(media, manifest_ops.ManifestConfig()))
    assert no_table["videos/002.mp4"]["sidecar_error"] == "missing_sidecar"


def test_bad_rows_become_quarantine_reasons_naming_their_row(media: Path, tmp_path: Path) -> None:
    keys = ["videos/000", "videos/001", "videos/001", "videos/002", "videos/009", "../../x", ""]
    rows = _rows(keys=keys)
    rows["license"][3] = None  # a null value is fine here: validation judges the missing license
    table = _write(tmp_path / "meta2.parquet", {**rows, "sha": [None, None, None, "abc", None, None, None]})
    found = _by_uri(_build(media, table, columns={**COLUMNS, "sha256": "sha"}, key_template="{key}.mp4"))
    assert found["videos/000.mp4"]["sidecar_error"] is None
    assert found["videos/001.mp4"]["sidecar_error"] == "duplicate_metadata_row"
    assert "rows [2, 3]" in found["videos/001.mp4"]["sidecar_error_detail"]
    assert found["videos/002.mp4"]["sidecar_error"] == "malformed_metadata_row"
    assert "row 4 " in found["videos/002.mp4"]["sidecar_error_detail"]
    assert "64 hex" in found["videos/002.mp4"]["sidecar_error_detail"]
    assert found["meta2.parquet#row=5"]["sidecar_error"] == "missing_object"
    assert "row 5 names 'videos/009.mp4'" in found["meta2.parquet#row=5"]["sidecar_error_detail"]
    assert found["meta2.parquet#row=5"]["metadata_row"] == 5
    assert found["meta2.parquet#row=6"]["sidecar_error"] == "path_escape"
    assert "row 6" in found["meta2.parquet#row=6"]["sidecar_error_detail"]
    assert found["meta2.parquet#row=7"]["sidecar_error"] == "malformed_metadata_row"
    assert "row 7" in found["meta2.parquet#row=7"]["sidecar_error_detail"]


def test_the_reasons_reach_quarantine(media: Path, tmp_path: Path) -> None:
    table = _write(tmp_path / "meta.parquet", _rows(keys=("000", "000", "009")))
    result = validation.validate(_build(media, table), validation.ValidationConfig(max_quarantine_fraction=1.0))
    reasons = dict(zip(result.rejected["uri"], result.rejected["reason"]))
    assert reasons == {"videos/000.mp4": "duplicate_metadata_row", "videos/001.mp4": "missing_metadata_row",
                       "videos/002.mp4": "missing_metadata_row", "meta.parquet#row=3": "missing_object"}


def test_non_utf8_caption_in_csv_makes_only_its_row_malformed(media: Path, tmp_path: Path) -> None:
    path = tmp_path / "meta.csv"
    path.write_bytes(b"key,caption,license,consent\n000,fine,CC-BY-4.0,granted\n"
                     b"001,caf\xe9,CC-BY-4.0,granted\n002,NA,CC-BY-4.0,granted\n")
    rows = _by_uri(_build(media, path))
    assert rows["videos/000.mp4"]["sidecar_error"] is None
    assert rows["videos/001.mp4"]["sidecar_error"] == "malformed_metadata_row"
    assert "row 2" in rows["videos/001.mp4"]["sidecar_error_detail"]
    assert "not UTF-8" in rows["videos/001.mp4"]["sidecar_error_detail"]
    assert rows["videos/002.mp4"]["caption"] == "NA"  # only an empty cell is null


def test_wrong_types_and_unknown_splits_are_malformed_rows(tmp_path: Path) -> None:
    path = tmp_path / "meta.parquet"
    pq.write_table(pa.table({"key": ["a.mp4", "b.mp4", "c.mp4"], "caption": [1, None, 3],
                             "split": ["train", "holdout", None]}), path)
    table = load_table(MetadataTableSpec(location=str(path), columns={"key": "key", "caption": "caption",
                                                                      "split": "split"}), SPLITS)
    assert set(table.value_problems) == {0, 1, 2}
    assert "caption (column 'caption') holds a int64 value" in table.value_problems[0]
    assert "'holdout' is not one of" in table.value_problems[1]
    joined = join(table, {"a.mp4", "b.mp4", "c.mp4"})
    assert {uri: problem[0] for uri, problem in joined.object_problems.items()} == dict.fromkeys(
        ["a.mp4", "b.mp4", "c.mp4"], "malformed_metadata_row")
    assert joined.object_problems["b.mp4"][2] == 2
    int_keys = tmp_path / "int_keys.parquet"
    pq.write_table(pa.table({"key": [1, 2]}), int_keys)
    table = load_table(MetadataTableSpec(location=str(int_keys), columns={"key": "key"}), SPLITS)
    assert [problem[0] for problem in table.key_problems.values()] == ["malformed_metadata_row"] * 2


def test_absolute_and_escaping_keys_are_path_escapes(tmp_path: Path) -> None:
    path = _write(tmp_path / "meta.csv", {"key": ["/etc/passwd", "../x.mp4", "a/../b.mp4", "a/./c.mp4"]})
    table = load_table(MetadataTableSpec(location=str(path), columns={"key": "key"}), SPLITS)
    assert {index: problem[0] for index, problem in table.key_problems.items()} == {0: "path_escape", 1: "path_escape"}
    assert "row 2" in table.key_problems[1][1]
    assert table.uris[2:] == ["b.mp4", "a/c.mp4"]


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_a_missing_mapped_column_is_a_clear_error_before_probing(media: Path, tmp_path: Path, suffix: str) -> None:
    table = _write(tmp_path / f"meta{suffix}", _rows())
    with pytest.raises(MetadataTableError, match=r"lacks the mapped column\(s\) \['lic'\].*its columns are"):
        _build(media, table, columns={**COLUMNS, "license": "lic"})


def test_an_unusable_table_is_a_clear_error(media: Path, tmp_path: Path) -> None:
    with pytest.raises(MetadataTableError, match="does not exist"):
        _build(media, tmp_path / "nothing.parquet")
    (tmp_path / "meta.json").write_text("{}")
    with pytest.raises(MetadataTableError, match="not Parquet"):
        _build(media, tmp_path / "meta.json")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(MetadataTableError, match="not readable Parquet"):
        _build(media, tmp_path / "broken.parquet")


def test_the_cli_exits_2_naming_the_missing_column(media: Path, tmp_path: Path, capsys) -> None:
    table = _write(tmp_path / "meta.csv", _rows())
    code = main(["manifest", "build", str(media), "--out", str(tmp_path / "out"), "--table", str(table),
                 "--map", "key=videoID", "--key-template", "videos/{key}.mp4"])
    assert code == 2
    assert "videoID" in capsys.readouterr().err
    code = main(["manifest", "build", str(media), "--out", str(tmp_path / "out"), "--table", str(table),
                 *[arg for name, column in COLUMNS.items() for arg in ("--map", f"{name}={column}")],
                 "--key-template", "videos/{key}.mp4"])
    assert code == 0
    assert "flagged" not in capsys.readouterr().out


def test_table_bytes_are_part_of_the_manifest_version(media: Path, tmp_path: Path) -> None:
    path = _write(tmp_path / "meta.csv", _rows())
    first = _build(media, path)
    assert _build(media, path).version == first.version
    path.write_bytes(path.read_bytes() + b"\n")  # one byte more, the same rows
    changed = _build(media, path)
    assert changed.version != first.version
    assert changed.config["metadata_table"]["sha256"] == sha256_file(path)


def test_sidecar_and_row_that_agree_pass_and_that_differ_conflict(media: Path, tmp_path: Path) -> None:
    (media / "videos/000.mp4.json").write_text(json.dumps({"caption": "clip 000", "license": "CC-BY-4.0"}))
    (media / "videos/001.mp4.json").write_text(json.dumps({"caption": "clip 001", "license": "MIT"}))
    (media / "videos/002.mp4.json").write_text(json.dumps({"caption": "only a sidecar", "license": "MIT",
                                                           "consent": "granted"}))
    rows = _by_uri(_build(media, _write(tmp_path / "meta.parquet", _rows(keys=("000", "001")))))
    assert rows["videos/000.mp4"]["sidecar_error"] is None
    assert rows["videos/000.mp4"]["license_source"] == "sidecar" and rows["videos/000.mp4"]["consent_source"] == "table"
    assert rows["videos/001.mp4"]["sidecar_error"] == "metadata_conflict"
    detail = rows["videos/001.mp4"]["sidecar_error_detail"]
    assert "['license']" in detail and "videos/001.mp4.json" in detail and "row 2 of meta.parquet" in detail
    assert rows["videos/002.mp4"]["sidecar_error"] is None and rows["videos/002.mp4"]["caption"] == "only a sidecar"


def test_a_table_inside_the_media_root_is_listed_not_quarantined(media: Path) -> None:
    table = _write(media / "meta.parquet", _rows())
    kinds = {item.uri: item.kind for item in scan.scan_media_root(media)}
    assert kinds["meta.parquet"] == scan.KIND_TABLE
    rows = _by_uri(_build(media, table))
    assert sorted(rows) == list(CLIPS) and not any(row["sidecar_error"] for row in rows.values())


def test_old_manifests_without_the_new_columns_still_read(demo_manifest, tmp_path: Path) -> None:
    legacy = demo_manifest.table.drop_columns(list(manifest_ops.LATER_COLUMNS))
    version = manifest_ops.manifest_version(legacy, config=demo_manifest.config, media_root=demo_manifest.media_root)
    folder = tmp_path / version
    with publish_dir(folder) as staging:  # as write_manifest published it before the new columns
        pq.write_table(legacy, staging / manifest_ops.MANIFEST_FILE)
        (staging / manifest_ops.INFO_FILE).write_text(json.dumps(
            {"version": version, "media_root": demo_manifest.media_root, "config": demo_manifest.config}))
    read = manifest_ops.read_manifest(folder)
    assert read.version == version and read.table.schema == manifest_ops.MANIFEST_SCHEMA
    assert read.table.column("metadata_row").null_count == read.table.num_rows


def test_a_table_in_the_object_store(media: Path, tmp_path: Path, s3) -> None:
    from ops.publish import objstore

    local = _write(tmp_path / "meta.parquet", _rows())
    url = s3.url("tables") + "/meta.parquet"
    objstore.write_object(url, local.read_bytes())
    built = _build(media, url)
    assert built.config["metadata_table"]["sha256"] == sha256_file(local)
    assert not any(row["sidecar_error"] for row in built.table.to_pylist())


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_the_demo_generator_emits_one_table_that_ingests_like_its_sidecars(fmt: str, tmp_path: Path) -> None:
    """The same demo media described by sidecars and by one table (plus its dataset card): the same
    assets are accepted and every edge case keeps its reason; sidecars without a media object become
    table rows without one."""
    from tools.demo_media import generate_demo_media

    results = {}
    for mode in ("sidecars", fmt):
        report = generate_demo_media(tmp_path / mode, seed=0, num_good=4, metadata=mode)
        config = manifest_ops.ManifestConfig(table=report.table_spec()) if mode != "sidecars" else \
            manifest_ops.ManifestConfig()
        built = manifest_ops.build_manifest(tmp_path / mode, config)
        results[mode] = (built, validation.validate(built, validation.ValidationConfig(
            max_quarantine_fraction=1.0)), report)
    (_, by_sidecar, _), (table_manifest, by_table, report) = results["sidecars"], results[fmt]
    assert not list((tmp_path / fmt).rglob("*.json.json")) and report.metadata_table.name == f"metadata.{fmt}"
    assert (tmp_path / fmt / "dataset_card.yaml").exists()
    assert set(by_table.accepted.column("asset_id").to_pylist()) == set(by_sidecar.accepted.column("asset_id").to_pylist())
    sidecar_reasons = dict(zip(by_sidecar.rejected["uri"], by_sidecar.rejected["reason"]))
    table_reasons = dict(zip(by_table.rejected["uri"], by_table.rejected["reason"]))
    renamed = {"edge_cases/no_sidecar.mp4": "missing_metadata_row"}
    for uri, reason in sidecar_reasons.items():
        if uri.endswith(".json"):  # an orphan sidecar: now a row of the table, named by its row number
            row = report.table_rows[uri]
            assert table_reasons[f"metadata.{fmt}#row={row}"] == reason, uri
        else:
            assert table_reasons[uri] == renamed.get(uri, reason), uri
    rows = table_manifest.table.to_pylist()
    assert {row["consent_source"] for row in rows if row["metadata_row"] is not None and row["asset_id"]} == {"table"}
    by_card = {row["uri"] for row in rows if row["consent_source"] == "card"}
    assert by_card and all(row["metadata_row"] is None for row in rows if row["uri"] in by_card), \
        "the card states consent only for what no row describes"
    assert table_manifest.version != by_sidecar.manifest_version


def test_excel_csv_with_a_byte_order_mark_and_multi_line_captions_reads_whole(tmp_path: Path) -> None:
    """Excel's "CSV UTF-8" starts with a byte-order mark; captions with line breaks are quoted. A table
    big enough for Arrow's chunked reader (4 MB here) must read every row."""
    rows = "".join(f'clips/{number}.mp4,"line one\nline two {number}"\n' for number in range(60_000))
    path = tmp_path / "excel.csv"
    path.write_bytes(b"\xef\xbb\xbfkey,caption\n" + rows.encode())
    table = load_table(MetadataTableSpec(location=str(path), columns={"key": "key", "caption": "caption"}),
                       ("train", "val", "test"))
    assert table.num_rows == 60_000 and not table.value_problems and not table.key_problems
    assert table.values["caption"][59_999] == "line one\nline two 59999"


def test_parquet_written_from_pandas_category_columns_is_text(tmp_path: Path) -> None:
    import pandas as pd

    path = tmp_path / "categories.parquet"
    pd.DataFrame({"key": ["a.mp4", "b.mp4", "a2.mp4"], "license": ["MIT", "MIT", "CC0-1.0"]}).astype(
        "category").to_parquet(path)
    table = load_table(MetadataTableSpec(location=str(path), columns={"key": "key", "license": "license"}),
                       ("train",))
    assert table.uris == ["a.mp4", "b.mp4", "a2.mp4"] and table.values["license"] == ["MIT", "MIT", "CC0-1.0"]
    assert not table.value_problems and not table.key_problems


# ---- Issue 32, item 5: one caption or one column never stops a table ----

TABLE_COLUMNS = {"key": "key", "caption": "caption", "license": "license"}


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
@pytest.mark.parametrize("caption_bytes", [MAX_CAPTION_BYTES + 1, 4 << 20])  # 4 MB: over Arrow's 1 MiB CSV block
def test_an_overlong_caption_makes_only_its_row_malformed(tmp_path: Path, suffix: str, caption_bytes: int) -> None:
    rows = _rows(caption=["short", "x" * caption_bytes, "also short\nover two lines"])
    table = load_table(MetadataTableSpec(location=str(_write(tmp_path / f"meta{suffix}", rows)),
                                         columns=TABLE_COLUMNS), SPLITS)
    assert table.num_rows == 3
    assert sorted(table.value_problems) == [1]
    assert f"is {caption_bytes} bytes" in table.value_problems[1]
    assert table.values["caption"] == ["short", None, "also short\nover two lines"]


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_a_second_column_of_one_name_is_refused_as_ambiguous(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"meta{suffix}"
    doubled = pa.table([pa.array(["000"]), pa.array(["CC-BY-4.0"]), pa.array(["MIT"])],
                       names=["key", "license", "license"])
    if suffix == ".csv":
        path.write_text("key,license,license\n000,CC-BY-4.0,MIT\n")
    else:
        pq.write_table(doubled, path)
    with pytest.raises(MetadataTableError, match=r"more than one column named \['license'\]: ambiguous"):
        load_table(MetadataTableSpec(location=str(path), columns={"key": "key", "license": "license"}), SPLITS)


def test_a_table_card_over_its_bound_is_refused_from_its_size(media: Path, tmp_path: Path) -> None:
    card = tmp_path / "card.yaml"
    with open(card, "wb") as handle:  # 300 MB, sparse: read whole, it would cost seconds and 300 MB
        handle.truncate(300 << 20)
    with pytest.raises(FileOverLimit, match="at most 65536"):
        read_bytes(str(card), "dataset card", max_bytes=64 * 1024)
    manifest = _build(media, _write(tmp_path / "meta.csv", _rows()), card=str(card), columns=TABLE_COLUMNS)
    assert {row["sidecar_error"] for row in manifest.table.to_pylist()} == {"invalid_dataset_card"}


def test_a_fifo_named_as_a_table_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "meta.csv"
    os.mkfifo(fifo)
    refused: list[Exception] = []

    def load() -> None:
        try:
            load_table(MetadataTableSpec(location=str(fifo), columns={"key": "key"}), SPLITS)
        except MetadataTableError as error:
            refused.append(error)

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(timeout=30)
    if reader.is_alive():  # blocked opening the FIFO: a writer that connects and closes releases it
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=10)
        pytest.fail("reading a FIFO named as a table blocked, waiting for a writer")
    assert len(refused) == 1 and "not a regular file" in str(refused[0])
