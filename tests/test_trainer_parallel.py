"""Tests of trainer/parallel.py in one process: per-rank seeding, the determinism flags it sets
and restores, the single-rank process group, and that parallelize's wrappers keep parameter
names and numerics (activation checkpointing recomputes the same ops, so losses are equal).

Run: python -m pytest tests/test_trainer_parallel.py -q
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from ops.loading.sampling import World, rank_seed
from trainer.launch.config import load_config
from trainer.launch.config_sections import tiny
from trainer.models.video import VideoFlowModel
from trainer.parallel import (
    Distributed,
    clip_and_reduce,
    destroy_distributed,
    init_distributed,
    parallelize,
    restore_determinism,
    seed_everything,
)

ONE_CPU_RANK = Distributed(world=World(rank=0, world_size=1), device=torch.device("cpu"), backend=None)


def draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_seeding_depends_on_seed_and_rank_and_flags_are_restored() -> None:
    before = torch.are_deterministic_algorithms_enabled()
    snapshot = seed_everything(3, 0, deterministic=True, device_type="cpu")
    assert torch.are_deterministic_algorithms_enabled()
    rank0 = draws()
    seed_everything(3, 0, deterministic=True, device_type="cpu")
    assert draws() == rank0
    seed_everything(3, 1, deterministic=True, device_type="cpu")
    rank1 = draws()
    assert all(a != b for a, b in zip(rank0, rank1, strict=True))
    restore_determinism(snapshot)
    assert torch.are_deterministic_algorithms_enabled() == before


def test_every_generator_is_seeded_with_the_one_rank_seed() -> None:
    # Pinned: the values seed_everything derived before ops.loading.sampling.rank_seed held the derivation,
    # so every rank's streams, and the losses, stay as they were.
    assert [rank_seed(3, rank) for rank in (0, 1)] == [6233904063939786893, 5712964121383671236]
    snapshot = seed_everything(3, 1, deterministic=False, device_type="cpu")
    seeded = draws()
    random.seed(5712964121383671236)
    np.random.seed(5712964121383671236 % 2**32)
    torch.manual_seed(5712964121383671236)
    assert draws() == seeded
    restore_determinism(snapshot)


def test_init_distributed_reads_the_world_from_torchruns_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match=r"RANK=2, WORLD_SIZE=2, LOCAL_RANK=0.*rank must be in \[0, 2\)"):
        init_distributed(parallelism="ddp", device="cpu", collective_timeout_s=10)
    assert not torch.distributed.is_initialized()


def test_parallelism_none_refuses_a_launched_multi_rank_world(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="parallelism 'none' runs 2 independent copies"):
        init_distributed(parallelism="none", device="cpu", collective_timeout_s=10)


def test_ddp_without_torchrun_runs_as_a_group_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    distributed = init_distributed(parallelism="ddp", device="cpu", collective_timeout_s=10)
    try:
        assert (distributed.world, distributed.backend) == (World(rank=0, world_size=1), "gloo")
        assert torch.distributed.get_world_size() == 1
    finally:
        destroy_distributed()
    assert not torch.distributed.is_initialized()


def build(activation_checkpointing: bool) -> torch.nn.Module:
    config = load_config(None, ["preset=tiny_cpu", "train.run_dir=unused",
                                f"train.activation_checkpointing={activation_checkpointing}"])
    model = VideoFlowModel(tiny(), video_shape=(4, 16, 16))
    model.init_weights(seed=0)
    return parallelize(model, config.train, ONE_CPU_RANK)


def test_activation_checkpointing_keeps_names_and_gradients() -> None:
    plain, checkpointed = build(False), build(True)
    assert "_checkpoint_wrapped_module" in "".join(name for name, _ in checkpointed.named_parameters())
    assert get_model_state_dict(checkpointed).keys() == get_model_state_dict(plain).keys()
    generator = torch.Generator().manual_seed(0)
    inputs = (torch.randint(0, 256, (2, 4, 16, 16, 3), dtype=torch.uint8, generator=generator),
              torch.randn(2, 256, generator=generator), torch.tensor([True, False]),
              torch.randn(2, 4, 16, 16, 3, generator=generator), torch.rand(2, generator=generator))
    norms = []
    for model in (plain, checkpointed):
        model(*inputs).mean().backward()
        norms.append(clip_and_reduce(model, None, [], distributed=ONE_CPU_RANK)[0])
    assert norms[0] == norms[1] and norms[0] > 0


def test_determinism_is_set_without_importing_inductor_and_a_compile_gets_the_same_setting() -> None:
    """torch.use_deterministic_algorithms imports inductor and dynamo (seconds in every rank's start);
    a rank that never compiles must not pay it, and one that compiles must compile deterministically."""
    import subprocess
    import sys

    code = """
import json, sys, torch
from trainer.parallel import compile_blocks, seed_everything
seed_everything(3, 0, deterministic=True, device_type="cpu")
seen = {"deterministic": torch.are_deterministic_algorithms_enabled(), "inductor": "torch._inductor" in sys.modules}
compile_blocks([torch.nn.Linear(2, 2)])
import torch._inductor.config as inductor_config
seen["inductor_deterministic"] = inductor_config.deterministic
print(json.dumps(seen))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"deterministic": True, "inductor": False,
                                                        "inductor_deterministic": True}


def _from_rank_0_worker(rank: int, init_file: str, fail: bool, out_dir: str) -> None:
    import datetime
    import types
    from pathlib import Path

    import torch.distributed as dist

    from trainer.wiring import _from_rank_0

    # A peer left waiting fails here within 30 s instead of hanging the test.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    trainer = types.SimpleNamespace(world=World(rank=rank, world_size=2, local_rank=rank))
    calls = []

    def compute():
        calls.append(rank)
        if fail:
            raise OSError("git is gone")
        return {"git_commit": "abc", "computed_on": rank}

    try:
        result = {"value": _from_rank_0(trainer, compute), "calls": calls}
    except Exception as error:  # noqa: BLE001 - the test reads which error each rank saw
        result = {"error": f"{type(error).__name__}: {error}", "calls": calls}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.parametrize("fail", [False, True], ids=["computed", "rank_0_failed"])
def test_what_every_rank_records_is_computed_once_and_a_failure_on_rank_0_never_leaves_a_peer_waiting(
        tmp_path, fail: bool) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(_from_rank_0_worker, args=(str(tmp_path / "init"), fail, str(tmp_path)), nprocs=2,
                       join=True, start_method="spawn")
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [record["calls"] for record in seen] == [[0], []]  # rank 1 never computes it
    if fail:
        assert seen[0]["error"] == "OSError: git is gone"
        assert "rank 0 could not compute what every rank records: OSError: git is gone" in seen[1]["error"]
    else:
        assert seen[0]["value"] == seen[1]["value"] == {"git_commit": "abc", "computed_on": 0}
