"""Model building blocks: TP-aware linear and embedding layers, RoPE, norms, attention."""
