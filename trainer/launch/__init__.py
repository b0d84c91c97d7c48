"""Before torchrun starts, with no torch imported: the config, preflight, memory estimate, redaction, launch record."""
