"""``trainyard``: command line for data engineers and researchers.

    trainyard demo-media DIR [--preset demo|realistic] [--seed N] [--num-good N] [--overwrite] [--metadata parquet|csv]
    trainyard manifest build MEDIA_DIR|s3://bucket/prefix --out PATH [--workers N]
        [--table PATH_OR_URL --map key=COLUMN [--map caption=COLUMN ...] [--key-template T] [--card PATH]]
    trainyard manifest validate PATH [--verify off|stat|hash] [--json] [--data-root DIR]   # rights ledger applied
    trainyard demo                      # generate demo media and materialize the asset graph
    trainyard cluster-check             # TRAINYARD_ENV=cluster: reach PostgreSQL, MLflow and the bucket; the store's room left
    trainyard dry-run CONFIG [--set a.b=c] [--world-size N] [--json]   # checks + a few decoded batches, as a report
    trainyard dry-run CONFIG --slurm [--world-size N] [--json]  # the report, then the sbatch script checked against
                                                                # the cluster (--json: the script alone)
    trainyard checkpoint list RUN_DIR   # committed, known-good and incomplete checkpoints
    trainyard checkpoint verify DIR     # re-hash against COMMITTED.json; exit 1 naming bad files
    trainyard checkpoint sign PATH      # sign checkpoints committed unsigned, after verifying every file
    trainyard compare RUN_A RUN_B [...] [--align step|samples] [--out PATH.png] [--json]   # runs side by side
    trainyard rights where|revoke|reinstate|list ASSET   # revocation and where an asset went (cli/rights.py)
    trainyard reproduce CHECKPOINT|--run RUN [--world-size N] [--json]   # rebuild from the record, compare (cli/reproduce.py)

Exit codes: 0 success, 1 a blocking check failed, 2 bad usage or input.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict
from pathlib import Path

EXIT_OK, EXIT_CHECK_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def _demo_media(args: argparse.Namespace) -> int:
    from tools.demo_media import generate_demo_media

    report = generate_demo_media(args.dir, seed=args.seed, num_good=args.num_good, overwrite=args.overwrite,
                                 preset=args.preset, metadata=args.metadata)
    print(f"wrote {len(report.good)} good clips and {len(report.bad) + len(report.split_leak)} edge cases to {args.dir}")
    if report.metadata_table is not None:
        mapping = " ".join(f"--map {name}={column}" for name, column in report.table_spec().columns.items())
        print(f"metadata: {report.metadata_table} and dataset_card.yaml; build with "
              f"trainyard manifest build {args.dir} --out OUT --table {report.metadata_table} {mapping}")
    return EXIT_OK


def _manifest_build(args: argparse.Namespace) -> int:
    from ops.curation import manifest

    config = manifest.ManifestConfig(num_probe_workers=args.workers, table=_table_spec(args))
    built = manifest.build_manifest(args.media_dir, config)
    path = manifest.write_manifest(built, args.out)
    print(f"manifest {built.version}: {built.table.num_rows} rows -> {path}")
    for code, count in built.reason_counts().items():
        print(f"  flagged at ingest: {code:<24} {count}")
    return EXIT_OK


def _table_spec(args: argparse.Namespace):
    """The --table/--map/--key-template/--card flags as a MetadataTableSpec (None without --table)."""
    from ops.media.metadata_table import MetadataTableSpec

    if args.table is None:
        if args.map or args.card or args.key_template != "{key}":
            raise ValueError("--map, --key-template and --card describe a metadata table: give it with --table")
        return None
    columns = {}
    for pair in args.map:
        name, sep, column = pair.partition("=")
        if not sep or not name or not column:
            raise ValueError(f"--map takes FIELD=COLUMN (e.g. key=videoID), got {pair!r}")
        columns[name.strip()] = column.strip()
    return MetadataTableSpec(location=args.table, columns=columns, key_template=args.key_template, card=args.card)


def _print_report(result, gate_results) -> None:
    print(f"manifest {result.manifest_version} -> validated {result.version}")
    print(f"  accepted {result.accepted.num_rows}, quarantined {len(result.rejected)}, splits {result.split_counts()}")
    if len(result.rejected):
        print("  quarantine by reason code:")
        for code, count in result.reason_counts().items():
            print(f"    {code:<24} {count}")
            for uri in result.rejected.loc[result.rejected["reason"] == code, "uri"].head(3):
                print(f"      {uri}")
    print("  blocking checks:")
    for gate in gate_results:
        print(f"    [{'PASS' if gate.passed else 'FAIL'}] {gate.name}: {gate.description} {gate.metadata}")


def _manifest_data_root(args: argparse.Namespace) -> Path:
    """--data-root, else the data root the manifest folder is published under (ROOT/manifests/VERSION),
    else the configured one: where the rights ledger is read."""
    from ops.publish import paths

    if args.data_root is not None:
        return args.data_root
    folder = args.path.parent if args.path.name == "manifest.parquet" else args.path
    return folder.parent.parent if folder.parent.name == "manifests" else paths.data_root()


def _manifest_validate(args: argparse.Namespace) -> int:
    from ops.curation import manifest, rights, validation

    built = manifest.read_manifest(args.path)
    config = validation.ValidationConfig(verify_objects=args.verify,
                                         max_quarantine_fraction=args.max_quarantine_fraction)
    # The stages' rule: an asset the rights ledger revokes is quarantined (rights_revoked), whatever its
    # sidecar says now; a ledger that cannot be trusted (rolled back, edited) is refused, exit 2.
    data_root = _manifest_data_root(args)
    result = validation.validate(built, config, revoked=rights.revoked(data_root))
    if not args.json:
        print(f"rights ledger: {rights.ledger_path(data_root)}")
    gate_results = validation.gates(result)
    if args.json:
        print(json.dumps({"version": result.version, "manifest_version": result.manifest_version,
                          "reason_counts": result.reason_counts(), "split_counts": result.split_counts(),
                          "quarantine": result.rejected.to_dict("records"),
                          "gates": [asdict(gate) for gate in gate_results]}, default=str))
    else:
        _print_report(result, gate_results)
    return EXIT_OK if all(gate.passed for gate in gate_results) else EXIT_CHECK_FAILED


def _dry_run(args: argparse.Namespace) -> int:
    if args.slurm and args.json:
        return _dry_run_slurm(args)  # the script and its checks alone: no data or torch needed on this machine
    if not args.json:
        return _dry_run_report(args)
    from trainer.dry_run import dry_run

    report = dry_run(args.config, args.overrides, world_size=args.world_size, num_batches=args.batches)
    print(json.dumps(report, default=str))
    return EXIT_OK


def _dry_run_report(args: argparse.Namespace) -> int:
    """The dry run for people (trainer/launch/report.py): warnings first, then the tables; with --slurm
    the sbatch script after them. A refusal (the launcher's checks included) ends it before any table."""
    import contextlib
    import io

    from trainer.dry_run import dry_run
    from trainer.launch.config import load_config
    from trainer.launch.redact import Redactor
    from trainer.launch.report import build_report, captured_warnings, print_report

    script = io.StringIO()
    if args.slurm:  # checked first, as cheap as it is; the script is held back to print after the report
        with contextlib.redirect_stdout(script):
            _dry_run_slurm(args)
    with captured_warnings() as warnings:  # the loader's, say a bucket smaller than a global batch
        result = dry_run(args.config, args.overrides, world_size=args.world_size, num_batches=args.batches)
    result = json.loads(json.dumps(result, default=str))  # the figures --json prints, exactly
    title = f"trainyard dry-run {args.config}: {result['config']['name']} on {args.world_size} rank(s)"
    print_report(build_report(result, title=title, warnings=warnings,
                              redactor=Redactor.for_config(load_config(args.config, args.overrides))))
    print(script.getvalue(), end="")
    return EXIT_OK


# The variable behind each SlurmLauncher setting that from_env reads (resources/slurm.py).
_SLURM_VARIABLES = {"partition": "PARTITION", "account": "ACCOUNT", "mem": "MEM", "time_limit": "TIME",
                    "nodes": "NODES", "min_nodes": "MIN_NODES", "nproc_per_node": "NPROC_PER_NODE",
                    "gpus_per_node": "GPUS_PER_NODE", "cpus_per_task": "CPUS_PER_TASK", "exclude": "EXCLUDE",
                    "shared_paths": "SHARED_PATHS"}


def _slurm_refusal(found: str, setting: str = "", allowed: str = ""):
    """A cluster Refusal for a SLURM setting; the fix names the TRAINYARD_SLURM_* variable behind it
    and ``allowed``, what it takes (else the example the message gives)."""
    from trainer.launch.refusal import Refusal

    name = setting.removeprefix("SlurmLauncher.")
    variable = _SLURM_VARIABLES.get(name)
    example = re.search(r"\(e\.g\. [^)]*\)", found)
    allowed = allowed or (f"a valid value {example.group(0)} on one line" if example else "a value the message allows")
    fix = (f"set TRAINYARD_SLURM_{variable} to {allowed}" if variable else
           "change the TRAINYARD_SLURM_* settings the message names (docs/slurm.md), then run dry-run --slurm again")
    return Refusal("cluster", found, fix, key=f"TRAINYARD_SLURM_{variable}" if variable else setting or "slurm")


def _slurm_launcher():
    """SlurmLauncher.from_env, or a cluster Refusal naming the variable that is not a whole number."""
    import os

    from resources.slurm import SlurmLauncher

    for name, variable in _SLURM_VARIABLES.items():
        value = os.environ.get(f"TRAINYARD_SLURM_{variable}")
        if value is not None and name in SlurmLauncher.model_fields and \
                SlurmLauncher.model_fields[name].annotation is int and not value.strip().isdigit():
            raise _slurm_refusal(f"TRAINYARD_SLURM_{variable}={value!r} is not a whole number", name,
                                 "a whole number, e.g. 2")
    return SlurmLauncher.from_env()


def _dry_run_slurm(args: argparse.Namespace) -> int:
    """The sbatch script SlurmLauncher (from TRAINYARD_SLURM_*) would submit for this config, and
    the checks it makes before submitting; a cluster Refusal (exit 2) when one refuses."""
    from ops.clips.shard_ref import ShardIndexRef
    from resources.sbatch_script import SbatchSettingError
    from resources.slurm import SlurmError
    from trainer.launch.config import check_no_literal_secrets, load_config
    from trainer.launch.stage_launch import StageLaunch

    check_no_literal_secrets(args.overrides, where="--set")

    config = load_config(args.config, args.overrides)
    data = ShardIndexRef(path=config.data.shard_index or str(Path(config.train.run_dir) / "no-shard-index"),
                         version="dry-run", manifest_version=config.data.manifest_version or "dry-run")
    launch = StageLaunch(stage=config.stage.stage or "dry_run", config_path=str(Path(args.config).resolve()), data=data,
                         steps=config.train.steps, world_size=args.world_size, run_dir=config.train.run_dir,
                         user_overrides=tuple(args.overrides))
    launcher = _slurm_launcher()
    try:
        print(launcher.render(launch))
        problems = launcher.check(launch)
    except SbatchSettingError as error:
        raise _slurm_refusal(str(error), error.setting) from None
    except SlurmError as error:
        raise _slurm_refusal(f"cannot check against the cluster: {error}") from None
    if problems:
        named = re.search(r"SlurmLauncher\.\w+", problems[0])
        raise _slurm_refusal("refused before submission: " + "; ".join(problems), named.group(0) if named else "")
    print("# the checks before submission pass", file=sys.stderr)
    return EXIT_OK


def _demo(args: argparse.Namespace) -> int:
    from pipelines.demo import run_demo
    from pipelines.environment import DeploymentConfigError

    try:
        return EXIT_OK if run_demo(num_good=args.num_good, skip=tuple(args.skip)) else EXIT_CHECK_FAILED
    except (DeploymentConfigError, ValueError) as error:
        print(f"trainyard demo: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _cluster_check(args: argparse.Namespace) -> int:
    from pipelines import environment

    try:
        lines = environment.check_cluster()
    except environment.DeploymentConfigError as error:
        print(f"trainyard cluster-check: {error}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    for line in lines:
        print(f"ok: {line}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainyard", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    media = commands.add_parser("demo-media", help="generate the deterministic demo media set")
    media.add_argument("dir", type=Path)
    media.add_argument("--seed", type=int, default=0)
    media.add_argument("--preset", choices=("demo", "realistic"), default="demo",
                       help="demo: 40 tiny sources (make demo); realistic: 12 sources at 720p/480p with stereo audio")
    media.add_argument("--num-good", type=int, default=None, help="good sources (default: the preset's, 40 or 12)")
    media.add_argument("--overwrite", action="store_true")
    media.add_argument("--metadata", choices=("sidecars", "parquet", "csv"), default="sidecars",
                       help="one JSON sidecar per object, or one metadata table (metadata.parquet|csv, columns named "
                            "as the fields) plus dataset_card.yaml: build with --table DIR/metadata.parquet "
                            "--map key=key --map caption=caption ...")
    media.set_defaults(handler=_demo_media)

    demo = commands.add_parser("demo", help="generate demo media and materialize the whole asset graph")
    demo.add_argument("--num-good", type=int, default=40)
    demo.add_argument("--skip", action="append", default=[], metavar="ASSET",
                      help="leave out an asset after the shards that nothing else needs (e.g. fault_drill)")
    demo.set_defaults(handler=_demo)

    check = commands.add_parser("cluster-check", help="reach the cluster deployment's services with their credentials "
                                                      "and state the object store's capacity left")
    check.set_defaults(handler=_cluster_check)

    dry = commands.add_parser("dry-run", help="check a training config and decode a few batches, without training")
    dry.add_argument("config", type=Path, help="experiment YAML (see configs/)")
    dry.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=C")
    dry.add_argument("--world-size", type=int, default=1)
    dry.add_argument("--batches", type=int, default=2)
    dry.add_argument("--json", action="store_true",
                     help="print one JSON object instead of the report; with --slurm, the script and its checks alone")
    dry.add_argument("--slurm", action="store_true",
                     help="after the report, print the sbatch script the SLURM launcher (TRAINYARD_SLURM_*) would "
                          "submit, and check it")
    dry.set_defaults(handler=_dry_run)

    manifest = commands.add_parser("manifest", help="build and validate manifests").add_subparsers(
        dest="manifest_command", required=True)
    build = manifest.add_parser("build", help="probe MEDIA_DIR and publish a manifest version under --out")
    build.add_argument("media_dir", help="a folder, or an object-store prefix (s3://bucket/prefix; docs/cluster.md)")
    build.add_argument("--out", type=Path, required=True, help="folder that receives <version>/manifest.parquet")
    build.add_argument("--workers", type=int, default=2, help="probe processes at once")
    build.add_argument("--table", default=None, metavar="PATH_OR_URL",
                       help="a metadata table (Parquet or CSV) describing the objects (ops/media/metadata_table.py)")
    build.add_argument("--map", action="append", default=[], metavar="FIELD=COLUMN",
                       help="the table's column for a field: key (required), caption, license, consent, "
                            "source_group, split, sha256; repeat per field")
    build.add_argument("--key-template", default="{key}", help="relative path of a key, e.g. 'videos/{key}.mp4'")
    build.add_argument("--card", default=None, metavar="PATH_OR_URL",
                       help="a dataset card (YAML) covering every object the table describes")
    build.set_defaults(handler=_manifest_build)
    check = manifest.add_parser("validate", help="validate a manifest version folder; exit 1 if a blocking check fails")
    check.add_argument("path", type=Path, help="a manifest version folder (holding manifest.parquet)")
    check.add_argument("--verify", choices=("off", "stat", "hash"), default="stat")
    check.add_argument("--max-quarantine-fraction", type=float, default=0.5)
    check.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    check.add_argument("--data-root", type=Path, default=None,
                       help="whose rights ledger revokes assets (default: the data root PATH is published under, "
                            "else TRAINYARD_DATA_ROOT's)")
    check.set_defaults(handler=_manifest_validate)

    from cli import checkpoint, compare, nodes, reproduce, rights, sweep

    checkpoint.register(commands)
    compare.register(commands)
    nodes.register(commands)
    reproduce.register(commands)
    rights.register(commands)
    sweep.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ops.publish.objstore import ObjectStoreError
    from ops.curation.ledger_anchor import LedgerAnchorError
    from ops.curation.rights import RightsLedgerError
    from resources.slurm import SlurmError

    from ops import progress

    from ops.publish.errors import PublishedFileError
    from trainer.launch.refusal import Refusal, one_line

    args = build_parser().parse_args(argv)
    try:
        with progress.reporting(console=True):  # a bar on a terminal, a line every 10 s on a pipe
            return args.handler(args)
    except Refusal as refusal:  # before launch: its category, what was found and the fix, on one line
        print(f"trainyard: {refusal.cli_line()}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except PublishedFileError as error:  # a published version that fails its digest or signature: data
        print(f"trainyard: refused (data) {one_line(error)}; fix: materialize that version again (its asset "
              "rebuilds it), or point the config at one that verifies", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (FileNotFoundError, FileExistsError, ValueError, ObjectStoreError, RightsLedgerError,
            LedgerAnchorError, SlurmError) as error:
        # Bad input from the user: one readable line, no traceback.
        print(f"trainyard: error: {one_line(error)}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
