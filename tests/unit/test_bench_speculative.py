"""`framework bench speculative` on the default model and its draft: every row measured and
written, with the accepted lengths of the speculative ones."""

from __future__ import annotations

import json
from pathlib import Path

from framework.bench.speculative import MODES, STREAMS, WORKLOADS, Settings, run_benchmark


def test_every_mode_workload_and_stream_count_is_measured_and_written(tmp_path: Path) -> None:
    settings = Settings(output_len=6, rounds=1, launch_mode="thread")
    json_path, md_path = run_benchmark(settings, str(tmp_path))
    result = json.loads(json_path.read_text())
    assert result["commit"] and result["machine"] and result["draft_model"] == "default-draft"
    rows = {(r["mode"], r["workload"], r["streams"]): r for r in result["rows"]}
    assert set(rows) == {(m, w, s) for m in MODES for w in WORKLOADS for s in STREAMS}
    assert all(r["output_tokens_per_s"] > 0 for r in rows.values())
    # Plain decoding verifies nothing; the speculative rows gain at least their own token.
    for (mode, _, _), row in rows.items():
        if mode == "plain":
            assert row["accept_length"] is None
        else:
            assert row["accept_length"] >= 1
    table = md_path.read_text()
    assert "| repeat | 8 | draft |" in table and "| free | 1 | ngram |" in table
