"""The tokenizer class ``AutoTokenizer`` picked for a directory, remembered across starts.

To pick a class, ``AutoTokenizer`` reads the model's configuration through
transformers' configuration classes, which import torch and much of
transformers: seconds of a process's start, and on a server's critical path
(the HTTP process and the Detokenizer wait for the Scheduler's choice, so as
not to import torch themselves). The choice depends only on the directory's
files and on the transformers release, so once made it is kept under the
user's cache (``~/.cache/framework/tokenizer_classes``), keyed by a hash of
those: the release, the names of the directory's files, and the content of
the files the choice reads (``config.json``, ``tokenizer_config.json``,
``tokenizer.json``). A later start with the same files finds it at once.
A cache that cannot be read or written is no error: the choice is made again.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import tempfile
from pathlib import Path

from framework.user_cache import user_cache_dir

# The files whose content can change AutoTokenizer's choice (the others count by name).
_READ_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json")


def remembered_tokenizer_class(path: str) -> str | None:
    """The class (``"module:Name"``) picked before for the directory ``path`` as it is now."""
    entry = _entry(path)
    if entry is None:
        return None
    with contextlib.suppress(OSError, UnicodeDecodeError):
        name = entry.read_text(encoding="utf-8").strip()
        return name or None
    return None


def remember_tokenizer_class(path: str, name: str) -> None:
    """Keep ``name`` as the class picked for the directory ``path`` as it is now."""
    entry = _entry(path)
    if entry is None:
        return
    with contextlib.suppress(OSError):
        entry.parent.mkdir(parents=True, exist_ok=True)
        # Written aside and renamed: a concurrent reader sees the whole name or nothing.
        fd, temporary = tempfile.mkstemp(dir=entry.parent, prefix=".tmp-")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(name)
        os.replace(temporary, entry)


def _entry(path: str) -> Path | None:
    """The cache file for the directory's current files; None if it cannot be listed."""
    key = hashlib.sha256()
    try:
        key.update(importlib.metadata.version("transformers").encode())
        names = sorted(os.listdir(path))
        key.update("\0".join(names).encode())
        for name in _READ_FILES:
            if name in names:
                key.update(name.encode() + b"\0" + Path(path, name).read_bytes())
    except (OSError, importlib.metadata.PackageNotFoundError):
        return None
    return user_cache_dir("tokenizer_classes") / key.hexdigest()[:32]
