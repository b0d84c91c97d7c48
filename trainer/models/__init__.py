"""The model protocol the platform trains through, and the built-in video model."""
