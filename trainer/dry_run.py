"""``trainyard dry-run CONFIG``: everything a launch would check, plus a few real batches, no training.

Validates the config (unknown keys, contradictions), the launch plan for the world size
(batch division, precision on this device, memory estimate against the budget), the data
(shard index present, manifest version and clip shape matching it), builds the model on the
meta device to count parameters and tokens, and decodes ``num_batches`` batches of rank 0 with
the real loader, each reported with its clip shape and bucket (bucketed data changes shape from
step to step), next to the source's resolved batching. Prints one JSON report; raises a
Refusal (trainer/launch/refusal.py: one line with its category and fix, exit 2) on the first problem:
a literal secret in the overrides, the config, the launch plan, the data, the rights ledger.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from ops.loading.sampling import World
from trainer.launch.config import check_no_literal_secrets, load_config
from trainer.data import build_data_source
from trainer.models.video import num_tokens
from trainer.models.protocol import build_model
from ops import progress
from trainer.launch.preflight import check_rights, preflight
from trainer.launch.redact import redacted_dict


def dry_run(config_path: str | Path, overrides: list[str], *, world_size: int, num_batches: int = 2) -> dict[str, Any]:
    check_no_literal_secrets(overrides, where="--set")  # as a stage's launch does: never a secret in clear text
    config = load_config(config_path, overrides)
    plan = preflight(config, world_size=world_size)
    check_rights(config)
    with torch.device("meta"):
        model = build_model(config)
    source = build_data_source(config.data, world=World(rank=0, world_size=world_size),
                               local_batch_size=plan.local_batch_size)
    batches = []
    with progress.task("decoding batches", num_batches, unit="batches") as bar:
        for _ in range(num_batches):
            batches.append(_one_batch(source, config))
            bar.advance()
    return {"config": redacted_dict(config), "plan": plan.as_dict(), "data": source.describe(),
            "num_params": sum(p.numel() for p in model.parameters()),
            "tokens_per_sample": num_tokens(config.data.video_shape, config.model.patch_size),
            "flops_per_local_step": plan.local_batch_size * model.flops_per_sample(config.data.video_shape),
            "batches": batches}


def _one_batch(source, config) -> dict[str, Any]:
    started = time.perf_counter()
    batch = source.next_batch()
    clip_shape = batch["video"].shape[1:4]
    return {"num_samples": len(batch["keys"]), "video": list(batch["video"].shape),
            "audio": list(batch["audio"].shape), "bucket": batch["bucket"],
            "tokens_per_sample": num_tokens(clip_shape, config.model.patch_size),
            "failed": len(batch.get("failed", [])),
            "decode_s": round(time.perf_counter() - started, 4), "first_key": batch["keys"][:1]}
