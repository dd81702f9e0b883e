"""The parallel settings, the launcher's plan of ranks, and the refusals of impossible ones."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from framework.config import ServerArgs
from framework.distributed.config import ParallelConfig, split_host_port, stage_layers
from framework.layers.embedding import VocabParallelEmbedding
from framework.layers.linear import RowParallelLinear, bind_tp_group
from framework.models.llama import LlamaForCausalLM
from framework.runtime.launch import ComponentTree, plan_components
from tests.model_fixtures import make_tiny_checkpoint, tiny_config


def test_rank_layout_puts_consecutive_ranks_on_each_node() -> None:
    config = ParallelConfig(tp_size=2, pp_size=2, nnodes=2, node_rank=1,
                            dist_init_addr="10.0.0.1:1234")
    config.check()
    assert config.world_size == 4 and config.ranks_per_node == 2
    assert list(config.local_ranks()) == [2, 3]
    assert not ParallelConfig().is_parallel


@pytest.mark.parametrize(("fields", "message"), [
    ({"tp_size": 0}, "tp_size must be at least 1, got 0"),
    ({"pp_size": 0}, "pp_size must be at least 1, got 0"),
    ({"nnodes": 2, "tp_size": 3, "dist_init_addr": "h:1"}, r"nnodes \(2\) must divide"),
    ({"nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, r"node_rank must be in \[0, 2\)"),
    ({"nnodes": 2, "tp_size": 2}, "dist_init_addr .* is required with nnodes > 1"),
    ({"tp_size": 2, "dist_init_addr": "nohost"}, "dist_init_addr must be host:port"),
])
def test_impossible_settings_are_refused_naming_the_field(fields: dict[str, object],
                                                           message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**fields).check()  # type: ignore[arg-type]


def test_host_port_parsing() -> None:
    assert split_host_port("127.0.0.1:29500") == ("127.0.0.1", 29500)
    assert split_host_port("[::1]:80") == ("::1", 80)
    for bad in ("127.0.0.1", ":80", "h:0", "h:99999", "h:x"):
        with pytest.raises(ValueError):
            split_host_port(bad)


def test_the_plan_starts_one_scheduler_per_rank_of_this_node() -> None:
    specs = plan_components(ServerArgs(tp_size=2, pp_size=2), cores=9)
    assert [(s.kind, s.rank, s.name, s.torch_threads) for s in specs] == [
        ("scheduler", 0, "scheduler rank 0", 2),
        ("scheduler", 1, "scheduler rank 1", 2),
        ("scheduler", 2, "scheduler rank 2", 2),
        ("scheduler", 3, "scheduler rank 3", 2),
        ("detokenizer", 0, "detokenizer", 1),
    ]
    second_node = plan_components(ServerArgs(tp_size=2, nnodes=2, node_rank=1,
                                             dist_init_addr="127.0.0.1:1"), cores=9)
    assert [(s.rank, s.name) for s in second_node if s.kind == "scheduler"] == [
        (1, "scheduler rank 1")]


def test_replicas_of_several_ranks_are_planned_replica_after_replica() -> None:
    specs = plan_components(ServerArgs(dp_size=2, tp_size=2), cores=9)
    assert [(s.kind, s.replica, s.rank, s.name, s.torch_threads) for s in specs] == [
        ("scheduler", 0, 0, "scheduler replica 0 rank 0", 2),
        ("scheduler", 0, 1, "scheduler replica 0 rank 1", 2),
        ("detokenizer", 0, 0, "detokenizer replica 0", 1),
        ("scheduler", 1, 0, "scheduler replica 1 rank 0", 2),
        ("scheduler", 1, 1, "scheduler replica 1 rank 1", 2),
        ("detokenizer", 1, 0, "detokenizer replica 1", 1),
    ]
    # Two nodes: a replica on each; node 0 turns both replicas' tokens into text.
    nodes = {"dp_size": 2, "tp_size": 2, "nnodes": 2, "dist_init_addr": "127.0.0.1:1"}
    node0 = plan_components(ServerArgs(**nodes), cores=9)
    node1 = plan_components(ServerArgs(**nodes, node_rank=1), cores=9)
    assert [s.name for s in node0] == ["scheduler replica 0 rank 0", "scheduler replica 0 rank 1",
                                       "detokenizer replica 0", "detokenizer replica 1"]
    assert [(s.name, s.torch_threads) for s in node1] == [
        ("scheduler replica 1 rank 0", 4), ("scheduler replica 1 rank 1", 4)]
    # A replica split over nodes: its rank 1 follows from node 1.
    split = plan_components(ServerArgs(dp_size=3, tp_size=2, nnodes=2, node_rank=1,
                                       dist_init_addr="127.0.0.1:1"), cores=9)
    assert [s.name for s in split] == ["scheduler replica 1 rank 1", "scheduler replica 2 rank 0",
                                       "scheduler replica 2 rank 1"]


def test_the_rank_layout_puts_each_replica_s_ranks_together() -> None:
    config = ParallelConfig(tp_size=2, pp_size=2, dp_size=3, nnodes=2,
                            dist_init_addr="127.0.0.1:1")
    config.check()
    assert (config.world_size, config.total_ranks, config.ranks_per_node) == (4, 12, 6)
    assert config.global_rank(2, 1) == 9 and config.place(9) == (2, 1)
    assert [config.node_of(config.global_rank(r, 0)) for r in range(3)] == [0, 0, 1]
    assert ParallelConfig(dp_size=2, nnodes=2, dist_init_addr="h:1").uses_distributed
    assert not ParallelConfig(dp_size=2).uses_distributed
    with pytest.raises(ValueError, match=r"nnodes \(2\) must divide dp_size × tp_size × "
                                         r"pp_size \(3\)"):
        ParallelConfig(dp_size=3, nnodes=2, dist_init_addr="h:1").check()


def test_launch_refuses_ranks_as_threads_and_remote_replicas_without_shared_keys() -> None:
    with pytest.raises(ValueError, match="needs launch_mode 'process'"):
        ComponentTree(ServerArgs(tp_size=2, launch_mode="thread"))
    with pytest.raises(ValueError, match="need the zmq transport and curve_key_dir"):
        ComponentTree(ServerArgs(dp_size=2, nnodes=2, dist_init_addr="127.0.0.1:1"))
    with pytest.raises(ValueError, match="node_rank must be in"):
        ComponentTree(ServerArgs(node_rank=1))


def test_tp_size_not_dividing_the_heads_is_a_one_line_error() -> None:
    with pytest.raises(ValueError, match=r"attention heads \(4\) is not divisible by tp_size "
                                         r"\(3\)"):
        LlamaForCausalLM(tiny_config("llama"), torch.float32, torch.device("cpu"),
                         tp_rank=0, tp_size=3)


class _SumOfTwo:
    """A stand-in group of two ranks whose other rank holds the same values."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat([x, x], dim=dim)


def test_split_layers_need_a_bound_group_and_use_it() -> None:
    row = RowParallelLinear(4, 3, bias=True, tp_rank=0, tp_size=2)
    torch.nn.init.ones_(row.weight)
    torch.nn.init.ones_(row.bias)
    x = torch.ones(1, 2)
    with pytest.raises(NotImplementedError, match="needs a tensor-parallel group"):
        row(x)
    assert bind_tp_group(row, _SumOfTwo()) == 1
    # The partial products are summed, then the bias is added once.
    assert row(x).tolist() == [[5.0, 5.0, 5.0]]
    embedding = VocabParallelEmbedding(6, 2, tp_rank=1, tp_size=2)
    bind_tp_group(embedding, _SumOfTwo())
    torch.nn.init.ones_(embedding.weight)
    # Token 0 belongs to rank 0: this rank contributes zeros for it.
    assert embedding(torch.tensor([0, 4])).tolist() == [[0.0, 0.0], [2.0, 2.0]]
    assert embedding.compute_logits(torch.ones(1, 2)).shape == (1, 6)


@pytest.mark.parametrize(("layers", "stages", "expected"), [
    (2, 2, [(0, 1), (1, 2)]), (5, 2, [(0, 3), (3, 5)]), (4, 1, [(0, 4)]),
    (3, 3, [(0, 1), (1, 2), (2, 3)]),
])
def test_stages_split_the_layers_evenly(layers: int, stages: int,
                                        expected: list[tuple[int, int]]) -> None:
    assert [stage_layers(layers, rank, stages) for rank in range(stages)] == expected


def test_more_stages_than_layers_is_a_one_line_error() -> None:
    with pytest.raises(ValueError, match=r"pp_size \(3\) is more than the model's 2 layers"):
        LlamaForCausalLM(tiny_config("llama"), torch.float32, torch.device("cpu"),
                         pp_rank=0, pp_size=3)


@pytest.mark.parametrize("tied", [False, True])
def test_each_stage_loads_only_its_layers(tmp_path: Path, tied: bool) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama", tie_word_embeddings=tied)
    weights = load_file(str(path / "model.safetensors"))
    config = tiny_config("llama", tie_word_embeddings=tied)
    stages = [LlamaForCausalLM(config, torch.float32, torch.device("cpu"), pp_rank=rank,
                               pp_size=2) for rank in range(2)]
    for stage in stages:
        stage.load_weights(weights.items())
    first, last = (dict(stage.named_parameters()) for stage in stages)
    assert "model.embed_tokens.weight" in first and "model.layers.0.mlp.down_proj.weight" in first
    assert not any(name.startswith(("model.layers.1.", "model.norm", "lm_head")) for name in first)
    assert "model.layers.1.mlp.down_proj.weight" in last and "model.norm.weight" in last
    assert not any(name.startswith(("model.layers.0.", "model.embed_tokens")) for name in last)
    head = weights["model.embed_tokens.weight" if tied else "lm_head.weight"]
    assert torch.equal(last["lm_head.weight"], head)


def test_an_engine_is_node_0_only() -> None:
    from framework import Engine

    with pytest.raises(ValueError, match="node_rank above 0 runs scheduler ranks only"):
        Engine(tp_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:1")


def test_a_sample_the_last_stage_could_not_make_raises_on_rank_0() -> None:
    from framework.layers.sampler import StepSample

    good = StepSample([4], [], [[]], [[]], [], [], [])
    assert good.checked() is good
    failed = StepSample([], [], [], [], [], [], [], error="ValueError('bad row')")
    with pytest.raises(RuntimeError, match=r"last pipeline stage failed to sample.*bad row"):
        failed.checked()


# ------------------------------------------------------------------ what each rank reads


class _CountingSlice:
    """A safetensors slice that counts the bytes its reads return."""

    def __init__(self, stored: Any, name: str, counts: Counter[str]) -> None:
        self._stored, self._name, self._counts = stored, name, counts

    def get_shape(self) -> list[int]:
        return self._stored.get_shape()

    def get_dtype(self) -> str:
        return self._stored.get_dtype()

    def __getitem__(self, index: Any) -> torch.Tensor:
        tensor = self._stored[index]
        self._counts[self._name] += tensor.numel() * tensor.element_size()
        return tensor


class _CountingFile:
    """A ``safe_open`` handle whose tensor reads are counted, by tensor name, in bytes."""

    def __init__(self, handle: Any, counts: Counter[str]) -> None:
        self._handle, self._counts = handle, counts

    def __enter__(self) -> _CountingFile:
        self._handle.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.__exit__(*exc)

    def keys(self) -> list[str]:
        return list(self._handle.keys())

    def get_tensor(self, name: str) -> torch.Tensor:
        tensor = self._handle.get_tensor(name)
        self._counts[name] += tensor.numel() * tensor.element_size()
        return tensor

    def get_slice(self, name: str) -> _CountingSlice:
        return _CountingSlice(self._handle.get_slice(name), name, self._counts)


def _bytes_read(monkeypatch: pytest.MonkeyPatch, path: Path, **ranks: int) -> Counter[str]:
    """Bytes of each checkpoint tensor that loading the model as ``ranks`` say reads."""
    from framework.model_executor import weight_loader
    from framework.model_executor.model_config import ModelConfig

    counts: Counter[str] = Counter()
    real = weight_loader.safe_open
    monkeypatch.setattr(weight_loader, "safe_open",
                        lambda *args, **kwargs: _CountingFile(real(*args, **kwargs), counts))
    config = ModelConfig.from_pretrained(path, dtype="float32", device=torch.device("cpu"))
    weight_loader.load_model(config, torch.device("cpu"), **ranks)
    return counts


def _stored_bytes(path: Path) -> dict[str, int]:
    return {name: t.numel() * t.element_size()
            for name, t in load_file(str(path / "model.safetensors")).items()}


def test_each_tensor_parallel_rank_reads_only_its_slice(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """TP=2: every split tensor is read half by each rank, never whole; only the norms
    (replicated) are read whole, so each rank reads a little over half the checkpoint."""
    path = make_tiny_checkpoint(tmp_path, "llama")
    stored = _stored_bytes(path)
    for rank in (0, 1):
        read = _bytes_read(monkeypatch, path, tp_rank=rank, tp_size=2)
        for name, size in stored.items():
            expected = size if name.endswith("norm.weight") else size // 2
            assert read[name] == expected, (rank, name, read[name], size)
        norms = sum(size for name, size in stored.items() if name.endswith("norm.weight"))
        assert sum(read.values()) == (sum(stored.values()) - norms) // 2 + norms


@pytest.mark.parametrize("tied", [False, True])
def test_each_pipeline_stage_reads_only_its_tensors(tmp_path: Path, tied: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """PP=2: stage 0 reads the embedding and layer 0, stage 1 layer 1, the final norm and
    the head (a tied head: the embedding table); nothing of the other stage's layers."""
    path = make_tiny_checkpoint(tmp_path, "llama", tie_word_embeddings=tied)
    stored = _stored_bytes(path)
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    own = [
        {n for n in stored if n.startswith(("model.embed_tokens.", "model.layers.0."))},
        {n for n in stored if n.startswith(("model.layers.1.", "model.norm."))} | {head},
    ]
    for stage in (0, 1):
        read = _bytes_read(monkeypatch, path, pp_rank=stage, pp_size=2)
        assert dict(read) == {name: stored[name] for name in own[stage]}, stage


def test_a_first_stage_holds_no_head_and_packs_none() -> None:
    """Tied embeddings: the first of two stages looks tokens up and never projects onto the
    vocabulary, so its table is not packed as a head (a copy as large as the table)."""
    from framework.model_executor.model_runner import matmul_modules

    config = tiny_config("llama", tie_word_embeddings=True)
    first, last = (LlamaForCausalLM(config, torch.float32, torch.device("cpu"), pp_rank=rank,
                                    pp_size=2) for rank in (0, 1))
    assert first.lm_head is None
    assert not any(isinstance(m, VocabParallelEmbedding) for m in matmul_modules(first))
    assert any(isinstance(m, VocabParallelEmbedding) for m in matmul_modules(last))


def test_reported_weight_bytes_count_the_packed_copies(tmp_path: Path) -> None:
    """With the onednn linear backend every matrix that multiplies has a packed copy beside
    it: ``weight_bytes`` counts them, ``param_bytes`` the parameters alone."""
    from framework.layers.linear_kernel import onednn_available
    from framework.model_executor.model_runner import ModelRunner, matmul_modules

    if not onednn_available():
        pytest.skip("this torch has no oneDNN")
    path = make_tiny_checkpoint(tmp_path, "llama")
    args = ServerArgs(model_path=str(path), device="cpu", dtype="float32",
                      linear_backend="onednn", max_running_requests=2, max_total_tokens=256)
    runner = ModelRunner(args, str(path))
    (info,) = runner.rank_info
    params = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    matrices = sum(m.weight.numel() * m.weight.element_size()
                   for m in matmul_modules(runner.model))
    assert info["param_bytes"] == params
    assert info["weight_bytes"] == params + matrices
    plain = ModelRunner(dataclasses.replace(args, linear_backend="torch"), str(path))
    assert plain.rank_info[0]["weight_bytes"] == params


def test_weight_update_failures_are_described_by_rank() -> None:
    from framework.distributed.step_sync import describe_failures, gather_failures

    assert gather_failures(None, None) == {}
    assert gather_failures(None, "no file") == {0: "no file"}
    assert describe_failures({0: "no file"}, 1) == "no file"
    assert describe_failures({0: "no file", 1: "no file"}, 2) == "on every rank: no file"
    assert describe_failures({3: "bad", 1: "worse"}, 4) == "rank 1: worse; rank 3: bad"


def test_the_batch_announced_to_other_ranks_carries_each_tensor_alone() -> None:
    """The scheduler makes a step's index tensors as views of one; a pickled view carries
    its whole storage, so the copy announced to the other ranks holds each on its own."""
    from framework.distributed.step_sync import batch_to
    from framework.forward_batch import ForwardBatch, ForwardMode

    packed = torch.arange(4096)
    ids, positions, rows, lens = packed[:3], packed[3:6], packed[6:7], packed[7:8]
    batch = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=1, input_ids=ids,
                         positions=positions, req_pool_indices=rows, seq_lens=lens,
                         out_cache_loc=torch.tensor([5, 6, 7]))
    as_is = batch_to(batch, torch.device("cpu"))
    compact = batch_to(batch, torch.device("cpu"), compact=True)
    for field in ("input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc"):
        mine, theirs = getattr(compact, field), getattr(batch, field)
        assert torch.equal(mine, theirs)
        assert mine.untyped_storage().nbytes() == mine.numel() * mine.element_size(), field
    assert as_is.input_ids.untyped_storage().nbytes() == packed.numel() * 8
