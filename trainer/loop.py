"""The Trainer: every component of one rank, and the loop that drives them (trainer/train.py runs it).

    trainer = Trainer(config, hooks=[ConsoleHook(...)], checkpointer=None)
    try:
        result = trainer.train()     # to train.steps, divergence or a SIGTERM stop
    finally:
        trainer.close()              # every outcome: checkpointer, process group, torch flags

One step: the rank's batch, split into grad_accum micro-batches, forward and backward with
gradients synced on the last one, then one all-reduce of (loss, stop flag) so every rank
decides alike whether to update, skip a non-finite step, or stop. Hooks see the reduced
metrics on rank 0; the checkpointer (trainer/observe/hooks.py) saves on every rank at the same step.
Rank 0 writes final.json however the run ends; every rank writes samples/rank_R.json.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import math
import os
import signal
import statistics
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from ops.clips.plan import bucket_name
from ops.loading.sampling import nested_state
from trainer.launch.config import ExperimentConfig
from trainer.data import build_data_source
from trainer.faults import FaultInjector, current_attempt
from trainer.observe.hooks import Checkpointer, Hook, RankHook
from ops.publish.durable import iso_time, write_json_atomic
from trainer.observe.metrics import StepTimer, probe_comm_s, profile_window, profiler_step, summarize
from trainer.observe.metrics import environment_record
from trainer.observe.startup import StartupClock, process_start_time
from trainer.models.video import num_tokens, sample_noise_and_time
from trainer.models.protocol import build_model
from trainer.optim import build_lr_scheduler, build_optimizer
from trainer.parallel import (
    all_reduce_values,
    barrier,
    clip_and_reduce,
    destroy_distributed,
    grad_sync,
    init_distributed,
    parallelize,
    resolve_deterministic,
    restore_determinism,
    seed_everything,
)
from trainer.supervisor.failure_report import record_rank_error
from trainer.heldout import Evaluator
from trainer.launch.pruning import PruningJudge
from trainer.launch.pruning import describe as describe_pruning
from trainer.observe.host import host_record, rank_hosts, with_hosts, write_hosts
from trainer.endings import PREEMPTED_EXIT, write_rank_end
from trainer.supervisor.elastic import read_bad_samples
from trainer.precision import (
    NonFiniteGuard, Precision, attention_context, probe_attention, restore_tf32, set_tf32,
)
from trainer.launch.preflight import preflight
from trainer.launch.redact import Redactor, redacted_dict
from trainer.watchdog import HangDetected, Watchdog
from trainer.state import ModelState, OptimizerState, RunResult, Stateful, TrainState

log = logging.getLogger("trainer")
_PROCESS_START = time.time()  # this module is imported at the start of the program: startup figures count from it

_BATCH_TENSORS = ("video", "audio", "has_audio")
# What close() releases: everything that may hold the process group or device memory.
_COMPONENTS = ("evaluator", "model", "optimizer", "lr_scheduler", "precision", "data", "timer")


class Trainer:
    """Every component of one rank, built from an ExperimentConfig, and the loop that drives them."""

    def __init__(self, config: ExperimentConfig, *, hooks: Sequence[Hook] = (),
                 checkpointer: Checkpointer | None = None, startup: StartupClock | None = None) -> None:
        self.config = config
        # Where the start-up went (trainer/observe/startup.py): trainer/train.py starts the clock at the
        # program's start and adds the Dagster process's marks; a Trainer built in a test starts its own.
        self.startup_clock = startup if startup is not None else StartupClock(
            {"process_started": process_start_time() or _PROCESS_START, "imports": _PROCESS_START})
        self.hooks = list(hooks)
        self.rank_hooks: list[RankHook] = []  # every rank, this rank's own timings (trainer/observe/prometheus.py)
        self.checkpointer = checkpointer
        self.redactor = Redactor.for_config(config)
        self.sample_log: list[list] = []  # [step, [sample keys]] read on this rank
        self.clip_shapes_trained: set[str] = set()  # "TxHxW" of every step this process ran
        self.startup: dict[str, Any] = {"process_start_s": _PROCESS_START}
        self.step_log: list[list] = []  # [step, consumed_samples, step_time_s, samples_per_s] of steps this process ran
        self.evaluations: list[dict[str, Any]] = []  # trainer/heldout.py results, in step order
        self.lineage: dict[str, Any] | None = None  # the run's lineage fields (trainer/wiring.py sets them)
        self._determinism = None
        self._tf32 = None
        self.distributed = init_distributed(parallelism=config.train.parallelism, device=config.train.device,
                                            collective_timeout_s=config.train.collective_timeout_s)
        self.world, self.device = self.distributed.world, self.distributed.device
        self.startup_clock.mark("rendezvous")
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        config, train, world = self.config, self.config.train, self.world
        # Rank 0 alone makes the memory estimate (it measures a block on CPU; every rank would agree).
        self.plan = preflight(config, world_size=world.world_size, estimate_memory=world.is_main)
        self.startup_clock.mark("rank_preflight")
        device_type = self.device.type
        self.deterministic = resolve_deterministic(train.deterministic, device_type)
        self._determinism = seed_everything(train.seed, world.rank, deterministic=self.deterministic,
                                            device_type=device_type)
        self._tf32 = set_tf32(train.tf32)
        self.precision = Precision(train.precision, device_type=device_type)
        probe_attention(train.attention_backend, device=self.device, dtype=self.precision.compute_dtype,
                        head_dim=config.model.dim // config.model.num_heads)
        model = build_model(config)  # model.factory, checked against the protocol (trainer/models/protocol.py)
        model.init_weights(seed=train.seed)
        self.num_params = sum(p.numel() for p in model.parameters())
        # Bound before wrapping (DDP hides the model's methods): the performance model's FLOPs and the
        # model's noise space, per clip shape.
        self.flops_per_sample, self.noise_shape = model.flops_per_sample, model.noise_shape
        self.model = parallelize(model.to(self.device), train, self.distributed, compute_dtype=self.precision.compute_dtype)
        self.optimizer = build_optimizer(self.model, config.optim, fused=device_type == "cuda")
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config.optim, total_steps=train.steps)
        self.startup_clock.mark("model_build")
        self.guard = NonFiniteGuard(max_consecutive=train.max_consecutive_nonfinite)
        self.pin_memory = config.data.pin_memory and device_type == "cuda"  # nothing to overlap on CPU
        self.data = build_data_source(config.data, world=world,
                                      local_batch_size=self.plan.local_batch_size, pin_memory=self.pin_memory)
        self.startup_clock.mark("loader_start")
        self.train_state = TrainState()
        self.faults = FaultInjector(config.faults, rank=world.rank)
        self.timer = StepTimer(device=self.device, warmup_steps=train.metrics_warmup_steps,
                               sync_phases=train.sync_phases or train.profile)
        self.run_dir = Path(train.run_dir)
        # The machine and software this run ran on (trainer/observe/host.py), with the run's lineage.
        hosts = rank_hosts(world.world_size)  # a collective: every rank, here
        self.environment = with_hosts(host_record(world_size=world.world_size), hosts) if world.is_main else None
        if world.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_hosts(self.run_dir, hosts, attempt=current_attempt())
        self.evaluator = (Evaluator(config, distributed=self.distributed, model=self.model, precision=self.precision,
                                    data=self.data, beat=lambda doing: self._beat(self.train_state.step, doing))
                          if train.eval_every else None)
        self.generated: dict[str, Any] | None = None  # the end-of-run samples (trainer/heldout.py)
        self._evaluated_step: int | None = None  # the last step evaluated here or by an earlier attempt
        self._sample_plan: tuple[int, Any] | None = None  # (step, conditions) rank 0 samples from in _finish
        self.watchdog: Watchdog | None = None  # during train() when train.watchdog_s > 0
        # Quarantined by an earlier attempt of this run (trainer/supervisor/elastic.py): skipped on every attempt.
        self.bad_samples = frozenset(read_bad_samples(self.run_dir))
        self.skipped_samples: list[list] = []  # [step, [keys]] left out of this rank's batches
        self.divergence: dict[str, Any] | None = None  # why the run diverged, when it did
        self._stop_requested = False  # set by a preemption signal on this rank
        self._stop_signals: list[str] = []
        self._stop_agreed = False  # some rank was asked to stop: all stop after this step
        # A sweep's trial: rank 0 reports evaluations to the study and asks its rule (trainer/launch/pruning.py).
        self.judge: PruningJudge | None = (_open_judge(config.sweep, eval_every=train.eval_every)
                                           if config.sweep.study and world.is_main and train.eval_every else None)
        self.pruning: dict[str, Any] | None = None  # the rule's recorded decision, when it stopped this trial
        self._started = time.time()

    def app_state(self) -> dict[str, Stateful]:
        """Everything a checkpoint must hold to resume bit-identically (trainer/state.py)."""
        return {
            "model": ModelState(self.model),
            "optimizer": OptimizerState(self.model, self.optimizer),
            "lr_scheduler": self.lr_scheduler,
            "grad_scaler": self.precision,
            "nonfinite": self.guard,
            "data": self.data,
            "train_state": self.train_state,
        }

    # -----------------------------------------------------------------------------------------
    # One step

    def _micro_batches(self, batch: Mapping[str, Any]) -> list[dict[str, Any]]:
        """grad_accum micro-batches; fewer samples than planned (decode failures reported by the
        loader, an uneven epoch tail) leave later micro-batches short or empty, never absent."""
        expected, size = self.plan.local_batch_size, self.plan.micro_batch_size
        if len(batch["keys"]) > expected:
            raise ValueError(f"batch source returned {len(batch['keys'])} samples, at most {expected} expected")
        tensors = {name: batch[name].to(self.device, non_blocking=True) for name in _BATCH_TENSORS}
        return [{**{name: tensor[start:start + size] for name, tensor in tensors.items()},
                 "keys": batch["keys"][start:start + size]}
                for start in range(0, expected, size)]

    def train_step(self) -> dict[str, float]:
        """One optimizer step over a global batch (grad_accum micro-batches per rank); its metrics."""
        step, timer = self.train_state.step + 1, self.timer
        self.faults.before_step(step)
        timer.start_step()
        with timer.phase("data_wait"):
            self._beat(step, "data fetch")
            self.faults.in_data_fetch(step)
            batch = self._without_bad_samples(step, self.data.next_batch())
            self.startup_clock.mark("first_batch")
            self._beat(step, "step (forward, backward, optimizer)")
        self.sample_log.append([self.train_state.step + 1, list(batch["keys"])])
        self.faults.check_batch(step, batch["keys"])
        with timer.phase("host_to_device"):
            micro_batches = self._micro_batches(batch)
        # Every rank of a step holds the same bucket, empty batches included ([0, T, H, W, 3]).
        clip_shape = tuple(batch["video"].shape[1:4])
        self.clip_shapes_trained.add(bucket_name(*clip_shape))
        local_samples = len(batch["keys"])
        # One small collective: the global sample count weights every sample equally even when
        # a rank's batch shrank, and an all-empty step is skipped instead of dividing by zero.
        (num_samples,) = all_reduce_values([float(local_samples)], op="sum", distributed=self.distributed)
        local_loss_sum = self._accumulate_gradients(step, micro_batches, num_samples=max(num_samples, 1.0))  # on device
        with timer.phase("optimizer"):
            loss, grad_norm, finite, lr = self._optimizer_step(local_loss_sum, num_samples=num_samples)
        if num_samples:
            self.guard.observe(finite=finite)
        else:  # a data fault, not a numerical one: it must not end the run as "diverged"
            log.warning("step %d: no sample of the global batch could be loaded; update skipped", step)
        self.train_state.record(loss=loss, grad_norm=grad_norm, samples=int(num_samples),
                                epoch=_epoch(self.data.state_dict()))
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "skipped": float(not finite),
                   "num_skipped_steps": float(self.guard.num_skipped_steps),
                   "loss_scale": self.precision.loss_scale,
                   "consumed_samples": float(self.train_state.consumed_samples)}
        metrics |= timer.elapsed()
        if "time_to_first_step_s" not in self.startup:
            self.startup["time_to_first_step_s"] = round(time.time() - _PROCESS_START, 4)
        self.startup_clock.mark("first_step")
        tokens_per_sample = num_tokens(clip_shape, self.config.model.patch_size)
        metrics["samples_per_s"] = num_samples / metrics["step_time_s"]
        metrics["num_samples"] = num_samples
        metrics["tokens_per_s"] = metrics["samples_per_s"] * tokens_per_sample
        timer.record_work(clip_shape=clip_shape, samples=local_samples, frames=local_samples * clip_shape[0],
                          tokens=local_samples * tokens_per_sample,
                          flops=int(num_samples) * self.flops_per_sample(clip_shape))
        return metrics

    def _without_bad_samples(self, step: int, batch: Mapping[str, Any]) -> Mapping[str, Any]:
        """The batch less the samples this run quarantined (the same decision on every restart:
        the step keeps its place in the order and trains on fewer samples, like a decode failure)."""
        keys = list(batch["keys"])
        if not self.bad_samples or not self.bad_samples.intersection(keys):
            return batch
        keep = [index for index, key in enumerate(keys) if key not in self.bad_samples]
        self.skipped_samples.append([step, [key for key in keys if key in self.bad_samples]])
        log.warning("step %d: skipping quarantined sample(s) %s", step, self.skipped_samples[-1][1])
        index = torch.tensor(keep, dtype=torch.long)
        return {**batch, **{name: batch[name].index_select(0, index) for name in _BATCH_TENSORS},
                "keys": [keys[i] for i in keep]}

    def _accumulate_gradients(self, step: int, micro_batches: Sequence[Mapping[str, Any]], *,
                              num_samples: float) -> torch.Tensor:
        """Forward and backward every micro-batch; gradients sync only on the last one.

        Each micro-batch contributes the sum of its per-sample losses times world_size /
        num_samples (the global sample count of the step); DDP / FSDP average over ranks, so the
        gradient is the mean over every sample of the global batch, however the samples were
        spread. Empty micro-batches still run forward and backward (zero loss) so every rank
        joins the same collectives. Returns the sum of this rank's per-sample losses, on the
        device: it is read on the host once, with the step's other values (`_optimizer_step`).
        """
        accum, timer = len(micro_batches), self.timer
        scale = self.world.world_size / num_samples
        loss_sum = torch.zeros((), device=self.device)
        for index, micro in enumerate(micro_batches):
            with grad_sync(self.model, enabled=index == accum - 1):
                with timer.phase("forward"):
                    noise, t = sample_noise_and_time(
                        micro["keys"], seed=self.config.train.seed, step=step,
                        noise_shape=self.noise_shape(tuple(micro["video"].shape[1:4])), device=self.device)
                    with self.precision.autocast(), attention_context(self.config.train.attention_backend):
                        loss = self.model(micro["video"], micro["audio"], micro["has_audio"],
                                          noise, t).sum()
                    loss = self.faults.corrupt_loss(step, loss)
                with timer.phase("backward"):
                    self.precision.backward(loss * scale)
            loss_sum += loss.detach()
        return loss_sum

    def _optimizer_step(self, local_loss_sum: torch.Tensor, *, num_samples: float) -> tuple[float, float, bool, float]:
        """Clip, decide on global values, update (or skip); (loss, grad_norm, finite, lr)."""
        self.precision.unscale(self.optimizer)
        # One collective and one host read for the global loss, whether any rank was asked to
        # stop, and (FSDP) the gradient norm over the shards (trainer/parallel.py:clip_and_reduce).
        grad_norm, (global_loss_sum, num_stop) = clip_and_reduce(
            self.model, self.config.optim.grad_clip_norm, [local_loss_sum, float(self._stop_requested)],
            distributed=self.distributed)
        self._stop_agreed = num_stop > 0
        loss = global_loss_sum / num_samples if num_samples else float("nan")
        # Both values are global (the grad norm is over all shards), so every rank decides alike.
        # A step whose every sample failed to load has no loss: it is skipped like a non-finite one.
        finite = NonFiniteGuard.is_finite(loss, grad_norm)
        self.precision.step(self.optimizer, finite=finite)
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.lr_scheduler.get_last_lr()[0]
        self.lr_scheduler.step()  # per step, skipped or not: lr is a function of the step
        return loss, grad_norm, finite, lr

    # -----------------------------------------------------------------------------------------
    # The loop

    def train(self) -> RunResult:
        """Run to train.steps (or divergence / cancellation); write final.json on every outcome."""
        with self._watchdog():  # the end-of-run work too: a hung MLflow server is a hang
            with self._sigterm_requests_stop():
                try:
                    status = self._loop()
                except KeyboardInterrupt as error:
                    self._finish("canceled", error=error, collective=False)
                    raise
                except BaseException as error:
                    self._finish("failed", error=error, collective=False)
                    raise
            return self._finish(status)

    @contextlib.contextmanager
    def _watchdog(self) -> Iterator[None]:
        """trainer/watchdog.py for the whole run, the end-of-run work included."""
        limit = self.config.train.watchdog_s
        if not limit:
            yield
            return

        def record_end(error: HangDetected, step: int) -> None:
            write_rank_end(self.run_dir, rank=self.world.rank, world_size=self.world.world_size, status="failed",
                           step=self.train_state.step, error=error, redact=self.redactor.text)
            record_rank_error(error, self.redactor.text)

        self.watchdog = Watchdog(limit_s=limit, rank=self.world.rank, run_dir=self.run_dir, record_end=record_end)
        with self.watchdog:
            yield

    def _beat(self, step: int, doing: str) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(step, doing)

    def _loop(self) -> str:
        train = self.config.train
        self._beat(self.train_state.step, "checkpoint restore")
        self._restore()
        self._carry_evaluations()
        last_saved = self.train_state.step
        with self._profile_window() as profiler:
            while self.train_state.step < train.steps:
                metrics = self.train_step()
                step = self.train_state.step
                with self.timer.phase("logging"):
                    if self.world.is_main:
                        for hook in self.hooks:
                            hook.on_step_end(step, metrics)
                self.step_log.append([step, int(metrics["consumed_samples"]), round(metrics["step_time_s"], 6),
                                      round(metrics["samples_per_s"], 4)])
                reason = self._divergence_reason(metrics)
                if reason is not None:
                    self.divergence = {"reason": reason, "step": step}
                    self._tell_rank_hooks(step, metrics, self.timer.end_step())
                    return "diverged"
                due = train.checkpoint_every and step % train.checkpoint_every == 0
                if self.checkpointer is not None and (due or self._stop_agreed):
                    with self.timer.phase("checkpoint"):
                        self._beat(step, "checkpoint save")
                        self.faults.in_save(step)
                        self.checkpointer.save(step, self.app_state())
                    self.startup_clock.mark("first_checkpoint")
                    last_saved = step
                self._tell_rank_hooks(step, metrics, self.timer.end_step())
                self._beat(step, "step end")
                profiler_step(profiler)
                if self.evaluator is not None and step % train.eval_every == 0 and not self._stop_agreed:
                    self._evaluate(step)  # after the step's timing: evaluation is not a training phase
                    if self._pruned_at(step):
                        if self.checkpointer is not None:
                            if last_saved != step:
                                self._beat(step, "checkpoint save")
                                self.checkpointer.save(step, self.app_state())
                            self.checkpointer.wait()  # committed before the final barrier (_finish)
                        return "pruned"
                if self._stop_agreed:
                    if self.checkpointer is not None:
                        self.checkpointer.wait()  # committed before the final barrier (_finish)
                    return "canceled"
        if self.checkpointer is not None:
            self._beat(self.train_state.step, "final checkpoint save")
            if last_saved != self.train_state.step:
                self.checkpointer.save(self.train_state.step, self.app_state())
            self.checkpointer.wait()  # an async final save commits before the run reports its checkpoint
            self.startup_clock.mark("first_checkpoint")  # a run shorter than checkpoint_every: its final save
        if self.evaluator is not None:
            step = self.train_state.step
            if self._evaluated_step != step:  # the same decision on every rank (see _carry_evaluations)
                self._evaluate(step)
            self._beat(step, "sample conditions")
            if self.evaluator.generation_is_collective:  # FSDP: every rank runs every forward, now
                self._record_samples(step, self.evaluator.generate(self._samples_dir(step)))
            else:  # rank 0 integrates after the final barrier (_finish), where no peer waits on it
                self._sample_plan = (step, self.evaluator.sample_conditions())
        return "completed"

    def _pruned_at(self, step: int) -> bool:
        """A sweep's trial: rank 0 reports this step's evaluation and asks the rule; one all-reduce shares the
        answer, so every rank stops here or none does. Never at the last step (the trial is done anyway)."""
        if not self.config.sweep.study:
            return False
        stop = 0.0
        latest = self.evaluations[-1] if self.evaluations else {}
        if self.judge is not None and latest.get("step") == step and latest.get("status") == "ok":
            self.pruning = self.judge.judge(step, latest["loss"], may_stop=step < self.config.train.steps)
            stop = float(self.pruning is not None)
        (stop,) = all_reduce_values([stop], op="max", distributed=self.distributed)
        if stop and self.pruning is not None:
            log.warning("step %d: %s", step, describe_pruning(self.pruning))
        return bool(stop)

    def _tell_rank_hooks(self, step: int, metrics: Mapping[str, float], timings: Mapping[str, float]) -> None:
        for hook in self.rank_hooks:
            hook.on_step_end(step, metrics, timings)

    def _carry_evaluations(self) -> None:
        """After a restore: the evaluations earlier attempts of this run recorded up to the restored step
        stay in final.json, and the one a stop left out at a due step is made up now. Every rank takes the
        same decisions (rank 0 reads the record; one small all-reduce shares what it found)."""
        step = self.train_state.step
        if self.evaluator is None or step == 0:
            return
        found = 0.0
        if self.world.is_main:
            self.evaluations = [item for item in _recorded_evaluations(self.run_dir) if item.get("step", 0) <= step]
            found = float(any(item.get("step") == step for item in self.evaluations))
        (found,) = all_reduce_values([found], op="max", distributed=self.distributed)
        if found:
            self._evaluated_step = step
        elif step % self.config.train.eval_every == 0:
            self._evaluate(step)

    def _evaluate(self, step: int) -> None:
        """The validation loss at this step (every rank joins; rank 0 records it and tells the hooks)."""
        self._beat(step, "evaluation")
        result = self.evaluator.validation_loss()
        self._evaluated_step = step
        if not self.world.is_main:
            return
        result = {"step": step, **result}
        self.evaluations.append(result)
        if result["status"] == "ok":
            log.info("step %d: %s loss %.6f over %d samples", step, result["split"], result["loss"], result["num_samples"])
        else:
            log.warning("step %d: evaluation %s: %s", step, result["status"], result.get("reason"))
        self._tell_hooks(step, result)

    def _samples_dir(self, step: int) -> Path:
        return self.run_dir / "eval" / f"step_{step:08d}"

    def _record_samples(self, step: int, generated: Mapping[str, Any]) -> None:
        """Rank 0: the samples' record into final.json and to the hooks (MLflow artifacts)."""
        if not self.world.is_main:
            return
        self.generated = {"step": step, **generated}
        if generated.get("status") != "ok":
            log.warning("step %d: samples %s: %s", step, generated.get("status"),
                        generated.get("reason") or f"{generated.get('num_non_finite')} non-finite, not encoded")
        self._tell_hooks(step, {"step": step, "samples": self.generated})

    def _tell_hooks(self, step: int, result: Mapping[str, Any]) -> None:
        for hook in self.hooks:
            try:  # a failing hook (MLflow down, a hook from before on_evaluation) must not end a run
                hook.on_evaluation(step, result)
            except Exception:
                log.exception("hook %s failed on the evaluation at step %d", type(hook).__name__, step)

    def _divergence_reason(self, metrics: Mapping[str, float]) -> str | None:
        """Why the run diverged at this step: non-finite losses past the limit, or a loss spike."""
        train = self.config.train
        if self.guard.diverged:
            return (f"non_finite: {self.guard.num_consecutive} consecutive non-finite step(s) reached "
                    f"train.max_consecutive_nonfinite={train.max_consecutive_nonfinite}")
        if not train.loss_spike_factor or metrics["skipped"]:
            return None
        losses = self.train_state.losses
        history = [loss for loss in losses[:-1] if loss is not None and math.isfinite(loss)][-train.loss_spike_window:]
        if len(history) < train.loss_spike_window:
            return None  # too little history to call anything a spike (the first steps never are)
        baseline = statistics.median(history)
        if metrics["loss"] > train.loss_spike_factor * baseline:
            return (f"loss_spike: loss {metrics['loss']:.6g} > train.loss_spike_factor={train.loss_spike_factor:g} "
                    f"x median {baseline:.6g} of the previous {len(history)} finite losses")
        return None

    def _restore(self) -> None:
        """Load the checkpointer's state, if any, before the first step; record how long it took."""
        if self.checkpointer is None:
            return
        started = time.perf_counter()
        restored = self.checkpointer.load(self.app_state())
        self.startup["restore_s"] = round(time.perf_counter() - started, 4)
        self.startup_clock.mark("checkpoint_load")
        self.startup["restored_step"] = restored
        if restored is not None and restored != self.train_state.step:
            raise ValueError(f"checkpointer restored step {restored}, but the train state it "
                             f"loaded is at step {self.train_state.step}")

    def _profile_window(self) -> contextlib.AbstractContextManager:
        train, data = self.config.train, self.config.data
        environment = (environment_record(distributed=self.distributed, batch_shape=[data.batch_size, *data.video_shape],
                                          clip_shapes=data.video_shapes, parallelism=train.parallelism,
                                          precision=train.precision)
                       if train.profile else None)
        return profile_window(enabled=train.profile, run_dir=self.run_dir, distributed=self.distributed,
                              skip_steps=train.metrics_warmup_steps, active_steps=train.profile_active_steps,
                              environment=environment)

    @contextlib.contextmanager
    def _sigterm_requests_stop(self) -> Iterator[None]:
        """A preemption signal (train.preempt_signals) asks every rank to stop at the next step
        boundary with a checkpoint; a repeat is noted and changes nothing. If that takes longer
        than train.preempt_grace_s, the rank exits PREEMPTED_EXIT without it (the last committed
        checkpoint stands)."""
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach only the main thread; a caller thread must stop us otherwise
            return
        grace: list[threading.Timer] = []

        def request_stop(signum: int, frame: object) -> None:
            name = signal.Signals(signum).name
            self._stop_signals.append(name)
            if self._stop_requested:
                log.warning("%s again while stopping: still stopping at the step boundary", name)
                return
            self._stop_requested = True
            log.warning("%s: preempted; stopping at the next step boundary with a checkpoint "
                        "(grace %g s)", name, self.config.train.preempt_grace_s)
            timer = threading.Timer(self.config.train.preempt_grace_s, self._grace_expired)
            timer.daemon = True
            timer.start()
            grace.append(timer)

        signals = [signal.Signals[name] for name in self.config.train.preempt_signals]
        previous = {sig: signal.signal(sig, request_stop) for sig in signals}
        try:
            yield
        finally:
            for timer in grace:
                timer.cancel()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _grace_expired(self) -> None:
        """The preemption grace ran out before the step boundary: record and leave, without cleanup."""
        message = (f"preempted ({', '.join(self._stop_signals)}), but no step boundary within "
                   f"train.preempt_grace_s={self.config.train.preempt_grace_s:g}: exiting without a checkpoint; the "
                   f"last committed one stands")
        log.error(message)
        try:
            write_rank_end(self.run_dir, rank=self.world.rank, world_size=self.world.world_size, status="canceled",
                           step=self.train_state.step, error=None, redact=self.redactor.text)
        finally:
            os._exit(PREEMPTED_EXIT)

    # -----------------------------------------------------------------------------------------
    # The end

    def _finish(self, status: str, *, error: BaseException | None = None,
                collective: bool = True) -> RunResult:
        """Summarize and record the outcome; collective=False after a failure (peers may be gone).

        Every rank writes its own classified end (trainer/endings.py), so a rank that outlives a
        hung or dead rank 0 still leaves a record. After an agreed ending the ranks meet at one
        last barrier before rank 0's slow work (final.json, MLflow, Pipes): no peer waits on it in
        a collective that could time out, and no collective follows.
        """
        if self.watchdog is not None:
            self.watchdog.hold_if_fired()  # a hang was recorded: the error that follows it is not the end
        self._beat(self.train_state.step, "end of run")
        if collective and self.config.train.dump_final_params:
            self._dump_params()
        self._write_samples()
        comm_s = (probe_comm_s(self.distributed, grad_bytes=4 * self.num_params,
                               parallelism=self.config.train.parallelism) if collective else 0.0)
        performance = summarize(self.timer, distributed=self.distributed, comm_s=comm_s, collective=collective)
        result = RunResult(
            status=status, final_step=self.train_state.step, losses=list(self.train_state.losses),
            grad_norms=list(self.train_state.grad_norms), num_skipped_steps=self.guard.num_skipped_steps,
            error=None if error is None else self.redactor.text(f"{type(error).__name__}: {error}"),
            pruning=self.pruning if status == "pruned" else None)
        ending = write_rank_end(self.run_dir, rank=self.world.rank, world_size=self.world.world_size,
                                     status=status, step=self.train_state.step, error=error,
                                     redact=self.redactor.text)
        result = dataclasses.replace(result, failure_class=ending["failure_class"])
        if collective:
            barrier(self.distributed)
        self.faults.before_end_work()
        if self.world.is_main and status == "completed" and self._sample_plan is not None:
            step, conditions = self._sample_plan  # rank 0's slow end work: no peer is left in a collective
            self._record_samples(step, self.evaluator.generate(self._samples_dir(step), conditions))
        if self.world.is_main:
            if status == "diverged":
                self._write_divergence()
            self._write_final(result, performance, failure_class=ending["failure_class"])
            for hook in self.hooks:
                try:  # one failing hook (say MLflow unreachable) must not silence the others
                    hook.on_train_end(result)
                except Exception:
                    log.exception("hook %s failed at the end of the run", type(hook).__name__)
        return result

    def _write_final(self, result: RunResult, performance: Mapping[str, Any], *, failure_class: str) -> None:
        record = {
            "status": result.status, "final_step": result.final_step,
            "steps_requested": self.config.train.steps, "losses": result.losses,
            "grad_norms": result.grad_norms, "num_skipped_steps": result.num_skipped_steps,
            "error": result.error, "name": self.config.name, "world_size": self.world.world_size,
            "parallelism": self.config.train.parallelism, "num_params": self.num_params,
            "failure_class": failure_class, "divergence": self.divergence,
            "stop_signals": self._stop_signals, "skipped_samples": self.skipped_samples,
            "precision": self.precision.describe(), "kernels": self._kernels(),
            "launch_plan": self.plan.as_dict(),
            "performance": performance, "config": redacted_dict(self.config),
            "data": {**self.data.describe(), "clip_shapes_trained": sorted(self.clip_shapes_trained)},
            "started_at": iso_time(self._started), "ended_at": iso_time(time.time()),
            "lineage": self.lineage, "environment": self.environment, "step_log": self.step_log,
            "evaluations": self.evaluations, "pruning": result.pruning,
            "generated": self.generated, "startup": self.startup_clock.breakdown(),
        }
        write_json_atomic(self.run_dir / "final.json", self.redactor.value(record))

    def _write_divergence(self) -> None:
        """run_dir/divergence.json: why, and the last train.loss_spike_window steps' losses, gradient
        norms and every rank's sample ids (their samples files are written before the last barrier)."""
        window = self.config.train.loss_spike_window
        first = max(1, self.train_state.step - window + 1)
        steps = range(first, self.train_state.step + 1)
        ids: dict[int, list[str]] = {step: [] for step in steps}
        for path in sorted((self.run_dir / "samples").glob("rank_*.json")):
            try:
                for step, keys in json.loads(path.read_text())["steps"]:
                    if step in ids:
                        ids[step] += keys
            except (OSError, ValueError, KeyError):
                continue  # a rank that left no samples file: its ids are unknown, not invented
        losses, norms = self.train_state.losses, self.train_state.grad_norms
        record = {**(self.divergence or {"reason": "unknown", "step": self.train_state.step}),
                  "window": [{"step": step, "loss": losses[step - 1], "grad_norm": norms[step - 1],
                              "sample_ids": ids[step]} for step in steps]}
        write_json_atomic(self.run_dir / "divergence.json", self.redactor.value(record))
        self.divergence = record

    def _kernels(self) -> dict[str, Any]:
        """The numerics choices that are not the precision policy, as they applied on this device."""
        train = self.config.train
        return {"deterministic": self.deterministic, "deterministic_requested": train.deterministic,
                "tf32": train.tf32 and self.device.type == "cuda", "attention_backend": train.attention_backend,
                "residual_dtype": (str(self.precision.compute_dtype).removeprefix("torch.")
                                   if train.residual_dtype == "compute" else "float32"),
                "fused_adamw": bool(self.optimizer.defaults.get("fused")), "compile": train.compile,
                "sync_phases": self.timer.sync_phases, "pin_memory": self.pin_memory}

    def _write_samples(self) -> None:
        """This rank's sample keys per step (samples/rank_R.json): restore drills compare orders."""
        path = self.run_dir / "samples" / f"rank_{self.world.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"rank": self.world.rank, "world_size": self.world.world_size,
                                 "startup": self.startup, "steps": self.sample_log})

    def _dump_params(self) -> None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)  # collective under FSDP
        if self.world.is_main:
            torch.save(state, self.run_dir / "final_params.pt")

    def close(self) -> None:
        """Release the components, the process group and torch's global flags.

        Safe after a failed build and idempotent. No barrier here: after an agreed ending the
        ranks met at the last one in `_finish` (every save committed, no collective left), and
        after a failure a peer may be gone, so a barrier would only wait out the collective timeout.
        """
        if self.checkpointer is not None:
            self.checkpointer.close()  # an async save still needs the process group
            self.checkpointer = None
        while self.rank_hooks:
            self.rank_hooks.pop().close()
        # Free DDP's reducer / FSDP's state (they hold the process group) while the interpreter
        # is fully alive: gloo torn down during interpreter exit can hang the process.
        for name in _COMPONENTS:
            vars(self).pop(name, None)
        gc.collect()
        destroy_distributed()
        if self._determinism is not None:
            restore_determinism(self._determinism)
            self._determinism = None
        if self._tf32 is not None:
            restore_tf32(self._tf32)
            self._tf32 = None



def _open_judge(sweep, *, eval_every: int) -> PruningJudge | None:
    """Rank 0's link to its trial; a study that cannot be opened is logged and the trial trains without early
    stopping (as when it stops answering mid-run: trainer/launch/pruning.py)."""
    try:
        return PruningJudge(sweep, eval_every=eval_every)
    except Exception as error:  # noqa: BLE001 (the storage's many errors: the trial trains on)
        from trainer.launch.redact import redact_uri

        log.warning("the sweep's study %s cannot be opened (%s): training without early stopping", sweep.study,
                    redact_uri(f"{type(error).__name__}: {error}")[:300])
        return None


def _recorded_evaluations(run_dir: Path) -> list[dict[str, Any]]:
    """The evaluations an earlier attempt of this run left in its final.json ([] when there is none)."""
    try:
        recorded = json.loads((run_dir / "final.json").read_text()).get("evaluations") or []
    except (OSError, ValueError, AttributeError):
        return []
    return [item for item in recorded if isinstance(item, dict) and isinstance(item.get("step"), int)]


def _epoch(data_state: Mapping[str, Any]) -> int:
    return int(nested_state(data_state)["sampler"]["epoch"])
