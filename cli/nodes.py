"""``trainyard nodes``: the cluster's nodes with their failure history, and the health check that
returns a drained node to service (resources/node_health.py, docs/slurm.md).

    trainyard nodes [--json]                         # state, reason, failures, drains, last check
    trainyard nodes check NODE [--peer P] [--floor compute_gflops=2] [--json]
                                                     # exit 0: passed (in service); 1: failed (drained)
"""

from __future__ import annotations

import argparse
import json

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def _list(args: argparse.Namespace) -> int:
    from resources.node_health import node_report

    report = node_report()
    if args.json:
        print(json.dumps(report, indent=2))
        return EXIT_OK
    print(f"{'node':<10} {'state':<28} {'failures':>8} {'drains':>6}  last check / reason")
    for node in report:
        check = node["last_check"]
        checked = (f"{'passed' if check['passed'] else 'FAILED'} {check['at'][:19]}" if check else "never checked")
        print(f"{node['node']:<10} {node['state'][:28]:<28} {len(node['failures']):>8} {len(node['drains']):>6}  "
              f"{checked}" + (f"; {node['reason']}" if node["reason"] else ""))
        for failure in node["failures"][-3:]:
            print(f"{'':<10} {failure['at'][:19]} {failure['failure_class']} run {failure['run_id']} "
                  f"job {failure['job_id']} step {failure['step']}: {failure['evidence']}")
    return EXIT_OK


def _floors(values: list[str]) -> dict[str, float]:
    floors = {}
    for value in values:
        name, sep, number = value.partition("=")
        try:
            floors[name] = float(number) if sep else float("nan")
        except ValueError:
            raise ValueError(f"--floor {value!r}: expected NAME=NUMBER, e.g. compute_gflops=2") from None
        if floors[name] != floors[name]:
            raise ValueError(f"--floor {value!r}: expected NAME=NUMBER, e.g. compute_gflops=2")
    return floors


def _check(args: argparse.Namespace) -> int:
    from resources.node_health import check_node

    result = check_node(args.node, peer=args.peer or "", floors=_floors(args.floor))
    if args.json:
        print(json.dumps({key: value for key, value in vars(result).items() if key != "job_output"}, indent=2))
    else:
        for name, floor in result.floors.items():
            value = result.figures.get(name)
            shown = f"{value:g}" if value is not None else "-"
            verdict = f"FAILED: {result.failed[name]}" if name in result.failed else "ok"
            print(f"{name:<16} {shown:>10}  floor {floor:g}  {verdict}")
        for name, why in result.failed.items():
            if name not in result.floors:
                print(f"{name:<16} FAILED: {why}")
        print(f"{result.node}: {'passed: in service' if result.passed else 'failed: drained'} "
              f"(peer {result.peer}; SLURM state {result.state_after})")
    return EXIT_OK if result.passed else EXIT_FAILED


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``nodes`` and ``nodes check`` to the ``trainyard`` parser."""
    nodes = subparsers.add_parser("nodes", help="the SLURM nodes with their failure history; check a drained node")
    nodes.add_argument("--json", action="store_true", help="print one JSON list instead of the table")
    nodes.set_defaults(handler=_list)
    commands = nodes.add_subparsers(dest="nodes_command")
    check = commands.add_parser("check", help="run the health job on NODE and a healthy peer; resume it only if "
                                              "every part passes its floor (exit 0), else drain it (exit 1)")
    check.add_argument("node")
    check.add_argument("--peer", help="the healthy node for the collective (default: one in NODE's partition)")
    check.add_argument("--floor", action="append", default=[], metavar="NAME=VALUE",
                       help="override a floor: compute_gflops, memory_gbps, disk_write_mbps, allreduce_gbps")
    check.add_argument("--json", action="store_true")
    check.set_defaults(handler=_check)
