"""Asset inputs whose stored form changed: what a reader accepts from Dagster's storage.

Dagster's default IO manager keeps each asset's last output pickled until the asset is
materialized again, so a reader of an output whose type changed meets the old form too.
A module of its own, Dagster and the reference only: the training assets' code version counts
everything they import (ops.lineage), and assets/clips.py would bring the clip code in.
"""

import dagster as dg

from ops.clips.shard_ref import ShardIndexRef

# shard_index as a ShardIndexRef, or the dict it returned before; readers take ShardIndexRef.of(it).
SHARD_INDEX_IN = dg.AssetIn(dagster_type=dg.PythonObjectDagsterType((ShardIndexRef, dict), name="ShardIndexRef"))
