"""retrain_sensor on a real Dagster instance: what counts as trained, retries, the retry budget,
and which shards are stale.

The assets the sensor reads (validated_manifest, clip_plan, clip_shards, shard_index, pretrain)
are materialized here by small stand-ins that report the same metadata and data versions as
the real ones, and the runs the sensor requests are executed as real runs of stand-in jobs
carrying the request's tags, failing or succeeding on demand. So the sensor sees exactly the
instance state it sees in production, in milliseconds instead of a training run.
(tests/test_training_assets.py drives it with the real assets end to end.)
"""

from __future__ import annotations

import dagster as dg
import pytest

from assets.shards import SHARD_PARTITIONS
from pipelines import training
from pipelines.training import BUDGET_TAG, MAX_ATTEMPTS, retrain_sensor

MANIFEST = "m" * 20


@pytest.fixture
def instance():
    with dg.DagsterInstance.ephemeral() as instance:
        yield instance


def _materialize(instance: dg.DagsterInstance, key: str, metadata: dict, *, data_version: str | None = None,
                 partition: str | None = None) -> None:
    @dg.asset(name=key, partitions_def=SHARD_PARTITIONS if partition else None)
    def stand_in() -> dg.MaterializeResult:
        return dg.MaterializeResult(metadata=metadata,
                                    data_version=dg.DataVersion(data_version) if data_version else None)

    assert dg.materialize([stand_in], instance=instance, partition_key=partition).success


def _validated(instance: dg.DagsterInstance, version: str) -> None:
    _materialize(instance, "validated_manifest", {"validated_version": version, "manifest_version": MANIFEST},
                 data_version=version)


def _planned(instance: dg.DagsterInstance, validated: str, plan: str, shards=("train-00000", "train-00001")) -> None:
    instance.add_dynamic_partitions(SHARD_PARTITIONS.name, list(shards))
    _materialize(instance, "clip_plan", {"plan_version": plan, "validated_version": validated,
                                         "manifest_version": MANIFEST, "data_path": f"/data/shards/{plan}"},
                 data_version=plan)


def _sharded(instance: dg.DagsterInstance, plan: str, shards=("train-00000", "train-00001")) -> None:
    for shard in shards:
        _materialize(instance, "clip_shards", {"plan_version": plan, "shard": shard}, partition=shard)


def _tick(instance: dg.DagsterInstance):
    return retrain_sensor(dg.build_sensor_context(instance=instance))


def _run(instance: dg.DagsterInstance, request: dg.RunRequest, *, ok: bool) -> dg.ExecuteInProcessResult:
    """Execute what the sensor requested, as Dagster would: a run of its job with its tags."""
    @dg.op
    def work() -> None:
        if not ok:
            raise dg.Failure("injected failure of the requested run")

    @dg.job(name=request.job_name)
    def stand_in_job():
        work()

    return stand_in_job.execute_in_process(instance=instance, tags=request.tags, raise_on_error=False)


def _ready_to_retrain(instance: dg.DagsterInstance, validated: str = "v1", plan: str = "p1") -> None:
    _validated(instance, validated)
    _planned(instance, validated, plan)
    _sharded(instance, plan)


def test_failed_retrain_is_retried_and_counts_as_trained_only_after_success(instance) -> None:
    _ready_to_retrain(instance)
    first = _tick(instance)
    assert isinstance(first, dg.RunRequest) and first.job_name == "retrain_job"
    assert first.run_key == "retrain-v1-attempt0" and first.tags[training.VALIDATED_TAG] == "v1"
    # Requested is not trained: until the run ends, the same (deduplicated) request is repeated.
    assert isinstance(again := _tick(instance), dg.RunRequest) and again.run_key == first.run_key
    assert not _run(instance, first, ok=False).success
    retry = _tick(instance)
    assert isinstance(retry, dg.RunRequest), "a failed retrain must be retried"
    assert retry.run_key == "retrain-v1-attempt1" and retry.tags[training.ATTEMPT_TAG] == f"2 of {MAX_ATTEMPTS}"
    assert _run(instance, retry, ok=True).success
    done = _tick(instance)
    assert isinstance(done, dg.SkipReason) and "already retrained on validated manifest v1" in done.skip_message


def _trained_pretrain(instance: dg.DagsterInstance, validated: str) -> None:
    """pretrain materialized by a successful run on the shards of ``validated`` (as `make demo` does)."""
    _ready_to_retrain(instance, validated, "p1")
    _materialize(instance, "shard_index", {"shard_index_version": "i1", "data_path": "/data/shards/p1"},
                 data_version="i1")
    _materialize(instance, "pretrain", {"shard_index_version": "i1", "manifest_version": MANIFEST})


def test_pretrain_on_this_validated_version_counts_as_trained(instance) -> None:
    _trained_pretrain(instance, "v1")
    result = _tick(instance)
    assert isinstance(result, dg.SkipReason)
    assert "pretrain already trained on validated manifest v1" in result.skip_message


def test_revalidation_with_other_rules_is_new_data_and_retrains(instance) -> None:
    """Same manifest, stricter rules: a new validated version, which pretrain never saw."""
    _trained_pretrain(instance, "v1")
    _validated(instance, "v2-stricter")
    result = _tick(instance)
    assert isinstance(result, dg.RunRequest), getattr(result, "skip_message", result)
    assert (result.job_name, result.run_key) == ("plan_job", "plan-v2-stricter-attempt0")


def test_pretrain_from_a_failed_run_does_not_count(instance) -> None:
    _trained_pretrain(instance, "v1")

    @dg.asset(name="pretrain")
    def pretrain_then_fail():
        yield dg.MaterializeResult(metadata={"shard_index_version": "i1", "manifest_version": MANIFEST})
        raise dg.Failure("finetune's blocking check failed after pretrain")

    assert not dg.materialize([pretrain_then_fail], instance=instance, raise_on_error=False).success
    result = _tick(instance)
    assert isinstance(result, dg.RunRequest) and result.job_name == "retrain_job"


def test_spent_retry_budget_is_said_tagged_and_not_looped(instance) -> None:
    _ready_to_retrain(instance)
    runs = []
    for attempt in range(MAX_ATTEMPTS):
        request = _tick(instance)
        assert isinstance(request, dg.RunRequest) and request.run_key == f"retrain-v1-attempt{attempt}"
        runs.append(_run(instance, request, ok=False))
    spent = _tick(instance)
    assert isinstance(spent, dg.SkipReason), spent
    assert "retry budget spent" in spent.skip_message and f"failed {MAX_ATTEMPTS} of {MAX_ATTEMPTS}" in spent.skip_message
    assert runs[-1].run_id in spent.skip_message
    assert BUDGET_TAG in instance.get_run_by_id(runs[-1].run_id).tags
    assert all(BUDGET_TAG not in instance.get_run_by_id(run.run_id).tags for run in runs[:-1])
    num_runs = instance.get_runs_count()
    again = _tick(instance)  # no loop: the same answer, no new request, no new run
    assert isinstance(again, dg.SkipReason) and again.skip_message == spent.skip_message
    assert instance.get_runs_count() == num_runs


def test_shards_of_an_older_plan_are_stale(instance) -> None:
    """Partition keys repeat from plan to plan: a shard written for the old plan is not fresh."""
    _ready_to_retrain(instance, "v1", "p1")
    _validated(instance, "v2")
    _planned(instance, "v2", "p2")
    requests = _tick(instance)
    assert isinstance(requests, list), requests
    assert sorted(request.partition_key for request in requests) == ["train-00000", "train-00001"]
    assert {request.run_key for request in requests} == {"shard-p2-train-00000-attempt0", "shard-p2-train-00001-attempt0"}
    _sharded(instance, "p2", shards=("train-00000",))
    (rest,) = _tick(instance)
    assert rest.partition_key == "train-00001"


def test_a_shard_with_a_spent_budget_holds_back_retraining(instance) -> None:
    _validated(instance, "v1")
    _planned(instance, "v1", "p1")
    _sharded(instance, "p1", shards=("train-00000",))
    for _ in range(MAX_ATTEMPTS):
        (request,) = _tick(instance)
        assert request.partition_key == "train-00001"
        _run(instance, request, ok=False)
    result = _tick(instance)
    assert isinstance(result, dg.SkipReason)
    assert "retry budget spent: step shard-p1-train-00001" in result.skip_message


def test_nothing_validated_yet_is_skipped(instance) -> None:
    result = _tick(instance)
    assert isinstance(result, dg.SkipReason) and "has not been materialized" in result.skip_message


def test_a_successful_retrain_counts_for_its_own_validated_version_only(instance) -> None:
    _ready_to_retrain(instance, "v1", "p1")
    assert _run(instance, _tick(instance), ok=True).success
    assert isinstance(_tick(instance), dg.SkipReason)
    _ready_to_retrain(instance, "v2", "p2")
    result = _tick(instance)
    assert isinstance(result, dg.RunRequest) and result.run_key == "retrain-v2-attempt0"
