"""Tests of ops/lineage.py and the LineageResource: the seven fields every result carries."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from ops import lineage
from ops.publish.hashing import digest_json
from resources import LineageResource

FIELDS = ("git_commit", "git_dirty", "container_digest", "env_digest", "manifest_version", "config_hash",
          "code_version")
HEX = re.compile(r"[0-9a-f]+")


def test_lineage_has_the_seven_contract_fields_typed() -> None:
    record = lineage.collect(manifest_version="m1", config={"a": 1}, code_version="c1")
    assert tuple(field.name for field in fields(record)) == FIELDS
    metadata = record.as_metadata()
    assert tuple(metadata) == FIELDS
    assert isinstance(metadata["git_dirty"], bool)
    assert all(isinstance(metadata[name], str) for name in FIELDS if name != "git_dirty")
    assert (record.manifest_version, record.code_version) == ("m1", "c1")
    assert record.git_commit == "unknown" or re.fullmatch(r"[0-9a-f]{40}", record.git_commit)
    assert HEX.fullmatch(record.env_digest) and len(record.env_digest) == 64
    assert record.config_hash == digest_json({"a": 1})


def test_tags_are_strings_with_lowercase_booleans() -> None:
    tags = lineage.Lineage(git_commit="abc", git_dirty=True, container_digest="none", env_digest="e",
                           manifest_version="m", config_hash="h", code_version="c").as_tags()
    assert tags["git_dirty"] == "true" and all(isinstance(value, str) for value in tags.values())


def test_container_digest_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert lineage.container_digest() == "none"
    monkeypatch.setenv(lineage.CONTAINER_DIGEST_ENV, "  ")
    assert lineage.container_digest() == "none"
    monkeypatch.setenv(lineage.CONTAINER_DIGEST_ENV, "sha256:feedface")
    assert lineage.container_digest() == "sha256:feedface"
    assert lineage.collect(manifest_version="m", config={}, code_version="c").container_digest == "sha256:feedface"


def test_lineage_resource_pins_the_container_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(lineage.CONTAINER_DIGEST_ENV, "sha256:from-env")
    assert LineageResource().collect(manifest_version="m", config={}, code_version="c").container_digest == (
        "sha256:from-env")
    pinned = LineageResource(container_digest="sha256:pinned").collect(manifest_version="m", config={},
                                                                       code_version="c")
    assert pinned.container_digest == "sha256:pinned"
    assert pinned.manifest_version == "m"


def test_git_state_outside_a_checkout_is_unknown_and_dirty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Stop git from finding a repository above tmp_path.
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert lineage.git_state(tmp_path) == ("unknown", True)


def test_git_state_without_git_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert lineage.git_state() == ("unknown", True)


def test_config_hash_follows_the_config() -> None:
    def config_hash(config: object) -> str:
        return lineage.collect(manifest_version="m", config=config, code_version="c").config_hash

    assert config_hash({"a": 1, "b": 2}) == config_hash({"b": 2, "a": 1})
    assert config_hash({"a": 1}) != config_hash({"a": 2})
    from ops.curation.validation import ValidationConfig

    assert config_hash(ValidationConfig()) != config_hash(ValidationConfig(min_side=16))


def test_source_digest_is_stable_and_follows_the_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    digest = lineage.source_digest("ops.media.scan", "ops.publish.hashing")
    assert re.fullmatch(r"[0-9a-f]{16}", digest)
    assert lineage.source_digest("ops.publish.hashing", "ops.media.scan") == digest
    assert lineage.source_digest("ops.media.scan") != digest

    (tmp_path / "pkg").mkdir()
    module = tmp_path / "pkg" / "mod.py"
    module.write_text("X = 1\n")
    monkeypatch.setattr(lineage, "REPO_ROOT", tmp_path)
    before = lineage.source_digest("pkg.mod")
    module.write_text("X = 2\n")
    assert lineage.source_digest("pkg.mod") != before
    with pytest.raises(lineage.CodeModuleError, match="pkg.gone has no source file"):
        lineage.source_digest("pkg.gone")
