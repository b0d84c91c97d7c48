"""Proof that recovery works: the restore drill, the fault drill, run health and the report computations."""
