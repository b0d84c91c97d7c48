"""The loader benchmark's judgement (ops/clips/throughput.py, benchmarks/loader.py): paired rounds,
medians with their interquartile range, and a target called met only when the spread is
narrower than the gap. The arithmetic runs on given numbers; the measuring parts run for real
on small demo shards (their figures are not asserted, only what they count and report).
"""

from __future__ import annotations

import json

import pytest
from helpers import write_shards

from benchmarks import loader as bench
from ops.clips import throughput
from ops.clips.plan import ShardConfig
from ops.loading.loader import LoaderConfig
from ops.clips.shards import ShardIndex


def test_quartiles_are_inclusive_and_one_round_is_its_own_spread() -> None:
    assert throughput.quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 3.0, 4.0)
    assert throughput.quartiles([0.9]) == (0.9, 0.9, 0.9)


def test_a_target_is_met_only_with_enough_rounds_and_a_spread_narrower_than_the_gap() -> None:
    tight_above = [0.90, 0.91, 0.92, 0.92, 0.93, 0.93, 0.94]
    judged = throughput.judge_target(tight_above, 0.85)
    assert judged["verdict"] == "met" and judged["median"] == 0.92 and judged["rounds"] == 7
    assert judged["iqr"] == [0.915, 0.93] and judged["spread"] == pytest.approx(0.015)
    # The four reruns of main: 0.73, 0.86, 1.01, 1.14 (and three more like them).
    noisy = [0.73, 0.86, 1.01, 1.14, 0.80, 0.95, 1.05]
    judged = throughput.judge_target(noisy, 0.85)
    assert judged["verdict"] == "inconclusive" and "wider than the gap" in judged["why"]
    assert throughput.judge_target([0.70, 0.71, 0.72, 0.72, 0.73, 0.74, 0.75], 0.85)["verdict"] == "not_met"
    # Six rounds, however tight, are not enough; a median just above the target with a
    # spread as wide as the gap is not met either.
    assert throughput.judge_target(tight_above[:6], 0.85)["verdict"] == "inconclusive"
    assert throughput.judge_target([0.84, 0.85, 0.86, 0.86, 0.87, 0.88, 0.90], 0.85)["verdict"] == "inconclusive"


def _variant(verdict_ceiling: str, verdict_naive: str = "met") -> dict:
    return {"targets": {"ratio_vs_ceiling": {"verdict": verdict_ceiling}, "ratio_vs_naive": {"verdict": verdict_naive}}}


def test_the_overall_verdict_is_the_worst_of_the_targeted_variants() -> None:
    met = {name: _variant("met") for name in ("compressed", "compressed_bucketed")}
    assert bench.summarize({**met, "decoded": _variant("not_met")}) == {"verdict": "met", "targets_met": True}
    assert bench.summarize({**met, "compressed": _variant("inconclusive")})["verdict"] == "inconclusive"
    assert bench.summarize({**met, "compressed_bucketed": _variant("not_met")})["targets_met"] is False
    assert bench.summarize({**met, "decoded": _variant("not_met", "inconclusive")})["verdict"] == "inconclusive"


def test_worker_counts_parse_and_refuse_nonsense() -> None:
    assert bench.worker_counts("2,1,2") == [1, 2]
    assert bench.worker_counts(None)[:2] == [1, 2]
    for bad in ("0,1", ","):
        with pytest.raises(SystemExit):
            bench.worker_counts(bad)
    for flag in ("--rounds", "--slices", "--scaling-rounds"):
        with pytest.raises(SystemExit):
            bench.main([flag, "0"])
    with pytest.raises(SystemExit):
        bench.main(["--preset", "4k"])
    with pytest.raises(SystemExit, match="num_good must be at least 4"):
        bench.main(["--num-good", "2", "--hwaccel", "none", "--scaling", "0"])


@pytest.fixture(scope="module")
def index(demo_validation, tmp_path_factory) -> ShardIndex:
    _, shard_index = write_shards(demo_validation, ShardConfig(clips_per_shard=8),
                                  tmp_path_factory.mktemp("bench_shards"))
    return shard_index


def test_the_ceiling_decodes_every_clip_exactly_repeats_times(index) -> None:
    # Its pool comes from a forkserver: called from this threaded pytest process, no worker can
    # inherit a lock held by another thread at fork time (a forked one once hung in CI).
    clips = index.split("train").num_rows
    frames = next(iter(index.bucket_shapes.values())).num_frames
    measured = throughput.ceiling(index, split="train", num_processes=2, repeats=3)
    assert measured.num_clips == 3 * clips
    assert measured.num_frames == 3 * clips * frames
    # A rate per process over its own busy time, summed: never below the pool's overall rate.
    assert measured.frames_per_s >= measured.num_frames / measured.elapsed_s * 0.999


def test_compare_pairs_rounds_in_a_seeded_random_order_and_reports_each_sides_work(index, demo) -> None:
    from ops.clips import plan as clips
    plan = clips.read_plan(index.directory)
    result = throughput.compare(index, plan, demo.out_dir, batch_size=4, num_workers=1, epochs=1, rounds=3,
                                slices=2, seed=5, naive_clips=4)
    assert len(result["orders"]) == 3  # seeded: test_paired_rounds... holds the order to its seed
    # Every pass runs the loader and the ceiling; the naive loader runs in a round's first pass only.
    for first, second in result["orders"]:
        assert sorted(first) == ["ceiling", "loader", "naive"] and sorted(second) == ["ceiling", "loader"]
    assert len({tuple(first) for first, _ in result["orders"]}) > 1
    assert len(result["ratio_vs_ceiling_rounds"]) == 3
    low, high = result["ratio_vs_ceiling_iqr"]
    assert low <= result["ratio_vs_ceiling"] <= high
    # Three rounds never meet a target, whatever they measured.
    assert {judged["verdict"] for judged in result["targets"].values()} <= {"inconclusive"}
    assert "colour conversion yuv420p -> rgb24 (libswscale)" in result["work"]["ceiling"]
    assert set(result["work"]["ceiling"]) - set(result["work"]["loader"]) == {
        "clip bytes already in memory", "frames into one reused buffer"}
    json.dumps(result)


def test_an_empty_split_is_refused_by_name_not_a_crash_inside_the_pool(index) -> None:
    from ops.loading.loader import EmptySplitError
    with pytest.raises(EmptySplitError, match="'nope'"):
        throughput.ceiling(index, split="nope", num_processes=2)


def test_the_loader_window_closes_on_a_whole_number_of_batches_per_worker(index) -> None:
    config = LoaderConfig(batch_size=4, num_workers=2, verify_shards=False)
    measured = throughput.loader(index, config, num_clips=20)
    # 20 clips in batches of 4 over 2 workers: 3 batches each after a 4-batch warm-up (an epoch's
    # uneven last step may be short, so the clips are at most 24).
    assert measured.num_batches == 6 and 20 <= measured.num_clips <= 24
    assert measured.startup_s > 0 and measured.consumer_cpu_s >= 0


def test_hardware_decoding_that_does_not_open_is_reported_not_raised(index) -> None:
    assert bench.probe_hwaccel(index, "none") == {"used": None, "tried": {}}
    probed = bench.probe_hwaccel(index, "no-such-device")
    assert probed["used"] is None and probed["tried"]["no-such-device"] != "ok"


def test_paired_rounds_weigh_each_pass_by_its_time_and_run_once_sides_once_a_round() -> None:
    import random

    calls = {"loader": 0, "ceiling": 0, "naive": 0}
    figures = {"loader": [(100.0, 1.0), (300.0, 3.0)], "ceiling": [(200.0, 2.0), (200.0, 2.0)], "naive": [(5.0, 4.0)]}

    def side(name: str):
        def measure() -> throughput.Throughput:
            rate, seconds = figures[name][calls[name] % len(figures[name])]
            calls[name] += 1
            return throughput.Throughput(frames_per_s=rate, num_clips=1, elapsed_s=seconds)
        return measure

    per_round, orders, loaders = throughput.paired_rounds({name: side(name) for name in figures}, rounds=2, slices=2,
                                                          rng=random.Random(0), once=("naive",))
    # (100 * 1 + 300 * 3) frames in 4 s: 250 frames/s, not the mean of the rates (200).
    assert per_round == {"loader": [250.0, 250.0], "ceiling": [200.0, 200.0], "naive": [5.0, 5.0]}
    assert calls == {"loader": 4, "ceiling": 4, "naive": 2} and len(loaders) == 4
    assert [len(passes) for passes in orders] == [2, 2]
