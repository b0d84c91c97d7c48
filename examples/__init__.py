"""Models written the way a lab writes its own, trained through Trainyard's stages unchanged (docs/training.md)."""
