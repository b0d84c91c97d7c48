"""Deterministic split assignment by source group.

Every clip of one source group lands in the same split, so near-duplicate frames of one
recording never straddle train and evaluation. The split depends only on (group, seed,
ratios): adding media never moves an existing group.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


def _default_ratios() -> dict[str, float]:
    return {"train": 0.8, "val": 0.1, "test": 0.1}


@dataclass(kw_only=True, slots=True, frozen=True)
class SplitConfig:
    ratios: dict[str, float] = field(default_factory=_default_ratios)
    """Split name -> fraction of source groups; fractions sum to 1."""
    seed: int = 0
    """Salt of the group hash: a new seed reshuffles groups across splits."""

    def __post_init__(self) -> None:
        if not self.ratios:
            raise ValueError("SplitConfig.ratios must name at least one split")
        if any(value < 0 for value in self.ratios.values()):
            raise ValueError(f"SplitConfig.ratios must be non-negative, got {self.ratios}")
        if abs(sum(self.ratios.values()) - 1.0) > 1e-6:
            raise ValueError(f"SplitConfig.ratios must sum to 1, got {sum(self.ratios.values())}")


def group_fraction(group: str, seed: int) -> float:
    """Uniform value in [0, 1) from sha256, stable across machines and Python versions."""
    digest = hashlib.sha256(f"{seed}\x00{group}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def assign_split(group: str, config: SplitConfig) -> str:
    """Split of ``group``: the bucket of cumulative ratios (in sorted-name order) its fraction falls in."""
    value = group_fraction(group, config.seed)
    cumulative = 0.0
    names = sorted(config.ratios)
    for name in names:
        cumulative += config.ratios[name]
        if value < cumulative:
            return name
    return names[-1]  # float rounding at the top edge
