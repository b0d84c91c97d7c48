"""Know whether the model is learning: a validation loss that compares, and samples you can watch.

    evaluator = Evaluator(config, distributed=distributed, model=model, precision=precision, data=source)
    result = evaluator.validation_loss()          # every rank; rank 0 gets the figures
    samples = evaluator.generate(out_dir)         # every rank (FSDP gathers); rank 0 writes MP4s

Validation loss. The held-out split (eval.split of the shard index; for synthetic data a set of
clips generated apart from the training ones) goes through the same loader, unshuffled, one epoch
(at most eval.max_samples). Each sample is scored at the same eval.timesteps fixed times
t_i = (i + 0.5) / n, all with one noise drawn from (eval.seed, sample key): the figure depends
on the weights alone, so two runs, or two checkpoints of one, compare directly.
Each sample's n losses come from one forward of that sample repeated n times, whichever rank
holds it, and rank 0 sums every sample's losses in key order: the result is the same bits on 1 or
2 ranks. Reported: the mean (``loss``), the mean per time (``loss_t``) and per clip shape
(``loss_bucket``), and how many samples (decode failures are left out and counted).

It never touches training: no optimizer, no gradient, and every RNG the training loop or the
loader might draw from (torch's CPU and CUDA generators, numpy's, Python's) is saved before and
restored after; the training loader is a different object, so the sample order is untouched.

Samples. The eval.samples held-out clips with the smallest keys lend their conditioning (audio):
from fixed noise (eval.seed, key) the flow ODE dx/dt = v(x, t) is integrated from t=1 to t=0 in
eval.sample_steps Euler or Heun steps. Each sample becomes an H.264 MP4 with the conditioning audio
muxed in, and one contact sheet PNG holds a row of frames per sample. A sample with a non-finite
value is reported and not encoded.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import math
import random
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ops.clips.plan import bucket_name
from ops.media.gallery import contact_sheet
from trainer.data import ShardClips, synthetic_clip
from trainer.models.video import sample_seed
from trainer.models.protocol import unwrap

log = logging.getLogger("trainer")

# Synthetic held-out clips are indices far past any training index (trainer/data.py:synthetic_clip), and
# each split name has its own block of them: "test" is not "val" over again.
_SYNTHETIC_HELD_OUT_OFFSET = 1_000_000_000
_SYNTHETIC_SPLIT_BLOCK = 1_000_000


def _synthetic_split_offset(split: str) -> int:
    if split == "val":
        return _SYNTHETIC_HELD_OUT_OFFSET
    return _SYNTHETIC_HELD_OUT_OFFSET + (1 + zlib.crc32(split.encode()) % 997) * _SYNTHETIC_SPLIT_BLOCK


class EvaluationSkipped(Exception):
    """Nothing to evaluate (an empty split): a reason to record, not a failure of the run."""


@contextlib.contextmanager
def rng_untouched() -> Iterator[None]:
    """Every generator the training loop or its loader could draw from, as it was before the block."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    numpy_state, python_state = np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        np.random.set_state(numpy_state)
        random.setstate(python_state)


class Evaluator:
    """Validation loss and samples for one rank's model (module docstring)."""

    def __init__(self, config: Any, *, distributed: Any, model: torch.nn.Module, precision: Any, data: Any = None,
                 beat: Callable[[str], None] | None = None) -> None:
        self.config, self.model, self.precision = config, model, precision
        self.distributed, self.world, self.device = distributed, distributed.world, distributed.device
        self.eval = config.eval
        self.data = data  # the training source: its shard index serves the held-out split
        self.beat = beat or (lambda doing: None)
        self.sharded = config.train.parallelism == "fsdp"  # every rank must run every forward
        inner = unwrap(model)
        self._noise_shape, self._to_video = inner.noise_shape, inner.to_video
        # Under FSDP the wrapped module is the model (forward and predict_velocity gather their shards);
        # otherwise the plain module: no DDP hooks, no collective per forward.
        self._scorer = model if self.sharded else inner
        self._verified = False

    # -----------------------------------------------------------------------------------------
    # Held-out data

    def _batches(self) -> Iterator[dict[str, Any]]:
        """This rank's part of the held-out split, one global step at a time, one epoch (capped)."""
        if self.config.data.source == "synthetic":
            yield from self._synthetic_batches()
            return
        yield from self._shard_batches()

    def _synthetic_batches(self) -> Iterator[dict[str, Any]]:
        data, world = self.config.data, self.world
        count = self.eval.synthetic_samples
        if self.eval.max_samples:
            count = min(count, self.eval.max_samples)
        shapes = data.video_shapes
        offset = _synthetic_split_offset(self.eval.split)
        for bucket, shape in enumerate(shapes):
            indices = [index for index in range(count) if index % len(shapes) == bucket]
            if not indices:
                continue  # a bucket with no held-out clip at all: every rank skips it alike
            mine = indices[world.rank::world.world_size]
            audio_samples = data.audio_samples_for(shape)
            clips = [synthetic_clip(seed=data.seed, index=offset + index, video_shape=shape,
                                    audio_samples=audio_samples) for index in mine]
            # A rank may hold none of a bucket's clips (more ranks than clips): an empty batch of the
            # bucket's shape, so it still joins FSDP's padding forwards.
            yield {"video": (torch.from_numpy(np.stack([clip[0] for clip in clips])) if clips
                             else torch.zeros((0, *shape, 3), dtype=torch.uint8)),
                   "audio": (torch.from_numpy(np.stack([clip[1] for clip in clips])) if clips
                             else torch.zeros((0, audio_samples))),
                   "has_audio": torch.tensor([clip[2] for clip in clips], dtype=torch.bool),
                   "keys": [f"synthetic-{self.eval.split}-{index:09d}" for index in mine], "bucket": bucket_name(*shape),
                   "failed": [], "fps": self.eval.fps, "audio_rate": self.eval.audio_rate}

    def _shard_batches(self) -> Iterator[dict[str, Any]]:
        from ops.loading.loader import ClipLoader, EmptySplitError, LoaderConfig

        data, world = self.config.data, self.world
        if isinstance(self.data, ShardClips):
            index = self.data.loader.index
        else:  # the standalone evaluation (trainer/evaluate.py): no training source
            from ops.clips.shard_cache import read_any_index

            index = read_any_index(data.shard_index)
        local_batch = max(1, data.batch_size // world.world_size)
        try:
            loader = ClipLoader(index, LoaderConfig(
                batch_size=local_batch, split=self.eval.split, num_workers=data.num_workers, seed=data.seed,
                shuffle=False, drop_last=False, batching=data.batching, verify_shards=not self._verified),
                rank=world.rank, world_size=world.world_size)
        except EmptySplitError as error:
            raise EvaluationSkipped(str(error)) from error
        self._verified = True
        cap = self.eval.max_samples or loader.num_samples
        shapes = index.bucket_shapes
        for batch in loader:
            # Every rank's loader walks the same global steps: the same state after each.
            shape = shapes[batch["bucket"]]
            yield {**batch, "fps": shape.fps, "audio_rate": shape.audio_rate}
            state = loader.state
            if state.epoch > 0 or state.consumed >= cap:
                return

    # -----------------------------------------------------------------------------------------
    # Validation loss

    @contextlib.contextmanager
    def _measuring(self) -> Iterator[None]:
        """Eval mode (dropout off, norms on their running statistics), no gradients, every RNG and every
        buffer of the model (running statistics included) as they were afterwards: evaluation leaves
        nothing of itself in the model a checkpoint would save."""
        inner = unwrap(self.model)
        buffers = {name: buffer.detach().clone() for name, buffer in inner.named_buffers()}
        was_training = self.model.training
        self.model.eval()
        try:
            with rng_untouched(), torch.no_grad():
                yield
        finally:
            self.model.train(was_training)
            with torch.no_grad():
                for name, buffer in inner.named_buffers():
                    if name in buffers:
                        buffer.copy_(buffers[name])

    def validation_loss(self) -> dict[str, Any]:
        """The held-out loss (module docstring), on rank 0; other ranks get {} after joining in.

        An empty split gives {"status": "skipped", "reason": ...} on every rank, not an error.
        """
        with self._measuring():
            try:
                local, failed = self._score_local()
            except EvaluationSkipped as skipped:
                return {"status": "skipped", "reason": str(skipped), "split": self.eval.split}
        scores = self._gather(local)
        failures = sum(self._gather([failed]), []) if self._distributed else failed
        if not self.world.is_main:
            return {}
        return self._summarize(scores, num_failed=len(failures))

    def _score_local(self) -> tuple[list[tuple[str, str, list[float]]], list[str]]:
        times = self.eval.times
        t = torch.tensor(times, device=self.device)
        scores, failed = [], []
        for batch in self._batches():
            failed += [failure["sample_key"] for failure in batch.get("failed", [])]
            keys, shape = list(batch["keys"]), tuple(batch["video"].shape[1:4])
            count = len(keys)
            rounds = self._rounds(count)
            for position in range(rounds):
                self.beat("evaluation")
                real = position < count
                index = position if real else 0
                if not real and count == 0:  # a rank with nothing in this step still joins FSDP's gathers
                    video = torch.zeros((1, *shape, 3), dtype=torch.uint8)
                    audio = torch.zeros((1, batch["audio"].shape[1]))
                    has_audio = torch.zeros(1, dtype=torch.bool)
                    key = "padding"
                else:
                    video, audio = batch["video"][index:index + 1], batch["audio"][index:index + 1]
                    has_audio, key = batch["has_audio"][index:index + 1], keys[index]
                losses = self._score(key, video, audio, has_audio, shape, t)
                if real:
                    scores.append((key, bucket_name(*shape), losses))
        return scores, failed

    def _rounds(self, count: int) -> int:
        """Forwards this rank runs for a step: its own samples, or under FSDP the most any rank has."""
        if not self.sharded or not self._distributed:
            return count
        from trainer.parallel import all_reduce_values

        (most,) = all_reduce_values([float(count)], op="max", distributed=self.distributed)
        return int(most)

    def _score(self, key: str, video: torch.Tensor, audio: torch.Tensor, has_audio: torch.Tensor,
               shape: tuple[int, int, int], t: torch.Tensor) -> list[float]:
        """One sample at every fixed time: one forward of the sample repeated len(t) times."""
        device, repeat = self.device, len(t)
        noise = self._noise(f"val:{key}", shape)
        with self.precision.autocast(), self._attention():
            losses = self._scorer(video.to(device).expand(repeat, *video.shape[1:]),
                                  audio.to(device).expand(repeat, *audio.shape[1:]),
                                  has_audio.to(device).expand(repeat), noise.expand(repeat, *noise.shape[1:]), t)
        return [float(value) for value in losses.float().cpu()]

    def _noise(self, name: str, shape: tuple[int, int, int]) -> torch.Tensor:
        generator = torch.Generator(device=self.device).manual_seed(sample_seed(self.eval.seed, 0, name))
        return torch.randn((1, *self._noise_shape(shape)), generator=generator, device=self.device)

    def _attention(self) -> contextlib.AbstractContextManager:
        from trainer.precision import attention_context

        return attention_context(self.config.train.attention_backend)

    @property
    def _distributed(self) -> bool:
        return self.distributed.backend is not None and self.world.world_size > 1

    def _gather(self, local: list) -> list:
        """Every rank's items on every rank (gathered as objects: keys and Python floats)."""
        if not self._distributed:
            return list(local)
        gathered: list[list] = [None] * self.world.world_size  # type: ignore[list-item]
        dist.all_gather_object(gathered, local)
        return [item for part in gathered for item in part]

    def _summarize(self, scores: list[tuple[str, str, list[float]]], *, num_failed: int) -> dict[str, Any]:
        times, split = self.eval.times, self.eval.split
        if not scores:
            return {"status": "skipped", "split": split, "num_failed": num_failed,
                    "reason": f"no sample of split {split!r} could be scored ({num_failed} failed to decode)"}
        scores = sorted(scores)  # key order: the same sums whichever rank scored what
        if len({key for key, _, _ in scores}) != len(scores):
            raise RuntimeError("a held-out sample was scored twice: the ranks' parts of the split overlap")
        per_time = [math.fsum(losses[i] for _, _, losses in scores) / len(scores) for i in range(len(times))]
        buckets: dict[str, list[float]] = {}
        for _, bucket, losses in scores:
            buckets.setdefault(bucket, []).extend(losses)
        finite = all(math.isfinite(value) for value in per_time)
        return {"status": "ok" if finite else "non_finite", "reason": None if finite else "a loss is not finite",
                "split": split, "num_samples": len(scores), "num_failed": num_failed,
                "loss": math.fsum(per_time) / len(per_time),
                "loss_t": {f"{time:.4f}": value for time, value in zip(times, per_time, strict=True)},
                "loss_bucket": {name: math.fsum(values) / len(values) for name, values in sorted(buckets.items())},
                "timesteps": times, "seed": self.eval.seed}

    # -----------------------------------------------------------------------------------------
    # Samples

    def sample_conditions(self) -> list[tuple] | dict[str, Any]:
        """Every rank (a collective): the conditioning of the eval.samples held-out clips with the smallest
        keys, the same list on every rank; or a skip record ({"status": "skipped", "reason": ...})."""
        if not self.eval.samples:
            return {"status": "skipped", "reason": "eval.samples is 0"}
        with self._measuring():
            try:
                conditions = self._conditions()
            except EvaluationSkipped as skipped:
                return {"status": "skipped", "reason": str(skipped)}
        if not conditions:
            return {"status": "skipped", "reason": f"split {self.eval.split!r} has no clip to condition on"}
        return conditions

    @property
    def generation_is_collective(self) -> bool:
        """Under FSDP every rank must run every forward of the sampler; otherwise rank 0 samples alone."""
        return self.sharded and self._distributed

    def generate(self, out_dir: str | Path, conditions: list[tuple] | dict[str, Any] | None = None) -> dict[str, Any]:
        """Samples in out_dir (MP4 each, contact_sheet.png) and their record (module docstring).

        With ``generation_is_collective`` every rank calls it (rank 0 gets the record, the others {});
        otherwise rank 0 alone calls it, with the conditions every rank gathered (``sample_conditions``),
        at a point where no peer waits on it in a collective (trainer/loop.py: after the final barrier).
        """
        if conditions is None:
            conditions = self.sample_conditions()
        if isinstance(conditions, dict):
            return conditions if self.world.is_main else {}
        if not (self.world.is_main or self.generation_is_collective):
            return {}  # rank 0 samples alone
        with self._measuring():
            samples = []
            for key, shape, audio, has_audio, _, _ in conditions:
                self.beat("sample generation")
                samples.append(self._integrate(key, shape, audio, has_audio))
        if not self.world.is_main:
            return {}
        return write_samples(out_dir, conditions, samples, eval_config=self.eval, to_video=self._to_video)

    def _conditions(self) -> list[tuple]:
        """(key, clip shape, audio, has_audio, fps, audio rate) of the eval.samples held-out clips with the
        smallest keys."""
        wanted = self.eval.samples
        kept: list[tuple] = []
        for batch in self._batches():
            shape = tuple(batch["video"].shape[1:4])
            for index, key in enumerate(batch["keys"]):
                item = (key, shape, batch["audio"][index].numpy().copy(), bool(batch["has_audio"][index]),
                        float(batch["fps"]), int(batch["audio_rate"]))
                kept = heapq.nsmallest(wanted, [*kept, item], key=lambda entry: entry[0])
        return heapq.nsmallest(wanted, self._gather(kept), key=lambda entry: entry[0])

    def _integrate(self, key: str, shape: tuple[int, int, int], audio: np.ndarray, has_audio: bool) -> torch.Tensor:
        """x at t=0 from noise at t=1: eval.sample_steps Euler or Heun steps of dx/dt = v(x, t)."""
        device = self.device
        x = self._noise(f"sample:{key}", shape).float()
        audio_t = torch.from_numpy(audio)[None].to(device)
        has_audio_t = torch.tensor([has_audio], device=device)
        steps = self.eval.sample_steps
        times = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64).tolist()

        def velocity(x_t: torch.Tensor, time: float) -> torch.Tensor:
            with self.precision.autocast(), self._attention():
                return self._scorer.predict_velocity(x_t, torch.full((1,), time, device=device), audio_t,
                                                     has_audio_t).float()

        for now, after in zip(times[:-1], times[1:], strict=True):
            dt = after - now
            v = velocity(x, now)
            if self.eval.solver == "heun":
                guess = x + dt * v
                x = x + dt * 0.5 * (v + velocity(guess, after))
            else:
                x = x + dt * v
        return x


def write_samples(out_dir: str | Path, conditions: Sequence[tuple], samples: Sequence[torch.Tensor], *,
                  eval_config: Any, to_video: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Any]:
    """Encode each finite sample as MP4 (with its conditioning audio) and the contact sheet; the record.

    conditions: (key, clip shape, audio, has_audio, fps, audio rate) per sample, as the data has them.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records, sheet_rows = [], []
    for (key, shape, audio, has_audio, clip_fps, audio_rate), sample in zip(conditions, samples, strict=True):
        record = {"key": key, "clip_shape": list(shape), "has_audio": has_audio}
        if not torch.isfinite(sample).all():
            bad = int((~torch.isfinite(sample)).sum())
            log.warning("sample conditioned on %s has %d non-finite values: not encoded", key, bad)
            records.append({**record, "status": "non_finite", "num_non_finite": bad})
            continue
        frames = _frames(sample, to_video)
        name = f"sample_{len(records):02d}.mp4"
        # The clip's own frame rate; a model that generates another number of frames spreads them over
        # the clip's duration (an image: one frame for it).
        fps = Fraction(clip_fps).limit_denominator(1000) * frames.shape[0] / shape[0]
        write_mp4(out / name, frames, audio=audio if has_audio else None, fps=fps, audio_rate=audio_rate)
        sheet_rows.append(frames)
        records.append({**record, "status": "ok", "path": name, "frames": int(frames.shape[0]),
                        "height": int(frames.shape[1]), "width": int(frames.shape[2]), "fps": float(fps)})
    sheet = None
    if sheet_rows:
        sheet = "contact_sheet.png"
        (out / sheet).write_bytes(contact_sheet(sheet_rows))
    ok = sum(record["status"] == "ok" for record in records)
    return {"status": "ok" if ok == len(records) else ("non_finite" if ok == 0 else "partial"),
            "dir": str(out), "samples": records, "contact_sheet": sheet, "solver": eval_config.solver,
            "steps": eval_config.sample_steps, "num_non_finite": len(records) - ok}


def _frames(sample: torch.Tensor, to_video: Callable[[torch.Tensor], torch.Tensor]) -> np.ndarray:
    frames = to_video(sample.cpu())
    if frames.dim() != 5 or frames.shape[0] != 1 or frames.shape[-1] != 3 or frames.dtype != torch.uint8:
        raise ValueError(f"the model's to_video must give uint8 [1, T, H, W, 3] for one sample, got "
                         f"{frames.dtype} {list(frames.shape)}")
    return frames[0].numpy()


def write_mp4(path: str | Path, frames: np.ndarray, *, audio: np.ndarray | None, fps: Fraction | float,
              audio_rate: int) -> None:
    """H.264 (yuv420p) frames [T, H, W, 3] and, when given, mono float audio as AAC, written atomically.

    yuv420p needs even sizes: an odd height or width is padded by one row or column (edge repeated).
    """
    import av

    frames = np.asarray(frames)
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if pad_h or pad_w:
        frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    with av.open(str(partial), "w", format="mp4") as container:
        video = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1000))
        video.width, video.height, video.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        video.options = {"crf": "18", "preset": "veryfast", "threads": "1"}
        packets = []
        for index, image in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")
            frame.pts = index
            packets.extend(video.encode(frame))
        packets.extend(video.encode(None))
        if audio is not None and len(audio):
            stream = container.add_stream("aac", rate=audio_rate, layout="mono")
            samples = np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0)[None]
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples), format="fltp", layout="mono")
            frame.sample_rate, frame.pts = audio_rate, 0
            packets.extend(stream.encode(frame))
            packets.extend(stream.encode(None))
        for packet in sorted(packets, key=lambda p: (float(p.dts * p.time_base), p.stream.index)):
            container.mux(packet)
    partial.replace(path)


def metric_names(result: Mapping[str, Any], prefix: str = "val") -> dict[str, float]:
    """MLflow metrics of one validation result: {prefix}/loss, {prefix}/loss_t<t>, {prefix}/loss_bucket_<shape>."""
    if result.get("status") != "ok":
        return {}
    metrics = {f"{prefix}/loss": result["loss"]}
    metrics |= {f"{prefix}/loss_t{time}": value for time, value in result["loss_t"].items()}
    metrics |= {f"{prefix}/loss_bucket_{name}": value for name, value in result["loss_bucket"].items()}
    return metrics
