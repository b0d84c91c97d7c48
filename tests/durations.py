"""Write tests/durations.json (seconds per test module) from a JUnit report of a full run.

    .venv/bin/python -m pytest --junitxml=/tmp/junit.xml ...   # make test PYTEST_ARGS=--junitxml=/tmp/junit.xml
    .venv/bin/python tests/durations.py /tmp/junit.xml

conftest.py starts the longest modules first under ``--dist loadgroup``, so two workers finish
together instead of one running a long module alone at the end. The figures order modules; they
never decide a result, so a stale file only costs time. Rewrite it when a module's cost changes a
lot (a new module counts as conftest.UNKNOWN_MODULE_S until then).
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

OUT = Path(__file__).with_name("durations.json")


def module_seconds(junit: Path) -> dict[str, float]:
    """Seconds per module file name (setup, call and teardown: JUnit's testcase time holds all three)."""
    totals: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).getroot().iter("testcase"):
        classname = case.attrib.get("classname", "")
        parts = classname.split(".")
        if not parts or parts[0] != "tests" or len(parts) < 2:
            continue
        totals[f"{parts[1]}.py"] += float(case.attrib.get("time", 0.0))
    return {name: round(seconds, 1) for name, seconds in sorted(totals.items())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit", type=Path, help="JUnit XML of a full run (pytest --junitxml)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    seconds = module_seconds(args.junit)
    if not seconds:
        raise SystemExit(f"{args.junit}: no test case of tests/ in it")
    args.out.write_text(json.dumps(seconds, indent=1) + "\n")
    print(f"{args.out}: {len(seconds)} modules, {sum(seconds.values()):.0f} s")


if __name__ == "__main__":
    main()
