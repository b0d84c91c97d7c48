"""Loader throughput against two references, measured side by side on the same clips.

- ``ceiling``: plain PyAV decoding (and colour conversion / resizing in libswscale) of the
  same shard clips in the same number of processes, bytes already in memory: no tar parsing,
  no batching, no inter-process transfer. What the loader could reach at best.
- ``loader``: the real ``ClipLoader`` (DataLoader workers, random access into shards, batching).
- ``naive``: the first version a researcher writes: a map-style Dataset that opens each
  source video, seeks, decodes the needed frames at source resolution and resizes them.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch.utils.data

from ops.media import codec as media_io, roots
from ops.clips import shards
from ops.clips.plan import ClipPlan
from ops.loading.loader import ClipLoader, EmptySplitError, LoaderConfig
from ops.clips.shards import ShardIndex


@dataclass(kw_only=True, slots=True)
class Throughput:
    frames_per_s: float
    num_clips: int
    elapsed_s: float
    startup_s: float = 0.0
    """Time to the first batch (process and worker start-up), outside ``elapsed_s``."""
    consumer_cpu_s: float = 0.0
    """CPU time the consuming (training) process spent inside ``elapsed_s`` receiving batches."""
    num_batches: int = 0
    """Batches inside ``elapsed_s`` (the loader)."""
    num_frames: int = 0
    """Frames decoded (the ceiling) or received (the loader) inside ``elapsed_s``."""


# The ceiling's clips in each pool worker, handed over once by the pool's initializer, before the
# clock, instead of pickled with every task inside it (which would count the transfer of hundreds
# of kB a clip, at 16x256x256, as decoding time).
_CEILING_SAMPLES: list[tuple[dict, media_io.ClipShape]] = []


def _receive_samples(samples: list[tuple[dict, media_io.ClipShape]]) -> None:
    global _CEILING_SAMPLES
    _CEILING_SAMPLES = samples


def _decode_range(job: tuple[int, int, str | None]) -> tuple[int, int, float]:
    """Decode ``count`` clips of the ceiling's list from ``start`` (wrapping round); returns
    (this process's id, the frames, when it finished on the system-wide monotonic clock).

    Frames go into one reused buffer per clip shape: the ceiling is decoding alone, without
    the fresh batch memory the loader writes into (that difference is the loader's to win back).
    """
    start, count, hwaccel = job
    frames = 0
    for position in range(start, start + count):
        members, shape = _CEILING_SAMPLES[position % len(_CEILING_SAMPLES)]
        out = _CEILING_BUFFERS.get(shape)
        if out is None:
            out = _CEILING_BUFFERS[shape] = np.empty((shape.num_frames, shape.height, shape.width, 3), np.uint8)
        shards.decode_members(members, shape, out=out, hwaccel=hwaccel_of(hwaccel))
        frames += shape.num_frames
    return os.getpid(), frames, time.perf_counter()


_CEILING_BUFFERS: dict[media_io.ClipShape, np.ndarray] = {}
_CEILING_TASKS_PER_PROCESS = 8
"""The clips are handed out in this many tasks per process, taken as processes finish. Two clips
a task cost the ceiling 15% on 8x64x64 clips (a task's messages against 1 ms of decoding, so
the loader measured 1.18x the ceiling); the idle tail of larger tasks is left out by the rate
per process (``ceiling``)."""


def hwaccel_of(device_type: str | None):
    """PyAV's hardware decoding on ``device_type``, never silently falling back to software."""
    if device_type is None:
        return None
    from av.codec.hwaccel import HWAccel
    return HWAccel(device_type=device_type, allow_software_fallback=False)


def sample_clip(index: ShardIndex, split: str = "train") -> tuple[dict, media_io.ClipShape]:
    """(members, shape) of the split's first sample."""
    return _read_split(index, split, 1)[0]


def decode_thread_sweep(index: ShardIndex, *, split: str, thread_counts: tuple[int, ...] = (1, 2, 0),
                        rounds: int = 3) -> dict[str, float]:
    """Frames/s of one process decoding the split with each FFmpeg thread count (0 = auto), best of rounds."""
    samples = _read_split(index, split, None)
    frames = sum(shape.num_frames for _, shape in samples)
    best = dict.fromkeys(thread_counts, 0.0)
    for _ in range(rounds):
        for count in thread_counts:
            started = time.perf_counter()
            for members, shape in samples:
                shards.decode_members(members, shape, thread_count=count)
            best[count] = max(best[count], frames / (time.perf_counter() - started))
    return {f"decode_threads_{count}_frames_per_s": round(value, 1) for count, value in best.items()}


def _read_split(index: ShardIndex, split: str, limit: int | None) -> list[tuple[dict, media_io.ClipShape]]:
    """(members, clip shape) of the split's samples, in index order."""
    table = index.split(split)
    rows = table.to_pylist()[:limit]
    samples, handles = [], {}
    try:
        for row in rows:
            if row["shard"] not in handles:
                handles[row["shard"]] = index.open_shard(row["shard"])
            samples.append((shards.read_members(handles[row["shard"]], row["offset"], row["length"]),
                            index.bucket_shapes[row["bucket"]]))
    finally:
        for handle in handles.values():
            handle.close()
    return samples


def ceiling(index: ShardIndex, *, split: str, num_processes: int, repeats: int = 1,
            limit: int | None = None, hwaccel: str | None = None) -> Throughput:
    """Decode every clip of ``split`` ``repeats`` times across ``num_processes`` processes.

    The clip bytes are read before the clock and handed to each worker once, as it starts; each
    worker decodes one clip before the clock (codec and scaler set-up) and the clock covers
    decoding only, handed out in tasks (``_CEILING_TASKS_PER_PROCESS``). The workers come from a
    forkserver, not a fork of the caller: a fork of a threaded process (pytest, Dagster) can
    inherit a lock another thread held at that moment, and a child once hung on one.
    ``hwaccel``: an FFmpeg hardware device type ("cuda", "vaapi", ...) to decode the video on.
    """
    samples = _read_split(index, split, limit)
    if not samples or repeats < 1 or num_processes < 1:
        raise EmptySplitError(f"nothing to decode: split {split!r} of shard index {index.version} has "
                              f"{len(samples)} samples (repeats {repeats}, processes {num_processes})")
    total = len(samples) * repeats
    chunk = max(1, -(-total // (_CEILING_TASKS_PER_PROCESS * num_processes)))
    jobs = [(start, min(chunk, total - start), hwaccel) for start in range(0, total, chunk)]
    context = multiprocessing.get_context("forkserver")
    # The server imports this module (torch, PyAV) once and every worker is forked from it already
    # imported: without it each worker imported them itself, seconds of CPU per worker and round.
    # It takes effect where this process starts its forkserver; one started before works as before.
    context.set_forkserver_preload([__name__])
    with context.Pool(num_processes, initializer=_receive_samples, initargs=(samples,)) as pool:
        # One clip per process first (codec and scaler set-up, buffers), outside the clock.
        pool.map(_decode_range, [(worker, 1, hwaccel) for worker in range(num_processes)], chunksize=1)
        started = time.perf_counter()
        done: dict[int, list[float]] = {}  # process -> [frames, when its last task ended]
        for pid, frames, ended in pool.imap_unordered(_decode_range, jobs):
            figures = done.setdefault(pid, [0, started])
            figures[0], figures[1] = figures[0] + frames, max(figures[1], ended)
        # Let the workers exit on their sentinel. The with-block's terminate() signals them with
        # SIGTERM, which a process started with SIGTERM ignored (nohup, some CI runners) passes
        # on to them: a worker blocked on the task queue's lock then never exits (seen in CI).
        pool.close()
        pool.join()
    # Each process's rate over its own busy time, summed: the last task leaves one process idle
    # while another finishes (up to a task, a few percent of a short run), and that idle time is
    # the pool's tail, not decoding capacity. perf_counter is CLOCK_MONOTONIC, one clock for all.
    rate = sum(frames / (ended - started) for frames, ended in done.values())
    elapsed = max(ended for _, ended in done.values()) - started
    return Throughput(frames_per_s=rate, num_clips=len(samples) * repeats, elapsed_s=elapsed,
                      num_frames=int(sum(frames for frames, _ in done.values())))


def loader(index: ShardIndex, config: LoaderConfig, *, num_clips: int, device: str | None = None) -> Throughput:
    """Steady-state frames/s of the ClipLoader over at least ``num_clips`` clips.

    Workers start together, so their first batches arrive together: a clock started at the
    first batch would find the other workers' first batches already (nearly) done and count
    them as its own. The clock therefore starts after a warm-up of two batches per worker, and
    stops after a whole number of batches per worker, so the window opens and closes on the
    same worker's batches and holds as much work as it counts. Start-up (worker processes,
    the warm-up) is reported apart as ``startup_s``.

    ``device``: also copy each batch there (non-blocking when the loader pins memory), as the
    trainer does, and wait for the copies before the clock stops.
    """
    workers = max(1, config.num_workers)
    warmup = 2 * workers
    window = workers * max(1, -(-num_clips // (config.batch_size * workers)))
    clip_loader = ClipLoader(index, config)
    started = time.perf_counter()
    batches = iter(clip_loader)
    for _ in range(warmup):
        next(batches)
    first, cpu = time.perf_counter(), time.process_time()
    count = frames = 0
    for _ in range(window):
        batch = next(batches)
        count += batch["video"].shape[0]
        frames += batch["video"].shape[0] * batch["video"].shape[1]
        if device is not None:
            batch["video"].to(device, non_blocking=config.pin_memory)
            batch["audio"].to(device, non_blocking=config.pin_memory)
    if device is not None and device.startswith("cuda"):
        torch.cuda.synchronize(device)
    elapsed, cpu = time.perf_counter() - first, time.process_time() - cpu
    return Throughput(frames_per_s=frames / elapsed, num_clips=count, elapsed_s=elapsed, startup_s=first - started,
                      consumer_cpu_s=cpu, num_batches=window, num_frames=frames)


class NaiveClips(torch.utils.data.Dataset):
    """Map-style: each item opens its source video, seeks and decodes just that clip (a source in an object
    store is read from the media cache, checked against its asset id, as ops.clips.shards reads it)."""

    def __init__(self, plan: ClipPlan, media_root: str | Path, split: str):
        self.rows = [row for row in plan.table.to_pylist() if row["split"] == split]
        self.media, self.shapes = roots.open_root(media_root), plan.config.bucket_shapes

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, item: int):
        row = self.rows[item]
        shape = self.shapes[row["bucket"]]
        with self.media.local_files([(row["uri"], row["asset_id"])]) as copies:
            if row["uri"] in copies.problems:
                raise OSError(f"naive loader: {': '.join(copies.problems[row['uri']])}")
            path = str(copies.paths[row["uri"]])
            video = media_io.decode_source_video(path, [row["start_s"]], shape)[0]
            audio = media_io.decode_source_audio(path, [row["start_s"]], shape)
        return torch.from_numpy(video), torch.from_numpy(audio[0]) if audio else torch.zeros(shape.num_audio_samples)


def naive(plan: ClipPlan, media_root: str | Path, *, split: str, batch_size: int, num_workers: int,
          num_clips: int) -> Throughput:
    dataset = NaiveClips(plan, media_root, split)
    started = time.perf_counter()
    count = frames = 0
    # Batches stay lists: the naive dataset knows nothing of buckets, and default collation would
    # fail on a batch of mixed clip shapes (stacking a few small clips is not what it measures).
    while count < num_clips:
        for clips in torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                                                 shuffle=False, collate_fn=list):
            count += len(clips)
            frames += sum(video.shape[0] for video, _audio in clips)
            if count >= num_clips:
                break
    elapsed = time.perf_counter() - started
    return Throughput(frames_per_s=frames / elapsed, num_clips=count, elapsed_s=elapsed)


TARGET_RATIO_VS_CEILING = 0.85
TARGET_RATIO_VS_NAIVE = 1.5
MIN_TRUSTED_ROUNDS = 7
"""Fewer paired rounds than this never meet a target: the quartiles of a handful say little."""


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile); the inclusive method, so one value is its own spread."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def judge_target(ratios: list[float], target: float, *, min_rounds: int = MIN_TRUSTED_ROUNDS) -> dict:
    """Whether the paired per-round ratios show ``target`` met, refuted, or neither.

    The spread is the interquartile range of the rounds' ratios. When it is wider than the
    distance of the median from the target, noise alone could put the median on either side:
    the verdict is ``inconclusive``, never ``met``. So it is with fewer than ``min_rounds``.
    """
    q1, median, q3 = quartiles(ratios)
    spread, gap = q3 - q1, median - target
    if len(ratios) < min_rounds:
        verdict, why = "inconclusive", f"{len(ratios)} paired rounds, fewer than {min_rounds}"
    elif spread > abs(gap):
        verdict, why = "inconclusive", (f"spread (IQR {spread:.3f}) is wider than the gap to the target "
                                        f"({gap:+.3f}); rerun on a quieter machine or with more rounds")
    else:
        verdict = "met" if gap >= 0 else "not_met"
        why = f"median {median:.3f} {'>=' if gap >= 0 else '<'} {target} by more than the spread {spread:.3f}"
    return {"target": target, "median": round(median, 4), "iqr": [round(q1, 4), round(q3, 4)],
            "spread": round(spread, 4), "gap": round(gap, 4), "rounds": len(ratios), "verdict": verdict, "why": why}


def work_done(encoding: str) -> dict[str, list[str]]:
    """What each side does per clip, so a reader can check the comparison is like for like."""
    if encoding == "compressed":
        ceiling_work = ["H.264 decode of the shard clip (its stored size: no resize)",
                        "FLAC audio decode", "colour conversion yuv420p -> rgb24 (libswscale)"]
    else:
        ceiling_work = ["npy parse of stored uint8 frames and float32 PCM (no codec, no resize)"]
    return {
        "ceiling": [*ceiling_work, "clip bytes already in memory", "frames into one reused buffer"],
        "loader": [*ceiling_work, "sample read from its shard (tar, page cache)",
                   "frames into a fresh shared-memory batch", "hand-over of the batch to the consuming process"],
        "naive": ["open and seek the source file", "H.264 decode at source resolution",
                  "cover-scale, crop and colour conversion to the clip size (libswscale)",
                  "source audio decode (AAC/Opus) and resample to mono"],
    }


def paired_rounds(measure: dict[str, Callable[[], Throughput]], *, rounds: int, slices: int, rng: random.Random,
                  once: tuple[str, ...] = ()) -> tuple[dict[str, list[float]], list, list[Throughput]]:
    """Frames/s of each side per round, the orders run, and the loader's measurements.

    A round is ``slices`` passes; each pass runs every side once, in a freshly shuffled order
    (sides in ``once`` only in the round's first pass). A side's figure for the round is its
    frames over its seconds across the round's passes. On this 2-core machine the speed moves
    by 10-20% from one second to the next (consecutive 0.7 s decodes in one process pool
    measured 2272 then 3026 frames/s), so several short interleaved passes let both sides of a
    ratio sample the same moments, where one long run each would meet different ones.
    """
    per_round: dict[str, list[float]] = {side: [] for side in measure}
    orders, loaders = [], []
    for _ in range(rounds):
        frames, seconds = dict.fromkeys(measure, 0.0), dict.fromkeys(measure, 0.0)
        passes = []
        for number in range(slices):
            order = [side for side in measure if number == 0 or side not in once]
            rng.shuffle(order)
            passes.append(order)
            for side in order:
                measured = measure[side]()
                frames[side] += measured.frames_per_s * measured.elapsed_s
                seconds[side] += measured.elapsed_s
                if side == "loader":
                    loaders.append(measured)
        orders.append(passes)
        for side in measure:
            per_round[side].append(frames[side] / seconds[side])
    return per_round, orders, loaders


def compare(index: ShardIndex, plan: ClipPlan, media_root: str | Path, *, split: str = "train",
            batch_size: int = 8, num_workers: int = 2, epochs: int = 2, rounds: int = MIN_TRUSTED_ROUNDS,
            slices: int = 3, seed: int = 0, naive_clips: int | None = None, hwaccel: str | None = None,
            fresh_memory: bool = False) -> dict:
    """Loader, ceiling and naive loader in paired rounds of interleaved passes in random order.

    Each round measures the sides in ``slices`` back-to-back passes (``paired_rounds``), so the
    round's ratios (loader / ceiling, loader / naive) compare runs that met the same machine
    state; the order is shuffled per pass (seeded, and reported) so no side always runs first,
    or last, after the others warmed or heated the machine. The result is the median of the
    per-round ratios with its interquartile range, and a verdict per target (``judge_target``).
    ``naive_clips`` caps the naive side's clips (it runs once a round: it is many times slower,
    and its rate is steady after a few clips). ``hwaccel`` adds a ``ceiling_hw`` side decoding
    on that FFmpeg device type. ``fresh_memory`` adds ``loader_fresh_memory``, the loader with a
    fresh shared-memory segment per batch (``reuse_batch_memory=False``): what reusing slots buys.
    """
    num_clips = index.split(split).num_rows * epochs
    config = LoaderConfig(batch_size=batch_size, split=split, num_workers=num_workers, verify_shards=False,
                          prefetch_factor=4)
    processes = max(1, num_workers)
    measure = {
        "loader": lambda: loader(index, config, num_clips=num_clips),
        "ceiling": lambda: ceiling(index, split=split, num_processes=processes, repeats=epochs),
        "naive": lambda: naive(plan, media_root, split=split, batch_size=batch_size, num_workers=num_workers,
                               num_clips=min(num_clips, naive_clips or num_clips)),
    }
    if hwaccel:
        measure["ceiling_hw"] = lambda: ceiling(index, split=split, num_processes=processes, repeats=epochs,
                                                hwaccel=hwaccel)
    if fresh_memory:
        fresh = dataclasses.replace(config, reuse_batch_memory=False)
        measure["loader_fresh_memory"] = lambda: loader(index, fresh, num_clips=num_clips)
    per_round, orders, loaders = paired_rounds(measure, rounds=rounds, slices=slices, rng=random.Random(seed),
                                               once=("naive",))
    startups = [measured.startup_s for measured in loaders]
    consumer = [measured.consumer_cpu_s / measured.elapsed_s for measured in loaders]
    vs_ceiling = [lo / ce for lo, ce in zip(per_round["loader"], per_round["ceiling"], strict=True)]
    vs_naive = [lo / na for lo, na in zip(per_round["loader"], per_round["naive"], strict=True)]
    result = {
        "encoding": index.config.encoding, "batching": ClipLoader(index, config).batching,
        "num_buckets": len(index.bucket_shapes), "num_clips": num_clips, "batch_size": batch_size,
        "num_workers": num_workers, "rounds": rounds, "slices": slices, "orders": orders,
        "loader_frames_per_s": round(statistics.median(per_round["loader"]), 1),
        "loader_startup_s": round(statistics.median(startups), 3),
        # The consuming process's own share of a core while it only receives batches: what the
        # hand-over costs the trainer.
        "consumer_cpu_fraction": round(statistics.median(consumer), 3),
        "decode_ceiling_frames_per_s": round(statistics.median(per_round["ceiling"]), 1),
        "naive_frames_per_s": round(statistics.median(per_round["naive"]), 1),
        "ratio_vs_ceiling": round(statistics.median(vs_ceiling), 3),
        "ratio_vs_ceiling_iqr": [round(value, 3) for value in quartiles(vs_ceiling)[::2]],
        "ratio_vs_ceiling_rounds": [round(value, 3) for value in vs_ceiling],
        "ratio_vs_naive": round(statistics.median(vs_naive), 3),
        "ratio_vs_naive_iqr": [round(value, 3) for value in quartiles(vs_naive)[::2]],
        "frames_per_s_rounds": {side: [round(value, 1) for value in values] for side, values in per_round.items()},
        "targets": {"ratio_vs_ceiling": judge_target(vs_ceiling, TARGET_RATIO_VS_CEILING),
                    "ratio_vs_naive": judge_target(vs_naive, TARGET_RATIO_VS_NAIVE)},
        "work": work_done(index.config.encoding),
    }
    if fresh_memory:
        result["fresh_memory_frames_per_s"] = round(statistics.median(per_round["loader_fresh_memory"]), 1)
        speedups = [lo / fresh for lo, fresh in zip(per_round["loader"], per_round["loader_fresh_memory"], strict=True)]
        result["slot_reuse_speedup"] = round(statistics.median(speedups), 3)
        result["slot_reuse_speedup_iqr"] = [round(value, 3) for value in quartiles(speedups)[::2]]
    if hwaccel:
        result["hw_ceiling_frames_per_s"] = round(statistics.median(per_round["ceiling_hw"]), 1)
        result["hw_over_sw_ceiling"] = round(statistics.median(
            [hw / sw for hw, sw in zip(per_round["ceiling_hw"], per_round["ceiling"], strict=True)]), 3)
    return result


def scaling(index: ShardIndex, *, batch_size: int, worker_counts: list[int], split: str = "train",
            epochs: int = 2, rounds: int = 5, slices: int = 3, seed: int = 0) -> dict:
    """Loader and ceiling frames/s at each worker count, against the ceiling at the same process
    count, in paired rounds (``paired_rounds``): medians, and the median per-round ratio."""
    num_clips = index.split(split).num_rows * epochs
    rng = random.Random(seed)
    out = {}
    for workers in worker_counts:
        config = LoaderConfig(batch_size=batch_size, split=split, num_workers=workers, verify_shards=False,
                              prefetch_factor=4)
        measured, _, _ = paired_rounds({
            "loader": lambda config=config: loader(index, config, num_clips=num_clips),
            "ceiling": lambda workers=workers: ceiling(index, split=split, num_processes=workers, repeats=epochs),
        }, rounds=rounds, slices=slices, rng=rng)
        ratios = [lo / ce for lo, ce in zip(measured["loader"], measured["ceiling"], strict=True)]
        out[str(workers)] = {"loader_frames_per_s": round(statistics.median(measured["loader"]), 1),
                             "decode_ceiling_frames_per_s": round(statistics.median(measured["ceiling"]), 1),
                             "ratio_vs_ceiling": round(statistics.median(ratios), 3),
                             "ratio_vs_ceiling_iqr": [round(value, 3) for value in quartiles(ratios)[::2]]}
    base = out[str(worker_counts[0])]["loader_frames_per_s"]
    for figures in out.values():
        figures["speedup_vs_first"] = round(figures["loader_frames_per_s"] / base, 3)
    return {"split": split, "batch_size": batch_size, "rounds": rounds, "slices": slices, "workers": out}


def host_to_device(index: ShardIndex, *, batch_size: int, num_workers: int, split: str = "train",
                   epochs: int = 2, rounds: int = 3) -> dict:
    """On CUDA: the loader with each batch copied to the device, pinned + non-blocking against
    pageable + blocking (medians of rounds). Elsewhere: says why it did not run."""
    if not torch.cuda.is_available():
        return {"ran": False, "why": "no CUDA device"}
    num_clips = index.split(split).num_rows * epochs
    figures: dict[str, list[float]] = {"pinned_non_blocking": [], "pageable_blocking": []}
    for _ in range(rounds):
        for name, pinned in (("pinned_non_blocking", True), ("pageable_blocking", False)):
            config = LoaderConfig(batch_size=batch_size, split=split, num_workers=num_workers, verify_shards=False,
                                  prefetch_factor=4, pin_memory=pinned)
            figures[name].append(loader(index, config, num_clips=num_clips, device="cuda").frames_per_s)
    medians = {f"{name}_frames_per_s": round(statistics.median(values), 1) for name, values in figures.items()}
    return {"ran": True, **medians, "pinned_over_pageable": round(
        medians["pinned_non_blocking_frames_per_s"] / medians["pageable_blocking_frames_per_s"], 3)}
