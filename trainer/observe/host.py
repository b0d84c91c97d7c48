"""The environment a training run ran in, recorded with its lineage.

    record = host_record(world_size=2, local_world_size=2)

Held in final.json (``environment``), the MLflow run's params (``environment.*``) and the stage's
Dagster metadata (``env/*``). Every field is read from the machine, never assumed: a value this
machine cannot give (no GPU, no NCCL in a CPU build of torch, no nvidia-smi) is None, not a guess.

    host, node_count, cpu_model, cpu_count, cpu_affinity, memory_bytes,
    gpu_model, gpu_count, gpu_driver, cuda, nccl, container_digest, python, torch, ffmpeg, pyav

and, from every rank (``rank_hosts``, a collective when several ranks run):

    hosts       the distinct hosts of the run, in rank order ("node1,node2")
    rank_hosts  the host of each rank ("0:node1,1:node2"); node_count is the number of hosts

Rank 0 also writes them to ``run_dir/hosts.json`` (``write_hosts``) as soon as the ranks have met, so
a launcher that loses a node mid-run can name the ranks that ran there (resources/slurm.py).
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

_NVIDIA_SMI_TIMEOUT_S = 10


def host_record(*, world_size: int, local_world_size: int | None = None) -> dict[str, Any]:
    """This process's machine and software, plus the job's node count (SLURM's, else torchrun's)."""
    import torch

    from ops.lineage import container_digest

    local = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or world_size
    nodes = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES")
    cuda_here = torch.cuda.is_available()
    return {
        "host": socket.gethostname(),
        "node_count": int(nodes) if nodes and nodes.isdigit() else max(1, -(-world_size // max(1, local))),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_bytes": _memory_bytes(),
        "gpu_model": torch.cuda.get_device_name(0) if cuda_here else None,
        "gpu_count": torch.cuda.device_count() if cuda_here else 0,
        "gpu_driver": _gpu_driver() if cuda_here else None,
        "cuda": torch.version.cuda,
        "nccl": _nccl_version(),
        "container_digest": container_digest(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ffmpeg": _ffmpeg_version(),
        "pyav": _pyav_version(),
    }


def rank_hosts(world_size: int) -> list[str]:
    """The host of every rank, in rank order: one all_gather_object when several ranks run (every
    rank must call it), else this host."""
    import torch.distributed as dist

    here = socket.gethostname()
    if world_size <= 1 or not dist.is_available() or not dist.is_initialized():
        return [here]
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, here)
    return [str(host) for host in gathered]


def with_hosts(record: dict[str, Any], hosts: list[str]) -> dict[str, Any]:
    """``record`` naming every host of the run (module docstring)."""
    distinct = list(dict.fromkeys(hosts))
    return {**record, "host": hosts[0], "hosts": ",".join(distinct), "node_count": len(distinct),
            "rank_hosts": ",".join(f"{rank}:{host}" for rank, host in enumerate(hosts))}


def write_hosts(run_dir: str | Path, hosts: list[str], *, attempt: int) -> None:
    """run_dir/hosts.json: which host each rank of this attempt runs on, with the SLURM job, if any."""
    from ops.publish.durable import write_json_atomic

    write_json_atomic(Path(run_dir) / "hosts.json",
                      {"attempt": attempt, "slurm_job_id": os.environ.get("SLURM_JOB_ID") or None,
                       "ranks": {str(rank): host for rank, host in enumerate(hosts)}})


def read_hosts(run_dir: str | Path) -> dict[int, str]:
    """The rank -> host map of run_dir/hosts.json; {} when it is missing or not that shape."""
    import json

    try:
        raw = json.loads((Path(run_dir) / "hosts.json").read_text())
        return {int(rank): str(host) for rank, host in raw["ranks"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or None


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _gpu_driver() -> str | None:
    """The NVIDIA driver version from nvidia-smi (torch reports the CUDA runtime, not the driver)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=_NVIDIA_SMI_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    versions = sorted({line.strip() for line in done.stdout.splitlines() if line.strip()})
    return ",".join(versions) or None


def _nccl_version() -> str | None:
    import torch

    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):  # a CPU build of torch has no NCCL
        return None
    return ".".join(str(part) for part in version) if isinstance(version, tuple) else str(version)


def _ffmpeg_version() -> str | None:
    """The FFmpeg PyAV decodes with (its own libraries, not a system ffmpeg binary)."""
    try:
        import av
    except ImportError:
        return None
    return getattr(av, "ffmpeg_version_info", None) or ".".join(map(str, av.library_versions["libavcodec"]))


def _pyav_version() -> str | None:
    try:
        import av
    except ImportError:
        return None
    return av.__version__
