"""The start-up breakdown (trainer/observe/startup.py) and the memory estimate's cache that cut it
(trainer/launch/memory.py); a stage's breakdown end to end is asserted in tests/test_training_assets.py."""

import json
import os
import subprocess
import sys
import time

import pytest

from trainer.launch import memory
from trainer.launch.config import load_config
from trainer.observe.startup import MARKS, StartupClock, flat_metadata, process_start_time


def test_each_phase_runs_from_the_latest_earlier_mark_and_queue_waits_are_apart():
    clock = StartupClock({"requested": 100.0, "run_started": 102.5, "step_started": 104.0, "preflight": 104.5,
                          "launched": 105.0, "job_started": 115.0, "process_started": 115.25, "imports": 117.0,
                          "first_batch": 118.0, "first_step": 118.5, "first_checkpoint": 120.0})
    record = clock.breakdown()
    assert record["queue_wait"] == 2.5 and record["slurm_queue_wait"] == 10.0
    assert record["phases"] == {"step_started": 1.5, "preflight": 0.5, "launched": 0.5, "process_started": 0.25,
                                "imports": 1.75, "first_batch": 1.0, "first_step": 0.5, "first_checkpoint": 1.5}
    # 18.5 s from the request, 12.5 s of them in queues: 6 s of start-up, the imports the largest part.
    assert record["to_first_step_with_queue_s"] == 18.5 and record["to_first_step_s"] == 6.0
    assert record["largest_phase"] == "imports" and record["first_mark"] == "requested"
    assert list(record["marks"]) == [name for name in MARKS if name in record["marks"]]  # in time order
    flat = flat_metadata(record)
    assert flat["startup/imports_s"] == 1.75 and flat["startup/queue_wait_s"] == 2.5
    assert flat["startup/to_first_step_s"] == 6.0 and flat["startup/largest_phase"] == "imports"


def test_the_first_mark_wins_and_marks_from_another_process_are_checked():
    clock = StartupClock()
    clock.mark("first_step", 10.0)
    clock.mark("first_step", 20.0)  # a second pass (a retried step) does not move it
    assert clock.marks["first_step"] == 10.0
    clock.merge({"requested": 5.0, "bogus": 1.0, "launched": "7", "run_started": True, "step_started": 6})
    assert clock.marks == {"first_step": 10.0, "requested": 5.0, "step_started": 6.0}
    with pytest.raises(ValueError, match="unknown start-up mark"):
        clock.mark("first_stpe")
    assert "to_first_step_s" not in StartupClock({"requested": 1.0}).breakdown()  # no step yet: no total


def test_a_process_start_time_is_when_the_process_began():
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        time.sleep(0.5)
        started = process_start_time(child.pid)
        assert started is not None and before - 0.05 <= started <= before + 0.45
    finally:
        child.kill()
        child.wait()
    assert process_start_time(2**22 + 7) is None  # no such process


CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "demo.yaml")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(memory.MEMORY_CACHE_VARIABLE, str(tmp_path / "memory"))
    memory._measure.cache_clear()
    yield tmp_path / "memory"
    memory._measure.cache_clear()


def _files(cache):
    """(the estimate's cache file, the measurement's), each the only one of its kind."""
    records = {path: json.loads(path.read_text()) for path in cache.glob("*.json")}
    (estimate,) = [path for path, record in records.items() if "estimate" in record["key"]]
    (measured,) = [path for path, record in records.items() if "estimate" not in record["key"]]
    return estimate, measured


def test_the_memory_estimate_and_its_measurement_are_cached_by_shape_and_code(cache, monkeypatch):
    config = load_config(CONFIG, [])
    truth = memory.estimate_memory(config, 2)
    estimate_file, measured_file = _files(cache)
    record = json.loads(measured_file.read_text())
    assert record["key"]["dim"] == config.model.dim and record["code"] == memory.measured_code_version()
    assert json.loads(estimate_file.read_text())["value"]["num_params"] == truth.num_params
    memory._measure.cache_clear()
    monkeypatch.setattr(memory, "_measure_now", lambda *a, **k: pytest.fail("measured again"))
    monkeypatch.setattr(memory, "_estimate", lambda *a, **k: pytest.fail("estimated again"))
    assert memory.estimate_memory(config, 2) == truth  # the estimate, from its file
    monkeypatch.undo()
    monkeypatch.setenv(memory.MEMORY_CACHE_VARIABLE, str(cache))
    monkeypatch.setattr(memory, "_measure_now", lambda *a, **k: pytest.fail("measured again"))
    assert memory.estimate_memory(config, 4) != truth  # another world size: estimated, the measurement read
    monkeypatch.undo()
    monkeypatch.setenv(memory.MEMORY_CACHE_VARIABLE, str(cache))
    wider = load_config(CONFIG, ["model.dim=128"])  # another shape: measured, not read
    assert memory.estimate_memory(wider, 2).activations_bytes > truth.activations_bytes


@pytest.mark.parametrize("which", ["estimate", "measured"])
@pytest.mark.parametrize("edit", ["key", "code", "garbage", "negative"])
def test_a_cache_file_that_does_not_hold_this_shape_and_code_is_not_used(cache, which, edit):
    config = load_config(CONFIG, [])
    truth = memory.estimate_memory(config, 2)
    estimate_file, measured_file = _files(cache)
    path = estimate_file if which == "estimate" else measured_file
    if which == "measured":
        estimate_file.unlink()  # else the estimate's own file answers first
    record = json.loads(path.read_text())
    if edit == "key":  # a file renamed onto another shape's name
        (record["key"]["estimate"] if which == "estimate" else record["key"])["batch_size" if which == "estimate"
                                                                              else "num_heads"] = 1
    elif edit == "code":  # written by other model code (or another torch)
        record["code"] = "0" * 20
    elif edit == "negative":
        if which == "estimate":
            record["value"]["num_params"] = -1
        else:
            record["value"]["per_layer"] = -1.0
    path.write_text("{not json" if edit == "garbage" else json.dumps(record))
    memory._measure.cache_clear()
    assert memory.estimate_memory(config, 2) == truth
    assert json.loads(path.read_text())["code"] == memory.measured_code_version()  # rewritten


def test_a_cpu_launch_estimated_before_imports_no_torch_in_the_dagster_process(cache):
    """The cut (docs/status.md): the Dagster process's preflight of a CPU fp32 config whose estimate is
    cached imports no torch (about a second of every launch's start-up)."""
    code = ("import sys; from trainer.launch.config import load_config; from trainer.launch.preflight import preflight; "
            f"plan = preflight(load_config({CONFIG!r}, []), world_size=2); "
            "print(plan.memory.total_bytes, 'torch' in sys.modules)")
    env = {**os.environ, memory.MEMORY_CACHE_VARIABLE: str(cache)}
    first, second = (subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                                    cwd=os.path.dirname(CONFIG) + "/..").stdout.split() for _ in range(2))
    assert first[0] == second[0] and first[1] == "True" and second[1] == "False", (first, second)


def test_the_cache_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv(memory.MEMORY_CACHE_VARIABLE, "off")
    memory._measure.cache_clear()
    try:
        memory.estimate_memory(load_config(CONFIG, []), 2)
    finally:
        memory._measure.cache_clear()
    assert memory._cache_path({"dim": 1}) is None


def test_a_retried_step_counts_its_start_up_from_its_own_start_not_the_runs_request():
    """A requeued stage (dagster.RetryRequested) runs its step again in the same run: its breakdown must
    not charge the earlier attempt's whole run to the retry's Dagster start."""
    import datetime
    import types

    from assets.stage_runs import dagster_startup_clock

    created = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=30)
    record = types.SimpleNamespace(create_timestamp=created, start_time=created.timestamp() + 1)
    instance = types.SimpleNamespace(get_run_record_by_id=lambda run_id: record)

    def context(retry_number):
        return types.SimpleNamespace(instance=instance, run=types.SimpleNamespace(run_id="r"), retry_number=retry_number)

    first = dagster_startup_clock(context(0)).marks
    assert first["requested"] == created.timestamp() and first["run_started"] == created.timestamp() + 1
    assert first["step_started"] - first["requested"] > 1700
    retried = dagster_startup_clock(context(1)).marks
    assert list(retried) == ["step_started"]
