"""Tests of trainer/data.py: SyntheticClips follows ops/sampling.py's global order (rank r takes
positions r, r+W, ...), so a global step holds the same samples for every world size, and its
state resumes under another world size with nothing missing or repeated.

Run: python -m pytest tests/test_trainer_data.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ops.sampling import ResumeStateMismatch, World, epoch_order
from trainer.data import DataConfig, SyntheticClips

GLOBAL_BATCH = 8
NUM_SAMPLES = 30  # not a multiple of 8: each epoch drops a tail of 6


def config(**overrides) -> DataConfig:
    fields = dict(batch_size=GLOBAL_BATCH, clip_frames=4, height=16, width=16, audio_samples=128,
                  num_samples=NUM_SAMPLES, seed=5)
    return DataConfig(**(fields | overrides))


def sources(world_size: int, cfg: DataConfig | None = None) -> list[SyntheticClips]:
    cfg = cfg or config()
    return [SyntheticClips(cfg, world=World(rank=rank, world_size=world_size),
                           local_batch_size=GLOBAL_BATCH // world_size) for rank in range(world_size)]


def global_steps(world_size: int, num_steps: int) -> list[list[int]]:
    """Each step's samples, ranks interleaved element by element (j-major, r-minor)."""
    ranks = sources(world_size)
    steps = []
    for _ in range(num_steps):
        per_rank = [source.next_indices() for source in ranks]
        steps.append([index for column in zip(*per_rank, strict=True) for index in column])
    return steps


def test_ranks_take_interleaved_positions_of_the_epoch_order() -> None:
    order = epoch_order(NUM_SAMPLES, 5, 0)
    rank0, rank1 = sources(2)
    assert rank0.next_indices() == order[[0, 2, 4, 6]].tolist()
    assert rank1.next_indices() == order[[1, 3, 5, 7]].tolist()


def test_global_steps_are_the_same_for_every_world_size() -> None:
    reference = global_steps(1, 9)  # crosses two epoch boundaries
    assert global_steps(2, 9) == reference
    assert global_steps(4, 9) == reference
    first_epoch = [index for step in reference[:3] for index in step]
    assert len(set(first_epoch)) == 24  # 3 full steps, no repeats; the 6 left over are dropped


def test_batches_have_the_contract_shapes_and_are_deterministic() -> None:
    (first,), (again,) = sources(1), sources(1)
    batch, repeat = first.next_batch(), again.next_batch()
    assert batch["video"].shape == (8, 4, 16, 16, 3) and batch["video"].dtype == torch.uint8
    assert batch["audio"].shape == (8, 128) and batch["audio"].dtype == torch.float32
    assert batch["has_audio"].dtype == torch.bool and len(batch["keys"]) == 8
    assert torch.equal(batch["video"], repeat["video"]) and batch["keys"] == repeat["keys"]
    silent = ~batch["has_audio"]
    assert bool((batch["audio"][silent] == 0).all()) and bool((batch["audio"][~silent] != 0).any())


def test_resume_on_another_world_size_continues_the_same_order() -> None:
    reference = global_steps(1, 6)
    (single,) = sources(1)
    for _ in range(4):
        single.next_indices()
    state = single.state_dict()
    resumed = sources(4)
    for source in resumed:
        source.load_state_dict(state)
    for expected in reference[4:]:
        per_rank = [source.next_indices() for source in resumed]
        assert [index for column in zip(*per_rank, strict=True) for index in column] == expected


def test_state_for_another_dataset_is_refused() -> None:
    (small,) = sources(1)
    (other,) = sources(1, config(num_samples=64))
    with pytest.raises(ResumeStateMismatch):
        other.load_state_dict(small.state_dict())


def test_content_depends_on_the_sample_not_the_epoch() -> None:
    (source,) = sources(1)
    seen: dict[str, np.ndarray] = {}
    for _ in range(8):  # more than two epochs
        batch = source.next_batch()
        for key, video in zip(batch["keys"], batch["video"], strict=True):
            if key in seen:
                assert np.array_equal(seen[key], video.numpy())
            seen[key] = video.numpy()
    assert len(seen) <= NUM_SAMPLES
