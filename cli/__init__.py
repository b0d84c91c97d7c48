"""The ``trainyard`` command line: the same ``ops/`` code as the Dagster assets, for people outside Dagster."""
