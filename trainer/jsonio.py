"""The run's JSON files (final.json, samples/rank_R.json, ...): strict JSON, written atomically."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from datetime import datetime, UTC
from pathlib import Path
from typing import Any


def iso_time(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, tz=UTC).isoformat()


def json_safe(value: Any) -> Any:
    """Non-finite floats become null: strict JSON readers (jq, JavaScript) reject NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def write_json_atomic(path: Path, record: Mapping[str, Any]) -> None:
    """Write then rename, so a reader sees the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(json_safe(record), indent=2, allow_nan=False))
    os.replace(tmp, path)
