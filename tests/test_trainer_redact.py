"""Tests of trainer/launch/redact.py: secret config fields and credential-like environment values never
survive into a redacted config, a redacted text, or a log line (traceback included).

Run: python -m pytest tests/test_trainer_redact.py -q
"""

from __future__ import annotations

import io
import json
import logging

import pytest

from trainer.launch.config import load_config
from trainer.launch.redact import REDACTED, Redactor, RedactingFilter, redact_text, redacted_dict

ENV_SECRET = "s3cr3t-xyz-env"
FIELD_SECRET = "tok-field-98765"


@pytest.fixture
def planted(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TRAINYARD_TEST_SECRET_TOKEN", ENV_SECRET)
    monkeypatch.setenv("TRAINYARD_TEST_PLAIN", "not-a-secret-value")
    return load_config(None, ["preset=tiny_cpu", f"train.run_dir=/runs/{ENV_SECRET}/a",
                              f"data.storage_token={FIELD_SECRET}", f"name=exp-{ENV_SECRET}"])


def test_redacted_dict_hides_secret_fields_and_env_secret_values(planted) -> None:
    record = redacted_dict(planted)
    text = json.dumps(record)
    assert ENV_SECRET not in text and FIELD_SECRET not in text
    assert record["data"]["storage_token"] == REDACTED
    assert record["name"] == f"exp-{REDACTED}"
    assert record["train"]["run_dir"] == f"/runs/{REDACTED}/a"
    assert record["model"]["dim"] == planted.model.dim  # everything else intact


def test_secret_field_value_is_scrubbed_from_other_fields_and_text(planted) -> None:
    planted.name = f"copied-{FIELD_SECRET}"
    assert FIELD_SECRET not in json.dumps(redacted_dict(planted))
    assert redact_text(f"error at {FIELD_SECRET} and {ENV_SECRET}", planted) == "error at *** and ***"


def test_repr_of_config_does_not_show_secret_fields(planted) -> None:
    assert FIELD_SECRET not in repr(planted)


def test_env_names_decide_and_short_values_are_only_replaced_whole() -> None:
    environ = {"MY_API_KEY": "key-123456", "DB_PASSWORD": "pw", "HOME": "/home/someone"}
    redactor = Redactor.for_config(None, environ=environ)
    assert redactor.text("k=key-123456") == "k=***"
    assert redactor.text("/home/someone/x") == "/home/someone/x"  # HOME is not credential-like
    assert redactor.value({"a": "pw", "b": "pwd-ok", "n": ["key-123456"]}) == {
        "a": REDACTED, "b": "pwd-ok", "n": [REDACTED]}


def test_numeric_secret_in_a_numeric_field_is_replaced() -> None:
    redactor = Redactor(["424242"])
    assert redactor.value({"pin": 424242, "steps": 5, "flag": True}) == {
        "pin": REDACTED, "steps": 5, "flag": True}


def test_logging_filter_redacts_messages_args_and_tracebacks(planted) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RedactingFilter(Redactor.for_config(planted)))
    logger = logging.getLogger("trainer.test_redact")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("token %s", FIELD_SECRET)
        try:
            raise RuntimeError(f"cannot open bucket with {ENV_SECRET}")
        except RuntimeError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    output = stream.getvalue()
    assert "token ***" in output and "RuntimeError: cannot open bucket with ***" in output
    assert FIELD_SECRET not in output and ENV_SECRET not in output


# ---------------------------------------------------------------------------------------------
# Secret fields in overrides (trainer/launch/config.py): only by reference to the environment


def test_secret_field_paths_come_from_the_config_tree() -> None:
    from trainer.launch.config import secret_field_paths

    assert "data.storage_token" in secret_field_paths()
    assert "train.steps" not in secret_field_paths()


@pytest.mark.parametrize("override", [f"data.storage_token={FIELD_SECRET}", f" data.storage_token ={FIELD_SECRET}"])
def test_literal_secret_override_is_refused_without_repeating_it(override: str) -> None:
    from trainer.launch.config import LiteralSecretError, check_no_literal_secrets

    with pytest.raises(LiteralSecretError) as refused:
        check_no_literal_secrets(["train.steps=3", override])
    assert "data.storage_token" in str(refused.value) and "dg.EnvVar('MY_TOKEN')" in str(refused.value)
    assert FIELD_SECRET not in str(refused.value)


def test_secret_by_environment_reference_or_empty_is_accepted() -> None:
    from trainer.launch.config import check_no_literal_secrets, env_reference

    check_no_literal_secrets([f"data.storage_token={env_reference('MY_TOKEN')}", "data.storage_token=",
                              f"name={FIELD_SECRET}"])  # a non-secret field is the redactor's business
    with pytest.raises(ValueError) as refused:
        env_reference(FIELD_SECRET)  # not a variable name: perhaps the secret itself, so never echoed
    assert FIELD_SECRET not in str(refused.value)


def test_overrides_file_must_be_private(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from resources.launcher import write_overrides_file
    from trainer.launch.config import read_overrides_file

    monkeypatch.setenv("MY_TOKEN", FIELD_SECRET)
    path = write_overrides_file(tmp_path / "o.json", ["data.storage_token=${env:MY_TOKEN}", "train.steps=2"])
    assert path.stat().st_mode & 0o777 == 0o600
    overrides = read_overrides_file(path)
    assert load_config(None, ["preset=tiny_cpu", *overrides]).data.storage_token == FIELD_SECRET
    path.chmod(0o644)
    with pytest.raises(ValueError, match="readable by its owner only"):
        read_overrides_file(path)


# ---------------------------------------------------------------------------------------------
# Review 11: the overrides file is 0600 whatever was planted next to it


def _old_predictable_tmp(path):
    """The temporary name the launcher used to write through (``.<name>.tmp-<pid>``): guessable."""
    import os

    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def test_a_planted_world_readable_tmp_cannot_widen_the_overrides_file(tmp_path) -> None:
    from resources.launcher import write_overrides_file

    target = tmp_path / "launch" / "run.overrides.json"
    target.parent.mkdir()
    planted = _old_predictable_tmp(target)
    planted.write_text("planted")
    planted.chmod(0o644)
    write_overrides_file(target, ["data.storage_token=${env:MY_TOKEN}"])
    assert target.stat().st_mode & 0o777 == 0o600
    assert json.loads(target.read_text()) == ["data.storage_token=${env:MY_TOKEN}"]
    assert planted.read_text() == "planted"  # not reused, not written through
    leftovers = {item.name for item in target.parent.iterdir()} - {target.name, planted.name}
    assert not leftovers, leftovers


def test_a_planted_symlink_cannot_redirect_the_overrides(tmp_path) -> None:
    from resources.launcher import write_overrides_file

    victim = tmp_path / "elsewhere" / "world-readable.txt"
    victim.parent.mkdir()
    victim.write_text("untouched")
    victim.chmod(0o644)
    target = tmp_path / "launch" / "run.overrides.json"
    target.parent.mkdir()
    _old_predictable_tmp(target).symlink_to(victim)
    target.symlink_to(victim)  # a link at the final name is replaced, never written through
    write_overrides_file(target, ["train.steps=2", "data.storage_token=${env:MY_TOKEN}"])
    assert victim.read_text() == "untouched" and victim.stat().st_mode & 0o777 == 0o644
    assert not target.is_symlink() and target.stat().st_mode & 0o777 == 0o600
    assert json.loads(target.read_text()) == ["train.steps=2", "data.storage_token=${env:MY_TOKEN}"]


def test_the_trainer_refuses_an_overrides_file_that_is_a_symlink(tmp_path) -> None:
    """Even a 0600 target: the launcher never writes a link, so a link there is not its file."""
    from trainer.launch.config import read_overrides_file

    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps(["train.steps=999"]))
    elsewhere.chmod(0o600)
    link = tmp_path / "run.overrides.json"
    link.symlink_to(elsewhere)
    with pytest.raises(ValueError, match="overrides file is a symlink"):
        read_overrides_file(link)
