"""A toy trainer for the checkpoint tests, runnable as the torchrun worker they launch.

Nothing here depends on the real trainer: a few Linear layers with dropout and LayerNorm,
AdamW, a StepLR schedule, a grad scaler (plain mode), a global data source whose state is a
plain dict, and noise drawn from python ``random`` and numpy so that every RNG a checkpoint
must restore changes the loss.

    python -m torch.distributed.run --nproc-per-node=2 tests/test_checkpoint_toy.py \
        train --run-dir RUN --parallel fsdp --steps 4 --save-at 2 --out result.json
    python tests/test_checkpoint_toy.py train --run-dir RUN --steps 4 --resume --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict)

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script by torchrun
    sys.path.insert(0, str(REPO))

from ops.loading.sampling import World  # noqa: E402
from trainer.checkpointing.checkpointer import Checkpointer  # noqa: E402

RUN_ID = "toy-run"
FINGERPRINT = "toy-model-v1"
DATASET_VERSION = "toy-data-v1"
PARALLEL_MODES = ("none", "ddp", "fsdp")


class ToyModel(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.drop = nn.Dropout(0.1)
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.drop(torch.nn.functional.gelu(self.inp(x)))))


class ToyData:
    """Global batch source: batch t is a function of (seed, position) alone; each rank takes a slice."""

    def __init__(self, *, seed: int = 7, batch_size: int = 4) -> None:
        self.seed, self.batch_size, self.position = seed, batch_size, 0

    def next_batch(self, world: World) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.position)
        rows = self.batch_size * world.world_size
        x, y = torch.randn(rows, 8, generator=generator), torch.randn(rows, 4, generator=generator)
        self.position += 1
        mine = slice(world.rank * self.batch_size, (world.rank + 1) * self.batch_size)
        return x[mine], y[mine]

    def state_dict(self) -> dict[str, Any]:
        """The data sources' layout (ops.loading.sampling.nested_state): the record reads the dataset version there."""
        return {"sampler": {"dataset_version": DATASET_VERSION, "seed": self.seed, "position": self.position}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sampler = state["sampler"]
        if sampler["dataset_version"] != DATASET_VERSION:
            raise ValueError(f"data state is for {sampler['dataset_version']!r}")
        self.seed, self.position = sampler["seed"], sampler["position"]


class Progress:
    def __init__(self) -> None:
        self.step, self.epoch, self.consumed_samples = 0, 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "epoch": self.epoch, "consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.epoch, self.consumed_samples = state["step"], state["epoch"], state["consumed_samples"]


def current_world() -> World:
    if dist.is_initialized():
        return World(rank=dist.get_rank(), world_size=dist.get_world_size())
    return World(rank=0, world_size=1)


def seed_everything(seed: int, rank: int) -> None:
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)


def build(parallel: str = "none", *, width: int = 32, world: World | None = None) -> dict[str, Any]:
    """app_state for a fresh toy run; parameters are identical on every rank and in every mode."""
    world = world or current_world()
    torch.manual_seed(0)
    model: nn.Module = ToyModel(width)
    if parallel == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world.world_size,))
        for layer in (model.inp, model.out):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    app_state = {"model": model, "optimizer": optimizer,
                 "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5),
                 "grad_scaler": torch.amp.GradScaler("cpu", init_scale=2.0**8) if parallel == "none" else None,
                 "data": ToyData(), "progress": Progress()}
    seed_everything(1234, world.rank)
    return app_state


def train_step(app_state: dict[str, Any], world: World) -> float:
    model, optimizer, scaler = app_state["model"], app_state["optimizer"], app_state["grad_scaler"]
    x, y = app_state["data"].next_batch(world)
    x = x + 1e-2 * torch.from_numpy(np.random.normal(size=x.shape).astype(np.float32)) + 1e-2 * random.random()
    loss = torch.nn.functional.mse_loss(model(x), y)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    app_state["lr_scheduler"].step()
    progress = app_state["progress"]
    progress.step += 1
    progress.consumed_samples += x.shape[0] * world.world_size
    return float(loss.detach())


def full_state(app_state: dict[str, Any]) -> dict[str, Any]:
    """Unsharded model and optimizer state (on every rank), for comparisons in tests."""
    options = StateDictOptions(full_state_dict=True)
    model, optimizer = app_state["model"], app_state["optimizer"]
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)["state"]
    return {"model": {k: v.detach().clone() for k, v in get_model_state_dict(model, options=options).items()},
            "optimizer": {fqn: {name: value.detach().clone() for name, value in per_param.items()}
                          for fqn, per_param in optimizer_state.items()}}


def checkpointer(run_dir: Path, *, async_mode: str = "off", keep_last_k: int = 10,
                 hmac_key: bytes | None = None, fingerprint: str = FINGERPRINT, run_id: str = RUN_ID,
                 seed: int = 99, thread_count: int = 2, start_over: bool = False,
                 store_url: str | None = None) -> Checkpointer:
    return Checkpointer(run_dir, world=current_world(), keep_last_k=keep_last_k, keep_every_m=0,
                        async_mode=async_mode, hmac_key=hmac_key, lineage={"run_id": run_id},
                        model_fingerprint=fingerprint, seed=seed, thread_count=thread_count,
                        start_over=start_over, store_url=store_url)


# --------------------------------------------------------------------------------------------
# Worker commands (run under torchrun, or as a plain script for one process)
# --------------------------------------------------------------------------------------------

def _train(args: argparse.Namespace) -> dict[str, Any]:
    world = current_world()
    app_state = build(args.parallel, world=world)
    ckpt = checkpointer(args.run_dir, async_mode=args.async_mode, store_url=args.store_url)
    start = ckpt.load(app_state) if args.resume else None
    losses = {}
    for step in range((start or 0) + 1, args.steps + 1):
        losses[step] = train_step(app_state, world)
        if step in args.save_at:
            ckpt.save(step, app_state)
    ckpt.close()
    if args.dump:
        _dump(app_state, args.dump, world)
    return {"start": start, "losses": losses, "notes": ckpt.last_load.notes if ckpt.last_load else []}


def _save_loop(args: argparse.Namespace) -> dict[str, Any]:
    """Save a tens-of-MB state at steps 1, 2, 3, ... until killed (the SIGKILL test)."""
    app_state = build("none", width=args.width)
    ckpt = checkpointer(args.run_dir, keep_last_k=2)
    for step in range(1, 10_000):
        train_step(app_state, current_world())
        ckpt.save(step, app_state)
    return {}


def _reshard_matrix(args: argparse.Namespace) -> dict[str, Any]:
    """Under torchrun: save from DDP and from FSDP2, then load every source into every wrapping.

    ``--checkpoint`` is a checkpoint saved on one rank (by the test). Writes ``<source>.pt`` (the
    state at save time) and ``<source>_into_<mode>.pt`` (the state after loading) under --run-dir.
    """
    world, work = current_world(), args.run_dir
    sources = {"single": args.checkpoint}
    for mode in ("ddp", "fsdp"):
        app_state = build(mode, world=world)
        for _ in range(3):
            train_step(app_state, world)
        ckpt = checkpointer(work / mode)
        ckpt.save(3, app_state)
        ckpt.close()
        _dump(app_state, work / f"{mode}.pt", world)
        sources[mode] = work / mode / "checkpoints" / "step_000003"
    results = {}
    for source, mode in (("single", "fsdp"), ("single", "ddp"), ("ddp", "fsdp"), ("fsdp", "ddp")):
        app_state = build(mode, world=world)
        ckpt = checkpointer(work / "loads")
        step = ckpt.load(app_state, sources[source])
        ckpt.close()
        _dump(app_state, work / f"{source}_into_{mode}.pt", world)
        notes: list[Any] = [None] * world.world_size
        dist.all_gather_object(notes, ckpt.last_load.notes)
        results[f"{source}_into_{mode}"] = {"step": step, "notes_per_rank": notes,
                                            "progress": app_state["progress"].state_dict(),
                                            "data": app_state["data"].state_dict()}
    return results


def _dump(app_state: dict[str, Any], path: Path, world: World) -> None:
    state = full_state(app_state)
    if world.rank == 0:
        torch.save(state, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=("train", "save-loop", "reshard-matrix"))
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--parallel", choices=PARALLEL_MODES, default="none")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-at", type=lambda text: {int(s) for s in text.split(",") if s}, default=set())
    parser.add_argument("--async-mode", choices=("off", "async"), default="off")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--dump", type=Path)
    parser.add_argument("--store-url", help="checkpoints straight to this object-store prefix (stage.checkpoint_io=store)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    try:
        commands = {"train": _train, "save-loop": _save_loop, "reshard-matrix": _reshard_matrix}
        result = commands[args.command](args)
        if args.out and current_world().rank == 0:
            args.out.write_text(json.dumps(result))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# The toy's own preconditions: the checkpoint tests compare runs bit for bit
# --------------------------------------------------------------------------------------------

def test_toy_training_is_deterministic_and_uses_every_rng():
    def run(reseed_numpy: int | None = None) -> list[float]:
        app_state = build("none")
        if reseed_numpy is not None:
            np.random.seed(reseed_numpy)
        return [train_step(app_state, World(rank=0, world_size=1)) for _ in range(3)]

    assert run() == run()
    assert run() != run(reseed_numpy=5)  # numpy's state reaches the loss, so it must be restored


def test_toy_data_state_resumes_the_same_batches():
    world = World(rank=1, world_size=2)
    data = ToyData()
    data.next_batch(world)
    state = data.state_dict()
    expected = data.next_batch(world)
    resumed = ToyData(seed=0)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.next_batch(world)[0], expected[0])
    assert not torch.equal(ToyData().next_batch(world)[0], expected[0])


if __name__ == "__main__":
    main()
