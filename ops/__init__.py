"""Plain-Python building blocks of Trainyard: no Dagster imports here.

Every Dagster asset in ``assets/`` and every ``trainyard`` CLI command calls into these
modules, so the same code path is tested once and used everywhere.
"""
