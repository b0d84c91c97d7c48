"""trainer/endings.py: every end of a run gets one class, and each rank writes its own record.

Run: python -m pytest tests/test_endings.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.endings import classify, rank_end_path, write_rank_end


class OutOfMemoryError(RuntimeError):
    """Named as torch's is: classified by name, without importing torch."""


@pytest.mark.parametrize(("status", "error", "expected"), [
    ("completed", None, "completed"),
    ("diverged", None, "diverged"),
    ("canceled", KeyboardInterrupt(), "preempted"),
    ("failed", RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 4000ms for recv"),
     "collective_timeout"),
    ("failed", RuntimeError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE)"),
     "collective_timeout"),
    ("failed", RuntimeError("NCCL communicator was aborted on rank 1"), "collective_timeout"),
    ("failed", RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:29500"), "peer_lost"),
    ("failed", OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "out_of_memory"),
    ("failed", RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes. out of memory"),
     "out_of_memory"),
    ("failed", ValueError("checkpointer restored step 3, but the train state it loaded is at step 4"), "error"),
])
def test_each_ending_gets_one_class(status: str, error: BaseException | None, expected: str) -> None:
    assert classify(status, error) == expected


def test_an_unagreed_status_without_an_error_is_refused() -> None:
    with pytest.raises(ValueError, match="without an error"):
        classify("failed", None)


def test_the_record_is_redacted_and_names_rank_host_and_step(tmp_path: Path) -> None:
    error = RuntimeError("Timed out; token=s3cr3t")
    record = write_rank_end(tmp_path, rank=1, world_size=2, status="failed", step=7, error=error,
                            redact=lambda text: text.replace("s3cr3t", "***"))
    on_disk = json.loads(rank_end_path(tmp_path, 1).read_text())
    assert on_disk == record and record["failure_class"] == "collective_timeout"
    assert record["rank"] == 1 and record["step"] == 7 and record["host"] and "s3cr3t" not in json.dumps(record)
