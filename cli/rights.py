"""``trainyard rights``: revoke an asset, and see everything that holds it (ops/curation/rights.py, docs/rights.md).

    trainyard rights where ASSET [--json]          # plans, shards, indexes, runs, checkpoints holding it
    trainyard rights revoke ASSET --reason R [--note TEXT] [--allow-unknown]
    trainyard rights reinstate ASSET --note TEXT   # consent given again
    trainyard rights list [--json]                 # the revocations in force
    trainyard rights erase ASSET --reason R [--note TEXT] [--delete-source] [--json]
                                                   # delete every copy of a revoked asset; a signed certificate

ASSET is an asset id (the content sha256), a unique prefix of one (8 or more hex characters), or a
media uri as the manifests name it. The data root is TRAINYARD_DATA_ROOT's (or --data-root).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

EXIT_OK, EXIT_BAD_INPUT = 0, 2


def _data_root(args: argparse.Namespace) -> Path:
    from ops.publish import paths

    return Path(args.data_root) if args.data_root else paths.data_root()


def _known(data_root: Path) -> tuple[dict[str, set[str]], list[str]]:
    from ops.curation.rights import known_assets

    return known_assets(data_root)


def resolve(data_root: Path, asset: str, *, allow_unknown: bool = False) -> tuple[str, set[str]]:
    """(asset id, its uris) for an id, a unique id prefix or a uri (ops.curation.rights.resolve_asset)."""
    from ops.curation.rights import resolve_asset

    return resolve_asset(data_root, asset, allow_unknown=allow_unknown, known=_known(data_root))


def _print_reach(asset_id: str, uris: set[str], reach: dict, problems: list[str], revocation: dict | None) -> None:
    from ops.curation import rights

    print(f"asset {asset_id}" + (f" ({', '.join(sorted(uris))})" if uris else ""))
    print(f"  rights: {'REVOKED, ' + rights.describe(revocation) if revocation else 'not revoked'}")
    if not any(reach[name] for name in ("plans", "shards", "shard_indexes", "runs", "checkpoints")):
        print("  in no clip plan, shard, shard index, training run or checkpoint under this data root")
    for plan in reach["plans"]:
        print(f"  clip plan   {plan['plan_version']}  {plan['num_clips']} clip(s)  {plan['path']}")
    for shard in reach["shards"]:
        written = "" if shard["written"] else ("  (deleted by an erasure)" if shard.get("erased")
                                               else "  (planned, not written)")
        print(f"  shard       {shard['shard']} of plan {shard['plan_version']}  "
              f"{len(shard['sample_keys'])} clip(s)  {shard['path']}{written}")
    for index in reach["shard_indexes"]:
        published = f"  published to {index['published_to']}" if index["published_to"] else ""
        print(f"  shard index {index['version']}  {index['path']}{published}")
    for run in reach["runs"]:
        state = f"  [{run['rights_state']}]" if run.get("rights_state") else ""
        print(f"  run         {run['stage']} {run['run_id']}  {run['run_dir']}  ({run['how']}){state}")
    for point in reach["checkpoints"]:
        print(f"  checkpoint  step {point['step']} ({point['status']})  {point['path']}")
    for problem in problems:
        print(f"  cannot tell: {problem}")


def _where(args: argparse.Namespace) -> int:
    from ops.curation import erasure, rights

    data_root = _data_root(args)
    asset_id, uris = resolve(data_root, args.asset, allow_unknown=True)
    lineage = rights.where(data_root, [asset_id])
    reach = lineage.reach[asset_id].as_dict()
    events = rights.read_events(data_root)
    revocation = rights.current(events).get(asset_id)
    erased = [{**event, "certificate": str(erasure.certificate_path(data_root, event["erasure_id"]))}
              for event in rights.erasures(events, asset_id)]
    for run in reach["runs"]:  # derived from the ledger (never stored in a checkpoint's signed record)
        taint = erasure.run_taint(data_root, run["run_dir"], events=events)
        run["rights_state"] = taint["state"] if taint else "clean"
    for shard in reach["shards"]:
        shard["erased"] = bool(erased) and not shard["written"]
    if args.json:
        print(json.dumps({**reach, "known_uris": sorted(uris), "revocation": revocation, "erasures": erased,
                          "problems": lineage.problems}, indent=2, sort_keys=True))
    else:
        _print_reach(asset_id, uris, reach, lineage.problems, revocation)
        for event in erased:
            print(f"  erased      {event['erasure_id']} at {event['at']} by {event['by']}  certificate "
                  f"{event['certificate']}")
    return EXIT_OK


def _erase(args: argparse.Namespace) -> int:
    from ops.curation import erasure, rights
    from trainer.launch.redact import redact_uri
    from trainer.observe.tracking import connect_uri, resolve_tracking_uri

    data_root = _data_root(args)
    asset_id, uris = resolve(data_root, args.asset, allow_unknown=True)
    hooks = erasure.TrackingHooks(connect=lambda recorded: resolve_tracking_uri(connect_uri(recorded)),
                                  redact=redact_uri)
    done = erasure.erase(data_root, asset_id, reason=args.reason, note=args.note, delete_source=args.delete_source,
                         uris=uris, hooks=hooks, log=(lambda line: None) if args.json else print)
    if not done.recorded:
        last = done.previous[-1]
        message = (f"{asset_id} was already erased ({last['erasure_id']} at {last['at']}, certificate "
                   f"{erasure.certificate_path(data_root, last['erasure_id'])}); no copy is left to delete, "
                   "nothing recorded")
        print(json.dumps({"asset_id": asset_id, "recorded": False, "message": message}) if args.json else message)
        return EXIT_OK
    certificate = erasure.read_certificate(data_root, done.erasure_id)
    path = erasure.certificate_path(data_root, done.erasure_id)
    if args.json:
        print(json.dumps({**certificate, "certificate": str(path), "recorded": True}, indent=2, sort_keys=True))
        return EXIT_OK if certificate["complete"] else 1
    print(f"erased {asset_id} ({done.erasure_id}): {len(certificate['deleted'])} cop(ies) deleted, "
          f"{len(certificate['kept'])} kept, {len(certificate['unreachable'])} not reachable; certificate {path}")
    for entry in certificate["successors"]:
        print(f"  successor   shard index {entry['from_index']} -> {entry['index']}  {entry['published_to'] or entry['path']}")
    for entry in certificate["kept"]:
        print(f"  kept        {entry['kind']}  {entry['location']}" + (f"  ({entry['state']})" if entry.get("state") else "")
              + f": {entry['why']}")
    for entry in certificate["unreachable"]:
        print(f"  not reached {entry['kind']}  {entry.get('location', '')}: {entry.get('error') or entry['why']}")
    if not certificate["complete"]:
        print("incomplete: run the same command again once the copies above can be reached")
        return 1
    revoked_by = rights.revoked(data_root).get(asset_id)
    if revoked_by is not None:
        print(f"  rights:     {rights.describe(revoked_by)}")
    return EXIT_OK


def _revoke(args: argparse.Namespace) -> int:
    from ops.curation import rights

    data_root = _data_root(args)
    asset_id, uris = resolve(data_root, args.asset, allow_unknown=args.allow_unknown)
    # Rights follow the content (its sha256): every name it has is revoked. Say so, and keep what was asked.
    note = args.note if args.asset.strip() not in uris else f"{args.note} (given as {args.asset.strip()})".strip()
    if len(uris) > 1:
        print(f"warning: this content has {len(uris)} names, all revoked with it: {', '.join(sorted(uris))}")
    event, recorded = rights.revoke(data_root, asset_id, reason=args.reason, note=note)
    if recorded:
        print(f"revoked {asset_id}: {rights.describe(event)}")
    else:
        print(f"{asset_id} was already revoked: {rights.describe(event)}; nothing recorded")
    lineage = rights.where(data_root, [asset_id])
    _print_reach(asset_id, uris, lineage.reach[asset_id].as_dict(), lineage.problems, event)
    if lineage.reach[asset_id].plans:
        print("next: validate again (the retrain sensor requests it): the asset is quarantined as rights_revoked, "
              "the next plan and shard index leave it out, and no training stage accepts an index that holds it")
    return EXIT_OK


def _reinstate(args: argparse.Namespace) -> int:
    from ops.curation import rights

    data_root = _data_root(args)
    asset_id, _ = resolve(data_root, args.asset, allow_unknown=True)
    event = rights.reinstate(data_root, asset_id, note=args.note)
    print(f"reinstated {asset_id} ({event['by']}, {event['at']})" if event else f"{asset_id} is not revoked; "
          "nothing recorded")
    return EXIT_OK


def _list(args: argparse.Namespace) -> int:
    from ops.curation import rights

    revoked = rights.revoked(_data_root(args))
    if args.json:
        print(json.dumps(revoked, indent=2, sort_keys=True))
        return EXIT_OK
    if not revoked:
        print("no asset is revoked")
    for asset_id, event in sorted(revoked.items()):
        print(f"{asset_id}  {rights.describe(event)}")
    return EXIT_OK


def register(subparsers: argparse._SubParsersAction) -> None:
    from ops.curation.rights import REASONS

    commands = subparsers.add_parser("rights", help="revoke assets and find what holds them").add_subparsers(
        dest="rights_command", required=True)

    def command(name: str, handler, help_text: str) -> argparse.ArgumentParser:
        parser = commands.add_parser(name, help=help_text)
        parser.add_argument("--data-root", default=None, help="default: TRAINYARD_DATA_ROOT's working copy")
        parser.set_defaults(handler=handler)
        return parser

    where = command("where", _where, "every clip plan, shard, index, run and checkpoint holding ASSET")
    where.add_argument("asset", help="asset id, unique id prefix, or media uri")
    where.add_argument("--json", action="store_true")
    def with_reason(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.add_argument("asset")
        parser.add_argument("--reason", required=True, choices=REASONS)
        parser.add_argument("--note", default="", help="e.g. the ticket or request behind it")
        return parser

    revoke = with_reason(command("revoke", _revoke, "revoke ASSET in the rights ledger, then show where it went"))
    revoke.add_argument("--allow-unknown", action="store_true",
                        help="record a full asset id that no manifest holds yet")
    reinstate = command("reinstate", _reinstate, "end ASSET's revocation (consent given again)")
    reinstate.add_argument("asset")
    reinstate.add_argument("--note", required=True)
    listing = command("list", _list, "the revocations in force")
    listing.add_argument("--json", action="store_true")
    erase = with_reason(command("erase", _erase, "delete every copy Trainyard made of a revoked ASSET; write a signed "
                                                 "certificate"))
    erase.add_argument("--delete-source", action="store_true",
                       help="delete the source media too (by default it is listed as kept: the lab may not own it)")
    erase.add_argument("--json", action="store_true")
