"""``make demo``: demo media, then every asset materialized on the embedded instance.

Runs in this process against the SQLite instance under DAGSTER_HOME, so ``make ui`` shows the
runs, materializations, checks and lineage afterwards. The graph runs in three stages, as a
user would from the UI: everything up to ``clip_plan``, then one run per ``clip_shards``
partition (a backfill), then everything downstream of the shards.
"""

from __future__ import annotations

import os
import time

import dagster as dg

from ops.publish import paths
from pipelines import environment
from pipelines.instance import ensure_dagster_home

_QUIET = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}
SHARDS = dg.AssetKey("clip_shards")
REPRODUCTION = dg.AssetKey("reproduction")


def _stages(defs: dg.Definitions) -> tuple[list[dg.AssetKey], list[dg.AssetKey]]:
    """(assets before the shards, assets after them), each a valid selection for one run."""
    graph = defs.resolve_asset_graph()
    before = (dg.AssetSelection.assets(SHARDS).upstream(include_self=False)
              .required_multi_asset_neighbors().resolve(graph))
    # Partitioned assets other than the shards are the sweeps' (pipelines/sweeps.py): run by `trainyard sweep run`.
    # The reproduction is weekly only (its re-runs would double the demo's training time; tests/test_end_to_end.py).
    after = {key for key in set(graph.get_all_asset_keys()) - before - {SHARDS} - {REPRODUCTION}
             if not graph.get(key).is_partitioned}
    return sorted(before, key=str), sorted(after, key=str)


def demo_selection(defs: dg.Definitions, skip: tuple[str, ...] = ()) -> tuple[list[dg.AssetKey], list[dg.AssetKey]]:
    """What the demo materializes: (assets before the shards, assets after them less ``skip``); ValueError naming
    a skipped asset that is not one of them, or that another asset the demo runs needs."""
    before, after = _stages(defs)
    skipped = {dg.AssetKey.from_user_string(name) for name in skip}  # "evaluation/finetune" is a two-part key
    unknown = skipped - set(after)
    if unknown:
        raise ValueError(f"--skip {', '.join(sorted(k.to_user_string() for k in unknown))}: not one of "
                         f"{', '.join(k.to_user_string() for k in after)}")
    graph = defs.resolve_asset_graph()
    # Only children the demo runs count: the weekly reproduction depends on the stages but is not run here.
    needed = [key.to_user_string() for key in skipped if (graph.get(key).child_keys & set(after)) - skipped]
    if needed:
        raise ValueError(f"--skip {', '.join(needed)}: other assets need it")
    return before, [key for key in after if key not in skipped]


def run_demo(*, num_good: int = 40, skip: tuple[str, ...] = ()) -> bool:
    """Materialize the whole graph; ``skip`` names leaf assets after the shards to leave out."""
    if environment.current().cluster:  # every service answers with its credentials before the first run
        for line in environment.check_cluster():
            print(f"cluster: {line}")
    home = ensure_dagster_home()
    from pipelines.definitions import defs

    before, after = demo_selection(defs, skip)
    started = time.monotonic()
    _ensure_demo_media(num_good)
    instance = dg.DagsterInstance.get()
    job = defs.resolve_implicit_global_asset_job_def()
    results = [job.execute_in_process(instance=instance, asset_selection=before, raise_on_error=False,
                                      run_config=_QUIET, tags={"trainyard/source": "make demo"})]
    if results[-1].success:
        for partition in instance.get_dynamic_partitions("clip_shards"):
            results.append(job.execute_in_process(instance=instance, asset_selection=[SHARDS], partition_key=partition,
                                                  raise_on_error=False, run_config=_QUIET,
                                                  tags={"trainyard/source": "make demo"}))
    if all(result.success for result in results):
        results.append(job.execute_in_process(instance=instance, asset_selection=after, raise_on_error=False,
                                              run_config=_QUIET, tags={"trainyard/source": "make demo"}))
    _summarize(results, home, time.monotonic() - started)
    return all(result.success for result in results)


def _ensure_demo_media(num_good: int) -> None:
    """Generate the demo media into the media root unless it holds some already; a root in an object store
    gets them through a local folder beside the Trainyard home, uploaded (what a bucket cannot hold, such as
    the symlink and FIFO edge cases, is left out and named)."""
    from ops.media import roots
    from tools.demo_media import generate_demo_media

    location = paths.media_location()
    media = roots.open_root(location)
    local = isinstance(media, roots.LocalMediaRoot)
    if (media.root.is_dir() and any(media.root.iterdir())) if local else media.exists():
        print(f"demo media: reusing {location}")
        return
    if local:
        report = generate_demo_media(media.root, num_good=num_good)
        print(f"demo media: {len(report.good)} clips + edge cases in {location}")
        return
    staging = paths.trainyard_home() / "demo_media_upload"
    if not staging.exists() or not any(staging.iterdir()):
        generate_demo_media(staging, num_good=num_good)
    uploaded, left_out = roots.upload_folder(staging, location)
    print(f"demo media: {uploaded} objects uploaded to {location}"
          + (f"; left out (an object store cannot hold them): {', '.join(left_out)}" if left_out else ""))


def _summarize(results: list[dg.ExecuteInProcessResult], home, elapsed_s: float) -> None:
    ok = all(result.success for result in results)
    print(f"\ndemo: {len(results)} runs {'succeeded' if ok else 'FAILED'} in {elapsed_s:.0f} s")
    for result in results:
        for event in result.get_asset_materialization_events():
            partition = f" [{event.partition}]" if event.partition else ""
            print(f"  materialized {event.asset_key.to_user_string()}{partition}")
        for evaluation in result.get_asset_check_evaluations():
            print(f"  check {evaluation.asset_key.to_user_string()}:{evaluation.check_name} "
                  f"{'passed' if evaluation.passed else 'FAILED'}")
        if not result.success:
            print(f"  run {result.run_id} failed: see `make ui`")
    ui = (f"the webserver of `make cluster-up` ({os.environ.get('TRAINYARD_DAGSTER_UI_URL', 'see docs/cluster.md')})"
          if environment.current().cluster else "make ui  (then open http://127.0.0.1:3000)")
    url = paths.data_store_url()
    data = f"{url} (working copy {paths.data_root()})" if url else paths.data_root()
    print(f"\nDagster home: {home}\ndata: {data}\nLook at it: {ui}")
