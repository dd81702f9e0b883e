"""Benchmark harnesses behind ``framework bench ...``, each measuring one seam of the runtime."""
