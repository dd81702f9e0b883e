"""Loading a Hugging Face tokenizer from a local model directory, never from the network."""

from __future__ import annotations

import os
from typing import Any

# Any one of these marks a directory as holding a tokenizer that transformers can load.
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
    "tiktoken.model",
)


def load_tokenizer(path: str) -> Any:
    """Load the tokenizer stored in the directory ``path`` with ``transformers.AutoTokenizer``.

    Only local files are read. Raises ``ValueError`` when ``path`` is not a
    directory, holds no tokenizer files, or transformers cannot build a
    tokenizer from them.
    """
    if not os.path.isdir(path):
        raise ValueError(f"tokenizer path {path!r} is not a directory")
    present = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(path, name))]
    if not present:
        raise ValueError(
            f"no tokenizer files in {path!r}: expected at least one of {', '.join(TOKENIZER_FILES)}"
        )
    # Imported here so that importing the runtime does not pay for transformers.
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers and the Rust tokenizers raise assorted types
        raise ValueError(
            f"cannot load a tokenizer from {path!r} (found {', '.join(present)}): {exc}"
        ) from exc
