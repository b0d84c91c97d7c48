"""Evaluate one committed checkpoint: held-out loss and samples, with no training.

    python -m trainer.evaluate --config exp.yaml --overrides-file run.json \\
        --checkpoint RUN/checkpoints/step_00000020 --run-id pretrain-abc --out EVAL_DIR [--split test]
    torchrun --nproc-per-node=2 -m trainer.evaluate ...      # the same figures on 2 ranks

The model is built from the run's own config (its launch overrides) through model.factory and
parallelized as the run was; its weights come from the checkpoint through the checkpointer's load,
which re-hashes every file against the signed record and checks its lineage names ``--run-id``
before anything is read: a checkpoint that fails verification is refused (exit 1, named), never
evaluated. The figures are trainer/heldout.py's; rank 0 writes ``EVAL_DIR/evaluation.json``
(the split's loss, per time and per clip shape; the samples and contact sheet under
``EVAL_DIR/samples``; the checkpoint, its step and the run's lineage).

Exit status: 0 evaluated (a skip, such as an empty split, is recorded in evaluation.json and is
still 0), 1 refused or failed, 2 config refused.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

log = logging.getLogger("trainer")


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer.evaluate", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="experiment YAML (the run's)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=C")
    parser.add_argument("--overrides-file", metavar="PATH", help="JSON list of overrides, applied before --set")
    parser.add_argument("--checkpoint", required=True, help="committed checkpoint folder or store URL")
    parser.add_argument("--run-id", required=True, help="run id its signed lineage must name")
    parser.add_argument("--out", required=True, help="folder for evaluation.json and the samples")
    parser.add_argument("--split", help="held-out split (default: the config's eval.split)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from ops.loading.sampling import World
    from trainer.launch.config import load_config, read_overrides_file
    from trainer.endings import CONFIG_ERROR_EXIT

    args = _parse_args(argv)
    world = World.from_env()
    logging.basicConfig(level=logging.INFO if world.is_main else logging.WARNING, stream=sys.stdout,
                        format=f"[rank {world.rank}] %(asctime)s %(levelname)s %(message)s")
    try:
        overrides = [*(read_overrides_file(args.overrides_file) if args.overrides_file else []), *args.overrides]
        if args.split:
            overrides.append(f"eval.split={args.split}")
        config = load_config(args.config, overrides)
        from trainer.launch.preflight import preflight

        preflight(config, world_size=world.world_size)
    except (ValueError, OSError, yaml.YAMLError) as error:
        log.error("config refused: %s", error)
        return CONFIG_ERROR_EXIT
    from trainer.checkpointing.checkpointer import CheckpointCorrupt, CheckpointIncompatible

    try:
        record = evaluate_checkpoint(config, checkpoint=args.checkpoint, run_id=args.run_id, out_dir=Path(args.out))
    except (CheckpointCorrupt, CheckpointIncompatible) as error:  # verification or fit: refused, nothing evaluated
        log.error("evaluation of %s refused: %s: %s", args.checkpoint, type(error).__name__, error)
        return 1
    except Exception:  # anything else is a failure of the evaluation itself: its traceback is the record
        log.exception("evaluation of %s failed", args.checkpoint)
        return 1
    if record is not None:
        log.info("evaluated %s: %s", args.checkpoint, json.dumps(record["loss"])[:500])
    return 0


def evaluate_checkpoint(config, *, checkpoint: str, run_id: str, out_dir: Path) -> dict | None:
    """Load ``checkpoint``'s weights into the configured model and evaluate it; rank 0's record."""
    from ops.checkpoints import store as store
    from trainer.checkpointing.checkpointer import Checkpointer
    from trainer.heldout import Evaluator
    from ops.publish.durable import write_json_atomic
    from trainer.models.protocol import build_model
    from trainer.parallel import destroy_distributed, init_distributed, parallelize, resolve_deterministic, seed_everything
    from trainer.precision import Precision
    from trainer.state import ModelState
    from trainer.wiring import model_fingerprint, run_lineage

    train = config.train
    distributed = init_distributed(parallelism=train.parallelism, device=train.device,
                                   collective_timeout_s=train.collective_timeout_s)
    world, device = distributed.world, distributed.device
    checkpointer = None
    try:
        deterministic = resolve_deterministic(train.deterministic, device.type)
        seed_everything(train.seed, world.rank, deterministic=deterministic, device_type=device.type)
        precision = Precision(train.precision, device_type=device.type)
        model = build_model(config)
        model.init_weights(seed=train.seed)  # overwritten below; a parameter left out would be named by the load
        model = parallelize(model.to(device), train, distributed, compute_dtype=precision.compute_dtype)
        if world.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
        lineage = {**run_lineage(config), "run_id": f"evaluation-{run_id}"}
        checkpointer = Checkpointer(out_dir, world=world, keep_last_k=1, keep_every_m=0, hmac_key=store.configured_key(),
                                    lineage=lineage, model_fingerprint=model_fingerprint(config), seed=train.seed,
                                    numerics={"device_type": device.type, "precision": precision.policy,
                                              "deterministic": deterministic})
        step = checkpointer.load({"model": ModelState(model)}, checkpoint_dir=checkpoint, expected_run_id=run_id)
        evaluator = Evaluator(config, distributed=distributed, model=model, precision=precision)
        loss = evaluator.validation_loss()
        samples = evaluator.generate(out_dir / "samples")  # no training here: every rank may wait for it
        if not world.is_main:
            return None
        record = {"checkpoint": checkpoint, "run_id": run_id, "checkpoint_step": step, "split": config.eval.split,
                  "loss": loss, "samples": samples, "world_size": world.world_size, "precision": precision.policy,
                  "config_name": config.name, "lineage": run_lineage(config, as_tags=False),
                  "eval": {"max_samples": config.eval.max_samples, "timesteps": config.eval.timesteps,
                           "seed": config.eval.seed, "synthetic_samples": config.eval.synthetic_samples}}
        write_json_atomic(out_dir / "evaluation.json", record)
        return record
    finally:
        if checkpointer is not None:
            checkpointer.close()
        destroy_distributed()


if __name__ == "__main__":
    sys.exit(main())
