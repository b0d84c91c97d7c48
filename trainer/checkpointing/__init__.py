"""The trainer's side of checkpoints: DCP save and restore of the app state, to a run folder or a store."""
