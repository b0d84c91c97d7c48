"""The environment record of a training run (trainer/observe/host.py): read from this machine, on CPU.
Run: python -m pytest tests/test_host_record.py -q
"""

from __future__ import annotations

import json
import os
import platform
import socket
from pathlib import Path

import av
import torch

from ops import lineage
from trainer.launch.config import load_config
from trainer.observe.host import host_record
from trainer.loop import Trainer


def _cpu_model() -> str:
    return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name"))


def test_the_record_holds_this_machine_and_its_software(monkeypatch) -> None:
    monkeypatch.delenv("SLURM_JOB_NUM_NODES", raising=False)
    monkeypatch.delenv("SLURM_NNODES", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    record = host_record(world_size=1)
    assert record["host"] == socket.gethostname() and record["node_count"] == 1
    assert record["cpu_model"] == _cpu_model() and record["cpu_count"] == os.cpu_count()
    assert record["cpu_affinity"] == len(os.sched_getaffinity(0))
    assert record["memory_bytes"] == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") > 2**30
    assert record["python"] == platform.python_version() and record["torch"] == torch.__version__
    assert record["ffmpeg"] == av.ffmpeg_version_info and record["pyav"] == av.__version__
    assert record["container_digest"] == lineage.container_digest()
    if not torch.cuda.is_available():  # a CPU machine: nothing invented for the GPU fields
        assert (record["gpu_model"], record["gpu_count"], record["gpu_driver"], record["nccl"]) == (None, 0, None, None)
        assert record["cuda"] == torch.version.cuda


def test_the_node_count_comes_from_slurm_else_from_the_ranks_per_node(monkeypatch) -> None:
    monkeypatch.delenv("SLURM_NNODES", raising=False)
    monkeypatch.delenv("SLURM_JOB_NUM_NODES", raising=False)
    assert host_record(world_size=4, local_world_size=2)["node_count"] == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert host_record(world_size=8)["node_count"] == 2
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "3")
    assert host_record(world_size=8)["node_count"] == 3


def test_a_run_records_it_in_final_json(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TRAINYARD_CONTAINER_DIGEST", "sha256:" + "ab" * 32)
    config = load_config(None, ["preset=tiny_cpu", "train.steps=2", f"train.run_dir={tmp_path / 'run'}"])
    trainer = Trainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()
    environment = json.loads((tmp_path / "run" / "final.json").read_text())["environment"]
    assert environment["host"] == socket.gethostname() and environment["container_digest"] == "sha256:" + "ab" * 32
    assert set(environment) == {"host", "node_count", "cpu_model", "cpu_count", "cpu_affinity", "memory_bytes",
                                "gpu_model", "gpu_count", "gpu_driver", "cuda", "nccl", "container_digest", "python",
                                "torch", "ffmpeg", "pyav", "hosts", "rank_hosts"}
    assert environment["hosts"] == socket.gethostname() and environment["rank_hosts"] == f"0:{socket.gethostname()}"
    assert environment["node_count"] == 1
    assert json.loads((tmp_path / "run" / "hosts.json").read_text())["ranks"] == {"0": socket.gethostname()}
