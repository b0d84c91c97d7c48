"""What a rank reports: hooks, step metrics, MLflow tracking, Dagster Pipes, Prometheus, the host record."""
