"""Secrets never reach a record: redaction of configs, text and log lines.

Resolved configs go to final.json, logs, and later MLflow and Dagster metadata, so everything
recorded passes through here. Two kinds of secret:

1. config fields marked `field(metadata={"secret": True}, repr=False)` (e.g. data.storage_token):
   `redacted_dict` shows them as "***", and their values are scrubbed from any text;
2. values of environment variables whose NAME contains TOKEN, SECRET, KEY, PASSWORD, PASSWD or
   CREDENTIAL (any case): scrubbed wherever they appear inside a recorded string or value.

3. credentials inside any URI, whatever variable, field or message holds it: the userinfo of
   ``scheme://user:password@host`` (http, https, s3, postgresql+psycopg2, ...), and the values of
   query or fragment parameters whose names look like credentials (``?token=``, ``X-Amz-Signature``,
   ``X-Amz-Credential``, ``password=``, ``sig=``, ``#access_token=``): `redact_uri`. The
   environment's URIs also give their credentials (and their percent-decoded forms) as secrets of
   kind 2, so a password an error message shows outside its URI is scrubbed as well.

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
from urllib.parse import unquote

REDACTED = "***"
SECRET_ENV_NAME = re.compile(r"TOKEN|SECRET|KEY|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
MIN_SCRUB_CHARS = 6
# A URI: a scheme, "://", and everything up to a blank or a quote (a URI holds neither unencoded).
URI = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<rest>[^\s\"'<>`]+)")
# Query and fragment parameters that carry credentials (any case; X-Amz-*, Azure's sig, OAuth's tokens).
SECRET_PARAM = re.compile(r"token|secret|passw|pwd|passphrase|signature|^sig$|credential|key|auth|session|jwt|bearer",
                          re.IGNORECASE)
_PARAM = re.compile(r"(?P<name>[^=&;#?]+)=(?P<value>[^&;#]*)")


def is_secret_field(field: dataclasses.Field) -> bool:
    return bool(field.metadata.get("secret"))


def secret_env_values(environ: Mapping[str, str] | None = None) -> set[str]:
    """Values of the environment variables whose names look like credentials, and the credentials
    inside any variable's URIs (MLFLOW_TRACKING_URI=http://user:password@host gives "password")."""
    environ = os.environ if environ is None else environ
    found = {value for name, value in environ.items() if value and SECRET_ENV_NAME.search(name)}
    for value in environ.values():
        if "://" in value:
            found |= uri_credentials(value)
    return found


def _userinfo(rest: str) -> str:
    """The userinfo of a URI's part after "://", or "". RFC 3986 ends the authority at the first
    "/", "?" or "#", and the userinfo at its last "@"; a password holding an unencoded "/", "?" or
    "#" (as people type them) is taken too: "user:pa/ss@host", where what follows ":" is no port."""
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if "@" in authority:
        return authority.rpartition("@")[0]
    loose = re.match(r"[^/?#@:]*:[^@\s]*@", rest)
    if loose and not re.match(r"[0-9]*(?:[/?#]|$)", loose.group(0).partition(":")[2]):
        return loose.group(0)[:-1]
    return ""


def uri_credentials(text: str) -> set[str]:
    """The credentials of every URI in ``text``: each userinfo, its password, their percent-decoded
    forms, and the values of credential-like query and fragment parameters."""
    found: set[str] = set()
    for match in URI.finditer(text):
        rest = match.group("rest")
        userinfo = _userinfo(rest)
        if userinfo:
            password = userinfo.partition(":")[2]
            found |= {userinfo, unquote(userinfo)} | ({password, unquote(password)} if password else set())
        for part in re.split(r"[?#]", rest[len(userinfo):], maxsplit=0)[1:]:
            for param in _PARAM.finditer(part):
                if SECRET_PARAM.search(unquote(param.group("name"))) and param.group("value"):
                    found |= {param.group("value"), unquote(param.group("value"))}
    return {secret for secret in found if secret}


def redact_uri(uri: str) -> str:
    """``uri`` (or any text holding URIs) with userinfo and credential-like parameters as "***":
    ``https://***@host/db?user=a&password=***``. Scheme, host, port, path and other parameters stay,
    so the record still says which store it was."""
    return URI.sub(_redact_one_uri, uri)


def _redact_one_uri(match: re.Match[str]) -> str:
    rest = match.group("rest")
    userinfo = _userinfo(rest)
    if userinfo:
        rest = f"{REDACTED}@{rest[len(userinfo) + 1:]}"
    cut = re.search(r"[?#]", rest)
    if cut:
        rest = rest[:cut.start()] + _PARAM.sub(_redact_param, rest[cut.start():])
    return match.group("scheme") + rest


def _redact_param(param: re.Match[str]) -> str:
    if param.group("value") and SECRET_PARAM.search(unquote(param.group("name"))):
        return f"{param.group('name')}={REDACTED}"
    return param.group(0)


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


# ---------------------------------------------------------------------------------------------
# Literal secrets in overrides, whatever the key's case, separators or nesting


def normalized_key(key: str) -> str:
    """A config key as the literal-secret check compares it: ``Storage-Token``, ``storageToken``,
    `` STORAGE_TOKEN `` and ``storage token`` are all ``storage_token``."""
    key = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", str(key).strip())
    return re.sub(r"[\s_-]+", "_", key.casefold()).strip("_")


def is_env_reference(value: object) -> bool:
    return isinstance(value, str) and re.fullmatch(r"\$\{env:[A-Za-z_][A-Za-z0-9_]*\}", value.strip()) is not None


def literal_secret_keys_in(overrides: Iterable[str], secret_paths: Iterable[str]) -> list[str]:
    """Keys of ``overrides`` ("a.b=c") that give a secret field a literal value, compared after
    ``normalized_key``: at the override's own key (``Data.Storage_Token=x``, ``data.storage_token.x=y``)
    or anywhere inside a value that is a mapping or a list (``data={storage_token: x}``,
    ``data=[{"Storage-Token": x}]``). A value that cannot be parsed is refused when it names a
    secret field at all: the trainer could not load it, but the run config that holds it is stored."""
    leaves = {normalized_key(path.rpartition(".")[2]) for path in secret_paths}
    found = []
    for override in overrides:
        key, _, value = override.partition("=")
        parts = [normalized_key(part) for part in key.split(".")]
        if any(part in leaves for part in parts) and value.strip() and not is_env_reference(value):
            found.append(key.strip())
        else:
            found += [f"{key.strip()}.{nested}" for nested in _nested_literal_secrets(value, leaves)]
    return found


_MAX_PARSED_VALUE_CHARS = 65536


def _nested_literal_secrets(value: str, leaves: set[str]) -> list[str]:
    """Paths inside a YAML/JSON override value whose key is a secret field's and whose value is a
    literal. A value that cannot be parsed gives "(value)" when it names a secret field or holds an
    escape (``"storage\\u005ftoken"`` is ``storage_token`` to a parser): it is not read, so not trusted."""
    import yaml

    try:
        if len(value) > _MAX_PARSED_VALUE_CHARS:
            raise ValueError("too long to parse")
        parsed = yaml.safe_load(value)
    except (yaml.YAMLError, ValueError, RecursionError):
        named = "\\" in value or any(leaf in normalized_key(value) for leaf in leaves)
        return ["(value)"] if named else []
    found, seen, stack = [], set(), [("", parsed)]
    while stack:  # iterative, each container once: an alias bomb or deep nesting costs its size only
        path, node = stack.pop()
        if id(node) in seen or not isinstance(node, (dict, list)):
            continue
        seen.add(id(node))
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, item in items:
            child = f"{path}.{key}" if path else str(key)
            named = any(normalized_key(part) in leaves for part in str(key).split("."))
            if named and item not in (None, "") and not is_env_reference(item):
                found.append(child)
            stack.append((child, item))
    return sorted(found)


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
        return redact_uri(text) if "://" in text else text

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
