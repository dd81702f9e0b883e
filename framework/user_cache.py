"""Where the runtime keeps what it can reuse across runs: ``$XDG_CACHE_HOME/framework``."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir(name: str) -> Path:
    """``name``'s directory under the user's cache (``~/.cache/framework/NAME`` by default)."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "framework" / name
