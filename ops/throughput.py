"""Loader throughput against two references, measured side by side on the same clips.

- ``ceiling``: plain PyAV decoding (and colour conversion / resizing in libswscale) of the
  same shard clips in the same number of processes, bytes already in memory: no tar parsing,
  no batching, no inter-process transfer. What the loader could reach at best.
- ``loader``: the real ``ClipLoader`` (DataLoader workers, random access into shards, batching).
- ``naive``: the first version a researcher writes: a map-style Dataset that opens each
  source video, seeks, decodes the needed frames at source resolution and resizes them.
"""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass
from pathlib import Path

import torch.utils.data

from ops import media_io, shards
from ops.clips import ClipPlan
from ops.loader import ClipLoader, LoaderConfig
from ops.shards import ShardIndex


@dataclass(kw_only=True, slots=True)
class Throughput:
    frames_per_s: float
    num_clips: int
    elapsed_s: float
    startup_s: float = 0.0
    """Time to the first batch (process and worker start-up), outside ``elapsed_s``."""


def _decode_all(samples: list[tuple[dict, media_io.ClipShape]]) -> int:
    """Decode (members, shape) pairs; returns the frames decoded."""
    for members, shape in samples:
        shards.decode_members(members, shape)
    return sum(shape.num_frames for _, shape in samples)


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
                handles[row["shard"]] = open(index.directory / f"{row['shard']}.tar", "rb")
            samples.append((shards.read_members(handles[row["shard"]], row["offset"], row["length"]),
                            index.bucket_shapes[row["bucket"]]))
    finally:
        for handle in handles.values():
            handle.close()
    return samples


def ceiling(index: ShardIndex, *, split: str, num_processes: int, repeats: int = 1,
            limit: int | None = None) -> Throughput:
    """Decode every clip of ``split`` ``repeats`` times across ``num_processes`` processes."""
    samples = _read_split(index, split, limit) * repeats
    chunks = [samples[k::num_processes] for k in range(num_processes)]
    with multiprocessing.get_context("fork").Pool(num_processes) as pool:
        pool.map(_decode_all, [[]] * num_processes)  # start workers before the clock
        started = time.perf_counter()
        frames = sum(pool.map(_decode_all, chunks))
        elapsed = time.perf_counter() - started
    return Throughput(frames_per_s=frames / elapsed, num_clips=len(samples), elapsed_s=elapsed)


def loader(index: ShardIndex, config: LoaderConfig, *, num_clips: int) -> Throughput:
    """Steady-state frames/s of the ClipLoader over ``num_clips`` clips after its first batch.

    The clock starts when the first batch arrives, as the ceiling's starts with its pool
    running: worker start-up is paid once per run (workers persist across epochs) and is
    reported separately as ``startup_s``.
    """
    clip_loader = ClipLoader(index, config)
    started = time.perf_counter()
    batches = iter(clip_loader)
    next(batches)
    first = time.perf_counter()
    count = frames = 0
    for batch in batches:
        count += batch["video"].shape[0]
        frames += batch["video"].shape[0] * batch["video"].shape[1]
        if count >= num_clips:
            break
    elapsed = time.perf_counter() - first
    return Throughput(frames_per_s=frames / elapsed, num_clips=count, elapsed_s=elapsed, startup_s=first - started)


class NaiveClips(torch.utils.data.Dataset):
    """Map-style: each item opens its source video, seeks and decodes just that clip."""

    def __init__(self, plan: ClipPlan, media_root: str | Path, split: str):
        self.rows = [row for row in plan.table.to_pylist() if row["split"] == split]
        self.media_root, self.shapes = Path(media_root), plan.config.bucket_shapes

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, item: int):
        row = self.rows[item]
        path, shape = str(self.media_root / row["uri"]), self.shapes[row["bucket"]]
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


def compare(index: ShardIndex, plan: ClipPlan, media_root: str | Path, *, split: str = "train",
            batch_size: int = 8, num_workers: int = 2, epochs: int = 2, rounds: int = 3) -> dict:
    """All three side by side in this process, alternating for ``rounds`` and keeping each one's best.

    Alternating and taking the best of each spreads machine noise (other processes, frequency
    changes) over all three instead of letting it land on one; the ratios are the result.
    """
    num_clips = index.split(split).num_rows * epochs
    config = LoaderConfig(batch_size=batch_size, split=split, num_workers=num_workers, verify_shards=False,
                          prefetch_factor=4)
    best: dict[str, float] = {"loader": 0.0, "ceiling": 0.0, "naive": 0.0}
    startup_s = float("inf")
    for _ in range(rounds):
        measured = loader(index, config, num_clips=num_clips)
        best["loader"], startup_s = max(best["loader"], measured.frames_per_s), min(startup_s, measured.startup_s)
        best["ceiling"] = max(best["ceiling"], ceiling(index, split=split, num_processes=max(1, num_workers),
                                                       repeats=epochs).frames_per_s)
        best["naive"] = max(best["naive"], naive(plan, media_root, split=split, batch_size=batch_size,
                                                 num_workers=num_workers, num_clips=num_clips).frames_per_s)
    return {
        "encoding": index.config.encoding, "batching": ClipLoader(index, config).batching,
        "num_buckets": len(index.bucket_shapes), "num_clips": num_clips, "num_workers": num_workers, "rounds": rounds,
        "loader_frames_per_s": round(best["loader"], 1), "loader_startup_s": round(startup_s, 3),
        "decode_ceiling_frames_per_s": round(best["ceiling"], 1),
        "naive_frames_per_s": round(best["naive"], 1),
        "ratio_vs_ceiling": round(best["loader"] / best["ceiling"], 3),
        "ratio_vs_naive": round(best["loader"] / best["naive"], 3),
    }
