"""Helpers that turn plain results into Dagster metadata (tables as Markdown, lineage fields)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import dagster as dg

from ops.lineage import Lineage


def markdown_table(rows: Iterable[Mapping], columns: list[str], *, limit: int = 50) -> dg.MetadataValue:
    rows = list(rows)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows[:limit]:
        cells = [str(row.get(column, "")).replace("|", "\\|").replace("\n", " ") for column in columns]
        lines.append("| " + " | ".join(cells) + " |")
    if len(rows) > limit:
        lines.append(f"\n{len(rows) - limit} more rows not shown.")
    return dg.MetadataValue.md("\n".join(lines) if rows else "_none_")


def counts_table(counts: Mapping[str, int], key: str = "reason") -> dg.MetadataValue:
    return markdown_table([{key: name, "count": count} for name, count in counts.items()], [key, "count"])


def lineage_metadata(record: Lineage) -> dict:
    """The seven lineage fields under their contract names (docs/design.md, "Lineage")."""
    return dict(record.as_metadata())
