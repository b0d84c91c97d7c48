"""Dataset cards (ops.curation.dataset_card): defaults stated once, per-object overrides, invalid cards quarantined."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import write_clip

from ops.curation import manifest as manifest_ops
from ops.curation import validation
from ops.curation.dataset_card import parse_card
from ops.publish.hashing import sha256_file
from ops.media.metadata_table import MetadataTableSpec
from trainer.launch.config import load_config

CARD = "license: CC-BY-4.0\nconsent: granted\nattested_by: Jane Doe\nattested_at: 2024-05-01\n"
CLIPS = ("a/one.mp4", "a/b/two.mp4", "c/three.mp4")


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("card_media") / "media"
    for index, uri in enumerate(CLIPS):
        write_clip(root / uri, num_frames=20, seed=10 + index)
    return root


@pytest.fixture
def media(clips: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(clips, tmp_path / "media"))


def _rows(media: Path, config: manifest_ops.ManifestConfig | None = None) -> dict[str, dict]:
    built = manifest_ops.build_manifest(media, config or manifest_ops.ManifestConfig())
    return {row["uri"]: row for row in built.table.to_pylist()}


def test_card_defaults_apply_and_a_sidecar_overrides(media: Path) -> None:
    (media / "dataset_card.yaml").write_text(CARD)
    (media / "a/one.mp4.json").write_text(json.dumps({"caption": "own terms", "license": "MIT"}))
    rows = _rows(media)
    two = rows["a/b/two.mp4"]
    assert (two["license"], two["license_source"], two["consent"], two["consent_source"]) == (
        "CC-BY-4.0", "card", "granted", "card")
    assert two["sidecar_error"] == "missing_sidecar"  # a card states rights, not a caption: still no sidecar
    one = rows["a/one.mp4"]
    assert (one["license"], one["license_source"], one["consent_source"]) == ("MIT", "sidecar", "card")
    assert one["sidecar_error"] is None
    card = json.loads(one["provenance"])["card"]
    assert card == {"path": "dataset_card.yaml", "sha256": sha256_file(media / "dataset_card.yaml"),
                    "attested_by": "Jane Doe", "attested_at": "2024-05-01"}


def test_the_nearest_card_wins(media: Path) -> None:
    (media / "dataset_card.yaml").write_text(CARD)
    (media / "a/b/dataset_card.yaml").write_text(CARD.replace("CC-BY-4.0", "CC0-1.0"))
    rows = _rows(media)
    assert rows["a/b/two.mp4"]["license"] == "CC0-1.0"
    assert rows["a/one.mp4"]["license"] == "CC-BY-4.0" and rows["c/three.mp4"]["license"] == "CC-BY-4.0"
    assert json.loads(rows["a/b/two.mp4"]["provenance"])["card"]["path"] == "a/b/dataset_card.yaml"


@pytest.mark.parametrize("text, problem", [
    (CARD.replace("CC-BY-4.0", "Creative Commons please"), "license"),
    (CARD.replace("attested_by: Jane Doe\n", ""), "no attestation"),
    (CARD.replace("license:", "lisence:"), "unknown key"),
    (CARD.replace("2024-05-01", "last tuesday"), "ISO date"),
    ("license: [unclosed", "not YAML"),
    (CARD + "description: " + "[" * 20_000 + "]" * 20_000 + "\n", "nested more than"),  # issue 32: no RecursionError
])
def test_an_invalid_card_quarantines_the_rows_that_rely_on_it(media: Path, text: str, problem: str) -> None:
    (media / "a/dataset_card.yaml").write_text(text)
    (media / "a/b/two.mp4.json").write_text(json.dumps({"caption": "x", "license": "MIT", "consent": "granted"}))
    (media / "a/one.mp4.json").write_text(json.dumps({"caption": "x", "license": "MIT"}))
    rows = _rows(media)
    one = rows["a/one.mp4"]  # relies on the card for consent
    assert one["sidecar_error"] == "invalid_dataset_card"
    assert "a/dataset_card.yaml" in one["sidecar_error_detail"] and problem in one["sidecar_error_detail"]
    assert rows["a/b/two.mp4"]["sidecar_error"] is None  # states its own license and consent
    result = validation.validate(manifest_ops.build_manifest(media, manifest_ops.ManifestConfig()),
                                 validation.ValidationConfig(max_quarantine_fraction=1.0))
    reasons = dict(zip(result.rejected["uri"], result.rejected["reason"]))
    assert reasons["a/one.mp4"] == "invalid_dataset_card"


def test_card_parsing_names_every_problem() -> None:
    card = parse_card(b"lisence: MIT\nattested_at: '2024-13-01'\n", "x/dataset_card.yaml")
    assert "unknown key(s) ['lisence']" in card.error and "attested_by" in card.error
    assert "attested_at is not an ISO date" in card.error and "neither license nor consent" in card.error
    assert "month must be in 1..12" in parse_card(CARD.replace("05", "13").encode(), "d.yaml").error
    good = parse_card(b"license: mit OR apache-2.0\nattested_by: me\nattested_at: '2024-05-01'\n", "c.yaml")
    assert good.error == "" and good.license == "MIT OR Apache-2.0" and good.consent is None


def test_a_card_in_the_table_spec_covers_the_rows_of_the_table(media: Path, tmp_path: Path) -> None:
    (media / "dataset_card.yaml").write_text(CARD)
    table = tmp_path / "meta.parquet"
    pq.write_table(pa.table({"key": ["a/one.mp4", "c/three.mp4"], "caption": ["one", "three"],
                             "consent": [None, "revoked"]}), table)
    spec = MetadataTableSpec(location=str(table), columns={"key": "key", "caption": "caption", "consent": "consent"},
                             card={"license": "MIT", "consent": "granted", "attested_by": "Vendor Ltd",
                                   "attested_at": "2023-01-31"})
    rows = _rows(media, manifest_ops.ManifestConfig(table=spec))
    one, three = rows["a/one.mp4"], rows["c/three.mp4"]
    assert (one["license"], one["license_source"], one["consent"], one["consent_source"]) == (
        "MIT", "card", "granted", "card")
    assert (three["consent"], three["consent_source"], three["metadata_row"]) == ("revoked", "table", 2)
    assert json.loads(one["provenance"])["card"]["attested_by"] == "Vendor Ltd"
    # Not described by the table: the folder card applies (and the table has no row for it).
    two = rows["a/b/two.mp4"]
    assert (two["license"], two["sidecar_error"]) == ("CC-BY-4.0", "missing_metadata_row")


def test_a_card_path_in_the_spec_that_is_missing_is_an_error(media: Path, tmp_path: Path) -> None:
    table = tmp_path / "meta.parquet"
    pq.write_table(pa.table({"key": ["a/one.mp4"]}), table)
    spec = MetadataTableSpec(location=str(table), columns={"key": "key"}, card=str(tmp_path / "nope.yaml"))
    with pytest.raises(ValueError, match="dataset card .*nope.yaml does not exist"):
        manifest_ops.build_manifest(media, manifest_ops.ManifestConfig(table=spec))


def test_the_card_bytes_reach_the_manifest_version(media: Path) -> None:
    (media / "dataset_card.yaml").write_text(CARD)
    first = manifest_ops.build_manifest(media, manifest_ops.ManifestConfig()).version
    (media / "dataset_card.yaml").write_text(CARD + "description: the same rights, described\n")
    assert manifest_ops.build_manifest(media, manifest_ops.ManifestConfig()).version != first


@pytest.mark.parametrize(("text", "problem"), [
    (b"license: MIT\nlicense: GPL-3.0-only\nconsent: granted\nattested_by: a\nattested_at: 2026-01-01\n",
     "stated twice"),
    (b"a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b]\n"
     b"license: *c\nattested_by: a\nattested_at: 2026-01-01\n", "aliases are not allowed"),
    (b"description: " + b"x" * 70_000 + b"\n", "at most"),
    # Issue 32, item 5: keys that cannot be keys, and nesting past Python's recursion limit.
    (b"? [a, b]\n: x\nlicense: MIT\nattested_by: a\nattested_at: 2026-01-01\n", "cannot be a key"),
    (b"? {a: 1}\n: x\nlicense: MIT\nattested_by: a\nattested_at: 2026-01-01\n", "cannot be a key"),
    (b"license: " + b"[" * 20_000 + b"]" * 20_000 + b"\n", "nested more than"),
    (b"license: " + b"{a: " * 12_000 + b"1" + b"}" * 12_000 + b"\n", "nested more than"),
])
def test_a_card_stating_a_key_twice_using_aliases_or_oversized_is_invalid_and_small(text: bytes, problem: str) -> None:
    card = parse_card(text, "dataset_card.yaml")
    assert problem in card.error and len(card.error) < 1_000, card.error[:200]


# ---- Issue 32, item 5: experiment configs are read with the cards' strict loader ----

ALIAS_BOMB = "a: &a [x, x, x, x]\nb: &b [*a, *a, *a, *a]\nc: &c [*b, *b, *b, *b]\ntrain: {steps: 2}\n"


@pytest.mark.parametrize(("text", "problem"), [
    (ALIAS_BOMB, "aliases are not allowed"),
    ("train: {steps: 2}\ntrain: {steps: 3}\n", "stated twice"),
    ("train: " + "[" * 20_000 + "]" * 20_000 + "\n", "nested more than"),
])
def test_an_experiment_config_with_aliases_a_doubled_key_or_deep_nesting_is_refused(tmp_path: Path, text: str,
                                                                                     problem: str) -> None:
    path = tmp_path / "experiment.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=problem):
        load_config(path)


def test_an_override_value_with_an_alias_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot parse"):
        load_config(None, ["preset=tiny_cpu", "train.preempt_signals=[&a SIGTERM, *a]"])
