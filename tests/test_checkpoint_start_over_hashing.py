"""start_over and resume re-hash each checkpoint once (review nit: it hashed every one 2-3 times).

Re-hashing is the cost of resuming a big run (every shard is read), so the trainer's sequence,
``start_over_if_none_verifies()`` then ``load()``, must read each data file once. Counted on the
real toy Checkpointer: the sha256 of each ``.distcp`` file computed by verification.
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

import test_checkpoint_toy as toy
from ops.checkpoints import store as store
from ops.loading.sampling import World

WORLD = World(rank=0, world_size=1)


def _two_checkpoints(run_dir: Path) -> list[Path]:
    app_state = toy.build("none")
    ckpt = toy.checkpointer(run_dir)
    for step in (1, 2):
        toy.train_step(app_state, WORLD)
        ckpt.save(step, app_state)
    ckpt.close()
    return [store.checkpoints_dir(run_dir) / store.step_dir_name(step) for step in (1, 2)]


def _count_shard_hashes(monkeypatch) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    sha256_file = store.sha256_file

    def counting(path):
        if Path(path).suffix == ".distcp":
            counts[f"{Path(path).parent.name}/{Path(path).name}"] += 1
        return sha256_file(path)

    monkeypatch.setattr(store, "sha256_file", counting)
    return counts


@pytest.mark.parametrize("damage", ["none", "newest", "all"])
def test_start_over_then_load_hashes_each_shard_at_most_once(tmp_path: Path, monkeypatch, damage: str) -> None:
    run_dir = tmp_path / "run"
    checkpoints = _two_checkpoints(run_dir)
    damaged = {"none": [], "newest": checkpoints[1:], "all": checkpoints}[damage]
    for checkpoint in damaged:  # a flipped shard byte: found only by hashing it
        shard = sorted(checkpoint.glob("*.distcp"))[0]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    counts = _count_shard_hashes(monkeypatch)
    ckpt = toy.checkpointer(run_dir, start_over=True)
    moved = ckpt.start_over_if_none_verifies()
    step = ckpt.load(toy.build("none"))
    ckpt.close()
    assert step == {"none": 2, "newest": 1, "all": None}[damage]
    assert len(moved) == (2 if damage == "all" else 0)
    assert counts and max(counts.values()) == 1, counts
