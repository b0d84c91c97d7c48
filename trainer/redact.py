"""Secrets never reach a record: redaction of configs, text and log lines.

Resolved configs go to final.json, logs, and later MLflow and Dagster metadata, so everything
recorded passes through here. Two kinds of secret:

1. config fields marked `field(metadata={"secret": True}, repr=False)` (e.g. data.storage_token):
   `redacted_dict` shows them as "***", and their values are scrubbed from any text;
2. values of environment variables whose NAME contains TOKEN, SECRET, KEY, PASSWORD, PASSWD or
   CREDENTIAL (any case): scrubbed wherever they appear inside a recorded string or value.

Scrubbing replaces every occurrence of a secret inside a string. A secret shorter than
`MIN_SCRUB_CHARS` is replaced only where a whole value equals it: substring-replacing a value
like "1" or "true" would garble every record while protecting nothing worth the name.
The environment is read when redacting, never at import.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

REDACTED = "***"
SECRET_ENV_NAME = re.compile(r"TOKEN|SECRET|KEY|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
MIN_SCRUB_CHARS = 6


def is_secret_field(field: dataclasses.Field) -> bool:
    return bool(field.metadata.get("secret"))


def secret_env_values(environ: Mapping[str, str] | None = None) -> set[str]:
    """Values of the environment variables whose names look like credentials."""
    environ = os.environ if environ is None else environ
    return {value for name, value in environ.items() if value and SECRET_ENV_NAME.search(name)}


def secret_field_values(config: Any) -> set[str]:
    """Non-empty values of secret-marked fields anywhere in a dataclass tree."""
    found: set[str] = set()
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        for field in dataclasses.fields(config):
            value = getattr(config, field.name)
            if is_secret_field(field) and value:
                found.add(str(value))
            found |= secret_field_values(value)
    return found


class Redactor:
    """Replaces a fixed set of secret strings by "***" in text and in nested values."""

    def __init__(self, secrets: Iterable[str]) -> None:
        # Longest first, so a secret that contains another is replaced whole.
        self.secrets = sorted({secret for secret in secrets if secret}, key=len, reverse=True)

    @classmethod
    def for_config(cls, config: Any = None, *, environ: Mapping[str, str] | None = None) -> Redactor:
        """Secrets of config's secret fields plus those of the (current) environment."""
        return cls(secret_field_values(config) | secret_env_values(environ))

    def text(self, text: str) -> str:
        if text in self.secrets:
            return REDACTED
        for secret in self.secrets:
            if len(secret) >= MIN_SCRUB_CHARS:
                text = text.replace(secret, REDACTED)
        return text

    def value(self, value: Any) -> Any:
        """A copy of a JSON-like value (dict, list, tuple, scalars) with secrets replaced."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            return {self.text(str(key)): self.value(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.value(item) for item in value]
        if value is not None and not isinstance(value, bool) and str(value) in self.secrets:
            return REDACTED  # e.g. a numeric PIN held in an int field
        return value


def redacted_dict(config: Any, *, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """config (a dataclass) as a plain dict that is safe to record anywhere."""
    redactor = Redactor.for_config(config, environ=environ)
    return redactor.value(_to_dict(config))


def _to_dict(config: Any) -> Any:
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {field.name: (REDACTED if is_secret_field(field) and getattr(config, field.name)
                             else _to_dict(getattr(config, field.name)))
                for field in dataclasses.fields(config)}
    if isinstance(config, (list, tuple)):
        return [_to_dict(item) for item in config]
    return config


def redact_text(text: str, config: Any = None, *, environ: Mapping[str, str] | None = None) -> str:
    """text with config's secret values and the environment's secret values replaced."""
    return Redactor.for_config(config, environ=environ).text(text)


class RedactingFilter(logging.Filter):
    """Handler filter: the formatted message and any traceback pass through a Redactor.

    Attach it to handlers, not loggers: logger filters skip records propagated from children.
    """

    def __init__(self, redactor: Redactor) -> None:
        super().__init__()
        self.redactor = redactor

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = self.redactor.text(record.getMessage())
        record.args = None
        if record.exc_info:
            formatted = logging.Formatter().formatException(record.exc_info)
            record.exc_text = self.redactor.text(formatted)
            record.exc_info = None
        if record.stack_info:
            record.stack_info = self.redactor.text(record.stack_info)
        return True
