"""Media on disk or in a store: scan, probe under limits, decode and encode, sidecars and metadata tables."""
