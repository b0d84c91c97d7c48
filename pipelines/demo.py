"""``make demo``: demo media, then every asset materialized on the embedded instance.

Runs in this process against the SQLite instance under DAGSTER_HOME, so ``make ui`` shows the
runs, materializations, checks and lineage afterwards.
"""

from __future__ import annotations

import time

import dagster as dg

from ops import paths
from pipelines.instance import ensure_dagster_home


_QUIET = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}


def run_demo(*, num_good: int = 40) -> bool:
    home = ensure_dagster_home()
    media = paths.media_root()
    started = time.monotonic()
    if not media.exists() or not any(media.iterdir()):
        from ops.demo_media import generate_demo_media

        report = generate_demo_media(media, num_good=num_good)
        print(f"demo media: {len(report.good)} clips + edge cases in {media}")
    else:
        print(f"demo media: reusing {media}")
    from pipelines.definitions import defs

    job = defs.resolve_implicit_global_asset_job_def()
    result = job.execute_in_process(instance=dg.DagsterInstance.get(), raise_on_error=False, run_config=_QUIET,
                                    tags={"trainyard/source": "make demo"})
    _summarize(result, home, time.monotonic() - started)
    return result.success


def _summarize(result: dg.ExecuteInProcessResult, home, elapsed_s: float) -> None:
    status = "succeeded" if result.success else "FAILED"
    print(f"\ndemo run {result.run_id} {status} in {elapsed_s:.0f} s")
    for event in result.get_asset_materialization_events():
        print(f"  materialized {event.asset_key.to_user_string()}")
    for evaluation in result.get_asset_check_evaluations():
        print(f"  check {evaluation.asset_key.to_user_string()}:{evaluation.check_name} "
              f"{'passed' if evaluation.passed else 'FAILED'}")
    print(f"\nDagster home: {home}\ndata: {paths.data_root()}\nLook at it: make ui  (then open http://127.0.0.1:3000)")
