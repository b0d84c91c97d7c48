"""Dagster Definitions: jobs, schedules, sensors and resource sets per environment."""
