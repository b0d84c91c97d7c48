"""A stage launch: what a training stage hands the trainer, recorded as the run's launch.json.

The asset that runs a stage (assets/training.py) fills a ``StageLaunch``; ``overrides()`` is
the one place the trainer's "a.b=c" list is made; the launcher (resources/launcher.py) starts
torchrun from it; ``write`` records it, and the restore drill reads the original run's back
with ``StageLaunch.read`` to replay it on the same data. Torch-free, like trainer/launch/config_sections.py:
the Dagster process imports it.

    launch = StageLaunch(stage="pretrain", config_path="/repo/configs/demo.yaml", data=ref, steps=20,
                         world_size=2, user_overrides=("optim.lr=1e-3",))
    launch.overrides()   # data, steps, stage defaults, parents, the user's, the run folder: each key once
    launch.write(run_dir / "launch.json", redactor=Redactor.for_config(resolved))
    StageLaunch.read(run_dir / "launch.json")   # LaunchRecordError, naming the file, if it does not hold one

launch.json holds the fields below, the overrides they make, and the redacted resolved config.
A file written before this module (no ``format`` key) is read through ``_from_v1``.
"""

from __future__ import annotations

import dataclasses
import json
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ops.clips.shard_ref import ShardIndexRef
from ops.publish.durable import write_file_atomic
from trainer.launch.redact import Redactor

FORMAT = 2
"""launch.json format; files without the key are the first one (``_from_v1``)."""
# What a replay sets itself: the run folder, its length, and every run-control (stage.*) field.
REPLAY_DROPS = ("train.run_dir=", "train.steps=", "stage.")
# Keys a first-format file's override list holds that the fields now render (``_from_v1``).
_V1_RENDERED = {"data.source", "data.shard_index", "data.manifest_version", "train.steps", "train.run_dir",
                "stage.stage", "stage.init_from", "stage.init_from_run_id", "stage.resume_from", "stage.resume_run_id",
                "stage.dagster_run_id", "stage.retry_of"}


class LaunchRecordError(ValueError):
    """A launch.json that is missing, not JSON, or does not hold a stage launch; names the file."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointRef:
    """A committed checkpoint of another run, and the run id its signed record must name."""

    path: str
    run_id: str

    def __post_init__(self) -> None:
        if not self.path or not self.run_id:
            raise ValueError(f"a checkpoint reference needs a path and a run id, got {self.path!r}, {self.run_id!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class StageLaunch:
    stage: str
    """Lifecycle stage (stage.stage): step_profile, pretrain, finetune or restore_drill."""
    config_path: str
    """Experiment YAML, absolute."""
    data: ShardIndexRef
    """The shard index the run reads (data.shard_index, data.manifest_version)."""
    steps: int
    """train.steps (a user override of it still wins)."""
    world_size: int
    """Ranks torchrun starts."""
    buckets: tuple[tuple[int, int, int], ...] = ()
    """data.buckets, [frames, height, width] each: the index's clip shapes when it has several."""
    defaults: tuple[str, ...] = ()
    """The stage's own "a.b=c" overrides, e.g. step_profile's train.profile=true."""
    init_from: CheckpointRef | None = None
    """Parent checkpoint whose weights start the run (finetune)."""
    resume_from: CheckpointRef | None = None
    """Checkpoint of another run to resume in full (a restore drill's continuation)."""
    user_overrides: tuple[str, ...] = ()
    """Run config overrides, then secrets as ${env:NAME}: applied last, so the user wins."""
    run_dir: str = ""
    """The run folder; empty until the stage names it from the resolved config."""
    dagster_run_id: str = ""
    retry_of: str = ""
    """MLflow run id of the earlier attempt this one retries; empty for a first attempt."""
    config: Mapping[str, Any] | None = None
    """The resolved config, redacted (trainer/launch/redact.py): recorded, never fed back to the trainer."""

    def __post_init__(self) -> None:
        if not self.stage or not self.config_path:
            raise ValueError("a stage launch needs a stage and a config path")
        if type(self.steps) is not int or self.steps < 1 or type(self.world_size) is not int or self.world_size < 1:
            raise ValueError(f"steps and world_size must be ints >= 1, got {self.steps!r}, {self.world_size!r}")
        for override in (*self.defaults, *self.user_overrides):
            if not isinstance(override, str) or "=" not in override:
                raise ValueError(f"an override looks like 'section.field=value', got {override!r}")
        for shape in self.buckets:
            if len(shape) != 3 or any(type(size) is not int for size in shape):
                raise ValueError(f"each bucket is [frames, height, width] of ints, got {shape!r}")
        for name in ("stage", "config_path", "run_dir", "dagster_run_id", "retry_of"):
            value = getattr(self, name)
            # These reach command lines, job scripts and log lines: a line end in one would start a line of its own.
            if not isinstance(value, str) or any(unicodedata.category(char) in ("Cc", "Zl", "Zp") for char in value):
                raise ValueError(f"StageLaunch.{name} must be text without control characters or line ends, "
                                 f"got {ascii(value)[:80]}")

    @property
    def run_id(self) -> str:
        return Path(self.run_dir).name

    def named(self, *, run_dir: str | Path, dagster_run_id: str, retry_of: str | None) -> StageLaunch:
        """This launch in its run folder, as one Dagster run's attempt."""
        return dataclasses.replace(self, run_dir=str(run_dir), dagster_run_id=dagster_run_id, retry_of=retry_of or "")

    def overrides(self) -> list[str]:
        """The trainer's overrides, each key once. trainer.launch.config applies them in order, later wins,
        so each keeps its last value at its last place: the config is the one the full list makes."""
        data = ["data.source=shards", f"data.shard_index={self.data.path}",
                f"data.manifest_version={self.data.manifest_version}"]
        if self.buckets:
            data.append(f"data.buckets={json.dumps([list(shape) for shape in self.buckets])}")
        head = [*data, f"train.steps={self.steps}", "stage.checkpoint=true", f"stage.stage={self.stage}"]
        return last_wins([*head, *self.defaults, *self._parents(), *self.user_overrides, *self._run()])

    def _parents(self) -> list[str]:
        parents = []
        if self.init_from:
            parents += [f"stage.init_from={self.init_from.path}", f"stage.init_from_run_id={self.init_from.run_id}"]
        if self.resume_from:
            parents += [f"stage.resume_from={self.resume_from.path}",
                        f"stage.resume_run_id={self.resume_from.run_id}"]
        return parents

    def _run(self) -> list[str]:
        """The attempt's own fields, once named; not part of the run folder's identity."""
        run = [f"train.run_dir={self.run_dir}"] if self.run_dir else []
        run += [f"stage.dagster_run_id={self.dagster_run_id}"] if self.dagster_run_id else []
        return run + ([f"stage.retry_of={self.retry_of}"] if self.retry_of else [])

    def replay_overrides(self) -> tuple[str, ...]:
        """The defaults and user overrides that shape the model, data and optimizer, for a replay of
        this run (the restore drill); its run folder, length and stage.* fields are the replay's own."""
        return tuple(override for override in (*self.defaults, *self.user_overrides)
                     if not override.startswith(REPLAY_DROPS))

    # -----------------------------------------------------------------------------------------
    # launch.json

    def record(self) -> dict[str, Any]:
        """The launch.json content, before redaction: the fields, and what they make for readers."""
        train = (self.config or {}).get("train", {})
        return {
            "format": FORMAT, "stage": self.stage, "config_path": self.config_path, "steps": self.steps,
            "world_size": self.world_size, "run_dir": self.run_dir, "run_id": self.run_id,
            "dagster_run_id": self.dagster_run_id, "retry_of": self.retry_of or None,
            "shard_index": self.data.as_dict(), "manifest_version": self.data.manifest_version,
            "shard_index_version": self.data.version, "buckets": [list(shape) for shape in self.buckets],
            "defaults": list(self.defaults), "user_overrides": list(self.user_overrides),
            "init_from": dataclasses.asdict(self.init_from) if self.init_from else None,
            "resume_from": dataclasses.asdict(self.resume_from) if self.resume_from else None,
            "overrides": self.overrides(), "precision": train.get("precision"), "seed": train.get("seed"),
            "config": self.config}

    def write(self, path: str | Path, *, redactor: Redactor) -> None:
        """``path`` (the run's launch.json), and this attempt's copy at launch/<dagster run id>.json
        beside it, each written atomically; every secret the redactor knows is scrubbed first."""
        assert self.run_dir and self.dagster_run_id, "only a named launch is recorded"
        path = Path(path)
        text = json.dumps(redactor.value(self.record()), indent=2, sort_keys=True, default=str).encode()
        write_file_atomic(path.parent / "launch" / f"{self.dagster_run_id}.json", text)
        write_file_atomic(path, text)

    @classmethod
    def read(cls, path: str | Path) -> StageLaunch:
        """The launch recorded at ``path``; LaunchRecordError naming the file and what is wrong."""
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise LaunchRecordError(f"{path}: no launch record (the stage writes it before launch)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise LaunchRecordError(f"{path}: not a JSON launch record ({error})") from None
        try:
            if not isinstance(raw, dict):
                raise ValueError(f"a launch record is a JSON object, got {type(raw).__name__}")
            launch = cls._from_record(raw) if "format" in raw else cls._from_v1(raw)
        except (KeyError, TypeError, ValueError) as error:
            message = f"missing field {error}" if isinstance(error, KeyError) else str(error)
            raise LaunchRecordError(f"{path}: {message}") from None
        return launch

    @classmethod
    def _from_record(cls, raw: Mapping[str, Any]) -> StageLaunch:
        if raw["format"] != FORMAT:
            raise ValueError(f"launch record format {raw['format']!r}; this code reads {FORMAT} and the first")
        launch = cls(
            stage=_typed(raw, "stage", str), config_path=_typed(raw, "config_path", str),
            data=ShardIndexRef.of(_typed(raw, "shard_index", dict)), steps=_typed(raw, "steps", int),
            world_size=_typed(raw, "world_size", int),
            buckets=tuple(tuple(shape) for shape in _typed(raw, "buckets", list)),
            defaults=_strings(raw, "defaults"), user_overrides=_strings(raw, "user_overrides"),
            init_from=_checkpoint(raw, "init_from"), resume_from=_checkpoint(raw, "resume_from"),
            run_dir=_typed(raw, "run_dir", str), dagster_run_id=_typed(raw, "dagster_run_id", str),
            retry_of=_typed(raw, "retry_of", (str, type(None))) or "", config=_typed(raw, "config", (dict, type(None))))
        derived = launch.record()
        edited = [key for key in ("run_id", "manifest_version", "shard_index_version", "overrides")
                  if raw.get(key) != derived[key]]
        if edited:
            raise ValueError(f"{', '.join(edited)} disagree with the fields that make them: the file was edited")
        return launch

    @classmethod
    def _from_v1(cls, raw: Mapping[str, Any]) -> StageLaunch:
        """A launch.json written before this module: a flat override list and the resolved config.
        The data and parents come from the config; the overrides the fields render are left out."""
        config, overrides = _typed(raw, "config", dict), _strings(raw, "overrides")
        stage = config["stage"]
        parents = {name: CheckpointRef(path=stage[name], run_id=stage[f"{name}_run_id"]) if stage[name] else None
                   for name in ("init_from", "resume_from")}
        return cls(
            stage=_typed(raw, "stage", str), config_path=_typed(raw, "config_path", str),
            data=ShardIndexRef(path=config["data"]["shard_index"], version=_typed(raw, "shard_index_version", str),
                               manifest_version=_typed(raw, "manifest_version", str)),
            steps=config["train"]["steps"], world_size=_typed(raw, "world_size", int), **parents,
            user_overrides=tuple(o for o in overrides if o.partition("=")[0].strip() not in _V1_RENDERED),
            run_dir=_typed(raw, "run_dir", str), dagster_run_id=_typed(raw, "dagster_run_id", str),
            retry_of=_typed(raw, "retry_of", (str, type(None))) or "", config=config)


def last_wins(overrides: Iterable[str]) -> list[str]:
    """Each key once, with its last value, at its last place (trainer.launch.config strips keys too)."""
    overrides = list(overrides)
    last = {override.partition("=")[0].strip(): index for index, override in enumerate(overrides)}
    return [override for index, override in enumerate(overrides) if last[override.partition("=")[0].strip()] == index]


def _typed(raw: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = raw[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise TypeError(f"field {key!r} must be {names}, got {type(value).__name__} {value!r}")
    return value


def _strings(raw: Mapping[str, Any], key: str) -> tuple[str, ...]:
    values: Sequence[Any] = _typed(raw, key, list)
    if not all(isinstance(value, str) for value in values):
        raise TypeError(f"field {key!r} must be a list of strings, got {values!r}")
    return tuple(values)


def _checkpoint(raw: Mapping[str, Any], key: str) -> CheckpointRef | None:
    value = _typed(raw, key, (dict, type(None)))
    return CheckpointRef(path=_typed(value, "path", str), run_id=_typed(value, "run_id", str)) if value else None


def record_placement(launch: StageLaunch, *, job_id: str, hosts: Sequence[str], per_node: int, partition: str,
                     excluded: Sequence[str]) -> None:
    """Add where a job of this launch ran to its launch.json (``placement``, one entry per job, in
    order): the scheduler picks the nodes after the launch is recorded, so the launcher adds them once
    the job runs. Rewritten atomically; the fields the launch was read from are left as they are."""
    path = Path(launch.run_dir) / "launch.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise LaunchRecordError(f"{path}: cannot add the job's placement: {error}") from None
    entry = {"job_id": job_id, "nodes": list(hosts), "node_count": len(hosts), "ranks_per_node": per_node,
             "world_size": len(hosts) * per_node, "partition": partition or None, "excluded": list(excluded)}
    record["placement"] = [*record.get("placement", []), entry]
    write_file_atomic(path, json.dumps(record, indent=2, sort_keys=True, default=str).encode())
