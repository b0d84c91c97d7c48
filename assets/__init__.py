"""Thin Dagster assets and asset checks over the plain modules in ``ops/``."""

import warnings

import dagster as dg

# Output(data_version=...) is Dagster's documented way to report a content version; it is
# marked beta, and the warning on every materialization would drown real messages.
warnings.filterwarnings("ignore", message=r"Parameter `data_version`", category=dg.BetaWarning)
