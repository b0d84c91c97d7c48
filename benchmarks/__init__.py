"""Side-by-side benchmarks: ``python -m benchmarks.<name>`` prints one JSON object as its last line."""
