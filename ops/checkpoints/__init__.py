"""Checkpoints as published artifacts: commit with a record written last, verify, sign, mirror."""
