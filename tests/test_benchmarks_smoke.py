"""Every benchmark in benchmarks/ runs with --smoke and prints a JSON line that keeps its schema.

A benchmark that no test runs rots: `make bench` once crashed on `manifest_scale` (a manifest
column added since) and `python -m benchmarks.step` on a changed `build_shards` signature, and
nothing noticed. Here each one runs as a user runs it (`python -m benchmarks.<name> --smoke`, a
real subprocess on tiny inputs), and its last line is held to benchmarks/schemas/<name>.json
(benchmarks/harness.py): a crash, a dropped or added key, or a changed type fails.

Run: python -m pytest tests/test_benchmarks_smoke.py -q   (~3 minutes on 2 cores; compare runs
the step and loader benchmarks on two worktrees)
"""

from __future__ import annotations

import argparse
import copy
import json

import pytest

from benchmarks import harness

_RUNS: dict[str, tuple] = {}


def smoke_run(name: str) -> tuple:
    """One --smoke run per benchmark per session (several tests read the same line)."""
    if name not in _RUNS:
        _RUNS[name] = harness.run(name)
    return _RUNS[name]


# Every benchmark, by its module name: one added to benchmarks/ without a smoke run and a schema fails here.
BENCHMARKS = ["benchmarks.backfill", "benchmarks.checkpoint", "benchmarks.comm", "benchmarks.compare", "benchmarks.first_step",
              "benchmarks.gpu_check",
              "benchmarks.loader", "benchmarks.manifest_scale", "benchmarks.media_store",
              "benchmarks.metadata_table", "benchmarks.step"]


def test_every_benchmark_has_a_schema_and_every_schema_a_benchmark() -> None:
    names = harness.benchmark_names()
    assert [f"benchmarks.{name}" for name in names] == BENCHMARKS
    schemas = sorted(path.stem for path in harness.SCHEMA_DIR.glob("*.json"))
    assert schemas == names, "each benchmark keeps benchmarks/schemas/<name>.json (python -m benchmarks.smoke --write-schema)"


# A cluster benchmark's smoke runs beside the other multi-node tests (tests/test_slurm_nodes.py).
@pytest.mark.parametrize("name", sorted(set(harness.benchmark_names()) - harness.CLUSTER_BENCHMARKS))
def test_the_benchmark_runs_with_smoke_and_its_line_keeps_the_schema(name: str) -> None:
    done, line = smoke_run(name)
    assert done.returncode == 0, f"benchmarks.{name} --smoke exited {done.returncode}:\n{done.stderr[-4000:]}"
    assert line is not None, f"benchmarks.{name} --smoke printed no JSON object last:\n{done.stdout[-2000:]}"
    assert line["smoke"] is True, "a smoke run's figures must be marked, so they are never quoted"
    assert line.get("benchmark") == name
    assert harness.validate(name, line) == []


def test_the_schema_check_fails_a_dropped_key_an_added_key_and_a_changed_type() -> None:
    done, line = smoke_run("manifest_scale")
    assert done.returncode == 0 and line is not None, done.stderr[-3000:]
    assert harness.validate("manifest_scale", line) == []
    dropped = copy.deepcopy(line)
    del dropped["results"][0]["validate_s"]
    assert any("validate_s" in problem for problem in harness.validate("manifest_scale", dropped))
    added = copy.deepcopy(line) | {"new_figure": 1.0}
    assert any("new_figure" in problem for problem in harness.validate("manifest_scale", added))
    retyped = copy.deepcopy(line)
    retyped["results"][0]["rows"] = str(retyped["results"][0]["rows"])
    assert any(problem.startswith("results/0/rows") for problem in harness.validate("manifest_scale", retyped))


def test_the_manifest_scale_smoke_quarantines_about_its_bad_fraction_not_everything() -> None:
    # The synthetic table must stay a valid manifest: a column added to the schema and filled
    # wrongly would quarantine every row and still "run".
    _done, line = smoke_run("manifest_scale")
    for result in line["results"]:
        assert 0 < result["num_quarantined"] <= 0.03 * result["rows"], result
        assert result["gates_passed"]


def test_mapping_keys_vary_freely_but_their_values_keep_a_type() -> None:
    schema = harness.infer_schema({"reason_counts": {"duplicate_content": 3}, "rows": 5})
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema)
    assert not list(validator.iter_errors({"reason_counts": {"truncated_file": 1, "split_leakage": 2}, "rows": 7}))
    assert list(validator.iter_errors({"reason_counts": {"truncated_file": "one"}, "rows": 7}))
    assert list(validator.iter_errors({"reason_counts": {}, "rows": 7, "extra": 1}))


def test_smoke_arguments_are_defaults_that_the_command_line_overrides() -> None:
    def parser() -> argparse.ArgumentParser:
        built = argparse.ArgumentParser()
        built.add_argument("--sizes", type=int, nargs="+", default=[100_000])
        built.add_argument("--rounds", type=int, default=5)
        return built

    smoke_args = ["--sizes", "10", "--rounds", "1"]
    assert harness.parse(parser(), [], smoke_args).sizes == [100_000]
    args = harness.parse(parser(), ["--smoke"], smoke_args)
    assert (args.sizes, args.rounds, args.smoke) == ([10], 1, True)
    assert harness.parse(parser(), ["--smoke", "--rounds", "3"], smoke_args).rounds == 3



def test_record_appends_each_run_with_commit_date_and_machine_and_keeps_a_failure_beside_the_figures(tmp_path) -> None:
    # A bad argument makes manifest_scale exit 2 (argparse): a real failed run, recorded, not lost.
    path, records = harness.record(["manifest_scale", "metadata_table"], smoke=True, results_dir=tmp_path,
                                   extra_args={"manifest_scale": ["--bad-fraction", "not-a-number"]})
    head, _dirty = harness.commit()
    assert path == tmp_path / f"{head[:12]}.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == records and [line["benchmark"] for line in lines] == ["manifest_scale", "metadata_table"]
    failed, ok = lines
    assert failed["status"] == "failed" and failed["exit"] == 2 and "bad-fraction" in failed["output_tail"]
    assert failed["args"] == ["--bad-fraction", "not-a-number"]
    assert ok["status"] == "ok" and ok["result"]["benchmark"] == "metadata_table" and ok["result"]["smoke"] is True
    assert harness.validate("metadata_table", ok["result"]) == []
    for line in lines:
        assert line["commit"] == head and line["smoke"] is True and line["date"].startswith("20")
        assert line["machine"]["cpu_count"] >= 1 and line["machine"]["memory_gb"] > 0
    # A second record appends: earlier figures of the same commit are never overwritten.
    harness.record(["metadata_table"], smoke=True, results_dir=tmp_path)
    assert len(path.read_text().splitlines()) == 3


def test_full_size_record_skips_the_gpu_check_without_a_gpu_and_says_why() -> None:
    if harness.machine()["gpus"]:
        pytest.skip("this machine has a GPU: the check runs")
    assert "no GPU" in harness.applicable("gpu_check")
    assert harness.applicable("manifest_scale") is None


def test_a_checkpoint_variant_that_fails_is_named_with_its_reason_beside_the_figures_that_succeeded() -> None:
    import subprocess
    import sys

    from benchmarks import checkpoint as bench

    failed: dict[str, str] = {}
    broken = [sys.executable, "-c", "import sys; sys.exit('No writable volumes and no free volumes left')"]
    figures = bench.variant("object_store", lambda: subprocess.run(broken, check=True, capture_output=True, text=True),
                            failed)
    kept = bench.variant("reshard_load", lambda: 0.25, failed)
    assert figures is None and kept == 0.25
    assert list(failed) == ["object_store"]
    assert "CalledProcessError" in failed["object_store"] and "No writable volumes" in failed["object_store"]
    # The schema takes any variant name with a string reason, so a failed run is still a valid line.
    assert harness.validate("checkpoint", {**json.loads(json.dumps(_reference_line())), "failed_variants": failed,
                                           "object_store": None}) == []


def _reference_line() -> dict:
    """The checkpoint smoke run's line (one run per session, shared with the schema test)."""
    done, line = smoke_run("checkpoint")
    assert done.returncode == 0 and line is not None, done.stderr[-3000:]
    return line


def test_the_checkpoint_benchmarks_store_holds_every_rounds_bytes(tmp_path) -> None:
    """SeaweedFS frees a deleted object's space only on compaction: the store must hold all rounds at once.

    The default store (2 GiB) filled at --state-mb 600 and every object-store figure was lost.
    """
    from benchmarks.checkpoint import sized_store

    checkpoint = tmp_path / "step_000001"
    checkpoint.mkdir()
    with open(checkpoint / "__0_0.distcp", "wb") as handle:
        handle.truncate(700 * 10**6)  # sparse: the size is what counts
    for repeats in (1, 3, 5):
        store = sized_store(tmp_path / "s3", checkpoint, repeats)
        capacity = store.volume_size_mb * 10**6 * store.max_volumes
        assert capacity >= 2 * 2 * repeats * 700 * 10**6, (repeats, store.volume_size_mb, store.max_volumes)
