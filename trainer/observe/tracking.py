"""MLflow tracking for one training-stage attempt (rank 0 only, through the Hook protocol).

- Parameters: the resolved config, flattened and redacted (trainer.launch.redact).
- Tags: the lineage fields (ops.lineage), parent checkpoint, world size, precision, stage,
  the Dagster run id, and ``retry_of`` (the MLflow run this attempt retries, if any).
- Metrics: every metric of every step, queued by the loop and written by a background thread
  in batches every ``flush_interval_s``, so a slow tracking store never stalls a step. The
  values are already reduced across ranks by the loop (mean loss and grad norm over ranks,
  max step time, summed throughput; see trainer/observe/metrics.py).
- Store: ``MLFLOW_TRACKING_URI``, else the embedded SQLite store under the Trainyard home
  (``ops.publish.paths.mlflow_tracking_uri``), wherever the trainer was started from. Artifacts (samples,
  divergence records) of experiments it creates in a SQLite store sit beside the store's file.
- Status: completed -> FINISHED, failed and diverged -> FAILED, canceled -> KILLED, with the
  exact Trainyard status in the ``trainyard.status`` tag (MLflow has no "diverged").
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ops.publish import paths
from trainer.launch.redact import Redactor, redact_uri

if TYPE_CHECKING:  # trainer.state imports torch.distributed.checkpoint (seconds): the launch's policy
    # imports this module only to reach the store after the ranks have gone (trainer/supervisor/elastic.py)
    from trainer.state import RunResult

log = logging.getLogger("trainer")
# A pruned trial is KILLED (stopped on purpose, not failed) and tagged trainyard.status=pruned with the rule.
MLFLOW_STATUS = {"completed": "FINISHED", "failed": "FAILED", "diverged": "FAILED", "canceled": "KILLED",
                 "pruned": "KILLED"}
_MAX_BATCH = 900  # MLflow's log_batch limit is 1000 entries


def flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """Nested dicts as dotted keys with string values (MLflow params are flat strings)."""
    if isinstance(value, Mapping):
        flat: dict[str, str] = {}
        for key, item in value.items():
            flat.update(flatten(item, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): str(value)}


def resolve_tracking_uri(uri: str) -> str:
    """``uri``, or when empty the embedded store under the Trainyard home (ops.publish.paths), never MLflow's
    own default (a ``mlflow.db`` or ``mlruns/`` in whatever folder the trainer was started from).
    A SQLite store's folder is created: SQLite creates the file, not its parents."""
    uri = uri or paths.mlflow_tracking_uri()
    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return uri


def recorded_tracking_uri(uri: str) -> str:
    """``uri`` as a record may hold it: its credentials (``http://user:password@host``, ``?token=``)
    as "***" (trainer.launch.redact.redact_uri). ``connect_uri`` gives the store back from it."""
    return redact_uri(uri)


def connect_uri(recorded: str, environ: Mapping[str, str] | None = None) -> str:
    """The URI to reach the store a record names: this process's MLFLOW_TRACKING_URI (which holds the
    credentials) when it is that store, else the recorded URI as it is."""
    import os

    environ = os.environ if environ is None else environ
    current = resolve_tracking_uri(environ.get("MLFLOW_TRACKING_URI", ""))
    return current if redact_uri(current) == recorded else recorded


def artifact_location(tracking_uri: str) -> str | None:
    """Where a new experiment's artifacts go: beside a SQLite store's file (under the Trainyard home for the
    embedded one). MLflow's own default for a SQLite store is ``./mlruns`` in whatever folder the process
    runs in (the repository, for the launched trainer); a tracking server decides for itself (None)."""
    if tracking_uri.startswith("sqlite:///"):
        return (Path(tracking_uri.removeprefix("sqlite:///")).parent / "artifacts").resolve().as_uri()
    return None


class MlflowHook:
    """Opens the run at construction, streams metrics, closes it with an honest status."""

    def __init__(self, *, tracking_uri: str, experiment: str, run_name: str, params: Mapping[str, Any],
                 tags: Mapping[str, str], redactor: Redactor, flush_interval_s: float = 2.0,
                 divergence_path: Path | None = None) -> None:
        from mlflow.tracking import MlflowClient

        self.divergence_path = divergence_path
        """run_dir/divergence.json, logged as an artifact when the run diverges."""
        self.record_path: Path | None = None
        """ranks/mlflow.json, the launch's pointer to this run (trainer/wiring.py); set by whoever writes it."""
        self.record: dict[str, Any] = {}
        self.startup: Callable[[], Mapping[str, Any]] | None = None
        """The run's start-up breakdown (trainer/observe/startup.py), logged as startup/* metrics at the end."""
        self.tracking_uri = resolve_tracking_uri(tracking_uri)
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.redactor = redactor
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = (found.experiment_id if found else
                         self.client.create_experiment(experiment, artifact_location=artifact_location(self.tracking_uri)))
        safe_tags = {key: self.redactor.text(str(value)) for key, value in tags.items()}
        self.run_id = self.client.create_run(experiment_id, run_name=run_name, tags=safe_tags).info.run_id
        from mlflow.entities import Param

        params = [Param(key[:250], self.redactor.text(value)[:6000])
                  for key, value in sorted(flatten(self.redactor.value(dict(params))).items())]
        for start in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[start:start + 100])
        self._queue: queue.Queue = queue.Queue()
        self._unsent: list = []
        self._stop = threading.Event()
        self._interval_s = flush_interval_s
        self._thread = threading.Thread(target=self._drain, name="mlflow-metrics", daemon=True)
        self._thread.start()

    def on_step_end(self, step: int, metrics: Mapping[str, float]) -> None:
        timestamp_ms = int(time.time() * 1000)
        self._queue.put([(name, float(value), timestamp_ms, step) for name, value in metrics.items()
                         if isinstance(value, (int, float)) and value == value])  # NaN is logged as skipped

    def on_evaluation(self, step: int, result: Mapping[str, Any]) -> None:
        """val/loss, val/loss_t<t> and val/loss_bucket_<shape> at the step; samples as artifacts
        (samples/step_N: the MP4s and the contact sheet)."""
        from trainer.heldout import metric_names

        timestamp_ms = int(time.time() * 1000)
        metrics = metric_names(result, prefix=result.get("split", "val"))
        if metrics:
            self._queue.put([(name, float(value), timestamp_ms, step) for name, value in metrics.items()])
        samples = result.get("samples")
        if samples and samples.get("dir") and Path(samples["dir"]).is_dir():
            try:
                self.client.log_artifacts(self.run_id, samples["dir"], artifact_path=f"samples/step_{step}")
            except Exception:  # the store may be down: the samples stay in the run folder, and the log says so
                log.exception("MLflow: samples of step %d not logged as artifacts (they are in %s)", step, samples["dir"])

    def _flush(self) -> None:
        from mlflow.entities import Metric

        pending = self._unsent
        self._unsent = []
        while True:
            try:
                pending.extend(self._queue.get_nowait())
            except queue.Empty:
                break
        for start in range(0, len(pending), _MAX_BATCH):
            metrics = [Metric(key, value, timestamp, step) for key, value, timestamp, step in pending[start:start + _MAX_BATCH]]
            try:
                self.client.log_batch(self.run_id, metrics=metrics)
            except Exception as error:
                if getattr(error, "error_code", None) == "INVALID_PARAMETER_VALUE":
                    # MLflow refuses the batch itself (a name or value it does not take): retrying
                    # it would stop every later metric of the run. Drop it, and say which.
                    log.error("MLflow refused %d metric(s) (%s): %s", len(metrics),
                              ", ".join(sorted({metric.key for metric in metrics}))[:300], error)
                    continue
                # Keep what was not written for the next flush; the store may come back.
                self._unsent = pending[start:] + self._unsent
                raise

    def _drain(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._flush()
            except Exception:
                log.exception("MLflow: metrics not written yet (%d pending); retrying", len(self._unsent))

    def on_train_end(self, result: RunResult) -> None:
        self._stop.set()
        self._thread.join()
        if self.startup is not None:
            from trainer.observe.startup import flat_metadata

            flat = flat_metadata(self.startup())
            timestamp_ms = int(time.time() * 1000)
            self._queue.put([(name, float(value), timestamp_ms, 0) for name, value in flat.items()
                             if isinstance(value, (int, float))])
            if isinstance(flat.get("startup/largest_phase"), str):
                self.client.set_tag(self.run_id, "trainyard.startup_largest_phase", flat["startup/largest_phase"])
        self._flush()
        self.client.set_tag(self.run_id, "trainyard.status", result.status)
        if result.failure_class:  # rank 0's view; the launch retags it with the run's class (trainer/supervisor/elastic.py)
            self.client.set_tag(self.run_id, "failure_class", result.failure_class)
        if result.status == "diverged":
            self.client.set_tag(self.run_id, "diverged", "true")
            if self.divergence_path is not None and self.divergence_path.is_file():
                self.client.log_artifact(self.run_id, str(self.divergence_path))
        self.client.set_tag(self.run_id, "trainyard.final_step", str(result.final_step))
        if result.error:
            self.client.set_tag(self.run_id, "trainyard.error", self.redactor.text(result.error)[:5000])
        if result.pruning:  # the rule, the step and the compared values: the decision can be audited in MLflow
            from trainer.launch.pruning import describe

            for key, value in (("trainyard.pruned", describe(result.pruning)),
                               ("trainyard.pruned.rule", result.pruning["rule"]),
                               ("trainyard.pruned.step", str(result.pruning["step"])),
                               ("trainyard.pruned.value", repr(result.pruning["value"])),
                               ("trainyard.pruned.compared", json.dumps(result.pruning["compared"])[:5000])):
                self.client.set_tag(self.run_id, key, value)
        if result.status in ("completed", "pruned"):
            # A completed (or pruned) attempt's class and decision are certain here (the policy's for exit 0:
            # trainer/supervisor/elastic.py): tagged now, and marked so, the launch need not start
            # MLflow again after the ranks have gone, which costs seconds on every launch.
            from trainer.faults import current_attempt

            attempt = current_attempt()
            for key, value in (("failure_class", result.status), ("trainyard.decision", "done"),
                               ("trainyard.attempt", str(attempt))):
                self.client.set_tag(self.run_id, key, value)
        self.client.set_terminated(self.run_id, status=MLFLOW_STATUS[result.status])
        if result.status in ("completed", "pruned") and self.record_path is not None:
            from ops.publish.durable import write_json_atomic

            write_json_atomic(self.record_path, {**self.record, "closed": {"failure_class": result.status,
                                                                           "decision": "done", "attempt": attempt}})
