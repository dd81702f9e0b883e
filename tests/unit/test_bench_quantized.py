"""`framework bench quantized` on a tiny model: every format measured and written."""

from __future__ import annotations

import json
from pathlib import Path

from framework.bench.quantized import Settings, run_benchmark


def test_every_format_is_measured_and_written_with_its_bytes(tmp_path: Path) -> None:
    settings = Settings(layers=1, hidden=64, intermediate=128, group_size=32, output_len=2,
                        single_requests=1, rounds=1, launch_mode="thread")
    json_path, md_path = run_benchmark(settings, str(tmp_path))
    result = json.loads(json_path.read_text())
    assert result["commit"] and result["machine"]
    rows = {(r["format"], r["streams"]): r for r in result["rows"]}
    assert set(rows) == {(f, s) for f in ("float32", "int8", "gptq", "int8, cpu_a8",
                                          "gptq, cpu_a8", "int8, int8 tables",
                                          "gptq, int8 tables, cpu_a8") for s in (1, 64)}
    assert all(r["output_tokens_per_s"] > 0 for r in rows.values())
    # The projections shrink to a quarter (int8) and about an eighth (4-bit) of float32's
    # bytes; the float embeddings and norms stay.
    float_bytes = rows[("float32", 1)]["weight_bytes"]
    assert float_bytes > rows[("int8", 1)]["weight_bytes"] > rows[("gptq", 1)]["weight_bytes"]
    # An int8 LM head and table hold a quarter of their float bytes (plus a scale a row).
    assert rows[("int8", 1)]["weight_bytes"] > rows[("int8, int8 tables", 1)]["weight_bytes"]
    assert (rows[("gptq", 1)]["weight_bytes"]
            > rows[("gptq, int8 tables, cpu_a8", 1)]["weight_bytes"])
    assert "| gptq | 64 |" in md_path.read_text()


def test_fp8_formats_are_measured_when_asked_for(tmp_path: Path) -> None:
    settings = Settings(layers=1, hidden=64, intermediate=128, output_len=2, single_requests=1,
                        rounds=1, launch_mode="thread", formats=("fp8", "fp8_block"))
    json_path, _ = run_benchmark(settings, str(tmp_path))
    rows = {(r["format"], r["streams"]): r for r in json.loads(json_path.read_text())["rows"]}
    assert set(rows) == {(f, s) for f in ("float32", "fp8", "fp8, cpu_a8",
                                          "fp8, blocks of 128") for s in (1, 64)}
    # One byte a weight, and a scale a row (per channel) or per block.
    float_bytes = rows[("float32", 1)]["weight_bytes"]
    fp8_bytes = rows[("fp8", 1)]["weight_bytes"]
    assert float_bytes > fp8_bytes == rows[("fp8, cpu_a8", 1)]["weight_bytes"]
    assert float_bytes > rows[("fp8, blocks of 128", 1)]["weight_bytes"]


def test_a_mixtral_s_experts_are_measured_quantized(tmp_path: Path) -> None:
    settings = Settings(layers=1, hidden=64, intermediate=64, output_len=2, single_requests=1,
                        rounds=1, launch_mode="thread", formats=("int8",), arch="mixtral",
                        experts=4)
    json_path, _ = run_benchmark(settings, str(tmp_path))
    result = json.loads(json_path.read_text())
    assert "Mixtral" in result["model"] and "4 experts" in result["model"]
    rows = {(r["format"], r["streams"]): r for r in result["rows"]}
    # The experts (4 x 3 x 64 x 64 floats: 196,608 bytes) and the attention (4 x 64 x 64:
    # 65,536) shrink to about a quarter; the embeddings, head, norms and router stay.
    saved = rows[("float32", 1)]["weight_bytes"] - rows[("int8", 1)]["weight_bytes"]
    assert saved > 0.7 * (196_608 + 65_536)
