"""Dataset cards: the rights of many objects, stated once and attested.

A ``dataset_card.yaml`` in any folder of the media root covers that folder and everything below
it (the nearest card wins); one named by a metadata table's spec (ops.media.metadata_table) covers every
object that table describes, and wins over folder cards for those objects::

    license: CC-BY-4.0             # an SPDX expression (ops.curation.licenses)
    consent: granted
    attested_by: Jane Doe <jane@lab.example>
    attested_at: 2024-05-01        # ISO date
    description: footage shot by the lab's own crew   # optional
    source: https://lab.example/shoots/2024-05        # optional

``attested_by`` and ``attested_at`` are required, and a card states at least one of ``license``
and ``consent``. Any other key is an error: a typo such as ``lisence`` must not leave objects
silently unlicensed. A per-object value (sidecar or table row) overrides the card's. A card that
is malformed is not an exception: every row that relies on it is ``invalid_dataset_card``, with a
detail naming the card and the problem; rows that state their own values do not rely on it.
"""

from __future__ import annotations

import datetime
import hashlib
import posixpath
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass

import yaml

from ops.curation import licenses

CARD_FILE = "dataset_card.yaml"
INVALID_DATASET_CARD = "invalid_dataset_card"
REQUIRED_KEYS = ("attested_by", "attested_at")
DEFAULT_KEYS = ("license", "consent")
KNOWN_KEYS = frozenset({*REQUIRED_KEYS, *DEFAULT_KEYS, "description", "source"})
MAX_CARD_BYTES = 64 * 1024


MAX_YAML_DEPTH = 64
"""Deepest nesting of mappings and lists accepted: a card is flat, a config a few levels deep; PyYAML
composes nodes recursively, so a document nested 20,000 deep would end in RecursionError."""


class StrictYamlLoader(yaml.SafeLoader):
    """YAML without aliases (nested aliases expand to gigabytes: a "billion laughs"), without a key
    stated twice (``license: MIT`` then ``license: GPL-3.0-only``: the later would silently win),
    without keys that cannot be a mapping key (``? [a, b]``), and at most ``MAX_YAML_DEPTH`` deep.
    Every refusal is a ``yaml.YAMLError`` naming the place. Dataset cards and experiment configs
    (trainer.launch.config) are read with it."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.YAMLError(f"aliases are not allowed ({event.start_mark})")
        depth = getattr(self, "_depth", 0)
        if depth >= MAX_YAML_DEPTH:
            raise yaml.YAMLError(f"nested more than {MAX_YAML_DEPTH} levels deep ({self.peek_event().start_mark})")
        self._depth = depth + 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth = depth

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _value in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:
                raise yaml.YAMLError(f"a {type(key).__name__} cannot be a key ({key_node.start_mark})") from None
            if key in seen:
                raise yaml.YAMLError(f"key {key!r} is stated twice ({key_node.start_mark})")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_strict_yaml(text: str):
    """The document in ``text`` read with ``StrictYamlLoader``; yaml.YAMLError (or ValueError, for a
    date YAML itself cannot hold such as 2024-13-01) when it is refused."""
    return yaml.load(text, Loader=StrictYamlLoader)  # noqa: S506 (a SafeLoader subclass)


@dataclass(kw_only=True, slots=True, frozen=True)
class DatasetCard:
    path: str
    """Where the card is: relative to the media root for a folder card, else its path, URL or "inline"."""
    sha256: str
    license: str | None = None
    """The default license in SPDX's canonical spelling."""
    consent: str | None = None
    attested_by: str | None = None
    attested_at: str | None = None
    """ISO date."""
    error: str = ""
    """What is wrong with the card ("" when it is usable)."""

    def provenance(self) -> dict:
        return {"path": self.path, "sha256": self.sha256, "attested_by": self.attested_by,
                "attested_at": self.attested_at}


def _iso_date(value) -> str:
    if isinstance(value, datetime.datetime):
        return value.date().isoformat()
    if isinstance(value, datetime.date):
        return value.isoformat()
    if isinstance(value, str):
        return datetime.date.fromisoformat(value.strip()).isoformat()  # ValueError names the bad text
    raise ValueError(f"{value!r} is not an ISO date")


def _problems(payload) -> tuple[list[str], dict]:
    """(problems, the card's values) of a parsed card."""
    if not isinstance(payload, Mapping):
        return [f"top level is {type(payload).__name__}, not a mapping"], {}
    problems = []
    unknown = sorted(str(key) for key in payload if key not in KNOWN_KEYS)
    if unknown:
        problems.append(f"unknown key(s) {unknown}; known: {sorted(KNOWN_KEYS)}")
    values = {}
    for key in sorted(KNOWN_KEYS & set(payload)):
        value = payload[key]
        if key == "attested_at" and value is not None:
            try:
                values[key] = _iso_date(value)
            except ValueError as error:
                problems.append(f"attested_at is not an ISO date: {error}")
        elif value is not None and (not isinstance(value, str) or not value.strip()):
            # reprlib: a value built from YAML aliases expands to gigabytes under repr()
            problems.append(f"{key} must be non-empty text, got {type(value).__name__} {reprlib.repr(value)}")
        elif value is not None:
            values[key] = value.strip()
    missing = [key for key in REQUIRED_KEYS if payload.get(key) is None]
    if missing:
        problems.append(f"no attestation: {missing} required")
    if not any(key in payload for key in DEFAULT_KEYS):
        problems.append(f"states neither {' nor '.join(DEFAULT_KEYS)}")
    if "license" in values:
        try:
            values["license"] = licenses.normalize(values["license"])
        except ValueError as error:
            problems.append(f"license: {error}")
    return problems, values


def parse_card(data: bytes, path: str) -> DatasetCard:
    """The card in ``data``; a malformed one comes back with ``error`` set, never raised."""
    sha256 = hashlib.sha256(data).hexdigest()
    if len(data) > MAX_CARD_BYTES:
        return DatasetCard(path=path, sha256=sha256, error=too_large(len(data)))
    try:
        payload = load_strict_yaml(data.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError, ValueError) as error:  # ValueError: YAML's own dates (2024-13-01)
        return DatasetCard(path=path, sha256=sha256, error=f"not YAML: {type(error).__name__}: {error}")
    return _card(payload, path, sha256)


def too_large(size_bytes: int) -> str:
    """The error of a card of ``size_bytes`` (found from its size, before reading it)."""
    return f"{size_bytes} bytes or more: a dataset card is at most {MAX_CARD_BYTES} (a few lines of YAML)"


def card_from_mapping(payload: Mapping, path: str = "inline") -> DatasetCard:
    """A card given inline (a table spec's ``card``): its sha256 is that of its canonical JSON."""
    from ops.publish.hashing import canonical_json

    return _card(payload, path, hashlib.sha256(canonical_json(dict(payload)).encode()).hexdigest())


def _card(payload, path: str, sha256: str) -> DatasetCard:
    problems, values = _problems(payload)
    if problems:
        return DatasetCard(path=path, sha256=sha256, error="; ".join(problems))
    return DatasetCard(path=path, sha256=sha256, license=values.get("license"), consent=values.get("consent"),
                       attested_by=values["attested_by"], attested_at=values["attested_at"])


def card_folder(card_uri: str) -> str:
    """The folder a card covers, relative to the media root ("" for the root itself)."""
    return posixpath.dirname(card_uri)


def nearest_card(uri: str, cards: Mapping[str, DatasetCard]) -> DatasetCard | None:
    """The card of the nearest folder above ``uri`` (``cards``: folder -> card), or None."""
    folder = posixpath.dirname(uri)
    while True:
        if folder in cards:
            return cards[folder]
        if not folder:
            return None
        folder = posixpath.dirname(folder)
