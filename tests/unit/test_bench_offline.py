"""`framework bench offline`: a quick run writes its results, and both sides compute the same."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from framework.bench.offline import (
    CSV_COLUMNS,
    SIDES,
    CeilingSide,
    EngineSide,
    KVReadSide,
    OfflineBenchResult,
    OfflineBenchRow,
    OfflineBenchSettings,
    TransformersSide,
    ratios,
    run_benchmark,
    settings_from_args,
)
from framework.cli import build_parser
from framework.layers.linear_kernel import onednn_available

NEAR_TIE = 1e-3  # the project's rule for comparing greedy outputs (docs: DESIGN)


def agreed_length(hf_model: object, prompt: list[int], tokens: list[int]) -> int:
    """How many of transformers' ``tokens`` come before the first near-tie of its logits."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    top2 = logits.topk(2, dim=-1).values
    close = ((top2[:, 0] - top2[:, 1]) < NEAR_TIE).nonzero()
    return int(close[0]) if len(close) else len(tokens)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[OfflineBenchResult, Path]:
    """One quick run (Engine in threads over inproc), its output and model directories.

    With oneDNN, the Engine asks for it (``auto`` leaves an Intel CPU's products to MKL).
    """
    root = tmp_path_factory.mktemp("offline")
    model_dir, output_dir = root / "model", root / "results"
    model_dir.mkdir()
    linear_backend = "onednn" if onednn_available() else "auto"
    result = run_benchmark(OfflineBenchSettings.quick(), output_dir,
                           engine_args={"launch_mode": "thread", "transport": "inproc",
                                        "linear_backend": linear_backend},
                           model_dir=model_dir)
    return result, model_dir


def test_quick_run_writes_every_side_with_a_positive_rate(
        quick_run: tuple[OfflineBenchResult, Path]) -> None:
    result, _ = quick_run
    output_dir = result.paths[0].parent
    assert sorted(p.name for p in result.paths) == ["offline.csv", "offline.md"]
    with (output_dir / "offline.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    repeats = result.settings.repeats
    assert list(rows[0]) == [*CSV_COLUMNS, *(f"run_{i}_seconds" for i in range(1, repeats + 1))]
    assert [r["side"] for r in rows] == list(SIDES)
    for row in rows:
        runs = [float(row[f"run_{i}_seconds"]) for i in range(1, repeats + 1)]
        assert float(row["output_tokens_per_s"]) > 0
        assert float(row["best_seconds"]) == min(runs) > 0
    report = (output_dir / "offline.md").read_text()
    assert "Machine:" in report and "commit" in report
    assert "× transformers" in report and "of the ceiling" in report
    assert "of that bound" in report  # ceiling + kv_read
    # The Scheduler's step time of the best run, and the model forward's share of it.
    assert 0 < result.engine_forward_seconds < result.engine_step_seconds
    assert "non-model time" in report


def test_engine_and_transformers_produce_the_same_greedy_tokens(
        quick_run: tuple[OfflineBenchResult, Path]) -> None:
    from transformers import AutoModelForCausalLM

    result, model_dir = quick_run
    n, length = result.settings.num_prompts, result.settings.output_len
    assert len(result.engine_outputs) == len(result.transformers_outputs) == n
    assert all(len(t) == length for t in result.engine_outputs + result.transformers_outputs)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, engine, reference in zip(result.prompts, result.engine_outputs,
                                         result.transformers_outputs, strict=True):
        agreed = agreed_length(hf_model, prompt, reference)
        assert engine[:agreed] == reference[:agreed]
    # Near-ties aside, whole outputs match: on a few prompts at the very least.
    assert result.identical_outputs() >= min(3, n)


def test_the_ceiling_does_the_jobs_matrix_work_and_the_decode_ceiling_the_steps_alone(
        quick_run: tuple[OfflineBenchResult, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every prompt token in chunks up to the last layer's q/k/v, then one row per request.

    As in the Engine, the rest of a chunk's last layer and the head take one row
    per request in the chunk; decode steps take one row per prompt everywhere.
    """
    from transformers import AutoModelForCausalLM

    result, model_dir = quick_run
    settings = dataclasses.replace(result.settings, num_prompts=3, output_len=4)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    names = {id(module): name for name, module in hf_model.named_modules()}
    last = f"model.layers.{settings.layers - 1}."
    watched = ("model.layers.0.self_attn.q_proj", f"{last}self_attn.q_proj",
               f"{last}mlp.down_proj", "lm_head")
    prompts = [[1] * 5, [2] * 9, [3] * 3]  # 17 tokens: prompts end at rows 4, 13 and 16
    seen: dict[str, list[int]] = {name: [] for name in watched}
    project = CeilingSide._project

    def record(self: CeilingSide, module: Any, x: torch.Tensor) -> torch.Tensor:
        if names[id(module)] in seen:
            seen[names[id(module)]].append(x.shape[0])
        return project(self, module, x)

    monkeypatch.setattr(CeilingSide, "_project", record)
    CeilingSide(hf_model, settings, with_prefill=True, prefill_chunk=7).generate(prompts)
    steps = [3] * 3  # output_len - 1 decode steps of 3 rows
    assert seen[watched[0]] == seen[watched[1]] == [7, 7, 3, *steps]
    # Chunk one holds prompt one's end and prompt two's start, chunk two the rest of
    # prompt two, chunk three prompt three.
    assert seen[watched[2]] == seen[watched[3]] == [2, 1, 1, *steps]
    for rows in seen.values():
        rows.clear()
    decode_only = CeilingSide(hf_model, settings, with_prefill=False)
    decode_only.generate(prompts)
    assert all(rows == [3] * 4 for rows in seen.values())
    assert decode_only.name == "decode_ceiling"


@pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")
def test_the_ceiling_multiplies_on_the_engine_s_linear_backend(
        quick_run: tuple[OfflineBenchResult, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``onednn``, every product (7 per layer, and the head) takes a packed weight."""
    from transformers import AutoModelForCausalLM

    from framework.layers import linear_kernel

    result, model_dir = quick_run
    assert result.linear_backend == "onednn"  # as the fixture asked
    report = (result.paths[0].parent / "offline.md").read_text()
    assert "linear backend `onednn`" in report
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    plain = CeilingSide(hf_model, result.settings, with_prefill=False)
    packed = CeilingSide(hf_model, result.settings, with_prefill=False, linear_backend="onednn")
    assert plain.packed == {}
    calls: list[bool] = []
    linear = linear_kernel.linear
    monkeypatch.setattr(linear_kernel, "linear", lambda x, w, b, p: (
        calls.append(p is not None), linear(x, w, b, p))[1])
    with torch.inference_mode():
        expected = plain._step(plain.hidden)
        assert calls == [False] * (7 * result.settings.layers + 1)
        calls.clear()
        torch.testing.assert_close(packed._step(packed.hidden), expected, atol=1e-4, rtol=1e-4)
    assert calls == [True] * (7 * result.settings.layers + 1)


def test_kv_read_reads_each_decode_step_s_keys_and_values_once(
        quick_run: tuple[OfflineBenchResult, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Per step, per layer, a key and a value buffer: prompt tokens + prompts × step rows."""
    result, _ = quick_run
    settings = dataclasses.replace(result.settings, layers=2, output_len=4)
    side = KVReadSide(settings)
    side.warm_up([[1] * 5, [2] * 9, [3] * 3])
    read: list[tuple[int, ...]] = []
    sum_ = torch.Tensor.sum
    monkeypatch.setattr(torch.Tensor, "sum",
                        lambda self, *a, **k: (read.append(tuple(self.shape)), sum_(self))[1])
    side.generate([[1] * 5, [2] * 9, [3] * 3])
    width = settings.num_kv_heads * settings.hidden // settings.heads
    assert read == [(17 + 3 * step, width) for step in (1, 2, 3) for _ in range(4)]


def test_the_bound_adds_the_ceiling_s_and_kv_read_s_seconds() -> None:
    rows = [OfflineBenchRow(side, 120.0 / seconds, seconds, (seconds,))
            for side, seconds in (("engine", 4.0), ("transformers", 6.0), ("ceiling", 1.0),
                                  ("kv_read", 2.0))]
    gains = ratios(rows)
    assert gains["engine_of_bound"] == pytest.approx(3.0 / 4.0)
    assert gains["bound_vs_transformers"] == pytest.approx(6.0 / 3.0)


def test_dummy_weights_of_another_shape_and_dtype_run_on_both_sides(tmp_path: Path) -> None:
    """The GPU preset's path, small and on the CPU: no checkpoint, bfloat16, GQA, a
    vocabulary wider than the tokenizer's (ids it cannot show are generated too)."""
    settings = dataclasses.replace(OfflineBenchSettings.quick(), vocab=8192, kv_heads=1,
                                   intermediate=96, dtype="bfloat16", dummy_weights=True,
                                   repeats=1, num_prompts=8, output_len=6)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    result = run_benchmark(settings, tmp_path / "out", model_dir=model_dir,
                           engine_args={"launch_mode": "thread", "transport": "inproc"})
    assert not list(model_dir.glob("*.safetensors"))  # the shape only
    assert all(len(t) == 6 for t in result.engine_outputs + result.transformers_outputs)
    report = (tmp_path / "out" / "offline.md").read_text()
    assert "2 heads (1 key/value), intermediate 96, vocabulary 8,192, dummy" in report
    assert "bfloat16" in report and "not compared" in report


def test_data_parallel_replicas_share_the_threads_the_other_sides_get(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two Engine replicas of one thread each: both get requests, and transformers and the
    ceilings run on two threads."""
    replicas: list[dict[str, Any]] = []
    threads_seen: dict[str, int] = {}
    close = EngineSide.close

    def close_after_looking(self: EngineSide) -> None:
        replicas.extend(self.engine.get_server_info()["replicas"])
        close(self)

    def counting(side: type) -> None:
        generate = side.generate

        def generate_counting(self: Any, prompts: list[list[int]]) -> float:
            threads_seen[self.name] = torch.get_num_threads()
            return generate(self, prompts)

        monkeypatch.setattr(side, "generate", generate_counting)

    monkeypatch.setattr(EngineSide, "close", close_after_looking)
    for side in (TransformersSide, CeilingSide):
        counting(side)
    settings = dataclasses.replace(OfflineBenchSettings.quick(), dp_size=2, torch_threads=1,
                                   repeats=1, num_prompts=8, output_len=6)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    result = run_benchmark(settings, tmp_path / "out", model_dir=model_dir,
                           engine_args={"launch_mode": "thread", "transport": "inproc"})
    routed = [r["load"]["routed_requests"] for r in replicas]
    assert len(routed) == 2 and min(routed) > 0
    assert {r["torch_threads"] for r in replicas} == {1}
    assert result.threads == 2
    assert threads_seen == {"transformers": 2, "ceiling": 2, "decode_ceiling": 2}
    assert result.identical_outputs() >= 3
    assert 0 < result.engine_forward_seconds < result.engine_step_seconds
    report = (tmp_path / "out" / "offline.md").read_text()
    assert "2 torch threads on every side, the Engine's as 2 data-parallel replicas of 1" \
        in report
    assert "summed over its 2 replicas" in report


def test_a_mixtral_shape_runs_and_its_checkpoint_runs_again_by_path(tmp_path: Path) -> None:
    """``arch="mixtral"`` writes a sparse-MoE checkpoint both sides agree on; ``model_path``
    runs that checkpoint as it is, its config overriding the shape settings."""
    settings = dataclasses.replace(OfflineBenchSettings.quick(), arch="mixtral", num_experts=4,
                                   top_k=2, intermediate=96, repeats=1, num_prompts=8,
                                   output_len=6)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    engine_args = {"launch_mode": "thread", "transport": "inproc"}
    result = run_benchmark(settings, tmp_path / "out", model_dir=model_dir,
                           engine_args=engine_args)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"],
            config["intermediate_size"]) == (4, 2, 96)
    assert result.identical_outputs() >= 3
    report = (tmp_path / "out" / "offline.md").read_text()
    assert "Mixtral (4 experts, top-2), 2 layers, hidden 64" in report
    written = sorted(p.name for p in model_dir.iterdir())
    by_path = dataclasses.replace(OfflineBenchSettings.quick(), layers=7, hidden=256,
                                  model_path=str(model_dir), repeats=1, num_prompts=8,
                                  output_len=6)
    again = run_benchmark(by_path, tmp_path / "again", engine_args=engine_args)
    assert sorted(p.name for p in model_dir.iterdir()) == written  # read, not rewritten
    assert (again.settings.layers, again.settings.hidden, again.settings.arch,
            again.settings.num_experts, again.settings.intermediate) == (2, 64, "mixtral", 4, 96)
    assert again.transformers_outputs == result.transformers_outputs
    assert again.identical_outputs() >= 3
    report = (tmp_path / "again" / "offline.md").read_text()
    assert f"`{model_dir}` (Mixtral (4 experts, top-2)-shaped), 2 layers" in report
    assert "the checkpoint's weights" in report


def test_cli_knows_the_benchmark_and_applies_flags_over_quick() -> None:
    parser = build_parser()
    args = parser.parse_args(["bench", "offline", "--quick", "--repeats", "1",
                              "--torch-threads", "2", "--dp-size", "2", "--output", "x"])
    assert args.output == "x"
    assert settings_from_args(args) == dataclasses.replace(
        OfflineBenchSettings.quick(), repeats=1, torch_threads=2, dp_size=2)
    gpu = settings_from_args(parser.parse_args(["bench", "offline", "--llama3-8b",
                                                "--repeats", "2"]))
    assert (gpu.layers, gpu.hidden, gpu.kv_heads, gpu.vocab, gpu.dtype, gpu.device,
            gpu.dummy_weights, gpu.repeats) == (32, 4096, 8, 128256, "bfloat16", "cuda", True, 2)
    moe = settings_from_args(parser.parse_args([
        "bench", "offline", "--arch", "mixtral", "--num-experts", "8", "--top-k", "2",
        "--layers", "4", "--hidden", "512", "--intermediate", "1792"]))
    assert moe == OfflineBenchSettings(arch="mixtral", num_experts=8, top_k=2, layers=4,
                                       hidden=512, intermediate=1792)
    by_path = settings_from_args(parser.parse_args(["bench", "offline", "--model-path", "m"]))
    assert by_path == OfflineBenchSettings(model_path="m")
    defaults = parser.parse_args(["bench", "offline"])
    assert defaults.output == "benchmarks/results/offline"
    assert settings_from_args(defaults) == OfflineBenchSettings(
        layers=4, hidden=256, heads=4, num_prompts=64, output_len=48, hf_batch_size=16,
        repeats=3)


@pytest.mark.parametrize(("change", "field"), [({"hidden": 30}, "hidden"),
                                               ({"repeats": 0}, "repeats"),
                                               ({"torch_threads": 0}, "torch_threads"),
                                               ({"dp_size": 0}, "dp_size"),
                                               ({"arch": "gpt2"}, "arch"),
                                               ({"top_k": 9}, "top_k")])
def test_impossible_settings_are_refused_by_name(change: dict[str, int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(OfflineBenchSettings(), **change).check()
