"""The arithmetic of benchmarks/compare.py on given numbers: medians, spread, tolerance, verdict.
The benchmarks themselves are not run here (minutes on 2 cores; python -m benchmarks.compare).

Run: python -m pytest tests/test_benchmarks_compare.py -q
"""

from __future__ import annotations

import os

import pytest

from benchmarks.compare import METRICS, MIN_TOLERANCE, judge, spread, summarize


def test_spread_is_the_largest_relative_distance_from_a_sides_median() -> None:
    assert spread([10.0, 11.0, 9.0], [20.0, 20.0, 20.0]) == pytest.approx(0.1)
    assert spread([4.0, 4.0], [2.0, 2.2]) == pytest.approx(0.1 / 2.1)
    assert spread([10.0, 10.0, 13.0]) == pytest.approx(0.3)  # from the median, not the mean (11)


def test_head_within_twice_the_spread_is_no_regression_beyond_it_a_regression() -> None:
    # base 100 +- 5 %: tolerance 10 %. Samples/s 8 % lower passes, 12 % lower fails.
    base = [95.0, 100.0, 105.0]
    assert judge(base, [92.0, 92.0, 92.0], "higher")["verdict"] == "no_regression"
    slower = judge(base, [88.0, 88.0, 88.0], "higher")
    assert slower["verdict"] == "regression" and slower["tolerance"] == pytest.approx(0.1)
    assert slower["head_over_base"] == pytest.approx(0.88)
    # Lower is better for step time: a faster head is never a regression, a slower one is.
    assert judge([1.0, 1.0], [0.5, 0.5], "lower")["verdict"] == "no_regression"
    assert judge([1.0, 1.0], [1.03, 1.03], "lower")["verdict"] == "regression"  # noiseless: MIN_TOLERANCE
    assert MIN_TOLERANCE < 0.03
    # Rounds 30 % apart: a band that wide would pass anything, so it is not called no_regression.
    assert judge([70.0, 100.0, 130.0], [100.0] * 3, "higher")["verdict"] == "too_noisy"


def test_summarize_judges_every_metric_and_names_the_regressed() -> None:
    def result(scale: float) -> dict:
        loader = {variant: {"loader_frames_per_s": 1000.0 * scale, "ratio_vs_ceiling": 0.9 * scale}
                  for variant in ("compressed", "decoded", "compressed_bucketed")}
        step = {"step_time_s": 0.2, "samples_per_s": 40.0, "data_wait_fraction": 0.02}
        return {"loader": loader, "step": step}

    same = summarize({"base": [result(1.0)] * 2, "head": [result(1.0)] * 2})
    assert same["verdict"] == "no_regression" and set(same["metrics"]) == set(METRICS)
    worse = summarize({"base": [result(1.0)] * 2, "head": [result(0.8)] * 2})
    assert worse["verdict"] == "regression"
    assert worse["regressed"] == sorted(name for name in METRICS if name.startswith("loader."))
    noisy = summarize({"base": [result(1.0), result(1.5)], "head": [result(1.25)] * 2})
    assert noisy["verdict"] == "too_noisy" and noisy["regressed"] == []


def test_a_base_that_cannot_run_todays_benchmarks_is_refused_by_name_before_any_round(tmp_path) -> None:
    """1473b84 (the old default base) predates the ops/ re-layout: `make bench` lost compare's figures
    minutes in, on an ImportError in the base's first loader run. Refused up front, with the reason."""
    import contextlib
    import subprocess

    from benchmarks import compare

    old = "1473b84"
    if subprocess.run(["git", "cat-file", "-e", f"{old}^{{commit}}"], cwd=compare.CHECKOUT).returncode != 0:
        pytest.skip(f"{old} is not in this clone's history (a shallow clone)")
    with contextlib.ExitStack() as stack:
        tree = compare.add_worktree(stack, old)
        with pytest.raises(compare.BenchmarkFailed, match="cannot run this checkout's benchmarks.*ops.clips"):
            compare.check_imports(tree, dict(os.environ))
        compare.check_imports(compare.CHECKOUT, dict(os.environ))  # today's tree runs them
        with pytest.raises(compare.BenchmarkFailed, match="no worktree of 'no-such-ref'"):
            compare.add_worktree(stack, "no-such-ref")
