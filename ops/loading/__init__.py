"""What a rank reads and in which order: the deterministic, resumable sample order and the clip loader."""
