"""The check that a model directory is one, without importing torch (the launcher runs it)."""

from __future__ import annotations

from pathlib import Path


def check_model_dir(model_path: str | Path) -> Path:
    """The model directory as a ``Path``; ``ValueError`` if it is missing or has no config.json."""
    path = Path(model_path)
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist")
    if not path.is_dir():
        raise ValueError(f"model path {str(path)!r} is not a directory")
    if not (path / "config.json").is_file():
        raise ValueError(f"no config.json in model directory {str(path)!r}")
    return path
