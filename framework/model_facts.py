"""``ModelFacts``: what the parts outside the Scheduler need to know about the served model.

The Scheduler (rank 0 of the first replica) learns them when it loads the model and sends
them once, in its ready message; the start-up front hands them to the TokenizerManager
(``TokenizerManager.start``) and to the HTTP routes (``ServerState.model``), which read
them from there and nowhere else.
"""

from __future__ import annotations

import msgspec


class ModelFacts(msgspec.Struct, frozen=True, kw_only=True):
    """The served model as the Scheduler found it.

    ``context_len`` is the longest sequence served (the model's, or ``--context-length``);
    ``vocab_size`` bounds the token ids a request may give; ``is_embedding`` says whether
    the model serves embeddings rather than text; ``hidden_size`` is the length of its
    embeddings.
    """

    context_len: int
    vocab_size: int
    is_embedding: bool
    hidden_size: int
