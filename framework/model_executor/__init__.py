"""Running a model: its configuration, weight loading, and the per-device ModelRunner."""
