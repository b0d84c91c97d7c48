"""Secrets never reach a record, and lineage is everywhere and stable (issue 9, items 6 and 9).

A real stage run: the pretrain asset materialized with ``dg.materialize`` on a DagsterInstance
with SQLite storage in a temporary folder, launching the trainer under torchrun (1 rank, the
tiny test model on shards written from the demo media), tracked in a real MLflow SQLite store.
The secret reaches the trainer from an environment variable (``dg.EnvVar``); a literal secret is
refused before Dagster stores the run. Then every byte written anywhere in the test's folders
(run folder, overrides file, Dagster's SQLite stores and compute logs, the MLflow database, the
captured output of the ranks) is searched for both secrets.

Run: python -m pytest tests/test_secrets_and_lineage.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pytest
from helpers import captured_fds, write_shards
from mlflow.tracking import MlflowClient

from assets import stage_runs, training
from ops.checkpoints import store as checkpoint_store
from ops import lineage
from ops.curation import manifest as manifest_ops
from ops.clips.plan import ShardConfig
from ops.loading.sampling import World
from ops.publish.paths import REPO_ROOT
from resources import LineageResource, StorageResource
from resources.launcher import LocalTorchrunLauncher
from trainer.launch.config import LiteralSecretError, check_no_literal_secrets
from trainer.launch import run_identity

CONFIG = "configs/test_tiny.yaml"
SECRET_ENV = "TRAINYARD_TEST_STORE_CREDENTIAL"
ENV_SECRET = "envsecret-5b1e77c2a9"  # reaches the trainer from the environment
LITERAL_SECRET = "literal-d41d8cd98f"  # typed into run config: must be refused, and stored nowhere
URI_TOKEN = "uritoken-7f3c9a01e2"  # in the MLflow URI's query string: reaches the trainer, recorded nowhere
LINEAGE_FIELDS = ("git_commit", "git_dirty", "container_digest", "env_digest", "manifest_version", "config_hash",
                  "code_version")
TRAINING_ASSETS = (training.step_profile, training.pretrain, training.finetune, training.restore_drill)
_QUIET = {"console": {"config": {"log_level": "WARNING"}}}


@dataclass(kw_only=True)
class StageLab:
    base: Path
    instance: dg.DagsterInstance
    storage: StorageResource
    launcher: LocalTorchrunLauncher
    mlflow_uri: str
    shard_index: dict
    output: Path
    """stdout and stderr of this process and the ranks while stages ran."""
    pretrain: dg.ExecuteInProcessResult | None = None

    def materialize(self, assets: list, run_config, *, ok: bool = True) -> dg.ExecuteInProcessResult:
        shard_index = self.shard_index

        @dg.asset(name="shard_index")
        def fixed_shard_index() -> dict:
            return shard_index

        resources = {"storage": self.storage, "launcher": self.launcher, "lineage": LineageResource()}
        with captured_fds(self.output, append=True):
            result = dg.materialize([fixed_shard_index, *assets], instance=self.instance, resources=resources,
                                    run_config=run_config, raise_on_error=False)
        if ok:
            assert result.success, [event.message for event in result.all_events if event.is_failure]
        return result

    def metadata(self, result: dg.ExecuteInProcessResult, key: str) -> dict:
        (event,) = [e for e in result.get_asset_materialization_events() if e.asset_key.to_user_string() == key]
        return {name: getattr(value, "value", value) for name, value in event.materialization.metadata.items()}


def stage_run_config(**config) -> dict:
    return {"loggers": _QUIET, "ops": {"pretrain": {"config": {"config_path": CONFIG, "nproc": 1, **config}}}}


@pytest.fixture(scope="module")
def stage_lab(demo_manifest, demo_validation, tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("secrets")
    data = base / "data"
    manifest_ops.write_manifest(demo_manifest, manifest_ops.manifests_dir(data))
    _, index = write_shards(demo_validation, ShardConfig(splits=("train",), clips_per_shard=8), data / "shards")
    assert index.manifest_version == demo_manifest.version
    # A credential in the store's URI (SQLAlchemy ignores the parameter; a tracking server would not).
    mlflow_uri = f"sqlite:///{base / 'mlflow.db'}?token={URI_TOKEN}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRAINYARD_HOME", str(base / "home"))
        patch.setenv("TRAINYARD_DATA_ROOT", str(data))
        patch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
        patch.delenv("TRAINYARD_CONTAINER_DIGEST", raising=False)
        patch.setenv(SECRET_ENV, ENV_SECRET)
        (base / "dagster").mkdir()
        with dg.DagsterInstance.local_temp(tempdir=str(base / "dagster")) as instance:
            lab = StageLab(base=base, instance=instance,
                           storage=StorageResource(media_root=str(base / "media"), data_root=str(data)),
                           launcher=LocalTorchrunLauncher(mlflow_tracking_uri=mlflow_uri), mlflow_uri=mlflow_uri,
                           shard_index={"path": str(data / "shards"), "manifest_version": index.manifest_version,
                                        "version": index.version},
                           output=base / "output.log")
            # The secret the documented way: dg.EnvVar in Python ({env: NAME} in run config). Two
            # checkpoints, so the restore drill below has something to verify.
            config = stage_runs.StageRunConfig(config_path=CONFIG, steps=2, nproc=1, overrides=["train.checkpoint_every=1"],
                                             secrets={"data.storage_token": dg.EnvVar(SECRET_ENV)})
            lab.pretrain = lab.materialize([training.pretrain], dg.RunConfig(ops={"pretrain": config}, loggers=_QUIET))
            yield lab


# ---------------------------------------------------------------------------------------------
# Secrets


def test_a_secret_from_an_environment_variable_reaches_the_trainer(stage_lab: StageLab) -> None:
    metadata = stage_lab.metadata(stage_lab.pretrain, "pretrain")
    assert metadata["status"] == "completed" and metadata["final_step"] == 2
    run_dir = Path(metadata["run_dir"])
    final = json.loads((run_dir / "final.json").read_text())
    # "***" is what a non-empty secret looks like in a record: the value reached the trainer's config.
    assert final["config"]["data"]["storage_token"] == "***"
    run = MlflowClient(stage_lab.mlflow_uri).get_run(metadata["mlflow_run_id"])
    assert run.data.params["data.storage_token"] == "***"
    launch = json.loads((run_dir / "launch.json").read_text())
    assert f"data.storage_token=${{env:{SECRET_ENV}}}" in launch["overrides"]


def test_overrides_reach_the_trainer_in_a_file_only_its_owner_reads(stage_lab: StageLab) -> None:
    run_dir = Path(stage_lab.metadata(stage_lab.pretrain, "pretrain")["run_dir"])
    overrides_file = run_dir / "launch" / f"{stage_lab.pretrain.run_id}.overrides.json"
    assert overrides_file.stat().st_mode & 0o777 == 0o600
    assert f"data.storage_token=${{env:{SECRET_ENV}}}" in json.loads(overrides_file.read_text())
    logs = [entry.message or "" for entry in stage_lab.instance.all_logs(stage_lab.pretrain.run_id)]
    (launching,) = [message for message in logs if message.startswith("launching")]
    assert f"--overrides-file {overrides_file}" in launching and "--set" not in launching


@pytest.mark.parametrize("config", [
    {"overrides": [f"data.storage_token={LITERAL_SECRET}"]},
    {"overrides": ["train.log_every=1", f" data.storage_token ={LITERAL_SECRET}"]},
    {"secrets": {"data.storage_token": LITERAL_SECRET}},
    {"overrides": [f"data={{storage_token: {LITERAL_SECRET}}}"]},
    {"overrides": [f"data.Storage_token={LITERAL_SECRET}"]},
    {"overrides": [f"DATA.STORAGE-TOKEN={LITERAL_SECRET}"]},
    {"overrides": [f'data=[{{"storageToken": "{LITERAL_SECRET}"}}]']},
], ids=["override", "override-with-spaces", "secrets-map", "nested-mapping", "other-case", "upper-dashes",
        "nested-in-a-list"])
def test_a_literal_secret_in_run_config_is_refused_before_the_run_is_stored(stage_lab: StageLab, config) -> None:
    runs_before = stage_lab.instance.get_runs_count()
    with pytest.raises(LiteralSecretError) as refused:
        stage_lab.materialize([training.pretrain], stage_run_config(steps=2, **config), ok=False)
    message = str(refused.value)
    assert "data.storage_token" in message or "secret" in message
    assert "dg.EnvVar('MY_TOKEN')" in message and "{env: MY_TOKEN}" in message, message
    assert LITERAL_SECRET not in message
    assert stage_lab.instance.get_runs_count() == runs_before, "the run (and its config) must not be stored"


def test_a_literal_secret_in_the_drills_overrides_is_refused_before_the_run_is_stored(stage_lab: StageLab) -> None:
    runs_before = stage_lab.instance.get_runs_count()
    run_config = {"loggers": _QUIET, "ops": {"restore_drill": {"config": {
        "overrides": [f"data.storage_token={LITERAL_SECRET}"]}}}}
    with pytest.raises(LiteralSecretError) as refused:
        stage_lab.materialize([training.restore_drill], run_config, ok=False)
    assert LITERAL_SECRET not in str(refused.value)
    assert stage_lab.instance.get_runs_count() == runs_before


def test_secrets_map_takes_only_secret_fields(stage_lab: StageLab) -> None:
    result = stage_lab.materialize([training.pretrain], stage_run_config(
        steps=2, secrets={"train.steps": {"env": SECRET_ENV}}), ok=False)
    errors = " ".join(str(event.step_failure_data.error) for event in result.all_events if event.is_step_failure)
    assert "train.steps is not a secret field" in errors


def test_the_restore_drill_carries_every_lineage_field(stage_lab: StageLab) -> None:
    parent = stage_lab.metadata(stage_lab.pretrain, "pretrain")
    # A corrupted checkpoint makes the drill fail its verification without training: the cheapest
    # drill that still materializes (and must still say which code, data and environment judged it).
    shard = sorted((Path(parent["checkpoint"])).glob("*.distcp"))[0]
    original = shard.read_bytes()
    try:
        shard.write_bytes(original[:64] + bytes([original[64] ^ 0xFF]) + original[65:])
        result = stage_lab.materialize([training.restore_drill], {"loggers": _QUIET}, ok=False)
    finally:
        shard.write_bytes(original)
    metadata = stage_lab.metadata(result, "restore_drill")
    assert metadata["passed"] is False
    for name in LINEAGE_FIELDS:
        assert metadata[name] not in (None, ""), name
    assert metadata["manifest_version"] == parent["manifest_version"]
    assert metadata["env_digest"] == parent["env_digest"] and metadata["code_version"] == parent["code_version"]


def _all_files(root: Path) -> list[Path]:
    return [path for path in root.rglob("*") if path.is_file()]


def test_no_secret_reaches_any_file_store_or_log(stage_lab: StageLab) -> None:
    """After the EnvVar run, the refused literals and the drill (tests run in file order)."""
    metadata = stage_lab.metadata(stage_lab.pretrain, "pretrain")
    run_dir = Path(metadata["run_dir"])
    files = _all_files(stage_lab.base)
    names = {path.name for path in files}
    # What must have been searched: the run folder, Dagster's SQLite stores and compute logs, MLflow.
    assert {"launch.json", "final.json", f"{stage_lab.pretrain.run_id}.overrides.json"} <= {
        path.name for path in _all_files(run_dir)}
    assert {"runs.db", "mlflow.db", "output.log"} <= names, sorted(names)
    assert (stage_lab.base / "dagster" / "history" / "runs" / f"{stage_lab.pretrain.run_id}.db").is_file()  # event log
    compute_logs = [path for path in _all_files(stage_lab.base / "dagster" / "storage")
                    if stage_lab.pretrain.run_id in str(path)]
    assert compute_logs, "Dagster captured no compute logs"
    assert b"step 2/2" in stage_lab.output.read_bytes(), "the ranks' output was not captured"
    assert (run_dir / "ranks" / "mlflow.json").is_file()  # the record that held the URI's credential
    leaks = [str(path) for path in files for secret in (ENV_SECRET, LITERAL_SECRET, URI_TOKEN)
             if secret.encode() in path.read_bytes()]
    assert not leaks
    # Dagster's records through its own API too (what the UI shows).
    for run in stage_lab.instance.get_runs():
        assert LITERAL_SECRET not in json.dumps(run.run_config, default=str)
        for entry in stage_lab.instance.all_logs(run.run_id):
            assert ENV_SECRET not in str(entry.dagster_event) and ENV_SECRET not in (entry.message or "")


# ---------------------------------------------------------------------------------------------
# Credentials in URIs and literal secrets under other spellings of a key (issue 32, item 7)

# Each: a URI as people write them, and the credential that must be recorded nowhere.
CREDENTIAL_URIS = {
    "http-userinfo": ("http://alice:hunter2-pass@mlflow.internal:5000", "hunter2-pass"),
    "https-encoded": ("https://bob:p%40ss-w0rd%21@mlflow.example.com/", "p@ss-w0rd!"),
    "s3-keys": ("s3://AKIAEXAMPLE:wJalrXUtnFEMI-secret@bucket/data", "wJalrXUtnFEMI-secret"),
    "postgres-driver": ("postgresql+psycopg2://dagster:pg-pass-42@db:5432/dagster", "pg-pass-42"),
    "token-only-userinfo": ("https://ghp_abcdef123456@github.com/org/repo.git", "ghp_abcdef123456"),
    "slash-in-password": ("http://carol:pa/ss-word@host/x", "pa/ss-word"),
    "query-token": ("https://mlflow.example.com/?token=qtok-998877", "qtok-998877"),
    "presigned-s3": ("https://b.s3.amazonaws.com/o?X-Amz-Algorithm=AWS4&X-Amz-Credential=AKIA%2F20261204"
                     "&X-Amz-Signature=sig-abcdef0123", "sig-abcdef0123"),
    "query-password": ("postgresql://db/dagster?sslmode=require&password=qpass-5566", "qpass-5566"),
    "azure-sas": ("https://acct.blob.core.windows.net/c?sv=2022&sig=azsig-1234567", "azsig-1234567"),
    "fragment-token": ("https://app.example.com/cb#access_token=oauth-tok-4321&state=1", "oauth-tok-4321"),
}


@pytest.mark.parametrize(("uri", "credential"), CREDENTIAL_URIS.values(), ids=CREDENTIAL_URIS.keys())
def test_credentials_in_any_uri_are_redacted_in_text_records_and_log_lines(uri: str, credential: str) -> None:
    """With no secret known in advance: a URI's credentials are recognised wherever the URI appears."""
    import io
    import logging
    from urllib.parse import quote

    from trainer.launch.redact import Redactor, RedactingFilter

    redactor = Redactor([])
    text = redactor.text(f"MlflowException: API request to {uri}/api/2.0 failed")
    record = json.dumps(redactor.value({"error": f"({uri})", "uris": [uri], uri: 1}))
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RedactingFilter(redactor))
    logger = logging.getLogger("trainer.test_uri_credentials")
    logger.addHandler(handler)
    try:
        logger.error("tracking store %s refused", uri)
    finally:
        logger.removeHandler(handler)
    for shown in (text, record, stream.getvalue()):
        assert credential not in shown and quote(credential, safe="/") not in shown, shown
    host = uri.split("@")[-1].split("://")[-1].split("/")[0].split("?")[0]
    assert host in text, "the record must still say which store it was"


def test_a_uri_password_from_the_environment_is_scrubbed_outside_its_uri_too() -> None:
    from trainer.launch.redact import Redactor

    environ = {"MLFLOW_TRACKING_URI": "http://alice:p%40ssw0rd-77@mlflow:5000", "HOME": "/home/alice"}
    redactor = Redactor.for_config(None, environ=environ)
    assert redactor.text("basic auth for alice with p@ssw0rd-77 rejected") == "basic auth for alice with *** rejected"
    assert redactor.text("/home/alice/x") == "/home/alice/x"


def test_a_tracking_server_with_a_password_leaves_it_in_no_record_of_the_failed_run(tmp_path: Path) -> None:
    """The attack: MLFLOW_TRACKING_URI=http://user:password@host. The real MLflow client fails to
    reach it (nothing listens) and its error, which holds the URI, goes where a failed start goes:
    final.json, this rank's end record and torchrun's error file, and the log."""
    import io
    import logging

    from mlflow.exceptions import MlflowException

    from trainer import train
    from trainer.launch.config import load_config
    from trainer.launch.redact import Redactor, RedactingFilter
    from trainer.observe.tracking import MlflowHook

    uri, password = "http://alice:hunter2-pass-31@127.0.0.1:9", "hunter2-pass-31"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", uri)
        patch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        patch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
        patch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
        config = load_config(None, ["preset=tiny_cpu", f"train.run_dir={tmp_path / 'run'}"])
        redactor = Redactor.for_config(config)
        with pytest.raises(MlflowException) as failed:
            MlflowHook(tracking_uri=uri, experiment="x", run_name="x", params={}, tags={}, redactor=redactor)
        assert password in str(failed.value), "the attack needs an error that shows the URI"
        stream = io.StringIO()
        handler = logging.StreamHandler(stream)
        handler.addFilter(RedactingFilter(Redactor.for_config(None)))  # as trainer.train sets it up
        train.log.addHandler(handler)
        try:
            train.log.error("could not attach the checkpointer or tracking", exc_info=failed.value)
            train._record_early_failure(config, failed.value, redactor, world=World(rank=0, world_size=1))
        finally:
            train.log.removeHandler(handler)
    written = _all_files(tmp_path)
    assert {"final.json", "error.json"} <= {path.name for path in written} and len(written) >= 3, written
    assert "127.0.0.1:9" in json.loads((tmp_path / "run" / "final.json").read_text())["error"]
    assert [str(path) for path in written if password.encode() in path.read_bytes()] == []
    assert password not in stream.getvalue() and "127.0.0.1:9" in stream.getvalue()


def test_the_stage_reports_an_unreachable_tracking_server_without_its_password() -> None:
    """The stage looks up earlier attempts before it launches: Dagster stores the error it raises."""
    from mlflow.exceptions import MlflowException

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        with pytest.raises(MlflowException) as failed:
            run_identity.previous_attempt("pretrain-x", "http://alice:hunter2-pass-32@127.0.0.1:9", "trainyard")
    assert "hunter2-pass-32" not in str(failed.value) and "127.0.0.1:9" in str(failed.value)
    assert failed.value.__suppress_context__ and failed.value.__cause__ is None


def test_the_policy_reaches_the_store_a_redacted_record_names() -> None:
    from trainer.observe.tracking import connect_uri, recorded_tracking_uri

    uri = "https://alice:s3cret-pw@mlflow.example.com/"
    recorded = recorded_tracking_uri(uri)
    assert "s3cret-pw" not in recorded and recorded == "https://***@mlflow.example.com/"
    assert connect_uri(recorded, {"MLFLOW_TRACKING_URI": uri}) == uri
    assert connect_uri(recorded, {"MLFLOW_TRACKING_URI": "https://other.example.com/"}) == recorded


@pytest.mark.parametrize("override", [
    f"data={{storage_token: {LITERAL_SECRET}}}", f"data.Storage_token={LITERAL_SECRET}",
    f"Data.STORAGE-TOKEN={LITERAL_SECRET}", f"data.storageToken={LITERAL_SECRET}",
    f" data . storage token = {LITERAL_SECRET}", f'data={{"storage_token": "{LITERAL_SECRET}"}}',
    f'data={{"storage\\u005ftoken": "{LITERAL_SECRET}"}}', f"data=[{{storage-token: {LITERAL_SECRET}}}]",
    f"x={{a: {{b: [{{Storage_Token: {LITERAL_SECRET}}}]}}}}", f'x={{"data.Storage_Token": {LITERAL_SECRET}}}',
    f"data.storage_token.inner={LITERAL_SECRET}", f"data={{storage_token: [{LITERAL_SECRET}",
])
def test_a_literal_secret_under_any_spelling_or_nesting_of_its_key_is_refused(override: str) -> None:
    with pytest.raises(LiteralSecretError) as refused:
        check_no_literal_secrets([override], where="run config overrides")
    assert LITERAL_SECRET not in str(refused.value)


@pytest.mark.parametrize("override", [
    "data.storage_token=${env:MY_TOKEN}", "data={storage_token: '${env:MY_TOKEN}'}", "data.Storage_Token=",
    "data={storage_token: null}", "train.lr=1e-3", "data.source=s3://bucket/shards", "name={note: storage}",
    "name=tokens: many",
])
def test_references_empty_values_and_other_fields_are_not_secrets(override: str) -> None:
    check_no_literal_secrets([override])


# ---------------------------------------------------------------------------------------------
# Lineage


def test_training_assets_declare_the_code_version_the_trainer_records(stage_lab: StageLab) -> None:
    recorded = stage_lab.metadata(stage_lab.pretrain, "pretrain")["code_version"]
    for assets_def in TRAINING_ASSETS:
        (version,) = set(assets_def.code_versions_by_key.values())
        assert version == recorded == stage_runs.TRAINING_CODE_VERSION, assets_def.key


def test_env_digest_of_this_process_is_the_one_the_trainer_recorded(stage_lab: StageLab) -> None:
    metadata = stage_lab.metadata(stage_lab.pretrain, "pretrain")
    assert metadata["env_digest"] == lineage.env_digest()
    tags = MlflowClient(stage_lab.mlflow_uri).get_run(metadata["mlflow_run_id"]).data.tags
    assert tags["env_digest"] == lineage.env_digest()
    record = checkpoint_store.read_record(metadata["checkpoint"])
    assert record["lineage"]["env_digest"] == lineage.env_digest()


def test_standalone_training_tracks_under_the_trainyard_home_not_the_working_folder(tmp_path: Path) -> None:
    """Started from another folder, without MLFLOW_TRACKING_URI: the store is the Trainyard home's,
    and the trainer's env_digest is still this process's (sys.path differs, the environment not)."""
    home, cwd = tmp_path / "home", tmp_path / "elsewhere"
    cwd.mkdir()
    (cwd / "exp.yaml").write_text("preset: tiny_cpu\n")
    env = {name: value for name, value in os.environ.items() if name != "MLFLOW_TRACKING_URI"}
    env |= {"TRAINYARD_HOME": str(home), "TRAINYARD_DATA_ROOT": str(home / "data")}
    command = [sys.executable, "-m", "trainer.train", "--config", "exp.yaml", "--set", f"train.run_dir={tmp_path / 'run'}",
               "--set", "train.steps=2", "--set", "stage.mlflow=true"]
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not (cwd / "mlflow.db").exists() and not (cwd / "mlruns").exists(), sorted(os.listdir(cwd))
    store = home / "mlflow" / "mlflow.db"
    assert store.is_file()
    client = MlflowClient(f"sqlite:///{store}")
    (run,) = client.search_runs([client.get_experiment_by_name("trainyard").experiment_id])
    assert run.data.tags["env_digest"] == lineage.env_digest()
    # Processes of one environment started as Dagster's may be (`python -c` or a code server
    # from the checkout: the checkout, and its stale *.egg-info, twice on sys.path) agree too.
    probe = "from ops.lineage import env_digest; print(env_digest())"
    for where in (REPO_ROOT, cwd):
        digest = subprocess.run([sys.executable, "-c", probe], cwd=where, env=env, capture_output=True, text=True,
                                check=True).stdout.strip()
        assert digest == run.data.tags["env_digest"], where
