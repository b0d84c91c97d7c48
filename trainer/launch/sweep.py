"""Sweeps: many trials of one stage as one declared experiment (docs/training.md, "Sweeps").

A sweep is a YAML file (``configs/sweeps/*.yaml``)::

    name: demo_lr                  # the study's name: [a-z0-9_]{1,40}
    base: configs/demo.yaml        # the stage config every trial starts from
    stage: pretrain                # the stage each trial launches (the same launch, launcher and checks)
    steps: 8
    world_size: 1                  # ranks per trial (0: the launcher's default)
    overrides: [train.eval_every=2]
    space:                         # config keys -> a grid, a list, or a distribution
      optim.lr: {loguniform: [1.0e-4, 1.0e-2]}
      optim.warmup_steps: {grid: [0, 2]}
      data.batch_size: {choice: [8, 16]}
    objective: {metric: val/loss, step: 8, direction: minimize}
    budget: 6                      # trials at most
    concurrency: 2                 # trials at once, at most
    sampler: {kind: random, seed: 0}              # grid | random | tpe
    pruner: {kind: median, warmup_steps: 2, min_trials: 2}   # none | median | successive_halving

``load_sweep`` reads and checks it before anything runs, refusing (trainer.launch.refusal.Refusal,
category config, the key named) an unknown config key, an empty space, a budget larger than the grid,
a concurrency of 0, or an objective or pruning rule that needs an evaluation the config never runs.
``plan_trials`` gives the trials' parameters without running them: the grid in order, or the
sampler's draws from its seed (Optuna's own samplers in a throwaway in-memory study, so the same
file gives the same trials; TPE's later trials depend on earlier results, which the plan says).
The search and the pruning are Optuna's (a well-kept library: trainer code never reimplements a
sampler or a pruner); its RDB storage is ``study_storage_url``: SQLite under the Trainyard home, or
``TRAINYARD_OPTUNA_STORAGE`` (PostgreSQL in the team deployment).

Torch-free, Dagster-free: the command line and the Dagster process read it before any launch.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ops.publish.hashing import digest_json
from trainer.launch.refusal import Refusal, nearest

KINDS = ("grid", "choice", "uniform", "loguniform", "int")
SAMPLERS = ("grid", "random", "tpe")
PRUNERS = ("none", "median", "successive_halving")
DIRECTIONS = ("minimize", "maximize")
METRICS = ("val/loss",)
"""What a trial can be judged by: the evaluation's loss on the held-out split (trainer/heldout.py)."""
STORAGE_VARIABLE = "TRAINYARD_OPTUNA_STORAGE"
_NAME = re.compile(r"^[a-z0-9_]{1,40}$")
_KEYS = {"name", "base", "stage", "steps", "world_size", "overrides", "space", "objective", "budget", "concurrency",
         "sampler", "pruner"}
STAGES = ("pretrain",)
"""Stages a sweep may launch (finetune sweeps need a parent per trial: not yet)."""
TPE_STARTUP = 10
"""TPE's random start-up trials (Optuna's default): the plan knows those; later ones follow results."""


def _refuse(found: str, fix: str, key: str) -> Refusal:
    return Refusal("config", found, fix, key=f"sweep.{key}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Dimension:
    """One searched config key: a grid or list of values, or a distribution."""

    key: str
    kind: str
    values: tuple = ()
    low: float | None = None
    high: float | None = None

    def distribution(self):
        """Optuna's distribution for this dimension."""
        import optuna

        if self.kind in ("grid", "choice"):
            return optuna.distributions.CategoricalDistribution(list(self.values))
        if self.kind == "int":
            return optuna.distributions.IntDistribution(int(self.low), int(self.high))
        return optuna.distributions.FloatDistribution(self.low, self.high, log=self.kind == "loguniform")

    def describe(self) -> str:
        return f"{self.kind} {list(self.values)}" if self.values else f"{self.kind} [{self.low}, {self.high}]"


@dataclass(frozen=True, kw_only=True, slots=True)
class Objective:
    metric: str = "val/loss"
    step: int = 0
    direction: str = "minimize"


@dataclass(frozen=True, kw_only=True, slots=True)
class PrunerSpec:
    kind: str = "none"
    warmup_steps: int = 0
    """Steps before the rule may stop a trial (median: Optuna's n_warmup_steps)."""
    min_trials: int = 2
    """Median: trials that must have reported before it prunes (Optuna's n_startup_trials)."""
    reduction_factor: int = 2
    """Successive halving: keep 1 / reduction_factor of the trials at each rung."""
    min_resource: int = 0
    """Successive halving: the first rung's step (0: the first evaluation step)."""

    def build(self, eval_every: int):
        """Optuna's pruner for this rule, or None."""
        import optuna

        if self.kind == "median":
            return optuna.pruners.MedianPruner(n_startup_trials=self.min_trials, n_warmup_steps=self.warmup_steps)
        if self.kind == "successive_halving":
            return optuna.pruners.SuccessiveHalvingPruner(min_resource=self.min_resource or eval_every,
                                                          reduction_factor=self.reduction_factor)
        return None


@dataclass(frozen=True, kw_only=True, slots=True)
class Trial:
    number: int
    trial_id: str
    params: dict[str, Any]
    planned: bool = True
    """False for a TPE trial past its random start-up: its parameters will follow the results."""

    def overrides(self) -> list[str]:
        return [f"{key}={_literal(value)}" for key, value in self.params.items()]


@dataclass(frozen=True, kw_only=True, slots=True)
class SweepSpec:
    name: str
    path: str
    base: str
    stage: str
    steps: int
    world_size: int
    overrides: tuple[str, ...]
    space: tuple[Dimension, ...]
    objective: Objective
    budget: int
    concurrency: int
    sampler: str
    seed: int
    pruner: PrunerSpec = field(default_factory=PrunerSpec)

    @property
    def grid_size(self) -> int | None:
        """The number of points when every dimension is a grid or a list; None with a distribution."""
        if any(dim.kind not in ("grid", "choice") for dim in self.space):
            return None
        return math.prod(len(dim.values) for dim in self.space)

    @property
    def digest(self) -> str:
        """What the study was declared as: a sweep file of the same name that says otherwise is refused."""
        return digest_json({name: _plain(getattr(self, name)) for name in sorted(_KEYS - {"name"})})[:20]

    def trial_id(self, number: int) -> str:
        return f"{self.name}-{number:03d}"


def _plain(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return {name: _plain(getattr(value, name)) for name in value.__dataclass_fields__}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _literal(value: Any) -> str:
    """A value as an override's text (trainer.launch.config parses it against the field's type)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _int(raw: Any, key: str, *, minimum: int) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < minimum:
        raise _refuse(f"{key}={raw!r} is not an integer >= {minimum}", f"set {key} to an integer >= {minimum}", key)
    return raw


def _dimension(key: str, raw: Any) -> Dimension:
    where = f"space.{key}"
    if not isinstance(raw, dict) or len(raw) != 1:
        raise _refuse(f"{where} is {raw!r}, not one of {{{' | '.join(KINDS)}: ...}}",
                      "write it as e.g. {grid: [1e-4, 1e-3]} or {loguniform: [1e-4, 1e-2]}", where)
    (kind, values), = raw.items()
    if kind not in KINDS:
        close = nearest(str(kind), KINDS)
        raise _refuse(f"{where}: {kind!r} is not a kind of dimension", (f"did you mean {close}? " if close else "")
                      + f"use one of {', '.join(KINDS)}", where)
    if not isinstance(values, list) or not values:
        raise _refuse(f"{where}: {kind} needs a non-empty list, got {values!r}", "give the values (or [low, high])",
                      where)
    if kind in ("grid", "choice"):
        if len(set(map(repr, values))) != len(values):
            raise _refuse(f"{where}: {kind} lists a value twice ({values})", "list each value once", where)
        return Dimension(key=key, kind=kind, values=tuple(values))
    if len(values) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values) \
            or not values[0] < values[1] or (kind == "loguniform" and values[0] <= 0):
        raise _refuse(f"{where}: {kind} needs [low, high] with low < high{' and low > 0' if kind == 'loguniform' else ''},"
                      f" got {values}", "give two numbers, the smaller first", where)
    if kind == "int" and not all(isinstance(v, int) for v in values):
        raise _refuse(f"{where}: int needs integer bounds, got {values}", "give two integers", where)
    return Dimension(key=key, kind=kind, low=values[0], high=values[1])


def load_sweep(path: str | Path, *, repo_root: str | Path | None = None) -> SweepSpec:
    """Read and check a sweep file (module docstring); a Refusal naming the key when it is wrong."""
    from ops.curation.dataset_card import load_strict_yaml

    path = Path(path)
    try:
        raw = load_strict_yaml(path.read_text()) or {}
    except (OSError, UnicodeDecodeError) as error:
        raise Refusal("config", f"sweep file {path} cannot be read ({getattr(error, 'strerror', None) or error})",
                      "give the path of a sweep YAML (configs/sweeps/ holds examples)", key=str(path)) from None
    except (ValueError, __import__("yaml").YAMLError) as error:
        raise Refusal("config", f"sweep file {path} is not usable YAML: {error}",
                      "correct the YAML at the line the message names", key=str(path)) from None
    if not isinstance(raw, dict):
        raise Refusal("config", f"sweep file {path} holds a {type(raw).__name__}, not a mapping",
                      "write it as a mapping of name, base, space, objective, budget, ...", key=str(path))
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        close = nearest(unknown[0], _KEYS)
        raise _refuse(f"unknown sweep keys {unknown}", (f"rename {unknown[0]} to {close}" if close else
                                                         f"use only {', '.join(sorted(_KEYS))}"), unknown[0])
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _refuse(f"name={name!r} is not a sweep name", "name it with 1 to 40 of a-z, 0-9 and _", "name")
    stage = raw.get("stage", "pretrain")
    if stage not in STAGES:
        raise _refuse(f"stage={stage!r} cannot be swept", f"use one of {', '.join(STAGES)}", "stage")
    base = raw.get("base")
    root = Path(repo_root) if repo_root is not None else Path(__file__).resolve().parents[2]
    if not isinstance(base, str) or not ((root / base).is_file() or Path(base).is_file()):
        raise _refuse(f"base={base!r} is not an experiment config file", "name a YAML such as configs/demo.yaml", "base")
    steps = _int(raw.get("steps"), "steps", minimum=1)
    overrides = raw.get("overrides", [])
    if not isinstance(overrides, list) or not all(isinstance(item, str) for item in overrides):
        raise _refuse(f"overrides={overrides!r} is not a list of 'a.b=c' strings", "list them as strings", "overrides")
    space = raw.get("space")
    if not isinstance(space, dict) or not space:
        raise _refuse("the search space is empty", "give at least one config key under space:, e.g. "
                      "{optim.lr: {loguniform: [1.0e-4, 1.0e-2]}}", "space")
    dimensions = tuple(_dimension(str(key), value) for key, value in space.items())
    objective_raw = raw.get("objective")
    if not isinstance(objective_raw, dict) or set(objective_raw) - {"metric", "step", "direction"}:
        raise _refuse(f"objective={objective_raw!r} is not {{metric, step, direction}}",
                      "write objective: {metric: val/loss, step: N, direction: minimize}", "objective")
    objective = Objective(metric=objective_raw.get("metric", "val/loss"),
                          step=_int(objective_raw.get("step", steps), "objective.step", minimum=1),
                          direction=objective_raw.get("direction", "minimize"))
    if objective.metric not in METRICS:
        raise _refuse(f"objective.metric={objective.metric!r} is not measured", f"use one of {', '.join(METRICS)}",
                      "objective.metric")
    if objective.direction not in DIRECTIONS:
        raise _refuse(f"objective.direction={objective.direction!r}", "use minimize (a loss) or maximize",
                      "objective.direction")
    if objective.step > steps:
        raise _refuse(f"objective.step {objective.step} is after the trials' last step {steps}",
                      f"set objective.step to at most {steps}", "objective.step")
    sampler_raw = raw.get("sampler", {"kind": "grid" if all(d.kind in ("grid", "choice") for d in dimensions)
                                      else "random"})
    if not isinstance(sampler_raw, dict) or sampler_raw.get("kind") not in SAMPLERS or set(sampler_raw) - {"kind", "seed"}:
        raise _refuse(f"sampler={sampler_raw!r}", f"write sampler: {{kind: {' | '.join(SAMPLERS)}, seed: 0}}", "sampler")
    pruner_raw = raw.get("pruner", {"kind": "none"})
    if not isinstance(pruner_raw, dict) or pruner_raw.get("kind") not in PRUNERS:
        raise _refuse(f"pruner={pruner_raw!r}", f"write pruner: {{kind: {' | '.join(PRUNERS)}, ...}}", "pruner")
    try:
        pruner = PrunerSpec(**pruner_raw)
    except TypeError as error:
        raise _refuse(f"pruner: {error}", "use kind, warmup_steps, min_trials, reduction_factor, min_resource",
                      "pruner") from None
    spec = SweepSpec(name=name, path=str(path), base=base, stage=stage, steps=steps,
                     world_size=_int(raw.get("world_size", 1), "world_size", minimum=0), overrides=tuple(overrides),
                     space=dimensions, objective=objective, budget=_int(raw.get("budget"), "budget", minimum=1),
                     concurrency=_int(raw.get("concurrency"), "concurrency", minimum=1),
                     sampler=sampler_raw["kind"], seed=_int(sampler_raw.get("seed", 0), "sampler.seed", minimum=0),
                     pruner=pruner)
    if spec.sampler == "grid" and spec.grid_size is None:
        raise _refuse("sampler grid with a distribution in the space", "use random or tpe, or list the values", "sampler")
    if spec.grid_size is not None and spec.budget > spec.grid_size:
        raise _refuse(f"budget {spec.budget} is larger than the grid's {spec.grid_size} points",
                      f"set budget to at most {spec.grid_size}, or widen the space", "budget")
    _check_against_config(spec, root)
    return spec


CHECKED_POINTS = 64
"""A grid up to this size has every point's config checked before anything runs; a larger one (or a
distribution) its corners: every dimension's first and last value."""


def _points(spec: SweepSpec) -> list[tuple]:
    def ends(dim: Dimension) -> tuple:
        return (dim.values[0], dim.values[-1]) if dim.values else (dim.low, dim.high)

    if spec.grid_size is not None and spec.grid_size <= CHECKED_POINTS:
        return list(itertools.product(*(dim.values for dim in spec.space)))
    return list(dict.fromkeys(itertools.product(*(ends(dim) for dim in spec.space))))[:CHECKED_POINTS]


def _check_against_config(spec: SweepSpec, root: Path) -> None:
    """Every searched key must be a config key whose values the config accepts, and the objective and the
    pruner need the evaluations the config runs: checked on the config of every point of a small grid (else
    of the space's corners, ``CHECKED_POINTS``)."""
    from trainer.launch.config import load_config

    base = root / spec.base if (root / spec.base).is_file() else Path(spec.base)
    for point in _points(spec):
        overrides = [*spec.overrides, f"train.steps={spec.steps}",
                     *(f"{dim.key}={_literal(value)}" for dim, value in zip(spec.space, point, strict=True))]
        try:
            resolved = load_config(base, overrides)
        except Refusal as refusal:
            searched = next((dim.key for dim in spec.space if dim.key == refusal.key
                             or refusal.key.startswith(dim.key + ".")), None)
            key = f"space.{searched}" if searched else "overrides"
            raise _refuse(f"{refusal.found}", refusal.fix, key) from None
    eval_every = resolved.train.eval_every
    if not eval_every:
        raise _refuse(f"objective {spec.objective.metric} at step {spec.objective.step} needs an evaluation, but "
                      "train.eval_every is 0 in the trials' config", "set train.eval_every under overrides (e.g. "
                      f"train.eval_every={spec.objective.step})", "objective.step")
    if spec.objective.step % eval_every:
        raise _refuse(f"objective.step {spec.objective.step} is not an evaluation step (train.eval_every={eval_every})",
                      f"set objective.step to a multiple of {eval_every}", "objective.step")
    if spec.pruner.kind != "none" and eval_every >= spec.objective.step:
        raise _refuse(f"pruner {spec.pruner.kind} compares evaluations before step {spec.objective.step}, but the "
                      f"first one is at step {eval_every}", f"set train.eval_every below {spec.objective.step}, or "
                      "pruner: {kind: none}", "pruner")


def plan_trials(spec: SweepSpec) -> list[Trial]:
    """The budget's trials, their parameters as the sampler gives them from its seed (module docstring)."""
    if spec.sampler == "grid":
        points = itertools.islice(itertools.product(*(dim.values for dim in spec.space)), spec.budget)
        return [Trial(number=number, trial_id=spec.trial_id(number),
                      params={dim.key: value for dim, value in zip(spec.space, point, strict=True)})
                for number, point in enumerate(points)]
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = (optuna.samplers.RandomSampler(seed=spec.seed) if spec.sampler == "random"
               else optuna.samplers.TPESampler(seed=spec.seed, n_startup_trials=TPE_STARTUP))
    study = optuna.create_study(sampler=sampler, direction=spec.objective.direction)
    distributions = {dim.key: dim.distribution() for dim in spec.space}
    trials = []
    for number in range(spec.budget):
        trial = study.ask(distributions)
        trials.append(Trial(number=number, trial_id=spec.trial_id(number), params=dict(trial.params),
                            planned=spec.sampler == "random" or number < TPE_STARTUP))
    return trials


def study_storage_url(home: str | Path | None = None) -> str:
    """Optuna's RDB storage: TRAINYARD_OPTUNA_STORAGE; else, in the team deployment (TRAINYARD_ENV=cluster...),
    its PostgreSQL's ``optuna`` database (deploy/cluster/up.sh creates it) with Dagster's credentials
    (TRAINYARD_PG_*); else SQLite under the Trainyard home."""
    if os.environ.get(STORAGE_VARIABLE):
        return os.environ[STORAGE_VARIABLE]
    env = os.environ
    if env.get("TRAINYARD_ENV", "").startswith("cluster") and env.get("TRAINYARD_PG_HOST"):
        from urllib.parse import quote

        return (f"postgresql+psycopg2://{quote(env.get('TRAINYARD_PG_USER', ''), safe='')}:"
                f"{quote(env.get('TRAINYARD_PG_PASSWORD', ''), safe='')}@{env['TRAINYARD_PG_HOST']}:"
                f"{env.get('TRAINYARD_PG_PORT', '5432')}/{env.get('TRAINYARD_OPTUNA_DB', 'optuna')}")
    from ops.publish import paths

    folder = Path(home) if home is not None else paths.trainyard_home()
    (folder / "optuna").mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder / 'optuna' / 'studies.db'}"


def open_study(spec: SweepSpec, storage_url: str | None = None):
    """The sweep's Optuna study in the RDB storage, created on first use. The same name with the same
    declaration resumes it; the same name declared otherwise is refused (a Refusal naming both). An
    unreachable storage is a Refusal naming its URL without the password."""
    import optuna

    from trainer.launch.redact import redact_uri

    url = storage_url or study_storage_url()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        storage = optuna.storages.RDBStorage(url, engine_kwargs={"pool_pre_ping": True})
        sampler = (optuna.samplers.GridSampler({d.key: list(d.values) for d in spec.space}, seed=spec.seed)
                   if spec.sampler == "grid" else optuna.samplers.RandomSampler(seed=spec.seed)
                   if spec.sampler == "random" else optuna.samplers.TPESampler(seed=spec.seed,
                                                                                n_startup_trials=TPE_STARTUP))
        study = optuna.create_study(study_name=spec.name, storage=storage, sampler=sampler,
                                    direction=spec.objective.direction, load_if_exists=True)
    except Exception as error:  # noqa: BLE001 (SQLAlchemy's many errors: the URL is what the user can act on)
        raise Refusal("credentials" if "password" in str(error).lower() or "auth" in str(error).lower() else "cluster",
                      f"the sweep storage {redact_uri(url)} cannot be reached: "
                      f"{redact_uri(f'{type(error).__name__}: {error}')[:300]}",
                      f"check {STORAGE_VARIABLE} (the team deployment's PostgreSQL) or unset it for the embedded "
                      "SQLite store", key=STORAGE_VARIABLE) from None
    declared = study.user_attrs.get("spec_digest")
    if declared is None:
        study.set_user_attr("spec_digest", spec.digest)
        study.set_user_attr("sweep_file", spec.path)
    elif declared != spec.digest:
        raise _refuse(f"a sweep named {spec.name!r} was declared otherwise before (study {spec.name} in "
                      f"{redact_uri(url)}, from {study.user_attrs.get('sweep_file')})",
                      "give this sweep another name: a study keeps the declaration it started with", "name")
    return study


# ---------------------------------------------------------------------------------------------
# The study while the sweep runs (pipelines/sweeps.py drives it; assets/sweeps.py runs one trial)

def parse_trial_id(trial_id: str) -> tuple[str, int]:
    """(sweep name, trial number) of a trial id such as ``demo_lr-003``; ValueError otherwise."""
    name, _, number = trial_id.rpartition("-")
    if not _NAME.match(name) or not number.isdigit():
        raise ValueError(f"{trial_id!r} is not a sweep trial id (<sweep name>-<number>, e.g. demo_lr-003)")
    return name, int(number)


def register(spec: SweepSpec, storage_url: str | None = None):
    """Open (or resume) the sweep's study and enqueue its planned trials in order, so that the study's trial
    number n is the plan's trial n, with its parameters (user attribute ``params``). Idempotent: a resumed
    sweep enqueues only the trials the study does not hold yet. Refused: a TPE sweep whose budget goes past
    the sampler's random start-up (those trials' parameters would follow results: not built yet)."""
    if spec.sampler == "tpe" and spec.budget > TPE_STARTUP:
        raise _refuse(f"a TPE sweep of {spec.budget} trials: trials past the first {TPE_STARTUP} are drawn from "
                      "results, which `sweep run` does not do yet", f"set budget to at most {TPE_STARTUP}, or use the "
                      "random sampler", "budget")
    study = open_study(spec, storage_url)
    held = len(study.get_trials(deepcopy=False))
    for trial in plan_trials(spec)[held:]:
        study.enqueue_trial(trial.params, user_attrs={"trial_id": trial.trial_id, "params": trial.params},
                            skip_if_exists=False)
    return study


def trial_states(study) -> dict[int, str]:
    """Trial number -> Optuna state name (WAITING, RUNNING, COMPLETE, PRUNED, FAIL)."""
    return {trial.number: trial.state.name for trial in study.get_trials(deepcopy=False)}


def trial_overrides(spec: SweepSpec, trial: Trial, *, storage_url: str, mlflow_parent: str = "") -> list[str]:
    """The trial's stage overrides: the sweep's, its parameters, and the sweep section that makes it report to
    the study and stop by the rule (trainer/launch/pruning.py). The storage goes into the config only when it is the
    embedded SQLite file: a server's URL (and its password) stays in TRAINYARD_OPTUNA_STORAGE."""
    pruner = spec.pruner
    return [*spec.overrides, *trial.overrides(), f"sweep.study={spec.name}", f"sweep.trial={trial.number}",
            f"sweep.pruner={pruner.kind}", f"sweep.warmup_steps={pruner.warmup_steps}",
            f"sweep.min_trials={pruner.min_trials}", f"sweep.reduction_factor={pruner.reduction_factor}",
            f"sweep.min_resource={pruner.min_resource}", f"sweep.sweep_id={spec.digest}", f"sweep.seed={spec.seed}",
            *([f"sweep.storage={storage_url}"] if storage_url.startswith("sqlite:") else []),
            *([f"sweep.mlflow_parent={mlflow_parent}"] if mlflow_parent else [])]


def objective_value(spec: SweepSpec, final: dict) -> float | None:
    """The objective from a run's final.json: its validation loss at the objective's step, or None."""
    for item in final.get("evaluations") or []:
        if item.get("step") == spec.objective.step and item.get("status") == "ok":
            return float(item["loss"])
    return None


def sweep_report(spec: SweepSpec, study) -> dict[str, Any]:
    """Every trial's state, parameters, objective and evaluation curve (validation loss against consumed
    samples, not wall-clock), the pruned ones with their recorded decision, and the best completed trial with
    its config diff against the base (the searched keys' values in the base config and in the trial)."""
    from trainer.launch.config import load_config

    rows = []
    for trial in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number):
        attrs = trial.user_attrs
        result = attrs.get("result") or {}
        rows.append({"trial_id": attrs.get("trial_id", spec.trial_id(trial.number)), "number": trial.number,
                     "state": "diverged" if attrs.get("failure_class") == "diverged" else trial.state.name.lower(),
                     "params": attrs.get("params", dict(trial.params)),
                     "objective": trial.value if trial.state.name == "COMPLETE" else None,
                     "curve": result.get("curve", []), "pruning": attrs.get("pruning"),
                     "failure_class": attrs.get("failure_class"), "attempts": attrs.get("attempts", []),
                     "run_id": result.get("run_id"), "checkpoint": result.get("checkpoint"),
                     "mlflow_run_id": result.get("mlflow_run_id")})
    finished = [row for row in rows if row["objective"] is not None]
    best = (min if spec.objective.direction == "minimize" else max)(finished, key=lambda r: r["objective"]) \
        if finished else None
    report: dict[str, Any] = {
        "report": "sweep_report", "sweep": spec.name, "sweep_id": spec.digest, "sweep_file": spec.path,
        "sampler": spec.sampler, "seed": spec.seed, "objective": _plain(spec.objective), "pruner": _plain(spec.pruner),
        "budget": spec.budget, "concurrency": spec.concurrency, "trials": rows,
        "counts": {state: sum(row["state"] == state for row in rows)
                   for state in ("complete", "pruned", "diverged", "fail", "running", "waiting")},
        "status": "ok" if best else "empty", "best": None}
    if best is None:
        report["empty_reason"] = "no trial has completed yet"
        return report
    root = Path(__file__).resolve().parents[2]
    base = load_config(root / spec.base if (root / spec.base).is_file() else spec.base, list(spec.overrides))
    diff = {key: {"base": _config_value(base, key), "trial": value} for key, value in best["params"].items()
            if _config_value(base, key) != value}
    report["best"] = {key: best[key] for key in ("trial_id", "number", "objective", "params", "run_id", "checkpoint",
                                                 "mlflow_run_id")} | {"config_diff": diff}
    return report


def _config_value(config: Any, key: str) -> Any:
    value = config
    for part in key.split("."):
        value = getattr(value, part)
    return value
