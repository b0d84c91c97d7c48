"""Synthetic demo media for Trainyard: good clips plus one file per quarantine reason.

The demo pipeline needs a media folder that is small, fast to make, free of
third-party rights, and that exercises every branch of the validator.  This
module synthesises one with PyAV:

    from tools.demo_media import generate_demo_media
    report = generate_demo_media("demo_media", seed=0)
    report.good        # ["clips/clip_000.mp4", ...]
    report.bad         # {"edge_cases/empty.mp4": "empty_file", ...}
    report.split_leak  # the two clips of `leaky_group`; the validator quarantines one

`trainyard demo-media DIR` calls `generate_demo_media(DIR)`.

Presets (``preset=``, ``trainyard demo-media --preset``):

- ``demo`` (the default, what ``make demo`` uses): 40 tiny sources (90-192 px, 0.5-12 s) that
  encode in seconds and cover every container, codec and duration branch.
- ``realistic``: 12 sources at 720p and 480p, landscape and portrait, 4-8 s, all with stereo
  audio. The picture is a textured field that pans (a "camera" moving over multi-scale noise)
  with sensor-like grain and a moving square, so H.264 spends real bits on it: decoding it,
  and its 16x256x256 cuts, costs what camera footage costs, unlike a flat gradient that
  compresses to almost nothing. ``benchmarks/loader.py --preset realistic`` measures on it.

Layout of the folder (every media file has a sidecar `<media filename>.json`):

    clips/clip_NNN.mp4|.mkv   good H.264 clips, AAC / Opus / no audio
    edge_cases/...            one bad input per quarantine reason code
    PROVENANCE.md             how the files were made; written last

The same seed gives byte-identical files: x264 runs single-threaded (its output
depends on the thread count) and the muxers run with `+bitexact` (otherwise
Matroska writes random UIDs and both muxers stamp the library version).  Every
file is written under a temporary name and renamed, sidecars after their media
and PROVENANCE.md after everything, so an interrupted run never leaves a file
that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import av
import numpy as np

from ops.publish.hashing import sha256_file
from tools.mp4_boxes import declare_absurd_duration
from ops.media.probe import sniff_format

__all__ = ["PRESETS", "ClipSpec", "DemoMediaReport", "MediaPreset", "generate_demo_media"]

RESOLUTIONS = ((160, 90), (90, 160), (128, 128), (192, 108), (96, 128))
FRAME_RATES = (24, 25, 30)
CONTAINERS = ("mp4", "matroska")
# Opus in MP4 is muxed and read back fine by FFmpeg 8, so audio is independent of container.
AUDIO_CODECS = ("aac", "libopus", None)
AUDIO_LAYOUTS = ("mono", "stereo")
LICENSES = ("CC-BY-4.0", "CC0-1.0", "CC-BY-SA-4.0")
COLOURS = {
    "red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220),
    "yellow": (230, 210, 40), "purple": (140, 50, 180), "orange": (240, 140, 30),
    "white": (240, 240, 240), "teal": (30, 160, 160),
}
# Unit steps in image coordinates (y grows downwards).
DIRECTIONS = {
    "left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1),
    "up and left": (-1, -1), "up and right": (1, -1),
    "down and left": (-1, 1), "down and right": (1, 1),
}
SPEEDS = {"slowly": 0.25, "quickly": 0.9}  # fraction of the short side per second
TONES_HZ = {"low": 220.0, "middle": 440.0, "high": 880.0}
AUDIO_RATE_HZ = 48_000  # Opus only runs at 48 kHz; AAC uses the same for simplicity
MIN_DURATION_S, MAX_DURATION_S = 0.5, 12.0
GRAIN_LEVELS = 13  # textured sources: grain uniform in [-6, 6] grey levels per pixel
BOMB_DURATION_S = 2_000_000  # ~23 days: absurd for a clip, still fits 32-bit box fields
_MUXER_OPTIONS = {"fflags": "+bitexact"}
_X264_OPTIONS = {"threads": "1", "preset": "ultrafast", "crf": "28"}

EDGE_CASE_PURPOSES = {
    "empty_file": "zero-byte file",
    "truncated_file": "MP4 cut to half its bytes, so the trailing moov atom is lost; Matroska cut to 60% with its "
                      "header (and declared duration) intact",
    "unrecognized_format": "random bytes that no FFmpeg demuxer recognises",
    "not_media": "UTF-8 text saved under a media extension",
    "exceeds_limits": "valid MP4 whose headers and sample table declare ~23 days",
    "no_video_stream": "AAC audio with no video stream",
    "checksum_mismatch": "valid clip whose sidecar sha256 is wrong",
    "duplicate_content": "byte-identical copy of clips/clip_003",
    "split_leakage": "two clips of one source group declaring different splits",
    "consent_revoked": "valid clip whose sidecar says consent was revoked",
    "missing_license": "valid clip whose sidecar has no license",
    "malformed_sidecar": "valid clip whose sidecar is not JSON",
    "path_escape": "symlink, or sidecar uri, pointing outside the media root",
    "missing_object": "sidecar whose uri names a file that does not exist",
    "invalid_duration": "valid clip of 0.1 s",
    "unexpected_dimensions": "valid clip of 16x16 pixels",
    "missing_sidecar": "valid clip with no sidecar",
}


@dataclass(kw_only=True, slots=True, frozen=True)
class MediaPreset:
    """What the good sources of one preset look like; edge cases are the same in every preset."""

    name: str
    resolutions: tuple[tuple[int, int], ...]
    """(width, height) cycle; index i takes resolutions[i % len]."""
    frame_rates: tuple[int, ...]
    min_duration_s: float
    max_duration_s: float
    audio_codecs: tuple[str | None, ...]
    audio_layout: str
    textured: bool
    """Panning multi-scale noise with grain (camera-like bits) instead of a flat gradient."""
    num_good: int
    """Default number of good sources."""
    crf: int = 28
    """x264 quality of the sources (lower: more bits; 23 is x264's default, web-video-like at 720p)."""


PRESETS = {
    "demo": MediaPreset(name="demo", resolutions=RESOLUTIONS, frame_rates=FRAME_RATES,
                        min_duration_s=MIN_DURATION_S, max_duration_s=MAX_DURATION_S, audio_codecs=AUDIO_CODECS,
                        audio_layout="mono", textured=False, num_good=40),
    # 854 (not 853) wide: yuv420p needs even sides. Four sizes, three rates: every combination in 12.
    "realistic": MediaPreset(name="realistic", resolutions=((1280, 720), (720, 1280), (854, 480), (480, 854)),
                             frame_rates=FRAME_RATES, min_duration_s=4.0, max_duration_s=8.0,
                             audio_codecs=("aac", "libopus"), audio_layout="stereo", textured=True, num_good=12,
                             crf=23),
}


@dataclass(kw_only=True, slots=True)
class ClipSpec:
    """What one synthetic clip shows and how it is encoded."""

    width: int
    """Frame width in pixels; even, because yuv420p subsamples chroma by 2."""
    height: int
    """Frame height in pixels; even for the same reason."""
    fps: int
    num_frames: int
    container: str
    """FFmpeg muxer name: "mp4" or "matroska"."""
    audio_codec: str | None
    """"aac", "libopus" or None for a silent clip."""
    square: str
    """Key of COLOURS for the moving square."""
    background: str
    """Key of COLOURS for the gradient behind it."""
    direction: str
    """Key of DIRECTIONS."""
    speed: str
    """Key of SPEEDS."""
    tone: str
    """Key of TONES_HZ; only heard when audio_codec is set."""
    start_xy: tuple[int, int] = (0, 0)
    """Top-left corner of the square in the first frame, in pixels."""
    texture_seed: int | None = None
    """None: a flat gradient. A seed: a panning textured field with grain, drawn from this seed."""
    audio_layout: str = "mono"
    crf: int = 28

    def __post_init__(self) -> None:
        if self.width <= 0 or self.height <= 0 or self.width % 2 or self.height % 2:
            raise ValueError(f"width and height must be positive and even, got {self.width}x{self.height}")
        if self.num_frames < 1:
            raise ValueError(f"num_frames must be at least 1, got {self.num_frames}")
        if self.container not in CONTAINERS:
            raise ValueError(f"container must be one of {CONTAINERS}, got {self.container!r}")
        if self.audio_codec not in AUDIO_CODECS:
            raise ValueError(f"audio_codec must be one of {AUDIO_CODECS}, got {self.audio_codec!r}")
        if self.audio_layout not in AUDIO_LAYOUTS:
            raise ValueError(f"audio_layout must be one of {AUDIO_LAYOUTS}, got {self.audio_layout!r}")

    @property
    def duration_s(self) -> float:
        return self.num_frames / self.fps

    @property
    def extension(self) -> str:
        return ".mp4" if self.container == "mp4" else ".mkv"

    def caption(self) -> str:
        article = "an" if self.background[0] in "aeiou" else "a"
        field_name = "gradient" if self.texture_seed is None else "textured field, filmed by a panning camera"
        text = (f"a {self.square} square drifting {self.speed} {self.direction}"
                f" over {article} {self.background} {field_name}")
        return text + (f", with a steady {self.tone} tone" if self.audio_codec else "")


@dataclass(kw_only=True, slots=True)
class DemoMediaReport:
    """What generate_demo_media wrote; paths are relative to out_dir."""

    out_dir: Path
    good: list[str] = field(default_factory=list)
    """Media files the validator must accept."""
    bad: dict[str, str] = field(default_factory=dict)
    """Path (media file, or sidecar when there is no media) -> expected quarantine reason."""
    split_leak: list[str] = field(default_factory=list)
    """The `leaky_group` pair; exactly one of them is quarantined as `split_leakage`."""
    metadata_table: Path | None = None
    """With ``metadata="parquet"`` or ``"csv"``: the one table that replaced the sidecars."""
    table_rows: dict[str, int] = field(default_factory=dict)
    """Sidecar path it replaced -> its 1-based row in ``metadata_table``."""

    def table_spec(self):
        """The ops.media.metadata_table spec that reads ``metadata_table`` (its columns are TABLE_COLUMNS)."""
        from ops.media.metadata_table import MetadataTableSpec

        if self.metadata_table is None:
            raise ValueError("this demo media was written with sidecars, not a metadata table")
        return MetadataTableSpec(location=str(self.metadata_table), columns=TABLE_COLUMNS)


METADATA_MODES = ("sidecars", "parquet", "csv")
TABLE_COLUMNS = {"key": "key", "caption": "caption", "license": "license", "consent": "consent",
                 "source_group": "source_group", "split": "split", "sha256": "sha256"}
"""The demo table's columns, named as the fields they hold (ops.media.metadata_table's mapping)."""
TABLE_NAME = "metadata"
CARD = {"consent": "granted", "attested_by": "trainyard demo generator (tools/demo_media.py)",
        "attested_at": "2026-01-01",
        "description": "Synthetic clips drawn and voiced by the generator itself: every one may be trained on."}


def generate_demo_media(
    out_dir: str | Path, *, seed: int = 0, num_good: int | None = None, overwrite: bool = False,
    preset: str = "demo", metadata: str = "sidecars",
) -> DemoMediaReport:
    """Write the demo media folder and return what is in it.

    ``num_good`` defaults to the preset's (40 demo sources, 12 realistic ones).
    Raises FileExistsError if out_dir is non-empty and overwrite is False; with
    overwrite=True the generated parts (clips/, edge_cases/, PROVENANCE.md, the table and card) are
    deleted first and anything else in out_dir is left alone.

    ``metadata``: "sidecars" (one JSON per object), or "parquet" / "csv": one metadata table
    (``metadata.parquet`` / ``metadata.csv``, columns TABLE_COLUMNS) plus a ``dataset_card.yaml``
    stating the consent basis, the way labs receive data. Every well-formed sidecar becomes a row,
    so the edge cases stay: an orphan sidecar is a row without an object, an escaping uri a row whose
    key escapes; a sidecar that is not JSON stays a file (a mixed folder, as real ones are).
    """
    if metadata not in METADATA_MODES:
        raise ValueError(f"metadata must be one of {METADATA_MODES}, got {metadata!r}")
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    chosen = PRESETS[preset]
    num_good = chosen.num_good if num_good is None else num_good
    if seed < 0:
        raise ValueError(f"seed must be non-negative (numpy SeedSequence), got {seed}")
    if num_good < 4:
        raise ValueError(f"num_good must be at least 4 (edge_cases/duplicate copies clip_003), got {num_good}")
    root = Path(out_dir)
    _prepare_out_dir(root, overwrite=overwrite)
    report = DemoMediaReport(out_dir=root)
    # Separate streams so the edge cases do not change when num_good does.
    clip_records = _write_good_clips(root, np.random.default_rng([seed, 0]), num_good, report, chosen)
    _write_edge_cases(root, np.random.default_rng([seed, 1]), clip_records, report)
    if metadata != "sidecars":
        _sidecars_to_table(root, metadata, report)
    _write_provenance(root, seed=seed, num_good=num_good, preset=chosen)
    return report


def _sidecars_to_table(root: Path, fmt: str, report: DemoMediaReport) -> None:
    """Replace every well-formed sidecar under ``root`` by a row of one table, and add a dataset card."""
    import pyarrow as pa
    import pyarrow.csv
    import pyarrow.parquet as pq
    import yaml

    rows, converted = [], []
    for path in sorted(root.rglob("*.json")):
        rel = path.relative_to(root).as_posix()
        try:
            payload = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue  # the malformed-sidecar edge case stays what it is
        if not isinstance(payload, dict) or any(not isinstance(value, (str, type(None))) for value in payload.values()):
            continue
        rows.append({"key": payload.get("uri") or rel[: -len(".json")],
                     **{name: payload.get(name) for name in TABLE_COLUMNS if name != "key"}})
        converted.append(path)
        report.table_rows[rel] = len(rows)
    table = pa.Table.from_pylist(rows, schema=pa.schema([(name, pa.string()) for name in TABLE_COLUMNS]))
    target = root / f"{TABLE_NAME}.{fmt}"
    buffer = pa.BufferOutputStream()
    if fmt == "parquet":
        pq.write_table(table, buffer)
    else:
        pyarrow.csv.write_csv(table, buffer)
    _write_bytes(target, buffer.getvalue().to_pybytes())
    _write_bytes(root / "dataset_card.yaml", yaml.safe_dump(CARD, sort_keys=True).encode())
    for path in converted:
        path.unlink()
    report.metadata_table = target


# --- folder handling ----------------------------------------------------------------------


def _prepare_out_dir(root: Path, *, overwrite: bool) -> None:
    if root.exists() and any(root.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{root} is not empty; pass overwrite=True to regenerate it")
        for name in ("clips", "edge_cases"):
            if (root / name).exists():
                shutil.rmtree(root / name)
        for name in ("PROVENANCE.md", "dataset_card.yaml", *(f"{TABLE_NAME}.{fmt}" for fmt in METADATA_MODES[1:])):
            (root / name).unlink(missing_ok=True)
    (root / "clips").mkdir(parents=True)
    (root / "edge_cases").mkdir()


@contextmanager
def _atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `final`; rename it into place only if the body succeeds."""
    tmp = final.with_name(f".{final.name}.partial")
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, final)


def _write_bytes(path: Path, data: bytes) -> None:
    with _atomic_path(path) as tmp:
        tmp.write_bytes(data)


def _write_sidecar(root: Path, media_rel: str, record: dict[str, str], *, name: str | None = None) -> None:
    """Write `<media>.json` (or `name`, relative to root) with keys in a fixed order."""
    target = root / (name or f"{media_rel}.json")
    _write_bytes(target, (json.dumps(record, indent=2) + "\n").encode())


def _sidecar(uri: str, caption: str, *, license_id: str, group: str, sha256: str | None,
             split: str | None = None) -> dict[str, str]:
    record = {"uri": uri, "caption": caption, "license": license_id, "consent": "granted",
              "source_group": group}
    if split is not None:
        record["split"] = split
    if sha256 is not None:
        record["sha256"] = sha256
    return record


# --- encoding ----------------------------------------------------------------------------


def _render_frames(spec: ClipSpec) -> Iterator[np.ndarray]:
    """RGB frames of a square drifting (wrapping at the edges) over a horizontal gradient, or,
    with ``texture_seed``, over a textured field that pans the other way, with grain."""
    h, w = spec.height, spec.width
    side = max(2, min(w, h) // 4)
    step = SPEEDS[spec.speed] * min(w, h) / spec.fps
    dx, dy = DIRECTIONS[spec.direction]
    if spec.texture_seed is None:
        ramp = np.linspace(0.25, 1.0, w, dtype=np.float32)[None, :, None]
        background = np.broadcast_to(ramp * np.array(COLOURS[spec.background], np.float32), (h, w, 3))
        background = background.astype(np.uint8)
    else:
        rng = np.random.default_rng(spec.texture_seed)
        # The camera pans against the square at half its speed and turns back at the canvas edge
        # (a quarter frame beyond the picture each way), so every frame is a slice of one canvas.
        reach_x, reach_y = w // 4, h // 4
        canvas = _texture(rng, w + reach_x, h + reach_y, COLOURS[spec.background])
        # Grain: a few frames of noise, drawn once, cycled with a shift (drawing a new 720p frame
        # of noise per frame would double the generator's time for no visible difference).
        grain = rng.integers(-(GRAIN_LEVELS // 2), GRAIN_LEVELS // 2 + 1, size=(3, h, w + 64, 1), dtype=np.int16)
    for index in range(spec.num_frames):
        x0 = int(round(spec.start_xy[0] + dx * step * index))
        y0 = int(round(spec.start_xy[1] + dy * step * index))
        if spec.texture_seed is None:
            frame = background.copy()
        else:
            px, py = _bounce(-dx * step * index / 2, reach_x), _bounce(-dy * step * index / 2, reach_y)
            shift = (7 * index) % 64
            noisy = canvas[py:py + h, px:px + w].astype(np.int16) + grain[index % 3, :, shift:shift + w]
            frame = np.clip(noisy, 0, 255).astype(np.uint8)
        frame[np.ix_((y0 + np.arange(side)) % h, (x0 + np.arange(side)) % w)] = COLOURS[spec.square]
        yield frame


def _bounce(distance: float, reach: int) -> int:
    """Position in [0, reach] after travelling ``distance``, turning back at either end."""
    if reach == 0:
        return 0
    folded = abs(distance) % (2 * reach)
    return int(round(folded if folded <= reach else 2 * reach - folded))


def _texture(rng: np.random.Generator, width: int, height: int, colour: tuple[int, int, int]) -> np.ndarray:
    """Multi-scale noise (blobs, then finer detail) tinted by ``colour``: uint8 [H, W, 3].

    Each octave is a small random image scaled up bicubically by libswscale: fast, and smooth
    where nearest-neighbour blocks would compress to nothing.
    """
    import av
    total = np.zeros((height, width), np.float32)
    even_w, even_h = width + width % 2, height + height % 2
    for cell, weight in ((96, 0.55), (24, 0.3), (6, 0.15)):
        small = rng.integers(0, 256, size=(max(2, height // cell), max(2, width // cell)), dtype=np.uint8)
        frame = av.VideoFrame.from_ndarray(np.repeat(small[:, :, None], 3, axis=2), format="rgb24")
        octave = frame.reformat(width=even_w, height=even_h, interpolation="BICUBIC").to_ndarray()[:height, :width, 0]
        total += weight * octave.astype(np.float32)
    shade = 0.35 + 0.65 * (total / 255.0)
    return np.clip(shade[:, :, None] * np.array(colour, np.float32), 0, 255).astype(np.uint8)


def _video_packets(container: av.container.OutputContainer, spec: ClipSpec) -> list[av.Packet]:
    stream = container.add_stream("libx264", rate=spec.fps)
    stream.width, stream.height, stream.pix_fmt = spec.width, spec.height, "yuv420p"
    stream.options = {**_X264_OPTIONS, "crf": str(spec.crf)}
    packets: list[av.Packet] = []
    for index, image in enumerate(_render_frames(spec)):
        frame = av.VideoFrame.from_ndarray(image, format="rgb24")
        frame.pts = index
        packets.extend(stream.encode(frame))
    packets.extend(stream.encode(None))
    return packets


def _audio_packets(container: av.container.OutputContainer, codec: str, tone_hz: float,
                   duration_s: float, layout: str = "mono") -> list[av.Packet]:
    stream = container.add_stream(codec, rate=AUDIO_RATE_HZ, layout=layout)
    stream.bit_rate = 32_000 if layout == "mono" else 96_000
    channels = AUDIO_LAYOUTS.index(layout) + 1
    num_samples = int(round(duration_s * AUDIO_RATE_HZ))
    chunk = 960  # 20 ms; PyAV re-buffers to the encoder's own frame size
    packets: list[av.Packet] = []
    for start in range(0, num_samples, chunk):
        t = np.arange(start, min(start + chunk, num_samples)) / AUDIO_RATE_HZ
        # A second channel a fifth above: stereo that a downmix to mono does not cancel.
        samples = np.stack([0.2 * np.sin(2 * np.pi * tone_hz * (1.5 ** channel) * t)
                            for channel in range(channels)]).astype(np.float32)
        frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout=layout)
        frame.sample_rate, frame.pts = AUDIO_RATE_HZ, start
        packets.extend(stream.encode(frame))
    packets.extend(stream.encode(None))
    return packets


def _mux_in_time_order(container: av.container.OutputContainer, packets: list[av.Packet]) -> None:
    """Mux by timestamp ourselves: the muxer's interleaving buffer gives up after 10 s of skew."""
    for packet in sorted(packets, key=lambda p: (float(p.dts * p.time_base), p.stream.index)):
        container.mux(packet)


def _write_clip(path: Path, spec: ClipSpec, *, muxer_options: dict[str, str] | None = None,
                last_frame_periods: int | None = None) -> None:
    """Encode `spec` to `path`.

    last_frame_periods gives the last frame a different duration, so it gets its
    own stts entry, which the decode-bomb patch then stretches in place.
    """
    with _atomic_path(path) as tmp:
        options = {**_MUXER_OPTIONS, **(muxer_options or {})}
        with av.open(str(tmp), "w", format=spec.container, options=options) as container:
            packets = _video_packets(container, spec)
            if last_frame_periods is not None:
                packets[-1].duration = last_frame_periods
            if spec.audio_codec is not None:
                packets += _audio_packets(container, spec.audio_codec, TONES_HZ[spec.tone], spec.duration_s,
                                          spec.audio_layout)
            _mux_in_time_order(container, packets)


def _write_tone(path: Path, tone_hz: float, duration_s: float) -> None:
    """An audio-only M4A (AAC) file."""
    with _atomic_path(path) as tmp:
        with av.open(str(tmp), "w", format="ipod", options=dict(_MUXER_OPTIONS)) as container:
            _mux_in_time_order(container, _audio_packets(container, "aac", tone_hz, duration_s))


# --- good clips --------------------------------------------------------------------------


def _random_look(rng: np.random.Generator, width: int, height: int) -> dict[str, object]:
    square, background = rng.choice(sorted(COLOURS), size=2, replace=False)
    return {
        "square": str(square), "background": str(background),
        "speed": str(rng.choice(sorted(SPEEDS))), "tone": str(rng.choice(sorted(TONES_HZ))),
        "start_xy": (int(rng.integers(width)), int(rng.integers(height))),
    }


def _good_clip_spec(index: int, num_good: int, rng: np.random.Generator,
                    preset: MediaPreset = PRESETS["demo"]) -> ClipSpec:
    """Cycle lengths 5, 3, 2, 3, 8 (demo; 4, 3, 2, 2, 8 realistic) are mixed so small sets still
    cover every option."""
    width, height = preset.resolutions[index % len(preset.resolutions)]
    fps = preset.frame_rates[index % len(preset.frame_rates)]
    span = preset.max_duration_s - preset.min_duration_s
    target_s = preset.min_duration_s + span * index / max(1, num_good - 1)
    # ceil keeps every clip at or above the minimum; 0.5 s and 12 s are exact at 24 fps.
    num_frames = int(np.ceil(target_s * fps - 1e-9))
    look = _random_look(rng, width, height)
    return ClipSpec(
        width=width, height=height, fps=fps, num_frames=num_frames,
        container=CONTAINERS[index % len(CONTAINERS)],
        audio_codec=preset.audio_codecs[index % len(preset.audio_codecs)],
        direction=list(DIRECTIONS)[index % len(DIRECTIONS)],
        # Drawn after the look, so the demo preset's random stream is what it always was.
        texture_seed=int(rng.integers(2**63)) if preset.textured else None,
        audio_layout=preset.audio_layout, crf=preset.crf, **look,
    )


def _group_splits(num_groups: int) -> list[str]:
    """One split per group, so good clips never leak across splits."""
    splits = ["train"] * num_groups
    if num_groups >= 3:
        splits[-2] = "val"
    if num_groups >= 2:
        splits[-1] = "test"
    return splits


def _write_good_clips(root: Path, rng: np.random.Generator, num_good: int, report: DemoMediaReport,
                      preset: MediaPreset) -> dict[int, dict[str, str]]:
    """Write clips/ and return each clip's sidecar record (edge cases reuse clip_003's)."""
    num_groups = max(1, min(12, num_good // 3))
    group_of = rng.permutation(num_good) % num_groups
    splits = _group_splits(num_groups)
    records: dict[int, dict[str, str]] = {}
    for index in range(num_good):
        spec = _good_clip_spec(index, num_good, rng, preset)
        rel = f"clips/clip_{index:03d}{spec.extension}"
        _write_clip(root / rel, spec)
        group = int(group_of[index])
        records[index] = _sidecar(rel, spec.caption(), license_id=str(rng.choice(LICENSES)),
                                  group=f"group_{group:02d}", split=splits[group],
                                  sha256=sha256_file(root / rel))
        _write_sidecar(root, rel, records[index])
        report.good.append(rel)
    return records


# --- edge cases --------------------------------------------------------------------------


class _EdgeWriter:
    """Writes edge_cases/ files, each with distinct content, and records them in the report."""

    def __init__(self, root: Path, rng: np.random.Generator, report: DemoMediaReport) -> None:
        self.root, self.rng, self.report = root, rng, report
        self.num_clips = 0

    def spec(self, **overrides: object) -> ClipSpec:
        """A fresh 1 s clip; the direction cycles so no two edge clips are alike."""
        width, height = overrides.pop("size", (128, 96))
        self.num_clips += 1
        fields = {"width": width, "height": height, "fps": 25, "num_frames": 25, "container": "mp4",
                  "audio_codec": None, "direction": list(DIRECTIONS)[self.num_clips % len(DIRECTIONS)],
                  **_random_look(self.rng, width, height)}
        return ClipSpec(**{**fields, **overrides})

    def clip(self, name: str, reason: str | None, **overrides: object) -> tuple[str, ClipSpec]:
        rel = f"edge_cases/{name}"
        spec = self.spec(**overrides)
        _write_clip(self.root / rel, spec)
        if reason is not None:
            self.report.bad[rel] = reason
        return rel, spec

    def sidecar(self, rel: str, caption: str, *, name: str | None = None, hashed: bool = True,
                omit: tuple[str, ...] = (), **changes: str) -> dict[str, str]:
        sha = sha256_file(self.root / rel) if hashed else None
        stem = Path(name or rel).name.split(".")[0]
        record = _sidecar(rel, caption, license_id=str(self.rng.choice(LICENSES)),
                          group=f"edge_{stem}", sha256=sha)
        record.update(changes)
        for key in omit:
            del record[key]
        _write_sidecar(self.root, rel, record, name=name)
        return record


def _write_edge_cases(root: Path, rng: np.random.Generator, clip_records: dict[int, dict[str, str]],
                      report: DemoMediaReport) -> None:
    edge = _EdgeWriter(root, rng, report)
    _write_unreadable_files(edge)
    _write_bomb(edge)
    _write_tone(root / "edge_cases/audio_only.m4a", TONES_HZ["middle"], 2.0)
    report.bad["edge_cases/audio_only.m4a"] = "no_video_stream"
    edge.sidecar("edge_cases/audio_only.m4a", "a steady middle tone")
    _write_duplicate(edge, clip_records[3])
    _write_sidecar_cases(edge)
    _write_escapes(edge)
    for name, reason, overrides in (("too_short.mp4", "invalid_duration", {"fps": 30, "num_frames": 3}),
                                    ("tiny.mp4", "unexpected_dimensions", {"size": (16, 16)})):
        rel, spec = edge.clip(name, reason, **overrides)
        edge.sidecar(rel, spec.caption())
    edge.clip("no_sidecar.mp4", "missing_sidecar")


def _write_unreadable_files(edge: _EdgeWriter) -> None:
    root, report = edge.root, edge.report
    _write_bytes(root / "edge_cases/empty.mp4", b"")
    spec = edge.spec(num_frames=50)
    _write_clip(root / "edge_cases/.whole.mp4", spec)
    whole = (root / "edge_cases/.whole.mp4").read_bytes()
    (root / "edge_cases/.whole.mp4").unlink()
    # PyAV's mp4 muxer writes moov after mdat, so the first half has no index at all.
    _write_bytes(root / "edge_cases/truncated.mp4", whole[: len(whole) // 2])
    # Matroska has no sample table: its header still declares 2 s, only the packets tell.
    _write_clip(root / "edge_cases/.whole.mkv", replace(spec, container="matroska"))
    whole = (root / "edge_cases/.whole.mkv").read_bytes()
    (root / "edge_cases/.whole.mkv").unlink()
    _write_bytes(root / "edge_cases/truncated.mkv", whole[: len(whole) * 3 // 5])
    _write_bytes(root / "edge_cases/random_bytes.mp4", _unprobeable_bytes(edge.rng, root))
    # ASCII first: sniffers judge a fixed-size head, which must not end inside a multi-byte character.
    text = ("This is not a video. It is a plain text file that Trainyard's demo generator saved\n"
            "under a .mkv name, to check that text is told apart from media. UTF-8: ünïcödé.\n")
    _write_bytes(root / "edge_cases/text.mkv", text.encode("utf-8"))
    for name, reason, caption in (("empty.mp4", "empty_file", "nothing at all"),
                                  ("truncated.mp4", "truncated_file", spec.caption()),
                                  ("truncated.mkv", "truncated_file", spec.caption()),
                                  ("random_bytes.mp4", "unrecognized_format", "random noise bytes"),
                                  ("text.mkv", "not_media", "a text file")):
        report.bad[f"edge_cases/{name}"] = reason
        edge.sidecar(f"edge_cases/{name}", caption)


def _unprobeable_bytes(rng: np.random.Generator, root: Path, num_bytes: int = 50_000) -> bytes:
    """Random bytes that neither the validator's signature sniffer nor FFmpeg recognises.

    About one random blob in thirty probes as raw H.263 in FFmpeg (a lucky start
    code), and one in ~2000 starts with an MP3 sync word; redraw those so the case
    means "unrecognised format" rather than "recognised but broken".
    """
    probe = root / "edge_cases/.probe.bin"
    try:
        for _ in range(32):
            blob = rng.bytes(num_bytes)
            if sniff_format(blob[:64]) != "unknown":
                continue
            probe.write_bytes(blob)
            try:
                av.open(str(probe)).close()
            except av.FFmpegError:
                return blob
    finally:
        probe.unlink(missing_ok=True)
    raise RuntimeError("32 random blobs in a row were recognised as media; has the probe logic changed?")


def _write_bomb(edge: _EdgeWriter) -> None:
    rel = "edge_cases/decode_bomb.mp4"
    # A 1000 Hz media timescale keeps BOMB_DURATION_S within 32-bit stts/mdhd fields.
    _write_clip(edge.root / rel, edge.spec(), muxer_options={"video_track_timescale": "1000"},
                last_frame_periods=2)
    data = bytearray((edge.root / rel).read_bytes())
    declare_absurd_duration(data, BOMB_DURATION_S)
    _write_bytes(edge.root / rel, bytes(data))
    edge.report.bad[rel] = "exceeds_limits"
    edge.sidecar(rel, "a short clip whose header claims weeks of video")


def _write_duplicate(edge: _EdgeWriter, original: dict[str, str]) -> None:
    rel = "edge_cases/duplicate" + Path(original["uri"]).suffix
    _write_bytes(edge.root / rel, (edge.root / original["uri"]).read_bytes())
    edge.report.bad[rel] = "duplicate_content"
    _write_sidecar(edge.root, rel, {**original, "uri": rel})


def _write_sidecar_cases(edge: _EdgeWriter) -> None:
    rel, spec = edge.clip("bad_checksum.mp4", "checksum_mismatch")
    edge.sidecar(rel, spec.caption(), sha256=hashlib.sha256(b"not these bytes").hexdigest())
    for name, split in (("split_leak_a.mp4", "train"), ("split_leak_b.mp4", "test")):
        rel, spec = edge.clip(name, None)
        edge.sidecar(rel, spec.caption(), source_group="leaky_group", split=split)
        edge.report.split_leak.append(rel)
    rel, spec = edge.clip("consent_revoked.mp4", "consent_revoked")
    edge.sidecar(rel, spec.caption(), consent="revoked")
    rel, spec = edge.clip("missing_license.mp4", "missing_license")
    edge.sidecar(rel, spec.caption(), omit=("license",))
    rel, _ = edge.clip("malformed_sidecar.mp4", "malformed_sidecar")
    _write_bytes(edge.root / f"{rel}.json", b'{"caption": "x",')


def _write_escapes(edge: _EdgeWriter) -> None:
    rel = "edge_cases/escape_link.mp4"
    link = edge.root / rel
    with _atomic_path(link) as tmp:
        # Relative to edge_cases/: two levels up is the parent of the media root. It may dangle.
        os.symlink("../../outside.mp4", tmp)
    edge.report.bad[rel] = "path_escape"
    edge.sidecar(rel, "a link that leaves the media root", hashed=False)
    for name, uri, reason in (("escape_uri.json", "../../etc/passwd", "path_escape"),
                              ("missing_object.json", "edge_cases/missing_object.mp4", "missing_object")):
        edge.sidecar(uri, "a sidecar without its media", name=f"edge_cases/{name}", hashed=False)
        edge.report.bad[f"edge_cases/{name}"] = reason


# --- provenance --------------------------------------------------------------------------


def _write_provenance(root: Path, *, seed: int, num_good: int, preset: MediaPreset) -> None:
    libs = ", ".join(f"{name} {'.'.join(map(str, v))}" for name, v in sorted(av.library_versions.items()))
    lines = [
        "# Provenance of this demo media folder",
        "",
        "Every file here was synthesised by Trainyard's demo media generator",
        "(`tools/demo_media.py`, `generate_demo_media`). No third-party media is included:",
        "the video is a coloured square drifting over a gradient, the audio is a sine tone.",
        *(() if preset.name == "demo" else (  # the demo preset's file stays what it always was
            f"Preset {preset.name}: the square drifts over panning textured noise with grain,",
            f"the tone is {preset.audio_layout}.")),
        "",
        f"- seed: {seed}",
        f"- good clips: {num_good}",
        f"- PyAV {av.__version__}, FFmpeg {av.ffmpeg_version_info}",
        f"- FFmpeg libraries: {libs}",
        "- encoders: libx264 (threads=1, ultrafast, crf 28), aac, libopus; muxers with +bitexact",
        "",
        "The same seed and library versions give byte-identical files.",
        "",
        "## Edge cases (`edge_cases/`)",
        "",
        "Each file exists to trip exactly one validator rule, named by its quarantine reason.",
        "",
        "| reason | what the file is |",
        "|---|---|",
        *(f"| `{reason}` | {purpose} |" for reason, purpose in EDGE_CASE_PURPOSES.items()),
        "",
        "`split_leak_a` and `split_leak_b` share `leaky_group` but declare train and test;",
        "the validator keeps the group's most common split and quarantines the other clip.",
        "",
    ]
    _write_bytes(root / "PROVENANCE.md", "\n".join(lines).encode("utf-8"))
