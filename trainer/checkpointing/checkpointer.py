"""Checkpointer: save and restore the trainer's ``app_state`` with DCP, published by ops.checkpoints.store.

    ckpt = Checkpointer(run_dir, world=world, keep_last_k=3, keep_every_m=1000, async_mode="async",
                        hmac_key=key, lineage={"run_id": run_id, **lineage.as_metadata()},
                        model_fingerprint=digest_json(model_config))
    start_step = ckpt.load(app_state) or 0     # newest checkpoint that verifies, or None
    for step in range(start_step + 1, num_steps + 1):
        ...train...
        if step % interval == 0:
            ckpt.save(step, app_state)         # async: returns after staging; commits in the background
    ckpt.close()                               # waits for the last async save to commit

Every rank constructs the Checkpointer (it creates a gloo group for checkpoint collectives) and
calls save/load/wait/close at the same points. Without torch.distributed initialized it runs in
one process.

What a checkpoint holds (one DCP state dict, documented keys):

    model          FQN-keyed model state (DDP, FSDP2 and plain modules alike; DTensor shards
                   under FSDP2), so any other world size or wrapping can load it
    optimizer      FQN-keyed optimizer state
    rng/rank_<r>   python, numpy, torch CPU (and CUDA) generator states of rank r
    <other part>   state_dict() of every other app_state entry: lr_scheduler, grad_scaler, data,
                   progress / train_state, ... These are global: saved once, checked equal across ranks.
                   "data" is a data source's state in ops.loading.sampling's layout ({"sampler": ...,
                   "batching": ...}); the record takes its dataset_version from the sampler.

"model" and "optimizer" may be the nn.Module and torch.optim.Optimizer themselves (read and
written with DCP's get/set_model_state_dict and get/set_optimizer_state_dict), or Stateful
wrappers that already do so (trainer.state.ModelState, OptimizerState).

and COMMITTED.json adds: step, world size, lineage (run_id, git commit, config hash, manifest
version, ...), the model fingerprint, the model's tensor names, shapes and dtypes (checked
against the live model before loading), the progress and data states, and references.

Where checkpoints live is one CheckpointLocation (trainer.checkpointing.location): the run folder
(``run_dir/checkpoints``, ops.checkpoints.store), or with ``store_url`` an object store written
and read straight through DCP's fsspec writer and reader (trainer.checkpointing.object_store).
It places each save, commits it, lists, verifies and retains the run's checkpoints.

Save order: every rank writes its DCP files into one staging place (the run folder's tmp dir),
hashing each file while writing it (ops.checkpoints.digesting); the digests are gathered to rank 0,
which hashes DCP's small .metadata and commits (ops.checkpoints.store.commit: record last, rename,
then `latest`). Async saves stage a CPU copy in save() and do the rest on a background thread, so
`latest` only ever names committed dirs.

Load order, refusing instead of guessing: rank 0 verifies (re-hashes, checks the signature and
loads .metadata through ops.checkpoints.dcp_metadata's allowlist) the checkpoint against its record and
broadcasts the verdict (CheckpointCorrupt names the failing files); every rank compares the
record's model tensors and fingerprint with the live model (CheckpointIncompatible names the
keys); only then does DCP read, through ops.checkpoints.dcp_metadata.RecordedMetadataReader (shared with
the restore drill): .metadata only if the record lists it and its bytes still have the record's
sha256, and only with the allowlist unpickler (DCP's own reader calls pickle.load), and every
non-tensor entry with weights_only=True.

Resume never throws progress away: when checkpoint folders exist but none verifies, load raises
NoVerifiedCheckpoint naming each one and why, unless start_over=True, which moves them to
checkpoints/quarantine/ (with REASON.json) and starts from step 0. Retention and a superseding
save also quarantine, never delete, a checkpoint that fails verification.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import random
import warnings
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, StorageWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from ops.checkpoints import store as store
from ops.checkpoints.dcp_metadata import DCP_METADATA_NAME
from ops.checkpoints.digesting import WrittenFiles
from ops.loading.sampling import World, nested_state, rank_seed
from ops.publish import objstore
from ops.publish.hashing import canonical_json, digest_json
from trainer.checkpointing import object_store
from trainer.checkpointing.location import CheckpointLocation, Staging, checkpoint_reader, open_location, verify_checkpoint

logger = logging.getLogger(__name__)

ASYNC_MODES = ("off", "async")
# DCP writer threads per rank, one file each, hashed while written. `python -m
# benchmarks.checkpoint` on a 2-core box: 1 thread saved 600 MB in 1.9 s (median), 2 and 4 in
# 0.9-1.3 s, within the disk's noise of each other; 2 keeps the thread count per rank small.
DEFAULT_THREAD_COUNT = 2
_DCP_PARTS = ("model", "optimizer")
_RNG_PART = "rng"
_PROGRESS_PARTS = ("progress", "train_state")


class CheckpointCorrupt(RuntimeError):
    """The checkpoint does not match its commit record; nothing was loaded."""

    def __init__(self, checkpoint_dir: Path | str, problems: list[tuple[str, str]]) -> None:
        self.checkpoint_dir, self.problems = Path(checkpoint_dir), list(problems)
        listed = "; ".join(f"{name}: {problem}" for name, problem in self.problems)
        super().__init__(f"checkpoint {checkpoint_dir} refused: {listed}")


class NoVerifiedCheckpoint(CheckpointCorrupt):
    """The run has checkpoint folders but none verifies; resuming refuses to start over silently."""

    def __init__(self, run_dir: Path | str, problems: list[tuple[str, str]]) -> None:
        super().__init__(run_dir, problems)
        listed = "; ".join(f"{name}: {problem}" for name, problem in self.problems)
        self.args = (f"run {run_dir} has {len(self.problems)} checkpoint(s) and none verifies, so it refuses to "
                     f"start again from step 0 and lose that progress: {listed}. Restore the damaged files, or "
                     "start over explicitly with start_over=True (trainer: stage.start_over=true), which moves "
                     "these checkpoints to checkpoints/quarantine/ with the reason instead of deleting them",)

    def __str__(self) -> str:
        return self.args[0]


class CheckpointIncompatible(ValueError):
    """The checkpoint was saved for another model config; nothing was loaded."""

    def __init__(self, checkpoint_dir: Path | str, mismatches: Mapping[str, str]) -> None:
        self.checkpoint_dir, self.mismatches = Path(checkpoint_dir), dict(mismatches)
        shown = "; ".join(f"{key}: {why}" for key, why in list(self.mismatches.items())[:20])
        more = f" (and {len(self.mismatches) - 20} more)" if len(self.mismatches) > 20 else ""
        super().__init__(f"checkpoint {checkpoint_dir} does not fit the live model: {shown}{more}")


class CheckpointSaveError(RuntimeError):
    """A save failed; the previous committed checkpoint and ``latest`` are untouched."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LoadReport:
    checkpoint_dir: Path | str | None
    """The checkpoint loaded: a folder, or a store URL (str)."""
    step: int | None
    notes: list[str]
    """What resume passed over (corrupt or incomplete checkpoints) and what it re-derived."""


@dataclasses.dataclass(slots=True, kw_only=True)
class _PendingSave:
    staging: Staging
    """Where the save writes until it is committed (the location placed it)."""
    record: dict[str, Any]
    written: WrittenFiles = dataclasses.field(default_factory=WrittenFiles)
    """This rank's digests, and the errors its writer threads hit: DCP drops an exception raised in a
    helper thread (it only logs it), which would commit a checkpoint missing tensors; these refuse the commit."""
    future: Future | None = None

    @property
    def step(self) -> int:
        return self.staging.step


# --------------------------------------------------------------------------------------------
# DCP plumbing: a loader that refuses arbitrary pickles
# --------------------------------------------------------------------------------------------

class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner unpickles non-tensor entries with weights_only=False; this one does not."""

    def load_bytes(self, read_item, value) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


# --------------------------------------------------------------------------------------------
# RNG
# --------------------------------------------------------------------------------------------

def capture_rng() -> dict[str, Any]:
    """This process's generator states as tensors and plain lists (loadable with weights_only)."""
    version, mt_state, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    state = {"python": [version, list(mt_state), gauss],
             "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
             "torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    version, mt_state, gauss = state["python"]
    random.setstate((version, tuple(mt_state), gauss))
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.set_state((np_name, np.asarray(np_keys, dtype=np.uint32), np_pos, np_has_gauss, np_gauss))
    torch.set_rng_state(state["torch_cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def derive_rng(seed: int, rank: int) -> None:
    """Seed every generator from (seed, rank), for a rank the checkpoint has no state for.

    The same streams as trainer.parallel.seed_everything gives the rank at a fresh start: one
    derivation (ops.loading.sampling.rank_seed), so a re-derived rank is a rank that just started.
    """
    derived = rank_seed(seed, rank)
    random.seed(derived)
    np.random.seed(derived % 2**32)  # numpy's legacy seeder takes 32 bits; rank_seed gives 63
    torch.manual_seed(derived)


# --------------------------------------------------------------------------------------------
# The Checkpointer
# --------------------------------------------------------------------------------------------

class Checkpointer:
    """Saves ``app_state`` as committed, verifiable DCP checkpoints under ``run_dir/checkpoints``.

    Implements the loop's checkpointer protocol (trainer.observe.hooks.Checkpointer) in full.
    """

    def __init__(self, run_dir: str | Path, *, world: World, keep_last_k: int, keep_every_m: int,
                 async_mode: str = "off", hmac_key: bytes | str | None = None,
                 lineage: Mapping[str, Any], model_fingerprint: str, seed: int = 0,
                 thread_count: int = DEFAULT_THREAD_COUNT, start_over: bool = False,
                 numerics: Mapping[str, Any] | None = None, mirror: Any = None,
                 store_url: str | None = None) -> None:
        if async_mode not in ASYNC_MODES:
            raise ValueError(f"async_mode must be one of {ASYNC_MODES}, got {async_mode!r}")
        if not lineage.get("run_id"):
            raise ValueError("lineage must name the run: lineage['run_id'] is required")
        if not model_fingerprint:
            raise ValueError("model_fingerprint must be a non-empty string")
        # Never logged, never written: only its HMAC output is. None: the configured key, created
        # under the Trainyard home on first use (ops.checkpoints.store.signing_key).
        self._hmac_key = store.signing_key() if hmac_key is None else hmac_key
        self._location: CheckpointLocation = open_location(
            run_dir, store_url=store_url, hmac_key=self._hmac_key, keep_last_k=keep_last_k,
            keep_every_m=keep_every_m, start_over=start_over, mirror=mirror)
        """The run folder, or with store_url (``<root>/<run name>``) the object store, written and read
        straight through DCP's fsspec writer and reader (trainer.checkpointing.location)."""
        self._distributed = dist.is_available() and dist.is_initialized()
        if not self._distributed:
            # DCP warns on every save and load without a process group, also from its async
            # thread where no catch_warnings block reaches; one process is a supported mode here.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                                    category=UserWarning)
        expected = (dist.get_rank(), dist.get_world_size()) if self._distributed else (0, 1)
        if (world.rank, world.world_size) != expected:
            raise ValueError(f"world says rank {world.rank} of {world.world_size}, torch.distributed "
                             f"says rank {expected[0]} of {expected[1]}")
        self.run_dir, self.world = Path(run_dir), world
        self.keep_last_k, self.keep_every_m, self.async_mode = keep_last_k, keep_every_m, async_mode
        self.lineage, self.model_fingerprint = dict(lineage), model_fingerprint
        self.seed, self.thread_count = seed, thread_count
        # How the run computes (device type, precision that ran, deterministic kernels), signed with
        # the record: the restore drill takes its comparison rule from here, not from final.json.
        self.numerics = dict(numerics or {})
        self.start_over = start_over
        """When checkpoint folders exist but none verifies: quarantine them and start from step 0
        (True), or refuse with NoVerifiedCheckpoint (False). Never discards one that verifies."""
        # Checkpoint collectives run on their own gloo group: async saves run DCP's collectives on
        # a background thread, which must never interleave with the trainer's on the default group.
        self._group = dist.new_group(backend="gloo") if self._distributed else None
        self._stager: DefaultStager | None = None
        self._pending: _PendingSave | None = None
        # Async saves finish (wait for DCP's write, gather digests, commit) on this thread, so
        # `latest` moves as soon as a save is durable and the next save() finds it done.
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-commit")
        self.last_record: dict[str, Any] | None = None
        """The record of the last checkpoint this process committed (rank 0) or saw committed."""
        self.last_load: LoadReport | None = None
        self.fault_hooks: Any = None
        self.reproduction: dict[str, Any] | None = None
        """What a reproduction needs beyond the lineage (ops/drills/reproduce.py), recorded in every commit."""
        """trainer/faults.py's FaultInjector (before_commit, after_commit), for drills; None: none."""

    def __repr__(self) -> str:
        return (f"Checkpointer({str(self.run_dir)!r}, rank={self.world.rank}/{self.world.world_size}, "
                f"async_mode={self.async_mode!r}, start_over={self.start_over})")

    @property
    def run_id(self) -> str:
        return str(self.lineage["run_id"])

    @property
    def mirror(self) -> Any:
        """ops/checkpoints/mirror.py's CheckpointMirror (rank 0 publishes each commit to the object store); None: none."""
        return self._location.mirror

    @mirror.setter
    def mirror(self, mirror: Any) -> None:
        self._location.mirror = mirror

    # ---- collectives (no-ops in one process) ----

    @property
    def _is_coordinator(self) -> bool:
        return self.world.rank == 0

    def _broadcast(self, value: Any) -> Any:
        if not self._distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def _all_gather(self, value: Any) -> list[Any]:
        if not self._distributed:
            return [value]
        gathered: list[Any] = [None] * self.world.world_size
        dist.all_gather_object(gathered, value, group=self._group)
        return gathered

    def _run_on_coordinator(self, action, *args) -> Any:
        """Run ``action`` on rank 0 and broadcast its result, or its error as a message to raise."""
        outcome: tuple[bool, Any] = (True, None)
        if self._is_coordinator:
            try:
                outcome = (True, action(*args))
            except Exception as error:  # raised on every rank below; a lost error would hang the others
                logger.error("checkpoint: %s failed on rank 0: %s", action.__name__, error)
                outcome = (False, _root_cause(error))
        return self._broadcast(outcome)

    # ---- save ----

    def save(self, step: int, app_state: Mapping[str, Any]) -> None:
        """Checkpoint ``app_state`` at ``step``. Sync: returns once committed. Async: once staged."""
        self._finish_pending()
        state = self._collect_state(app_state)
        self._check_replicated(state)
        ok, staging = self._run_on_coordinator(self._location.stage, step)
        if not ok:
            raise CheckpointSaveError(f"checkpoint for step {step} not started: {staging}")
        pending = _PendingSave(staging=staging, record=self._record_for(step, state))
        writer = self._location.writer(staging, pending.written, self.thread_count)
        try:
            if self.async_mode == "async":
                upload = self._async_save(state, writer)
                pending.future = self._committer.submit(self._complete_async, pending, upload)
                self._pending = pending
                return
            dcp.save(state, storage_writer=writer, process_group=self._group, no_dist=not self._distributed)
        except (Exception, CheckpointException) as error:  # DCP's CheckpointException is a BaseException
            self._abandon(pending, error)
        self._commit(pending)

    def wait(self) -> None:
        """Wait until an async save in flight is committed; raise its error (every rank calls this)."""
        self._finish_pending()

    def save_in_flight(self) -> bool:
        """Whether an async save is still writing or committing."""
        return self._pending is not None and not self._pending.future.done()

    def close(self) -> None:
        try:
            self._finish_pending()
        finally:
            self._committer.shutdown(wait=True)
            self._location.close()
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None

    def _async_save(self, state: dict[str, Any], writer: StorageWriter) -> Future:
        if self._stager is None:
            # Reused across saves: it keeps the CPU copies and refills them (0.05 s per 500 MB
            # against 0.5 s to allocate fresh). Safe because a save finishes before the next stages.
            on_device = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=on_device, use_shared_memory=False,
                                                        use_async_staging=False,
                                                        use_non_blocking_copy=on_device))
        response = dcp.async_save(state, storage_writer=writer, process_group=self._group,
                                  async_stager=self._stager, no_dist=not self._distributed)
        # DCP returns the upload future, or an AsyncSaveResponse holding it when staging itself is
        # asynchronous: a probe of DCP's return type, not of our checkpointer protocol.
        return response.upload_completion if hasattr(response, "upload_completion") else response

    def _complete_async(self, pending: _PendingSave, upload: Future) -> None:
        """On the committer thread of every rank: wait for DCP's write, then commit."""
        try:
            upload.result()
        except (Exception, CheckpointException) as error:
            self._abandon(pending, error)
        self._commit(pending)

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.future.result()  # raises the CheckpointSaveError of a failed async save

    def _collect_state(self, app_state: Mapping[str, Any]) -> dict[str, Any]:
        if "model" not in app_state:
            raise ValueError("app_state must hold the 'model'")
        if _RNG_PART in app_state:
            raise ValueError(f"app_state key {_RNG_PART!r} is reserved for the per-rank RNG states")
        state = {"model": _model_state(app_state["model"])}
        if app_state.get("optimizer") is not None:
            state["optimizer"] = _optimizer_state(app_state["model"], app_state["optimizer"])
        for name, part in app_state.items():
            if name not in _DCP_PARTS and part is not None:
                state[name] = part.state_dict()
        state[_RNG_PART] = {f"rank_{self.world.rank}": capture_rng()}
        return state

    def _check_replicated(self, state: Mapping[str, Any]) -> None:
        """Global parts are saved once: refuse if ranks disagree, rather than keep one at random."""
        digests = {name: digest_json(value) for name, value in state.items()
                   if name not in (*_DCP_PARTS, _RNG_PART)}
        gathered = self._all_gather(digests)
        differing = sorted({name for other in gathered for name in digests if other.get(name) != digests[name]})
        if differing:
            raise ValueError(f"app_state parts {differing} differ across ranks; they are saved once per "
                             "checkpoint, so they must be global (e.g. ops.loading.sampling.SamplerState)")

    def location(self, step: int) -> str:
        """Where this run's checkpoint of ``step`` lives: a run-folder path, or a store URL."""
        return self._location.where(step)

    def has_own_checkpoint(self) -> bool:
        """Whether this run has committed a checkpoint of its own (its folder's ``latest``, or the store's versions)."""
        ok, answer = self._run_on_coordinator(self._location.has_committed)
        if not ok:
            raise CheckpointCorrupt(self._location.root, [("", f"listing the store failed: {answer}")])
        return answer

    def _record_for(self, step: int, state: Mapping[str, Any]) -> dict[str, Any]:
        # A data part is a data source's state (ops.loading.sampling.nested_state reads old flat ones too).
        sampler_state = nested_state(state["data"])["sampler"] if state.get("data") else {}
        optimizer_names = sorted({name for per_param in state.get("optimizer", {}).get("state", {}).values()
                                  for name in per_param})
        content = {
            "parts": sorted(state),
            "model_tensors": _tensor_specs(state["model"]),
            "optimizer_state_names": optimizer_names,
            "rng_ranks": list(range(self.world.world_size)),
            "rng_has_cuda": torch.cuda.is_available(),
            "rng_seed": self.seed,
            "progress": _progress_summary(state),
            "data": _jsonable(state.get("data")),
            "references": {"config_hash": self.lineage.get("config_hash", "unknown"),
                           "manifest_version": self.lineage.get("manifest_version", "unknown"),
                           "code_commit": self.lineage.get("git_commit", "unknown"),
                           "dataset_version": sampler_state.get("dataset_version", "unknown")},
            "async": self.async_mode == "async",
            "torch_version": torch.__version__,
            "numerics": self.numerics,
            **({"reproduction": self.reproduction} if self.reproduction is not None else {}),
        }
        return {"step": step, "world_size": self.world.world_size, "lineage": self.lineage,
                "model_fingerprint": self.model_fingerprint, "content": content}

    def _abandon(self, pending: _PendingSave, error: BaseException | None, reason: str = "") -> NoReturn:
        """Remove the partial tmp dir (rank 0) and raise a CheckpointSaveError (every rank calls this)."""
        if pending.written.errors:  # this rank's own I/O error says more than DCP's wrapper of it
            reason = _root_cause(pending.written.errors[0])
        if self._is_coordinator:
            self._location.abandon(pending.staging)
        latest = self._location.latest_name()
        partial = pending.staging.shown
        raise CheckpointSaveError(
            f"checkpoint for step {pending.step} was not saved ({reason or _root_cause(error)}); the partial "
            f"checkpoint {partial} was removed and the previous checkpoint "
            f"({latest or 'none'}) is untouched") from error

    def _commit(self, pending: _PendingSave) -> None:
        if self.fault_hooks is not None:
            self.fault_hooks.before_commit(pending.step)
        gathered = self._all_gather((pending.written.files, [_root_cause(e) for e in pending.written.errors]))
        failed = [f"rank {rank}: {errors[0]}" for rank, (_, errors) in enumerate(gathered) if errors]
        if failed:
            self._abandon(pending, None, "; ".join(failed))
        ok, result = self._run_on_coordinator(self._commit_on_coordinator, pending, gathered)
        if not ok:
            raise CheckpointSaveError(f"checkpoint for step {pending.step} was not committed: {result}; "
                                      f"latest still points to {self._location.latest_name() or 'nothing'}")
        self.last_record = result
        if self.fault_hooks is not None:  # a byte flip is a drill of the run folder's copy
            self.fault_hooks.after_commit(pending.step, self._location.folder(pending.step))

    def _commit_on_coordinator(self, pending: _PendingSave, gathered: list[tuple]) -> dict[str, Any]:
        digests: dict[str, store.FileDigest] = {}
        for rank_digests, _ in gathered:
            digests.update(rank_digests)
        return self._location.commit(pending.staging, pending.record, digests)

    # ---- load ----

    def load(self, app_state: Mapping[str, Any], checkpoint_dir: str | Path | None = None, *,
             expected_run_id: str | None = None) -> int | None:
        """Restore ``app_state``; return the checkpoint's step, or None when there is none.

        Without ``checkpoint_dir``, the newest committed checkpoint of this run that verifies
        (older ones are fallen back to, with notes). The checkpoint's lineage must name
        ``expected_run_id``: this run by default, the parent run's id to start from its checkpoint.
        """
        self._finish_pending()
        run_id = expected_run_id or self.run_id
        ok, verdict = self._run_on_coordinator(self._choose_checkpoint, checkpoint_dir, run_id)
        if not ok:
            raise CheckpointCorrupt(checkpoint_dir or self.run_dir, [("", verdict)])
        chosen, record, problems, notes, none_verified = verdict
        for note in notes:
            logger.warning("checkpoint: %s", note)
        if problems and none_verified:
            raise NoVerifiedCheckpoint(self.run_dir, [tuple(problem) for problem in problems])
        if problems:
            raise CheckpointCorrupt(chosen or self.run_dir, [tuple(problem) for problem in problems])
        if chosen is None:
            self.last_load = LoadReport(checkpoint_dir=None, step=None, notes=notes)
            return None
        # Model first: building the optimizer template initializes a fresh optimizer's state.
        self._check_compatible(chosen, {"model": _model_state(app_state["model"])}, record)
        template = self._load_template(app_state, record)
        self._check_compatible(chosen, template, record)
        notes += [f"{name} is in the checkpoint but not in app_state; not restored"
                  for name in sorted(set(record["content"]["parts"]) - set(template) - {_RNG_PART})]
        reader = checkpoint_reader(chosen, record["files"])
        try:
            dcp.load(template, storage_reader=reader, planner=_WeightsOnlyLoadPlanner(),
                     process_group=self._group, no_dist=not self._distributed)
        except (Exception, CheckpointException) as error:  # DCP's CheckpointException is a BaseException
            if reader.refusals:  # the rank that refused (.metadata: rank 0); other ranks get DCP's error naming it
                refused = reader.refusals[0]
                name = str(refused).split(":", 1)[0] if isinstance(refused, object_store.StoreObjectRefused) \
                    else DCP_METADATA_NAME
                raise CheckpointCorrupt(chosen, [(name, f"refused: {refused}")]) from error
            raise
        notes += self._apply(app_state, template, record)
        self.last_load = LoadReport(checkpoint_dir=chosen if objstore.is_remote(chosen) else Path(chosen),
                                    step=record["step"], notes=notes)
        logger.info("checkpoint: restored step %d from %s", record["step"], chosen)
        return record["step"]

    def _choose_checkpoint(self, checkpoint_dir: str | Path | None, run_id: str | None) -> tuple:
        """(dir, record, problems, notes, none_verified) on rank 0: verified before anything is read."""
        if checkpoint_dir is not None:
            report = verify_checkpoint(checkpoint_dir, self._hmac_key, run_id)
            return str(checkpoint_dir), report.record, report.problems, [], False
        return tuple(self._location.choose(run_id))

    def restore_from_mirror(self) -> str | None:
        """When the run folder has no checkpoint, fetch the mirror's newest committed one into it (rank 0 acts).

        Every rank calls it, before deciding where the run starts; the fetched checkpoint is then
        verified by load() like any other. Returns the fetched checkpoint's name, or None.
        """
        if self.mirror is None:
            return None
        ok, name = self._run_on_coordinator(self.mirror.restore_into, self.run_dir)
        if not ok:
            raise CheckpointCorrupt(self.mirror.url, [("", f"restoring from the mirror failed: {name}")])
        return name

    def start_over_if_none_verifies(self) -> list[str]:
        """With start_over: quarantine the run's checkpoints now if none verifies; notes on what moved.

        For a caller that decides from the folder what a fresh run starts from (train.py: a
        parent's weights unless the run has its own checkpoint) before calling load(). Every rank
        calls it; rank 0 acts. Without start_over, or when one verifies, it moves nothing.
        """
        if not self.start_over:
            return []
        self._finish_pending()
        ok, notes = self._run_on_coordinator(self._location.start_over_if_none_verifies, self.run_id)
        if not ok:
            raise CheckpointCorrupt(self.run_dir, [("", notes)])
        return notes

    def _load_template(self, app_state: Mapping[str, Any], record: Mapping[str, Any]) -> dict[str, Any]:
        """The state dict DCP loads into: live tensors (resharded in place) and placeholders."""
        template = self._collect_state(app_state)
        rng = template.pop(_RNG_PART)
        if self.world.rank in record["content"]["rng_ranks"]:
            if not record["content"].get("rng_has_cuda"):
                rng[f"rank_{self.world.rank}"].pop("cuda", None)
            template[_RNG_PART] = rng
        return template

    def _check_compatible(self, checkpoint_dir: Path, template: Mapping[str, Any],
                          record: Mapping[str, Any]) -> None:
        mismatches: dict[str, str] = {}
        if record["model_fingerprint"] != self.model_fingerprint:
            mismatches["model_fingerprint"] = (f"checkpoint {record['model_fingerprint']!r}, "
                                               f"live model {self.model_fingerprint!r}")
        saved, live = record["content"]["model_tensors"], _tensor_specs(template["model"])
        for key in sorted(saved.keys() | live.keys()):
            if key not in live:
                mismatches[f"model.{key}"] = "in the checkpoint, not in the live model"
            elif key not in saved:
                mismatches[f"model.{key}"] = "in the live model, not in the checkpoint"
            elif saved[key] != live[key]:
                mismatches[f"model.{key}"] = f"checkpoint {_spec_text(saved[key])}, live model {_spec_text(live[key])}"
        for name in sorted(set(template) - {"model", _RNG_PART}):
            if name not in record["content"]["parts"]:
                mismatches[name] = "in app_state, not in the checkpoint"
        if "optimizer" in template and "optimizer" in record["content"]["parts"]:
            live_names = sorted({name for per_param in template["optimizer"].get("state", {}).values()
                                 for name in per_param})
            if live_names != record["content"]["optimizer_state_names"]:
                mismatches["optimizer.state"] = (f"checkpoint holds {record['content']['optimizer_state_names']}, "
                                                 f"live optimizer {live_names}")
        if mismatches:
            raise CheckpointIncompatible(checkpoint_dir, mismatches)

    def _apply(self, app_state: Mapping[str, Any], loaded: dict[str, Any], record: Mapping[str, Any]) -> list[str]:
        model, optimizer = app_state["model"], app_state.get("optimizer")
        if isinstance(model, nn.Module):
            set_model_state_dict(model, loaded["model"])
        else:
            model.load_state_dict(loaded["model"])
        if isinstance(optimizer, torch.optim.Optimizer):
            set_optimizer_state_dict(model, optimizer, loaded["optimizer"])
        elif optimizer is not None:
            optimizer.load_state_dict(loaded["optimizer"])
        for name, part in app_state.items():
            if name not in _DCP_PARTS and part is not None:
                part.load_state_dict(loaded[name])
        rank = self.world.rank
        if _RNG_PART in loaded:
            restore_rng(loaded[_RNG_PART][f"rank_{rank}"])
            return []
        derive_rng(self.seed, rank)
        note = (f"rank {rank}: checkpoint saved on {record['world_size']} ranks has no RNG state for it; "
                f"re-derived every generator from (seed={self.seed}, rank={rank})")
        logger.warning("checkpoint: %s", note)
        return [note]


def _model_state(model: Any) -> dict[str, Any]:
    return get_model_state_dict(model) if isinstance(model, nn.Module) else model.state_dict()


def _optimizer_state(model: Any, optimizer: Any) -> dict[str, Any]:
    if not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer.state_dict()  # a Stateful wrapper, FQN-keyed already
    if not isinstance(model, nn.Module):
        raise ValueError("app_state['optimizer'] is a torch Optimizer, so app_state['model'] must be the "
                         "nn.Module (its parameter names key the optimizer state)")
    return get_optimizer_state_dict(model, optimizer)


def _progress_summary(state: Mapping[str, Any]) -> dict[str, Any] | None:
    """The scalar fields (step, epoch, consumed samples, ...) of the progress part, for the record."""
    for name in _PROGRESS_PARTS:
        if isinstance(state.get(name), Mapping):
            return {key: value for key, value in state[name].items() if isinstance(value, (int, float, str))}
    return None


def _tensor_specs(model_state: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Global shape and dtype per model entry (DTensor.shape is the global shape)."""
    specs = {}
    for key, value in model_state.items():
        if isinstance(value, torch.Tensor):
            specs[key] = {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
        else:
            specs[key] = {"type": type(value).__name__}
    return specs


def _spec_text(spec: Mapping[str, Any]) -> str:
    return f"{spec['dtype']}{spec['shape']}" if "shape" in spec else spec.get("type", "?")


def _jsonable(value: Any) -> Any:
    """A JSON round trip of ``value`` (for the record), or None."""
    return None if value is None else json.loads(canonical_json(value))


def _root_cause(error: BaseException) -> str:
    """The underlying error, unwrapping DCP's per-rank CheckpointException and exception chains.

    torch.save turns a failed write into "RuntimeError: [enforce fail ...] unexpected pos"; the
    OSError (e.g. ENOSPC) survives only as its __context__.
    """
    if isinstance(error, CheckpointException) and error.failures:
        rank, (inner, _) = sorted(error.failures.items())[0]
        return f"rank {rank}: {_root_cause(inner)}"
    chain: list[BaseException] = []
    cause: BaseException | None = error
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    if disk_full := next((c for c in chain if isinstance(c, OSError) and c.errno == errno.ENOSPC), None):
        return f"disk full: {disk_full}"
    if store_full := next((c for c in chain if isinstance(c, objstore.StoreFull)), None):
        return f"StoreFull: {store_full}"  # the store's own answer to it is a generic InternalError
    return f"{type(chain[-1]).__name__}: {chain[-1]}"
