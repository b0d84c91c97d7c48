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

Save order: every rank writes its DCP files into one tmp dir, hashing each file while writing
it; the digests are gathered to rank 0, which hashes DCP's small .metadata and commits
(ops.checkpoints.store.commit: record last, rename, then `latest`). Async saves stage a CPU copy
in save() and do the rest on a background thread, so `latest` only ever names committed dirs.

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
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, FileSystem
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from ops.checkpoints import store as store
from ops.publish import objstore
from ops.checkpoints.dcp_metadata import DCP_METADATA_NAME, RecordedMetadataReader
from ops.publish.hashing import canonical_json, digest_json
from ops.loading.sampling import World, nested_state, rank_seed
from trainer.checkpointing import object_store

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
    step: int
    tmp_dir: Path | None
    """The run folder's tmp dir the save writes into; None when it writes to the store (``url``)."""
    supersede: bool
    record: dict[str, Any]
    digests: dict[str, store.FileDigest] = dataclasses.field(default_factory=dict)
    write_errors: list[BaseException] = dataclasses.field(default_factory=list)
    """Errors this rank's writer threads hit. DCP drops an exception raised in a helper thread
    (it only logs it), which would commit a checkpoint missing tensors; these refuse the commit."""
    future: Future | None = None
    url: str | None = None
    """``<store>/<run>/step_<N>`` for a save straight to the object store (trainer.checkpointing.object_store)."""


# --------------------------------------------------------------------------------------------
# DCP plumbing: a writer that hashes while writing, a loader that refuses arbitrary pickles
# --------------------------------------------------------------------------------------------

class _DigestingFileSystem(FileSystem):
    """DCP's local filesystem, recording the sha256 and size of each data file as written."""

    def __init__(self, pending: _PendingSave) -> None:
        super().__init__()
        self._pending = pending

    @contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as raw:
            name = Path(path).name
            if mode != "wb" or not name.endswith(DEFAULT_SUFFIX):
                yield raw  # the small .metadata pickle: hashed at commit
                return
            stream = store.DigestingFile(raw)
            try:
                yield stream
            except BaseException as error:
                self._pending.write_errors.append(error)  # list.append is atomic across threads
                raise
            finally:
                digest = stream.finish()  # also stops its hashing thread when the write failed
            # One file per writer thread, unique names: dict assignment needs no lock.
            self._pending.digests[name] = digest


def _writer(pending: _PendingSave, thread_count: int) -> FileSystemWriter:
    writer = FileSystemWriter(pending.tmp_dir, thread_count=thread_count, sync_files=True, overwrite=False)
    writer.fs = _DigestingFileSystem(pending)
    return writer


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
        store.plan_retention([], keep_last_k, keep_every_m)  # validates the retention numbers
        if store_url is not None and mirror is not None:
            raise ValueError("a checkpointer that writes to the store has nothing local to mirror: pass one of "
                             "store_url and mirror")
        if store_url is not None and start_over:
            raise ValueError("start_over moves a run folder's failed checkpoints aside and starts from step 0; in "
                             "the store a run never discards its progress wholesale (a resume passes a failing "
                             "version over, a new save of its step sets it aside): remove the failed versions "
                             "there, or use a new run")
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
        # Never logged, never written: only its HMAC output is. None: the configured key, created
        # under the Trainyard home on first use (ops.checkpoints.store.signing_key).
        self._hmac_key = store.signing_key() if hmac_key is None else hmac_key
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
        # Retention deletes old checkpoints here: rmtree of 500 MB costs ~0.1 s of a save's pause.
        self._deleter = ThreadPoolExecutor(1, thread_name_prefix="ckpt-delete")
        self.last_record: dict[str, Any] | None = None
        """The record of the last checkpoint this process committed (rank 0) or saw committed."""
        self.last_load: LoadReport | None = None
        self.fault_hooks: Any = None
        """trainer/faults.py's FaultInjector (before_commit, after_commit), for drills; None: none."""
        self.mirror = mirror
        """ops/checkpoints/mirror.py's CheckpointMirror (rank 0 publishes each commit to the object store); None: none."""
        self.store_url = store_url.rstrip("/") if store_url else None
        """Where checkpoints are written and read straight through DCP's fsspec writer and reader
        (``<root>/<run name>``, trainer.checkpointing.object_store), instead of the run folder; None: the run folder."""
        self._store_retention: Any = None
        self._survey: tuple[str, store.ResumeSurvey] | None = None
        """(run id, verdict) of start_over_if_none_verifies on rank 0, for the next load() only."""

    def __repr__(self) -> str:
        return (f"Checkpointer({str(self.run_dir)!r}, rank={self.world.rank}/{self.world.world_size}, "
                f"async_mode={self.async_mode!r}, start_over={self.start_over})")

    @property
    def run_id(self) -> str:
        return str(self.lineage["run_id"])

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
        self._survey = None  # a save changes the folder: no earlier verdict holds
        state = self._collect_state(app_state)
        self._check_replicated(state)
        if self.store_url is not None:
            ok, placed = self._run_on_coordinator(self._place_in_store, step)
            if not ok:
                raise CheckpointSaveError(f"checkpoint for step {step} not started: {placed}")
            pending = _PendingSave(step=step, tmp_dir=None, url=placed, supersede=False,
                                   record=self._record_for(step, state))
            writer = object_store.writer(placed, pending.digests, pending.write_errors, self.thread_count)
        else:
            ok, placed = self._run_on_coordinator(self._place_tmp_dir, step)
            if not ok:
                raise CheckpointSaveError(f"checkpoint for step {step} not started: {placed}")
            tmp_dir, supersede = Path(placed[0]), placed[1]
            pending = _PendingSave(step=step, tmp_dir=tmp_dir, supersede=supersede,
                                   record=self._record_for(step, state))
            writer = _writer(pending, self.thread_count)
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
            self._deleter.shutdown(wait=True)
            if self.mirror is not None and self._is_coordinator:
                self.mirror.close()
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None

    def _async_save(self, state: dict[str, Any], writer: FileSystemWriter) -> Future:
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

    def _place_tmp_dir(self, step: int) -> tuple[str, bool]:
        final = store.checkpoints_dir(self.run_dir) / store.step_dir_name(step)
        supersede = False
        if final.exists():
            report = store.verify(final, self._hmac_key)
            if report.ok:
                raise FileExistsError(f"step {step} is already committed at {final}")
            logger.warning("checkpoint: %s fails verification and will be superseded: %s", final, report.summary())
            supersede = True
        return str(store.new_tmp_dir(self.run_dir, step)), supersede

    def _place_in_store(self, step: int) -> str:
        url = objstore.join(self.store_url, store.step_dir_name(step))
        object_store.prepare(url, self._hmac_key)  # a committed step that verifies is never overwritten
        return url

    def location(self, step: int) -> str:
        """Where this run's checkpoint of ``step`` lives: a run-folder path, or a store URL."""
        if self.store_url is not None:
            return objstore.join(self.store_url, store.step_dir_name(step))
        return str(store.checkpoints_dir(self.run_dir) / store.step_dir_name(step))

    def has_own_checkpoint(self) -> bool:
        """Whether this run has committed a checkpoint of its own (its folder's ``latest``, or the store's versions)."""
        if self.store_url is not None:
            ok, names = self._run_on_coordinator(object_store.committed_versions, self.store_url)
            if not ok:
                raise CheckpointCorrupt(self.store_url, [("", f"listing the store failed: {names}")])
            return bool(names)
        return (store.checkpoints_dir(self.run_dir) / store.LATEST_NAME).exists()

    def _latest_name(self) -> str | None:
        if self.store_url is None:
            return store.read_latest(self.run_dir)
        try:
            names = object_store.committed_versions(self.store_url)
        except objstore.ObjectStoreError:
            return "unknown (the store did not answer)"
        return names[0] if names else None

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
        }
        return {"step": step, "world_size": self.world.world_size, "lineage": self.lineage,
                "model_fingerprint": self.model_fingerprint, "content": content}

    def _abandon(self, pending: _PendingSave, error: BaseException | None, reason: str = "") -> NoReturn:
        """Remove the partial tmp dir (rank 0) and raise a CheckpointSaveError (every rank calls this)."""
        if pending.write_errors:  # this rank's own I/O error says more than DCP's wrapper of it
            reason = _root_cause(pending.write_errors[0])
        if self._is_coordinator:
            if pending.url is not None:
                object_store.abandon(pending.url)  # uncommitted: no reader took them meanwhile
            else:
                store.remove_incomplete(pending.tmp_dir)
        latest = self._latest_name()
        partial = pending.url or pending.tmp_dir.name
        raise CheckpointSaveError(
            f"checkpoint for step {pending.step} was not saved ({reason or _root_cause(error)}); the partial "
            f"checkpoint {partial} was removed and the previous checkpoint "
            f"({latest or 'none'}) is untouched") from error

    def _commit(self, pending: _PendingSave) -> None:
        if self.fault_hooks is not None:
            self.fault_hooks.before_commit(pending.step)
        gathered = self._all_gather((pending.digests, [_root_cause(e) for e in pending.write_errors]))
        failed = [f"rank {rank}: {errors[0]}" for rank, (_, errors) in enumerate(gathered) if errors]
        if failed:
            self._abandon(pending, None, "; ".join(failed))
        ok, result = self._run_on_coordinator(self._commit_on_coordinator, pending, gathered)
        if not ok:
            raise CheckpointSaveError(f"checkpoint for step {pending.step} was not committed: {result}; "
                                      f"latest still points to {self._latest_name() or 'nothing'}")
        self.last_record = result
        if self.fault_hooks is not None:  # a byte flip is a drill of the run folder's copy
            self.fault_hooks.after_commit(pending.step, None if pending.url else Path(self.location(pending.step)))

    def _commit_on_coordinator(self, pending: _PendingSave, gathered: list[tuple]) -> dict[str, Any]:
        digests: dict[str, store.FileDigest] = {}
        for rank_digests, _ in gathered:
            digests.update(rank_digests)
        if pending.url is not None:
            return self._commit_in_store(pending, digests)
        final = store.checkpoints_dir(self.run_dir) / store.step_dir_name(pending.step)
        try:
            record = store.commit(pending.tmp_dir, final, pending.record, self._hmac_key,
                                  known_digests=digests, supersede_existing=pending.supersede)
        except Exception:
            if pending.tmp_dir.exists():  # not renamed: never became a checkpoint
                store.remove_incomplete(pending.tmp_dir)
            raise
        try:
            plan = store.apply_retention(self.run_dir, self.keep_last_k, self.keep_every_m,
                                         remove=self._delete_in_background)
        except OSError as error:  # a full or read-only disk must not fail a committed save
            logger.error("checkpoint: retention after step %d failed: %s", pending.step, error)
        else:
            if plan.delete:
                logger.info("checkpoint: retention let go of %s", [info.name for info in plan.delete])
        if self.mirror is not None:
            self.mirror.submit(self.run_dir)
        return record

    def _commit_in_store(self, pending: _PendingSave, digests: dict[str, store.FileDigest]) -> dict[str, Any]:
        try:
            record = object_store.commit_in_store(pending.url, pending.record, digests, self._hmac_key)
        except Exception:  # always re-raised (the caller turns it into CheckpointSaveError on every rank)
            object_store.abandon(pending.url)  # uncommitted: clear its objects (a committed one is kept, logged)
            raise
        if self._store_retention is None:
            from ops.checkpoints.mirror import CheckpointMirror

            self._store_retention = CheckpointMirror(self.store_url, keep_last_k=self.keep_last_k,
                                                     keep_every_m=self.keep_every_m)
        try:  # the stage's rule on the store's versions, pinned steps kept (the mirror's retention)
            self._store_retention.apply_retention(self.run_dir)
            if cleared := object_store.clear_orphans(self.store_url, pending.step):
                logger.info("checkpoint: removed uncommitted saves %s from %s", cleared, self.store_url)
        except objstore.ObjectStoreError as error:  # must not fail a committed save; the next one retries
            logger.error("checkpoint: retention in %s after step %d failed: %s", self.store_url, pending.step, error)
        return record

    def _delete_in_background(self, path: Path) -> None:
        """store.discard on the deleter thread: verify, then delete, or quarantine if it fails."""
        def report(done: Future) -> None:
            if done.exception() is not None:  # left as a hidden dir; the next retention retries
                logger.error("checkpoint: could not delete %s: %s", path, done.exception())
            elif done.result() is not None:
                logger.error("checkpoint: %s failed verification; kept in %s", path.name, done.result())

        self._deleter.submit(store.discard, path, self._hmac_key).add_done_callback(report)

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
        reader = (object_store.VerifyingStoreReader(chosen, record["files"]) if objstore.is_remote(chosen)
                  else RecordedMetadataReader(chosen, record["files"]))
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
            if objstore.is_remote(checkpoint_dir):  # every object re-hashed here, and again as it loads
                report = object_store.check_version(str(checkpoint_dir), self._hmac_key, run_id, rehash=True)
            else:
                report = store.verify(checkpoint_dir, self._hmac_key, run_id)
            return str(checkpoint_dir), report.record, report.problems, [], False
        if self.store_url is not None:
            return self._choose_in_store(run_id)
        survey = self._take_survey(run_id)
        if survey.chosen is not None:
            return str(survey.chosen), survey.record, [], survey.notes, False
        if survey.failed and not self.start_over:  # a run's progress is never thrown away silently
            return None, None, [(info.name, why) for info, why in survey.failed], survey.notes, True
        return None, None, [], survey.notes + self._quarantine_failed(survey.failed), False

    def _choose_in_store(self, run_id: str | None) -> tuple:
        """The newest committed version in the store that verifies whole (every object re-hashed, as the
        run folder's survey does, so a damaged newest one falls back to an older one), older ones fallen
        back to with notes; none verifying refuses the resume. The reader hashes each object again as
        DCP loads it: bytes changed after this check are refused, never loaded unchecked."""
        notes: list[str] = []
        failed: list[tuple[str, str]] = []
        for name in object_store.committed_versions(self.store_url):
            report = object_store.check_version(objstore.join(self.store_url, name), self._hmac_key, run_id,
                                                    rehash=True)
            if report.ok:
                return str(report.checkpoint_dir), report.record, [], notes, False
            why = "; ".join(f"{file}: {problem}" for file, problem in report.problems)
            failed.append((name, why))
            notes.append(f"{name} in {self.store_url} failed verification and was passed over: {why}")
        return None, None, failed, notes, bool(failed)

    def _take_survey(self, run_id: str | None) -> store.ResumeSurvey:
        """The survey start_over_if_none_verifies just made for this run id (once), else a new one."""
        cached, self._survey = self._survey, None
        if cached is not None and cached[0] == run_id:
            return cached[1]
        return store.survey_resume(self.run_dir, self._hmac_key, run_id)

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
        ok, notes = self._run_on_coordinator(self._quarantine_if_none_verifies)
        if not ok:
            raise CheckpointCorrupt(self.run_dir, [("", notes)])
        return notes

    def _quarantine_if_none_verifies(self) -> list[str]:
        survey = store.survey_resume(self.run_dir, self._hmac_key, self.run_id)
        if survey.chosen is not None:
            # The load() that follows takes this verdict instead of re-hashing every file again;
            # the reader still re-checks .metadata's sha256 when DCP reads it.
            self._survey = (self.run_id, survey)
            return []
        return self._quarantine_failed(survey.failed)

    @staticmethod
    def _quarantine_failed(failed: list[tuple[store.CheckpointInfo, str]]) -> list[str]:
        notes = []
        for info, why in failed:
            target = store.quarantine_checkpoint(info.path, reason=f"start_over: no checkpoint verified: {why}",
                                                 by="start_over")
            notes.append(f"start_over: no checkpoint verified; moved {info.name} to {target} ({why})")
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
