"""Report assets: comm_benchmark, scaling_report, cost_report and canary.

Each is thin over ops/drills/reports.py: it measures (or reads run folders), writes report.json and plot.png
under ``<data>/reports/<name>/<version>/`` (version: the report's own digest), and returns the figures
as metadata with the plot inline. A report with nothing to report yet says so (``status: empty`` and
``empty_reason``) instead of failing.

- comm_benchmark: all_reduce / all_gather / reduce_scatter on 2 spawned ranks (gloo on CPU, NCCL on
  GPUs) at the sizes DDP's gradient buckets have for the configured model, plus 25 MiB. In node-pair
  mode (``node_pairs: true``, or the deployment's launcher a SlurmLauncher with nodes > 1) the same
  collectives between every pair of SLURM nodes instead, one job per pair (ops/drills/comm_pairs.py),
  at the sizes of the model's DDP buckets and FSDP units, with the outlier pair named.
- scaling_report: the same short workload on 1, 2 (and more where devices exist) ranks at a fixed
  per-device batch (weak scaling); efficiency = throughput(n) / (n x throughput(1)).
- cost_report: device-hours of every run folder (failed and abandoned ones too) x a price table,
  by stage and by data version, with checkpoint-writing time priced apart.
- canary: the workload under arms A and B, loss and grad norm compared step by step; the blocking
  check ``canary_passed`` keeps a failing candidate from whatever depends on ``canary``.
"""

import base64
import json
import os
from pathlib import Path

import dagster as dg

from assets.metadata import lineage_metadata, markdown_table
from ops.drills import comm_pairs, reports
from ops.publish.hashing import digest_json
from ops.lineage import code_version_of
from ops.publish.paths import REPO_ROOT
from resources import LineageResource, StorageResource

GROUP = "reports"
REPORTS_CODE_VERSION = code_version_of("ops.drills.reports")
COMM_CODE_VERSION = code_version_of("ops.drills.reports", "ops.drills.comm_pairs")
MAX_INLINE_PLOT_BYTES = 512 * 1024


def _publish(context: dg.AssetExecutionContext, name: str, report: dict, png: bytes | None, *,
             storage: StorageResource, lineage: LineageResource, config: dict, table: dg.MetadataValue | None = None,
             manifest_version: str = "none", extra: dict | None = None) -> dg.MaterializeResult:
    """Write the report and return its metadata: status, path, the plot inline, a table, lineage."""
    version = digest_json(report)[:16]
    path = reports.write_report(storage.data / "reports" / name / version, report, png)
    metadata = {"status": report["status"], "report_path": str(path), "report_version": version}
    if report["status"] == "empty":
        metadata["empty_reason"] = report["empty_reason"]
        context.log.info(f"{name}: empty: {report['empty_reason']}")
    if png is not None and len(png) <= MAX_INLINE_PLOT_BYTES:
        metadata["plot"] = dg.MetadataValue.md(f"![{name}](data:image/png;base64,{base64.b64encode(png).decode()})")
    if png is not None:
        metadata["plot_path"] = dg.MetadataValue.path(str(path.parent / "plot.png"))
    if table is not None:
        metadata["table"] = table
    record = lineage.collect(manifest_version=manifest_version, config=config, code_version=REPORTS_CODE_VERSION)
    return dg.MaterializeResult(metadata={**metadata, **(extra or {}), **lineage_metadata(record)},
                                data_version=dg.DataVersion(version))


def _config_file(config_path: str) -> Path:
    path = Path(config_path)
    return path if path.is_absolute() else REPO_ROOT / path


# ---------------------------------------------------------------------------------------------


class CommBenchmarkConfig(dg.Config):
    config_path: str = "configs/demo.yaml"
    """Experiment whose model's gradient buckets give the message sizes."""
    sizes_bytes: list[int] = []
    """Message sizes; empty means the model's DDP buckets, its total gradient bytes and 25 MiB."""
    world_size: int = 2
    iterations: int = 20
    warmup: int = 5
    node_pairs: bool = False
    """Time every pair of SLURM nodes instead (ops/drills/comm_pairs.py); also on when the deployment's
    launcher is a SlurmLauncher with nodes > 1."""
    partition: str = ""
    """Node-pair mode: the partition; empty: the SLURM launcher's, else the cluster's default."""
    nodes: list[str] = []
    """Node-pair mode: the nodes to pair; empty: every node of the partition that is up and not drained."""
    pair_time_limit_s: int = 120
    """Node-pair mode: each pair's SLURM time limit."""


def _model_numels(config_path: str | Path) -> tuple[list[int], list[int]]:
    """The trainable parameters' sizes (model order), and the FSDP units' (trainer/parallel.py: one
    unit per block, the root unit holding the rest)."""
    from trainer.launch.config import load_config  # torch: imported by the run that measures
    from trainer.models.protocol import build_model

    config = load_config(_config_file(str(config_path)), ["data.source=synthetic"])
    model = build_model(config)
    numels = [param.numel() for param in model.parameters() if param.requires_grad]
    blocks = [sum(param.numel() for param in block.parameters() if param.requires_grad) for block in model.blocks]
    return numels, [*blocks, sum(numels) - sum(blocks)]


def model_gradient_sizes(config_path: str | Path) -> dict:
    """The model's parameter sizes (fp32 gradients) and the buckets DDP forms from them."""
    numels, _units = _model_numels(config_path)
    return {"num_params": sum(numels), "gradient_bytes": 4 * sum(numels), "bucket_bytes": reports.bucket_bytes(numels)}


def model_message_sizes(config_path: str | Path) -> dict:
    """model_gradient_sizes and the FSDP units' fp32 bytes (what each unit all-gathers and reduce-scatters)."""
    numels, units = _model_numels(config_path)
    return {"num_params": sum(numels), "gradient_bytes": 4 * sum(numels), "bucket_bytes": reports.bucket_bytes(numels),
            "fsdp_unit_bytes": [4 * numel for numel in units if numel]}


def deployment_slurm_launcher():
    """The SlurmLauncher pipelines/definitions.py binds as ``launcher`` (TRAINYARD_ENV names slurm), else
    None. Built from the same variables rather than received as the resource: Dagster has no optional
    resources, and comm_benchmark also runs where no launcher is bound (tests/test_reports.py)."""
    if "slurm" not in os.environ.get("TRAINYARD_ENV", "").split("+"):
        return None
    from resources.slurm import SlurmLauncher

    return SlurmLauncher.from_env()


def pair_mode(config: CommBenchmarkConfig, launcher) -> tuple[str, list[str]] | None:
    """(partition, excluded nodes) when comm_benchmark times node pairs, else None (one host, as before):
    on ``node_pairs``, or when ``launcher`` is a SlurmLauncher over more than one node."""
    from resources.slurm import SlurmLauncher

    slurm = launcher if isinstance(launcher, SlurmLauncher) else None
    if not config.node_pairs and (slurm is None or slurm.nodes <= 1):
        return None
    return config.partition or (slurm.partition if slurm else ""), list(slurm.exclude) if slurm else []


def _node_pairs(context: dg.AssetExecutionContext, config: CommBenchmarkConfig, storage: StorageResource,
                lineage: LineageResource, partition: str, exclude: list[str]) -> dg.MaterializeResult:
    model = model_message_sizes(config.config_path)
    sizes = config.sizes_bytes or sorted({*model["bucket_bytes"], *model["fsdp_unit_bytes"]})
    settings = comm_pairs.PairSettings(
        partition=partition, sizes_bytes=tuple(sizes), nodes=tuple(config.nodes), exclude=tuple(exclude),
        out_dir=storage.data / "reports" / "comm_benchmark" / "pairs" / context.run.run_id,
        iterations=config.iterations, warmup=config.warmup, time_limit_s=config.pair_time_limit_s)
    report = {"report": "comm_benchmark", "status": "ok", "mode": "node_pairs", "model": model,
              **comm_pairs.run_node_pairs(settings)}
    context.log.info(f"comm_benchmark: {len(report['pairs'])} node pairs; outlier {report['outlier']} "
                     f"({report['outlier_rule']})")
    rows = [{**row, "time_s": f"{row['time_s']:.3g}", "algbw_mb_per_s": f"{row['algbw_bytes_per_s'] / 1e6:.4g}"}
            for row in comm_pairs.pair_rows(report)]
    table = markdown_table(rows, ["pair", "collective", "size_bytes", "time_s", "algbw_mb_per_s", "outlier"],
                           limit=1000)
    summary = markdown_table([{"pair": name, "hosts": ", ".join(pair["hosts"]), "job_id": pair["job_id"],
                               "bandwidth_mb_per_s": f"{pair['bandwidth_bytes_per_s'] / 1e6:.4g}",
                               "outlier": name in report["outlier_pairs"]} for name, pair in report["pairs"].items()],
                             ["pair", "hosts", "job_id", "bandwidth_mb_per_s", "outlier"], limit=1000)
    return _publish(context, "comm_benchmark", report, reports.plot_pairs(report), storage=storage, lineage=lineage,
                    config=config.model_dump(), table=table,
                    extra={"mode": "node_pairs", "partition": report["partition"], "num_pairs": len(report["pairs"]),
                           "pair_bandwidths": summary, "outlier": report["outlier"] or "none",
                           "outlier_pairs": ", ".join(report["outlier_pairs"]) or "none",
                           "outlier_nodes": ", ".join(report["outlier_nodes"]) or "none",
                           "outlier_rule": report["outlier_rule"], "gradient_bytes": model["gradient_bytes"]})


@dg.asset(group_name=GROUP, kinds={"torch"}, code_version=COMM_CODE_VERSION,
          description="all_reduce / all_gather / reduce_scatter time, algbw and busbw at the model's gradient bucket "
                      "sizes; between every pair of SLURM nodes in node-pair mode.")
def comm_benchmark(context: dg.AssetExecutionContext, config: CommBenchmarkConfig, storage: StorageResource,
                   lineage: LineageResource) -> dg.MaterializeResult:
    pairs = pair_mode(config, deployment_slurm_launcher())
    if pairs is not None:
        return _node_pairs(context, config, storage, lineage, *pairs)
    model = model_gradient_sizes(config.config_path)
    sizes = config.sizes_bytes or sorted({*model["bucket_bytes"], model["gradient_bytes"], reports.DDP_BUCKET_CAP_BYTES})
    settings = reports.CommSettings(sizes_bytes=tuple(sizes), world_size=config.world_size,
                                    iterations=config.iterations, warmup=config.warmup)
    report = {"report": "comm_benchmark", "status": "ok", "model": model, **reports.time_collectives(settings)}
    table = markdown_table([{**row, "time_s": f"{row['time_s']:.3g}", "algbw_gbps": f"{row['algbw_gbps']:.3g}",
                             "busbw_gbps": f"{row['busbw_gbps']:.3g}"} for row in report["rows"]],
                           ["collective", "size_bytes", "time_s", "algbw_gbps", "busbw_gbps"])
    return _publish(context, "comm_benchmark", report, reports.plot_comm(report), storage=storage, lineage=lineage,
                      config=config.model_dump(), table=table,
                    extra={"backend": report["backend"], "world_size": report["world_size"],
                                     "dtype": report["dtype"], "iterations": report["iterations"],
                                     "gradient_bytes": model["gradient_bytes"]})


# ---------------------------------------------------------------------------------------------


class WorkloadConfig(dg.Config):
    config_path: str = "configs/demo.yaml"
    steps: int = 8
    warmup_steps: int = 3
    """Steps excluded from the throughput (train.metrics_warmup_steps)."""
    per_device_batch: int = 4
    checkpoint_every: int = 0
    """0: no checkpoints (a throughput figure without saves); else save every this many steps."""
    overrides: list[str] = ["data.source=synthetic"]
    """Applied to every run of the report; synthetic clips by default, so no shard index is needed."""


def _workload(stage: str, config: WorkloadConfig, nproc: int, extra: list[str], data: Path,
              attempt: str) -> tuple[Path, list[str]]:
    """A report run's folder under <data>/runs and its overrides. Named by what it runs and by the Dagster
    run (``attempt``): a report measures when it is materialized, never reuses an earlier run's timings
    or numerics (after a library upgrade, an old canary arm would pass for the new one)."""
    saves = (["stage.checkpoint=true", f"train.checkpoint_every={config.checkpoint_every}"] if config.checkpoint_every
             else ["stage.checkpoint=false"])
    overrides = [f"stage.stage={stage}", "stage.mlflow=false", *saves, "train.eval_every=0",
                 f"train.steps={config.steps}", f"train.metrics_warmup_steps={config.warmup_steps}",
                 f"data.batch_size={config.per_device_batch * nproc}",
                 f"train.parallelism={'ddp' if nproc > 1 else 'none'}", *config.overrides, *extra]
    name = digest_json({"config": str(_config_file(config.config_path)), "nproc": nproc, "overrides": overrides})[:12]
    return data / "runs" / f"{stage}-{name}-{attempt[:8]}", overrides


class ScalingConfig(WorkloadConfig):
    world_sizes: list[int] = []
    """Ranks to run; empty means 1, 2, then powers of two up to the CUDA devices here."""
    nodes: list[int] = []
    """Node counts to run as SLURM jobs under the deployment's SlurmLauncher (TRAINYARD_ENV=slurm),
    SlurmLauncher.nproc_per_node ranks on each node; the fewest is the baseline. Empty: 1 and 2 when
    that launcher spans more than one node (TRAINYARD_SLURM_NODES > 1), else the world sizes above on
    this machine. In node mode ``world_sizes`` is not used (a refusal says so)."""
    job_timeout_s: float = 1800.0
    """How long one node count's job may take, from submission (queueing included)."""


def _world_sizes(requested: list[int]) -> list[int]:
    if requested:
        return sorted(set(requested))
    import torch

    devices = torch.cuda.device_count() if torch.cuda.is_available() else 2
    sizes, n = [1, 2], 4
    while n <= devices:
        sizes.append(n)
        n *= 2
    return sizes


@dg.asset(group_name=GROUP, kinds={"torch"}, code_version=REPORTS_CODE_VERSION, deps=["step_profile"],
          description="Weak scaling: throughput of the same workload on 1, 2, ... ranks and efficiency vs linear.")
def scaling_report(context: dg.AssetExecutionContext, config: ScalingConfig, storage: StorageResource,
                   lineage: LineageResource) -> dg.MaterializeResult:
    launcher = deployment_slurm_launcher()
    if config.nodes or (launcher is not None and launcher.nodes > 1):
        return _node_scaling(context, config, storage, lineage, launcher)
    finals = {}
    for nproc in _world_sizes(config.world_sizes):
        run_dir, overrides = _workload("scaling_report", config, nproc, [], storage.data, context.run.run_id)
        context.log.info(f"scaling_report: {nproc} rank(s) in {run_dir}")
        [finals[nproc]] = reports.run_workloads([(run_dir, _config_file(config.config_path), nproc, overrides)])
    rows = reports.scaling_rows(finals)
    if not rows:
        report = reports.empty_report("scaling_report", "no world sizes were run")
        return _publish(context, "scaling_report", report, None, storage=storage, lineage=lineage, config=config.model_dump())
    report = {"report": "scaling_report", "status": "ok", "scaling": "weak (fixed per-device batch)",
              "per_device_batch": config.per_device_batch, "warmup_steps_excluded": config.warmup_steps,
              "steps": config.steps, "precision": rows[0]["precision"], "clip_shapes": rows[0]["clip_shapes"],
              "baseline_step_profile": _step_profile_baseline(context), "rows": rows}
    return _publish(context, "scaling_report", report, reports.plot_scaling(rows), storage=storage, lineage=lineage,
                      config=config.model_dump(),
                      table=markdown_table(rows, ["world_size", "global_batch", "per_device_batch", "samples_per_s",
                                                  "efficiency", "num_steady_steps", "precision"]),
                    extra={**{f"efficiency_{row['world_size']}": row["efficiency"]
                                                          for row in rows if row["efficiency"] is not None}})


def _node_scaling(context: dg.AssetExecutionContext, config: ScalingConfig, storage: StorageResource,
                  lineage: LineageResource, launcher) -> dg.MaterializeResult:
    """scaling_report across nodes: the same workload as a SLURM job on 1 node, then on 2 (or
    ``config.nodes``), each on nodes of its own; efficiency against the fewest nodes' throughput."""
    from resources.sbatch_script import SbatchSettingError
    from resources.slurm_commands import SlurmError
    from resources.slurm_workload import Workload, WorkloadJobFailed, run_workload

    if config.world_sizes:
        raise dg.Failure(f"scaling_report: world_sizes {config.world_sizes} and nodes across SLURM nodes do not go "
                         f"together: across nodes the world size is nodes x SlurmLauncher.nproc_per_node; set one")
    if config.steps <= config.warmup_steps:
        raise dg.Failure(f"scaling_report: steps ({config.steps}) must exceed warmup_steps ({config.warmup_steps}): "
                         f"only steady steps are timed")
    if launcher is None:
        raise dg.Failure(f"scaling_report: nodes={config.nodes} needs the SLURM deployment (TRAINYARD_ENV=slurm, "
                         f"TRAINYARD_SLURM_PARTITION): no SlurmLauncher is configured")
    counts = sorted(set(config.nodes)) if config.nodes else [1, 2]
    if counts[0] < 1 or (config.nodes and counts[-1] > launcher.nodes):
        raise dg.Failure(f"scaling_report: node counts {counts} must be between 1 and the launcher's nodes "
                         f"({launcher.nodes}, TRAINYARD_SLURM_NODES)")
    per_node = launcher.nproc_per_node
    finals, hosts = {}, {}
    for count in counts:
        run_dir, overrides = _workload("scaling_report", config, count * per_node, [], storage.data,
                                       context.run.run_id)
        run_dir = run_dir.with_name(f"{run_dir.name}-{count}n")  # 2 nodes x 1 rank is not 1 node x 2 ranks
        workload = Workload(f"scaling_report-{count}n", run_dir, _config_file(config.config_path), tuple(overrides),
                            nodes=count, ranks_per_node=per_node)
        try:
            finals[count], hosts[count] = run_workload(launcher, workload, timeout_s=config.job_timeout_s,
                                                       log=context.log.info)
        except (WorkloadJobFailed, SlurmError, SbatchSettingError, ValueError) as error:
            raise dg.Failure(f"scaling_report: the {count}-node job: {type(error).__name__}: {error}") from None
    rows = reports.node_scaling_rows(finals, hosts)
    report = {"report": "scaling_report", "status": "ok", "mode": "nodes",
              "scaling": "weak (fixed per-device batch), across nodes", "ranks_per_node": per_node,
              "partition": launcher.partition or "(default)",
              "efficiency_rule": f"samples/s at n nodes / (n / {counts[0]} x samples/s at {counts[0]} node(s)); "
                                 f"steady steps only (the first {config.warmup_steps} excluded), every row on "
                                 f"nodes of its own (--exclusive)",
              "per_device_batch": config.per_device_batch, "warmup_steps_excluded": config.warmup_steps,
              "steps": config.steps, "precision": rows[0]["precision"], "clip_shapes": rows[0]["clip_shapes"],
              "rows": rows}
    context.log.info("scaling_report: " + "; ".join(
        f"{row['nodes']} node(s) {row['samples_per_s']:.4g} samples/s on {', '.join(row['hosts'])}, efficiency "
        + (f"{row['efficiency']:.3f}" if row["efficiency"] is not None else "n/a (no baseline throughput)")
        for row in rows))
    return _publish(context, "scaling_report", report, reports.plot_scaling(rows, unit="nodes"), storage=storage,
                    lineage=lineage, config=config.model_dump(),
                    table=markdown_table([{**row, "hosts": ", ".join(row["hosts"])} for row in rows],
                                         ["nodes", "world_size", "hosts", "global_batch", "per_device_batch",
                                          "samples_per_s", "samples_per_s_per_node", "efficiency",
                                          "num_steady_steps", "precision"]),
                    extra={"mode": "nodes", **{f"efficiency_{row['nodes']}n": row["efficiency"] for row in rows
                                                if row["efficiency"] is not None}})


def _step_profile_baseline(context: dg.AssetExecutionContext) -> dict:
    """step_profile's throughput figures where it was materialized (the single-device baseline)."""
    event = context.instance.get_latest_materialization_event(dg.AssetKey("step_profile"))
    if event is None or event.asset_materialization is None:
        return {"status": "not materialized yet"}
    return {key: value.value for key, value in event.asset_materialization.metadata.items()
            if "per_s" in key and isinstance(value.value, (int, float))}


# ---------------------------------------------------------------------------------------------


class CostConfig(dg.Config):
    prices_per_hour: dict[str, float] = {"cpu": 0.10, "NVIDIA H200": 3.50, "NVIDIA H100 80GB HBM3": 2.50}
    """Device type -> price per device-hour: a GPU's model name (final.json environment.gpu_model)
    per GPU-hour, and "cpu" per machine-hour. Placeholder prices; set your own."""


@dg.asset(group_name=GROUP, code_version=REPORTS_CODE_VERSION,
          description="Device-hours x prices of every run folder (failed and abandoned too), by stage and data version.")
def cost_report(context: dg.AssetExecutionContext, config: CostConfig, storage: StorageResource,
                lineage: LineageResource) -> dg.MaterializeResult:
    try:
        report = reports.cost_report(storage.data, config.prices_per_hour)
    except reports.PriceMissing as error:
        raise dg.Failure(str(error)) from error
    if report["status"] == "empty":
        return _publish(context, "cost_report", report, None, storage=storage, lineage=lineage, config=config.model_dump())
    rows = [{**row, "cost": f"{row['cost']:.4g}", "device_hours": f"{row['device_hours']:.4g}",
             "run": Path(row["run_dir"]).name} for row in report["runs"]]
    return _publish(context, "cost_report", report, reports.plot_cost(report), storage=storage, lineage=lineage,
                      config=config.model_dump(),
                      table=markdown_table(rows, ["run", "stage", "data_version", "status", "device_type", "num_devices",
                                                  "elapsed_s", "checkpoint_s", "device_hours", "cost"]),
                    extra={"total_cost": report["total_cost"], "num_runs": report["num_runs"],
                                     "num_unfinished": report["num_unfinished"], "checkpoint_cost": report["checkpoint_cost"],
                                     "by_stage": dg.MetadataValue.json(report["by_stage"]),
                                     "by_data_version": dg.MetadataValue.json(report["by_data_version"])})


# ---------------------------------------------------------------------------------------------

CANARY_CHECK = "canary_passed"


class CanaryConfig(WorkloadConfig):
    steps: int = 6
    nproc: int = 1
    arm_a: list[str] = ["train.precision=fp32", "train.attention_backend=auto"]
    """Overrides of the reference arm."""
    arm_b: list[str] = ["train.precision=fp32", "train.attention_backend=math"]
    """Overrides of the candidate arm (a precision, a kernel setting, ...)."""
    label_b: str = "attention backend math"
    """What the candidate changes, e.g. a library version; recorded with the verdict."""
    loss_rtol: float = 0.02
    loss_atol: float = 1e-4
    grad_norm_rtol: float = 0.05
    grad_norm_atol: float = 1e-4
    max_steps: int = 20


@dg.asset(group_name=GROUP, kinds={"torch"}, code_version=REPORTS_CODE_VERSION,
          description="The same workload under arms A and B: loss and grad norm compared step by step against tolerances.")
def canary(context: dg.AssetExecutionContext, config: CanaryConfig, storage: StorageResource,
           lineage: LineageResource) -> dg.MaterializeResult:
    tolerances = reports.Tolerances(loss_rtol=config.loss_rtol, loss_atol=config.loss_atol,
                                    grad_norm_rtol=config.grad_norm_rtol, grad_norm_atol=config.grad_norm_atol,
                                    max_steps=config.max_steps)
    # The arm's letter names its folder: identical arms are two runs, not one run compared with itself.
    arms = {arm: _workload(f"canary_{arm}", config, config.nproc, extra, storage.data, context.run.run_id)
            for arm, extra in (("a", config.arm_a), ("b", config.arm_b))}
    # Side by side: the canary compares numerics, not speed.
    reports.run_workloads([(run_dir, _config_file(config.config_path), config.nproc, overrides)
                           for run_dir, overrides in arms.values()], side_by_side=True)
    arms = {arm: run_dir for arm, (run_dir, _overrides) in arms.items()}
    try:
        report = reports.compare_arms(arms["a"], arms["b"], tolerances)
    except reports.CanaryDataMismatch as error:
        raise dg.Failure(f"canary refused: {error}") from error
    report = {**report, "label_b": config.label_b, "overrides": {"a": config.arm_a, "b": config.arm_b}}
    png = reports.plot_canary(report) if report["status"] != "empty" else None
    return _publish(context, "canary", report, png, storage=storage, lineage=lineage, config=config.model_dump(),
                      table=markdown_table(report.get("steps", []), ["step", "loss_a", "loss_b", "loss_ok",
                                                                     "grad_norm_a", "grad_norm_b", "grad_norm_ok"]),
                    extra={"passed": report["status"] == "passed",
                                     "failed_steps": str(report.get("failed_steps", [])), "label_b": config.label_b})


@dg.asset_check(asset=canary, name=CANARY_CHECK, blocking=True,
                description="The candidate arm's loss and grad norm stayed within the canary's tolerances.")
def canary_passed(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
    event = context.instance.get_latest_materialization_event(dg.AssetKey("canary"))
    if event is None or event.asset_materialization is None:
        return dg.AssetCheckResult(passed=False, metadata={"reason": "canary has not been materialized"})
    report = json.loads(Path(event.asset_materialization.metadata["report_path"].value).read_text())
    return dg.AssetCheckResult(
        passed=report["status"] == "passed",
        metadata={"status": report["status"], "failed_steps": str(report.get("failed_steps", [])),
                  "max_loss_abs_delta": report.get("max_loss_abs_delta", "n/a"),
                  "max_grad_norm_abs_delta": report.get("max_grad_norm_abs_delta", "n/a"),
                  "tolerances": dg.MetadataValue.json(report.get("tolerances", {}))})


report_assets = [comm_benchmark, scaling_report, cost_report, canary]
report_checks = [canary_passed]
