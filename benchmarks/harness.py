"""What every benchmark shares: ``--smoke``, the JSON Schema its line is held to, and the record.

    python -m benchmarks.harness record                # make bench: every benchmark at full size, each
                                                       # line appended to benchmarks/results/<commit>.jsonl
    python -m benchmarks.harness smoke [--only step]   # every benchmark with --smoke, each line checked
    python -m benchmarks.harness write-schema step     # (re)write benchmarks/schemas/step.json from a run

A benchmark that no test runs rots: two crashed on main once, unnoticed, because nothing ran
them. So each benchmark takes ``--smoke`` (seconds, tiny inputs, its figures meaningless and
marked ``"smoke": true``) and tests/test_benchmarks_smoke.py runs every one of them and
validates its JSON line against ``benchmarks/schemas/<name>.json``. A benchmark that crashes,
drops a key, adds one, or changes a value's type fails CI; a deliberate change of output is
made by rewriting the schema (``--write-schema``) and reviewing the diff.

The schemas are JSON Schema (draft 2020-12), checked with the ``jsonschema`` package. Written
from a smoke run, they are strict: every key required, no other key allowed, one type per value
(plus any type named in ``NULLABLE`` for figures that a smoke run on a CPU leaves null but a
full run fills, such as MFU on a GPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

BENCHMARKS_DIR = Path(__file__).resolve().parent
SCHEMA_DIR = BENCHMARKS_DIR / "schemas"
# Not benchmarks: this module, and the package file.
NOT_BENCHMARKS = frozenset({"__init__", "harness"})
# Keys whose value a CPU smoke run leaves null (or a number) but a full or GPU run sets otherwise.
NULLABLE = frozenset({"mfu", "mfu_2_ranks", "mfu_eager", "mfu_compile", "peak_memory_kind", "error", "reason",
                      "samples_per_s_2_ranks", "ddp_scaling_efficiency", "verdict_2_ranks", "cache_saves_s"})
# Keys whose value is a mapping with data-dependent keys (reason codes, package names): held to
# "an object whose values all have this type", not to the keys one smoke run happened to see.
MAPPINGS = frozenset({"reason_counts", "packages", "bucket_counts", "counts", "failures_by_reason", "failed_variants",
                      "sides", "phases"})
# Benchmarks that run on the multi-node SLURM cluster (make slurm-up NODES=3): their smoke runs in
# tests/test_slurm_nodes.py, the one module that uses the cluster's nodes (another module's node
# faults would meet them), not in tests/test_benchmarks_smoke.py.
CLUSTER_BENCHMARKS = frozenset({"backfill"})
SMOKE_TIMEOUT_S = 600
RESULTS_DIR = BENCHMARKS_DIR / "results"
FULL_TIMEOUT_S = 3 * 3600


def add_smoke_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true",
                        help="seconds, tiny inputs: CI's check that the benchmark still runs (figures mean nothing)")


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None, smoke_args: Sequence[str]) -> argparse.Namespace:
    """``parser``'s arguments, with ``smoke_args`` in front when ``--smoke`` is given.

    Given before the command line, the smoke arguments are defaults: anything the caller names
    explicitly still wins (argparse keeps the last value of an option).
    """
    add_smoke_flag(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.smoke:
        args = parser.parse_args([*smoke_args, *argv])
    return args


def emit(summary: dict[str, Any], args: argparse.Namespace) -> None:
    """Print the benchmark's one JSON line; a smoke run says so, so its figures are never quoted."""
    print(json.dumps({**summary, "smoke": bool(getattr(args, "smoke", False))}), flush=True)


def benchmark_names() -> list[str]:
    """Every module in benchmarks/ that is a benchmark."""
    return sorted(path.stem for path in BENCHMARKS_DIR.glob("*.py") if path.stem not in NOT_BENCHMARKS)


def schema_path(name: str) -> Path:
    return SCHEMA_DIR / f"{name}.json"


def run(name: str, *, smoke: bool = True, timeout_s: float | None = None,
        extra: Sequence[str] = ()) -> tuple[subprocess.CompletedProcess, dict | None]:
    """Run ``python -m benchmarks.<name>`` (``--smoke`` unless full); the process and its last line (None if not JSON)."""
    repo = BENCHMARKS_DIR.parent
    env = {key: value for key, value in os.environ.items() if not key.startswith("DAGSTER_PIPES")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", f"benchmarks.{name}", *(["--smoke"] if smoke else []), *extra]
    timeout_s = timeout_s or (SMOKE_TIMEOUT_S if smoke else FULL_TIMEOUT_S)
    done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    try:
        last = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        last = None
    return done, last if isinstance(last, dict) else None


def infer_schema(value: Any, key: str | None = None) -> dict[str, Any]:
    """A strict JSON Schema of one sample value: types, required keys, no others."""
    if isinstance(value, bool):
        schema: dict[str, Any] = {"type": "boolean"}
    elif isinstance(value, int):
        schema = {"type": "integer"}
    elif isinstance(value, float):
        schema = {"type": "number"}
    elif isinstance(value, str):
        schema = {"type": "string"}
    elif value is None:
        schema = {"type": "null"}
    elif isinstance(value, list):
        schema = {"type": "array"}
        items = [infer_schema(item) for item in value]
        if items:
            schema["items"] = _merge(items)
    elif isinstance(value, dict) and key in MAPPINGS:
        schema = {"type": "object"}
        if value:
            schema["additionalProperties"] = _merge([infer_schema(v) for v in value.values()])
    elif isinstance(value, dict):
        schema = {"type": "object", "properties": {k: infer_schema(v, k) for k, v in value.items()},
                  "required": sorted(value), "additionalProperties": False}
    else:
        raise TypeError(f"not a JSON value: {type(value).__name__}")
    if key in NULLABLE:
        schema = {"anyOf": [schema, {"type": ["null", "number", "string"]}]}
    return schema


def _merge(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    """One schema for a list's items: objects merged key by key (a key absent from some item is optional)."""
    if all(s.get("type") == "object" and "properties" not in s for s in schemas):  # mappings
        values = [s["additionalProperties"] for s in schemas if "additionalProperties" in s]
        return {"type": "object", **({"additionalProperties": _merge(values)} if values else {})}
    if all(s.get("type") == "object" and "properties" in s for s in schemas):
        keys = sorted({k for s in schemas for k in s["properties"]})
        properties = {k: _merge([s["properties"][k] for s in schemas if k in s["properties"]]) for k in keys}
        required = sorted(set.intersection(*(set(s["required"]) for s in schemas)))
        return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    distinct = []
    for s in schemas:
        if s not in distinct:
            distinct.append(s)
    if len(distinct) == 1:
        return distinct[0]
    types = {s.get("type") for s in distinct}
    if types <= {"integer", "number"}:
        return {"type": "number"}
    return {"anyOf": distinct}


def validate(name: str, line: dict[str, Any]) -> list[str]:
    """The ways ``line`` breaks ``name``'s schema, as readable messages (empty when it conforms)."""
    import jsonschema

    schema = json.loads(schema_path(name).read_text())
    validator = jsonschema.Draft202012Validator(schema)
    return [f"{'/'.join(map(str, error.absolute_path)) or '<top>'}: {error.message}"
            for error in sorted(validator.iter_errors(line), key=lambda e: list(map(str, e.absolute_path)))]


def machine() -> dict[str, Any]:
    """What the figures were measured on: CPU model and count, memory, accelerator if any."""
    cpu_model = next((line.split(":", 1)[1].strip() for line in _read_lines("/proc/cpuinfo")
                      if line.startswith("model name")), platform.processor() or platform.machine())
    mem_kb = next((int(line.split()[1]) for line in _read_lines("/proc/meminfo") if line.startswith("MemTotal:")), 0)
    gpus = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                          text=True, check=False).stdout.split("\n") if _on_path("nvidia-smi") else []
    return {"cpu_model": cpu_model, "cpu_count": os.cpu_count(), "memory_gb": round(mem_kb / 2**20, 1),
            "gpus": [gpu.strip() for gpu in gpus if gpu.strip()], "python": platform.python_version()}


def _read_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:  # not Linux: the figure is recorded without it
        return []


def _on_path(command: str) -> bool:
    import shutil

    return shutil.which(command) is not None


def commit() -> tuple[str, bool]:
    """This checkout's commit and whether the tree differs from it (figures of edited code say so)."""
    repo = BENCHMARKS_DIR.parent
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo, capture_output=True,
                           text=True, check=True).stdout
    return head.strip(), bool(dirty.strip())


def applicable(name: str) -> str | None:
    """Why ``name`` cannot run at full size on this machine, or None."""
    if name == "gpu_check" and not machine()["gpus"]:
        return "no GPU here (nvidia-smi lists none): the GPU check runs on a lent device (docs/status.md)"
    if name in CLUSTER_BENCHMARKS and not _slurm_nodes():
        return "no SLURM partition 'nodes' with two nodes here (sudo make slurm-up NODES=3; docs/slurm.md)"
    return None


def _slurm_nodes() -> bool:
    try:
        done = subprocess.run(["sinfo", "-h", "-p", "nodes", "-o", "%D"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and done.stdout.strip().isdigit() and int(done.stdout.strip()) >= 2


def record(names: Sequence[str], *, smoke: bool, results_dir: Path = RESULTS_DIR,
           extra_args: Mapping[str, Sequence[str]] | None = None) -> tuple[Path, list[dict]]:
    """Run each benchmark and append one record per run to ``results_dir/<commit>.jsonl``.

    Each record carries the commit (and whether the tree was edited), the date, the machine and
    either the benchmark's line or, for one that failed, its exit and the tail of its output:
    a failure is a recorded result beside the others, never a lost run. ``extra_args`` adds
    arguments to one benchmark's command line (recorded with it).
    """
    extra_args = extra_args or {}
    head, dirty = commit()
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{head[:12]}.jsonl"
    where = machine()
    records = []
    for name in names:
        args = list(extra_args.get(name, ()))
        base = {"benchmark": name, "args": args, "commit": head, "dirty": dirty, "smoke": smoke, "machine": where,
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
        skipped = None if smoke else applicable(name)
        if skipped:
            entry = base | {"status": "skipped", "reason": skipped}
        else:
            done, line = run(name, smoke=smoke, extra=args)
            if done.returncode == 0 and line is not None:
                # A benchmark that lost a variant still printed the others' figures: partial, not ok.
                entry = base | {"status": "partial" if line.get("failed_variants") else "ok", "result": line}
            else:
                entry = base | {"status": "failed", "exit": done.returncode,
                                "output_tail": (done.stdout + done.stderr)[-3000:]}
        records.append(entry)
        with path.open("a") as out:  # appended as each finishes: a crash later keeps what came before
            out.write(json.dumps(entry, sort_keys=True) + "\n")
        print(json.dumps({"benchmark": name, "status": entry["status"]}), file=sys.stderr, flush=True)
    return path, records


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    record_parser = commands.add_parser("record", help="every benchmark at full size, recorded (make bench)")
    record_parser.add_argument("--only", nargs="+", choices=benchmark_names())
    record_parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    smoke_parser = commands.add_parser("smoke", help="every benchmark with --smoke, each line checked")
    smoke_parser.add_argument("--only", nargs="+", choices=benchmark_names())
    schema_parser = commands.add_parser("write-schema", help="run NAME --smoke and write its schema")
    schema_parser.add_argument("names", nargs="+", choices=benchmark_names(), metavar="NAME")
    args = parser.parse_args(argv)
    if args.command == "record":
        path, records = record(args.only or benchmark_names(), smoke=False, results_dir=args.results_dir)
        print(json.dumps({"benchmark": "harness", "results": str(path),
                          "status": {entry["benchmark"]: entry["status"] for entry in records}}))
        raise SystemExit(1 if any(entry["status"] == "failed" for entry in records) else 0)
    failed = False
    for name in args.names if args.command == "write-schema" else args.only or benchmark_names():
        done, line = run(name)
        if line is None:
            print(f"{name}: no JSON line (exit {done.returncode})\n{done.stderr[-2000:]}", file=sys.stderr)
            failed = True
        elif args.command == "write-schema":
            write_schema(name, line)
        else:
            problems = validate(name, line)
            failed |= bool(problems) or done.returncode != 0
            print(json.dumps({"benchmark": name, "exit": done.returncode, "schema_problems": problems}))
    raise SystemExit(1 if failed else 0)


def write_schema(name: str, line: dict[str, Any]) -> None:
    SCHEMA_DIR.mkdir(exist_ok=True)
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": f"benchmarks.{name}",
              **infer_schema(line)}
    schema_path(name).write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
    print(f"{name}: wrote {schema_path(name).relative_to(BENCHMARKS_DIR.parent)}")


if __name__ == "__main__":
    main()
