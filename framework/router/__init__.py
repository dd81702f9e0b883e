"""``framework router``: a cache-aware HTTP router in front of OpenAI-compatible servers."""
