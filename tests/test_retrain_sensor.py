"""retrain_sensor on a real Dagster instance: what counts as trained, retries (of failed and of
canceled runs), the retry budget, in-flight runs, which shards are stale, and how many queries a
tick makes.

The assets the sensor reads (validated_manifest, clip_plan, clip_shards, shard_index, pretrain)
are materialized here by small stand-ins that report the same metadata and data versions as
the real ones, and the runs the sensor requests are executed as real runs of stand-in jobs
carrying the request's tags, failing or succeeding on demand (or recorded as the run launcher
leaves them: submitted, started, canceled). So the sensor sees exactly the
instance state it sees in production, in milliseconds instead of a training run.
(tests/test_training_assets.py drives it with the real assets end to end.)
"""

from __future__ import annotations

import dagster as dg
import pytest

from assets.clips import SHARD_PARTITIONS
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


def _stand_in_job(name: str, *, ok: bool = True) -> dg.JobDefinition:
    @dg.op
    def work() -> None:
        if not ok:
            raise dg.Failure("injected failure of the requested run")

    @dg.job(name=name)
    def stand_in_job():
        work()

    return stand_in_job


def _run(instance: dg.DagsterInstance, request: dg.RunRequest, *, ok: bool) -> dg.ExecuteInProcessResult:
    """Execute what the sensor requested, as Dagster would: a run of its job with its tags."""
    job = _stand_in_job(request.job_name, ok=ok)
    return job.execute_in_process(instance=instance, tags=request.tags, raise_on_error=False)


def _launched(instance: dg.DagsterInstance, request: dg.RunRequest, status: dg.DagsterRunStatus) -> dg.DagsterRun:
    """A run of the request as the run launcher leaves it in the instance: submitted, started
    (perhaps orphaned by a dead worker) or canceled (what Dagster records when a run is cancelled)."""
    job = _stand_in_job(request.job_name)
    if status == dg.DagsterRunStatus.CANCELED:
        run = instance.create_run_for_job(job, tags=request.tags, status=dg.DagsterRunStatus.CANCELING)
        instance.report_run_canceled(run)
        return instance.get_run_by_id(run.run_id)
    return instance.create_run_for_job(job, tags=request.tags, status=status)


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


def _trained_pretrain(instance: dg.DagsterInstance, validated: str, *, finetune: bool = True) -> None:
    """pretrain, then finetune, materialized by successful runs on the shards of ``validated`` (as
    `make demo` does); without ``finetune``, a pretrain-only run by hand."""
    _ready_to_retrain(instance, validated, "p1")
    _materialize(instance, "shard_index", {"shard_index_version": "i1", "data_path": "/data/shards/p1"},
                 data_version="i1")
    _materialize(instance, "pretrain", {"shard_index_version": "i1", "manifest_version": MANIFEST})
    if finetune:
        _materialize(instance, "finetune", {"shard_index_version": "i1", "manifest_version": MANIFEST})


def test_pretrain_and_finetune_on_this_validated_version_count_as_trained(instance) -> None:
    _trained_pretrain(instance, "v1")
    result = _tick(instance)
    assert isinstance(result, dg.SkipReason)
    assert "pretrain already trained on validated manifest v1, and finetune" in result.skip_message


def test_a_pretrain_only_run_does_not_count_as_trained(instance) -> None:
    """Finding 8: a manual pretrain-only run leaves finetune untrained on this data: retrain."""
    _trained_pretrain(instance, "v1", finetune=False)
    result = _tick(instance)
    assert isinstance(result, dg.RunRequest), getattr(result, "skip_message", result)
    assert (result.job_name, result.run_key) == ("retrain_job", "retrain-v1-attempt0")


def test_finetune_on_older_data_does_not_count_as_trained(instance) -> None:
    """pretrain saw v1 (a pretrain-only run) but finetune's latest run saw other shards."""
    _trained_pretrain(instance, "v1", finetune=False)
    _materialize(instance, "shard_index", {"shard_index_version": "i0", "data_path": "/data/shards/p0"},
                 data_version="i0")
    _materialize(instance, "finetune", {"shard_index_version": "i0", "manifest_version": MANIFEST})
    result = _tick(instance)
    assert isinstance(result, dg.RunRequest) and result.job_name == "retrain_job"


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


# ---------------------------------------------------------------------------------------------
# Finding 6: cancelled and in-flight runs


def test_a_canceled_retrain_is_retried_under_a_new_run_key(instance) -> None:
    _ready_to_retrain(instance)
    first = _tick(instance)
    canceled = _launched(instance, first, dg.DagsterRunStatus.CANCELED)
    assert canceled.status == dg.DagsterRunStatus.CANCELED
    retry = _tick(instance)
    assert isinstance(retry, dg.RunRequest), getattr(retry, "skip_message", retry)
    assert retry.run_key == "retrain-v1-attempt1" and retry.tags[training.ATTEMPT_TAG] == f"2 of {MAX_ATTEMPTS}"


def test_canceled_and_failed_runs_spend_one_budget(instance) -> None:
    _ready_to_retrain(instance)
    _launched(instance, _tick(instance), dg.DagsterRunStatus.CANCELED)
    _run(instance, _tick(instance), ok=False)
    last = _launched(instance, _tick(instance), dg.DagsterRunStatus.CANCELED)
    spent = _tick(instance)
    assert isinstance(spent, dg.SkipReason), spent
    assert f"failed {MAX_ATTEMPTS} of {MAX_ATTEMPTS}" in spent.skip_message and last.run_id in spent.skip_message
    assert BUDGET_TAG in instance.get_run_by_id(last.run_id).tags


@pytest.mark.parametrize("status", [dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTED])
def test_an_in_flight_run_is_named_instead_of_a_duplicate_request(instance, status) -> None:
    _ready_to_retrain(instance)
    first = _tick(instance)
    run = _launched(instance, first, status)
    waiting = _tick(instance)
    assert isinstance(waiting, dg.SkipReason), waiting
    assert f"step retrain-v1 is in flight: run {run.run_id} is {status.value}" in waiting.skip_message
    instance.report_run_canceled(run)  # a person cancels the stuck run: the sensor retries the step
    retry = _tick(instance)
    assert isinstance(retry, dg.RunRequest) and retry.run_key == "retrain-v1-attempt1"


def test_in_flight_shards_are_not_requested_again(instance) -> None:
    _validated(instance, "v1")
    _planned(instance, "v1", "p1")
    requests = _tick(instance)
    by_shard = {request.partition_key: request for request in requests}
    running = _launched(instance, by_shard["train-00000"], dg.DagsterRunStatus.STARTED)
    (rest,) = _tick(instance)
    assert rest.partition_key == "train-00001"
    _launched(instance, rest, dg.DagsterRunStatus.NOT_STARTED)
    waiting = _tick(instance)
    assert isinstance(waiting, dg.SkipReason), waiting
    assert f"step shard-p1-train-00000 is in flight: run {running.run_id} is STARTED" in waiting.skip_message
    assert "step shard-p1-train-00001 is in flight" in waiting.skip_message


def _counted(monkeypatch, instance: dg.DagsterInstance, method: str) -> list:
    """Calls of one real DagsterInstance method (still executed), to count queries per tick."""
    calls = []
    real = getattr(type(instance), method)
    monkeypatch.setattr(type(instance), method, lambda self, *a, **k: calls.append(a) or real(self, *a, **k))
    return calls


def test_queries_per_tick_do_not_grow_with_the_number_of_shards(instance, monkeypatch) -> None:
    """The nit: one get_runs (and one materialization lookup) per stale shard on every tick."""
    shards = tuple(f"train-{index:05d}" for index in range(6))
    _ready_to_retrain(instance, "v1", "p1")
    _validated(instance, "v2")
    _planned(instance, "v2", "p2", shards=shards)
    _sharded(instance, "p2", shards=shards[:2])  # fresh; the rest hold p1's shards or none: stale
    runs_queries = _counted(monkeypatch, instance, "get_runs")
    materialization_queries = _counted(monkeypatch, instance, "fetch_materializations")
    requests = _tick(instance)
    assert sorted(request.partition_key for request in requests) == list(shards[2:])
    # runs in progress on the chain, the retrain_job success lookup, then every shard's runs at once
    assert len(runs_queries) == 3, runs_queries
    shard_queries = [call for call in materialization_queries
                     if getattr(call[0], "asset_key", call[0]) == dg.AssetKey("clip_shards")]
    assert len(shard_queries) == 1, shard_queries  # every partition's latest at once


@pytest.mark.parametrize("status", [dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTED])
def test_a_run_materializing_the_chain_now_is_waited_for(instance, status) -> None:
    """On a shared instance somebody's `make demo` may be training this very version right now."""
    _validated(instance, "v1")
    from pipelines.definitions import defs

    running = instance.create_run_for_job(defs.resolve_implicit_global_asset_job_def(), status=status,
                                          asset_selection=frozenset({dg.AssetKey("pretrain")}),
                                          tags={"trainyard/source": "make demo"})
    waiting = _tick(instance)
    assert isinstance(waiting, dg.SkipReason), waiting
    assert f"run {running.run_id} is materializing the training chain now" in waiting.skip_message
    instance.report_run_failed(running)
    assert isinstance(_tick(instance), dg.RunRequest)  # once it ended, the sensor goes on
