"""Mutation check: does the suite catch plausible bugs? (`make mutants`, docs/testing.md)

Each ``tests/mutants/<name>.patch`` is one planted bug as a unified diff against the working tree,
under a header of comment lines::

    # kills: tests/test_sampling.py -k resume
    # why: the real bug it models

For each patch this copies the checkout (tracked and untracked, non-ignored files; never .venv or
.trainyard) into a temporary directory, applies the patch there, and runs the pytest arguments of
its ``kills`` line with that copy's code first on PYTHONPATH (checked: ``ops`` and ``trainer`` must
import from the copy, not from the venv's editable install of the checkout). A failing test kills the
mutant; passing tests let it survive; a patch that does not apply, a run that times out or that ends
in anything but pass or fail (a collection error, no test selected) is an error, named.

Prints a table and one JSON line (the score and, per mutant, the test that killed it); exits 1 if
any mutant survived or errored. ``--baseline`` runs each mutant's tests on the unpatched copy
instead: all must pass there, or a kill means nothing.

Run: .venv/bin/python tests/mutants/run.py [--only NAME ...] [--jobs N] [--timeout-s S] [--baseline]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

MUTANTS_DIR = Path(__file__).resolve().parent
CHECKOUT = MUTANTS_DIR.parent.parent
SKIPPED_TOP_DIRS = {".venv", ".trainyard", ".git"}
# pytest's short summary line of a failed or errored test: "FAILED tests/x.py::test_y - reason".
# A parametrized id may hold blanks ("[MIT AND GPL-3.0-only-...]"): the id runs to " - " or the line's end.
FAILED_LINE = re.compile(r"^(FAILED|ERROR) (.+?)(?: - .*)?$", re.MULTILINE)


class MutantHeaderError(ValueError):
    """A patch without the ``# kills:`` line that says which tests must catch it."""


@dataclass(frozen=True, slots=True)
class Mutant:
    name: str
    path: Path
    kills: list[str]
    why: str


@dataclass(slots=True)
class Outcome:
    name: str
    status: str  # killed | survived | error (baseline: passed | failed | error)
    killed_by: str | None
    detail: str
    elapsed_s: float


def read_mutant(path: Path) -> Mutant:
    """The patch's header: ``# kills: <pytest arguments>`` (required) and ``# why: ...``."""
    kills: list[str] | None = None
    why = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if text.startswith("kills:"):
            kills = shlex.split(text.removeprefix("kills:"))
        elif text.startswith("why:"):
            why.append(text.removeprefix("why:").strip())
        elif why:
            why.append(text)  # a continuation line of the why
    if not kills:
        raise MutantHeaderError(f"{path.name}: no '# kills: <pytest arguments>' line in its header")
    return Mutant(path.stem, path, kills, " ".join(why))


def list_mutants(only: list[str] | None) -> list[Mutant]:
    mutants = [read_mutant(path) for path in sorted(MUTANTS_DIR.glob("*.patch"))]
    if only:
        unknown = set(only) - {mutant.name for mutant in mutants}
        if unknown:
            raise SystemExit(f"no such mutant: {', '.join(sorted(unknown))}")
        mutants = [mutant for mutant in mutants if mutant.name in only]
    return mutants


def checkout_files() -> list[str]:
    """Tracked and untracked non-ignored files of the checkout as they are on disk now."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=CHECKOUT, check=True, capture_output=True).stdout.decode().split("\0")
    return sorted({name for name in listed if name and name.split("/", 1)[0] not in SKIPPED_TOP_DIRS
                   and (CHECKOUT / name).is_file()})


def copy_checkout(files: list[str], tree: Path) -> None:
    for name in files:
        target = tree / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(CHECKOUT / name, target)


def tree_env(tree: Path, home: Path) -> dict[str, str]:
    """The caller's environment with the copy first on PYTHONPATH and every location in ``home``."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("DAGSTER_PIPES")}
    env |= {"PYTHONPATH": str(tree), "TRAINYARD_HOME": str(home), "DAGSTER_HOME": str(home / "dagster_home"),
            "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}", "PYTHONDONTWRITEBYTECODE": "1"}
    (home / "dagster_home").mkdir(parents=True, exist_ok=True)
    return env


def imports_from(tree: Path, env: dict[str, str]) -> str | None:
    """None if ``ops`` and ``trainer`` import from ``tree``; else the path they import from."""
    probe = "import ops, trainer; print(ops.__file__); print(trainer.__file__)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return f"import failed: {done.stderr.strip()[-500:]}"
    for path in done.stdout.split():
        if not Path(path).resolve().is_relative_to(tree.resolve()):
            return path
    return None


def run_one(mutant: Mutant, files: list[str], *, timeout_s: float, baseline: bool) -> Outcome:
    started = time.monotonic()

    def outcome(status: str, detail: str, killed_by: str | None = None) -> Outcome:
        return Outcome(mutant.name, status, killed_by, detail, round(time.monotonic() - started, 1))

    with tempfile.TemporaryDirectory(prefix=f"trainyard-mutant-{mutant.name}-") as scratch:
        tree, home = Path(scratch) / "tree", Path(scratch) / "home"
        copy_checkout(files, tree)
        if not baseline:
            applied = subprocess.run(["git", "apply", "--verbose", str(mutant.path)], cwd=tree,
                                     capture_output=True, text=True)
            if applied.returncode != 0:
                return outcome("error", f"patch does not apply: {applied.stderr.strip()[-400:]}")
        env = tree_env(tree, home)
        wrong = imports_from(tree, env)
        if wrong:
            return outcome("error", f"the copy would import {wrong}, not its own code")
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rfE",
                   "-o", "addopts=", *mutant.kills]
        try:
            done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s,
                                  start_new_session=True)
        except subprocess.TimeoutExpired:
            return outcome("error", f"tests ran past {timeout_s:.0f} s")
        output = done.stdout + done.stderr
        failed = FAILED_LINE.findall(output)
        first = failed[0][1] if failed else None
        if done.returncode == 0:
            return outcome("passed" if baseline else "survived", "the named tests passed")
        if done.returncode == 1 and first:
            return outcome("failed" if baseline else "killed", _reason(output, first), first)
        return outcome("error", f"pytest exited {done.returncode}: {output.strip()[-400:]}")


def _reason(output: str, test: str) -> str:
    """The short-summary reason pytest gave for ``test`` (one line)."""
    for line in output.splitlines():
        if test in line and " - " in line:
            return line.split(" - ", 1)[1][:160]
    return next((line[1:].strip()[:160] for line in output.splitlines() if line.startswith("E ") and line[1:].strip()), "")


def print_table(outcomes: list[Outcome]) -> None:
    width = max(len(outcome.name) for outcome in outcomes)
    for outcome in outcomes:
        print(f"{outcome.name:<{width}}  {outcome.status:<8}  {outcome.elapsed_s:>6.1f}s  "
              f"{outcome.killed_by or ' '.join(outcome.detail.split())[:200]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutants (file names without .patch)")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once (default 1)")
    parser.add_argument("--timeout-s", type=float, default=600, help="per mutant (default 600)")
    parser.add_argument("--baseline", action="store_true",
                        help="run each mutant's tests without its patch: they must all pass")
    args = parser.parse_args(argv)
    mutants = list_mutants(args.only)
    files = checkout_files()
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(run_one, mutant, files, timeout_s=args.timeout_s, baseline=args.baseline): mutant
                   for mutant in mutants}
        for number, future in enumerate(as_completed(futures), 1):  # progress; the table follows in order
            done = future.result()
            print(f"[{number}/{len(mutants)}] {done.name}: {done.status} ({done.elapsed_s:.0f} s)",
                  file=sys.stderr, flush=True)
        outcomes = [future.result() for future in futures]
    print_table(outcomes)
    good = "passed" if args.baseline else "killed"
    num_good = sum(outcome.status == good for outcome in outcomes)
    print(json.dumps({"mutants": "baseline" if args.baseline else "score",
                      "score": f"{num_good}/{len(outcomes)}", good: num_good, "total": len(outcomes),
                      "wall_s": round(time.monotonic() - started, 1),
                      "outcomes": {outcome.name: {key: value for key, value in asdict(outcome).items() if key != "name"}
                                   for outcome in outcomes}}))
    return 0 if num_good == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
