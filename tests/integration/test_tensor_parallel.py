"""``--tp-size 2`` and ``--pp-size 2`` on CPU over gloo: two ranks, each holding its share.

Through the Engine, the greedy tokens must be those of one rank (float32, the
tiny model) while each rank reports its share of the parameter and KV bytes
(half of every matrix with TP, its own layers with PP). A
two-rank harness that drives the ``ModelRunner`` directly shows the
all-reduce is load-bearing: replaced by a no-op, the tokens change; and that a
step failing on either rank ends that rank rather than hang the other. (A killed
rank ending the server is tested through ``framework serve``, in
``tests/e2e/test_tensor_parallel_server.py``.)
"""

from __future__ import annotations

import json
import multiprocessing as mp
import struct
from collections.abc import Iterator
from pathlib import Path
from queue import Empty
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from framework import Engine
from framework.comm.zmq import free_tcp_port
from framework.config import ServerArgs
from framework.distributed.config import ParallelConfig
from framework.model_executor.model_runner import ModelRunner
from tests.model_fixtures import make_tiny_checkpoint, make_tiny_tokenizer, tiny_config

PROMPTS = ["the quick brown fox", "hello world, this is a test", "def add(a, b):", "x"]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
ONE_PARITY = [{**GREEDY, "max_new_tokens": n} for n in (40, 1, 40, 1)]
ENGINE_ARGS = {"log_level": "warning", "dtype": "float32"}
HARNESS_STEPS = 6
HARNESS_TIMEOUT_S = 120.0  # a liveness bound for the two-rank harness


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tp"), "llama", seed=11)


@pytest.fixture(scope="module")
def one_rank(model_dir: Path) -> dict[str, Any]:
    """Greedy tokens and server info of the model on one rank."""
    with Engine(model_path=str(model_dir), launch_mode="thread", **ENGINE_ARGS) as engine:
        return {"outputs": [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)],
                "scored": _scored(engine), "sampled": _sampled(engine),
                "info": engine.get_server_info()}


# Seeded sampling with penalties and top logprobs, and a constraint: what the last pipeline
# stage must sample exactly as rank 0 does alone.
SAMPLED = [{"temperature": 0.8, "top_p": 0.9, "seed": 7 + i, "repetition_penalty": 1.3,
            "max_new_tokens": 8, "ignore_eos": True} for i in range(3)] + [
           {"temperature": 0.7, "seed": 3, "max_new_tokens": 8, "regex": "(yes|no|maybe)"}]


def _sampled(engine: Engine) -> list[tuple[list[int], list[float]]]:
    outs = engine.generate(PROMPTS, SAMPLED, return_logprob=True, top_logprobs_num=2)
    return [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
            for o in outs]


def _scored(engine: Engine) -> list[list[float]]:
    """Every prompt's prompt logprobs, all prompts in one batch."""
    outs = engine.generate(PROMPTS, GREEDY, return_logprob=True, logprob_start_len=0)
    return [[lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]] for o in outs]


@pytest.mark.timeout(240)
def test_two_ranks_give_one_rank_s_tokens_each_holding_half(
    model_dir: Path, one_rank: dict[str, Any], tmp_path: Path
) -> None:
    other = make_tiny_checkpoint(tmp_path, "llama", seed=12)  # same shapes, other weights
    with Engine(model_path=str(other), launch_mode="thread", **ENGINE_ARGS) as engine:
        other_outputs = [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]
    with Engine(model_path=str(model_dir), tp_size=2, **ENGINE_ARGS) as engine:
        outputs = [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]
        # Again: the prompts' KV is now reused from the prefix cache, on every rank.
        cached = engine.generate(PROMPTS, GREEDY)
        info = engine.get_server_info()
        ready = dict(engine.components.scheduler_infos)
        # A weight update reaches every rank, each loading its own slice.
        assert engine.update_weights_from_disk(str(other)).success
        updated = [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]
    assert outputs == one_rank["outputs"]
    assert [o["output_ids"] for o in cached] == outputs
    assert sum(o["meta_info"]["cached_tokens"] for o in cached) > 0
    assert updated == other_outputs
    assert info["tp_size"] == 2 and info["kv_cache_idle_and_free"] is True, info
    assert sorted(ready) == [(0, 0), (0, 1)]
    assert ready[0, 0]["pid"] != ready[0, 1]["pid"]  # two scheduler processes
    whole = one_rank["info"]
    for rank in (0, 1):
        # Every weight matrix is split, the norms are replicated: a little over half.
        for kind in ("param_bytes", "weight_bytes"):  # weights: packed copies included
            held = info[f"{kind}_rank_{rank}"]
            assert 0.45 * whole[f"{kind}_rank_0"] <= held <= 0.55 * whole[f"{kind}_rank_0"]
        # Two key/value heads, one per rank.
        assert info[f"kv_cache_bytes_rank_{rank}"] * 2 == whole["kv_cache_bytes_rank_0"]
    assert "param_bytes_rank_2" not in info
    # One rank (the thread-mode Engine of this process) never touched torch.distributed.
    assert not torch.distributed.is_initialized()


@pytest.fixture(scope="module")
def pp_engine(model_dir: Path) -> Iterator[tuple[Engine, dict[str, Any]]]:
    """A two-stage Engine, and its server info after its first requests: two of them
    decoding on rows of one parity (a fresh pool gives rows 0-3, and the requests on rows 1
    and 3 end at their prefill)."""
    with Engine(model_path=str(model_dir), pp_size=2, **ENGINE_ARGS) as engine:
        engine.generate([PROMPTS[0]] * 4, ONE_PARITY)
        yield engine, engine.get_server_info()


@pytest.mark.timeout(240)
def test_two_pipeline_stages_give_one_rank_s_tokens_each_holding_its_layers(
    pp_engine: tuple[Engine, dict[str, Any]], one_rank: dict[str, Any]
) -> None:
    engine, parity = pp_engine
    outputs = [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]
    # Prompt logprobs travel back from the last stage with the next-token logits, each
    # micro-batch's rows put back in place.
    scored = _scored(engine)
    # The last stage samples: seeded draws, penalties, grammars and logprobs as one rank.
    sampled = _sampled(engine)
    info = engine.get_server_info()
    assert outputs == one_rank["outputs"]
    for (ids, logprobs), (ref_ids, ref_logprobs) in zip(sampled, one_rank["sampled"],
                                                        strict=True):
        assert ids == ref_ids
        assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)
    for got, expected in zip(scored, one_rank["scored"], strict=True):
        assert got == pytest.approx(expected, abs=1e-4)
    assert info["pp_size"] == 2 and info["kv_cache_idle_and_free"] is True, info
    # Two requests on rows of one parity still run as two micro-batches. They are sent
    # together; at most a step or two at either end may see one of them alone.
    assert 2 * parity["pp_micro_batches"] >= 3 * parity["decode_steps"] > 0, parity
    # The four requests' steps ran as two micro-batches each, overlapping the stages.
    micro_batches = info["pp_micro_batches"] - parity["pp_micro_batches"]
    assert micro_batches >= 2 * (info["decode_steps"] - parity["decode_steps"]) > 0, info
    whole = one_rank["info"]
    config = tiny_config("llama")
    embedding = config.vocab_size * config.hidden_size * 4  # float32 bytes
    for stage in (0, 1):
        # Stage 0: the embedding and layer 0; stage 1: layer 1, the final norm and the head.
        params = info[f"param_bytes_rank_{stage}"]
        layers_only = whole["param_bytes_rank_0"] - 2 * embedding
        assert abs(params - embedding - layers_only / 2) <= config.hidden_size * 4, stage
        assert info[f"kv_cache_bytes_rank_{stage}"] * 2 == whole["kv_cache_bytes_rank_0"]


def _make_unreadable(checkpoint: Path, name: str) -> None:
    """Store the float32 tensor ``name`` of ``checkpoint`` as 4-bit floats: its name, shape
    and offsets check out (the update's dry run passes), reading it fails."""
    tensors = load_file(checkpoint / "model.safetensors")
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    chunks: list[bytes] = []
    offset = 0
    for key, tensor in tensors.items():
        assert tensor.dtype == torch.float32
        dtype, data = ("F4", bytes(tensor.numel() // 2)) if key == name else \
            ("F32", tensor.contiguous().view(torch.uint8).numpy().tobytes())
        header[key] = {"dtype": dtype, "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    (checkpoint / "model.safetensors").write_bytes(
        struct.pack("<Q", len(encoded)) + encoded + b"".join(chunks))


@pytest.mark.timeout(240)
def test_a_weight_update_one_stage_cannot_load_leaves_every_stage_on_the_old_weights(
    pp_engine: tuple[Engine, dict[str, Any]], one_rank: dict[str, Any], model_dir: Path,
    tmp_path: Path,
) -> None:
    """All or nothing: stage 1 cannot read the final norm (stage 0 never reads it), so
    stage 0, which loaded its new layers, goes back to its old ones too."""
    engine, _ = pp_engine
    broken = make_tiny_checkpoint(tmp_path, "llama", seed=12)  # same shapes, other weights
    _make_unreadable(broken, "model.norm.weight")
    reply = engine.update_weights_from_disk(str(broken))
    outputs = [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]
    assert not reply.success
    assert outputs == one_rank["outputs"]  # both stages serve the old weights, and serve on
    assert f"loading weights from {broken} failed: rank 1: " in reply.message, reply.message
    assert reply.message.endswith(f"every rank keeps the previous weights from {model_dir}")
    assert "rank 0:" not in reply.message


# --------------------------------------------------------------------------- the harness


def _runner_args(model_dir: str, tp_size: int) -> ServerArgs:
    return ServerArgs(model_path=model_dir, tp_size=tp_size, device="cpu", dtype="float32",
                      max_running_requests=8, max_total_tokens=1024)


def _greedy_tokens(runner: ModelRunner) -> list[list[int]]:
    """Greedy tokens of every prompt, driving the runner as the Scheduler does."""
    from tests.unit.test_llama_models import Driver, greedy

    tokenizer = make_tiny_tokenizer()
    driver = Driver(runner)
    requests = driver.start(len(PROMPTS))
    logits = driver.extend(requests, [tokenizer(p).input_ids for p in PROMPTS])
    tokens, _ = greedy(driver, requests, logits, HARNESS_STEPS)
    return tokens


def _fail_at_step(runner: ModelRunner, step: int) -> None:
    """Make the model of ``runner`` raise at its ``step``-th forward (counting from 0)."""
    real, calls = runner.model.forward, iter(range(step + 1))

    def forward(*args: Any, **kwargs: Any) -> Any:
        if next(calls, None) is None:
            raise RuntimeError("a step broken on purpose")
        return real(*args, **kwargs)

    runner.model.forward = forward  # type: ignore[method-assign]


def _harness_rank(rank: int, port: int, model_dir: str, no_op_all_reduce: bool,
                  failing_rank: int | None, results: Any) -> None:
    """One of two TP ranks: rank 0 drives greedy steps, rank 1 follows them."""
    torch.set_num_threads(1)
    from framework.distributed.parallel_state import destroy_parallel, init_parallel
    from framework.distributed.step_sync import Follower

    config = ParallelConfig(tp_size=2, dist_init_addr=f"127.0.0.1:{port}")
    context = init_parallel(config, rank, torch.device("cpu"))
    # Left to the interpreter's teardown, a rank ending with RankStepFailed sometimes
    # aborts in gloo's threads (exit code -6); the launcher leaves the groups first too.
    try:
        if no_op_all_reduce:
            context.tp.all_reduce = lambda x: x  # type: ignore[method-assign]
        runner = ModelRunner(_runner_args(model_dir, 2), model_dir, parallel=context)
        if rank == failing_rank:
            _fail_at_step(runner, 2)
        if rank == 0:
            try:
                results.put(_greedy_tokens(runner))
            except Exception as exc:  # what the Scheduler contains (RankStepFailed is not one)
                results.put(repr(exc))
        else:
            Follower(context.control, runner, runner.pools.req_to_token_pool.req_to_token).run()
    finally:
        destroy_parallel()


def rank_processes() -> Any:
    """Where the harness's rank processes come from: a fork server that imported torch and the
    runtime once (a fresh interpreter for each rank spends seconds importing them; a fork of
    this process would copy its threads)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "framework.model_executor.model_runner",
                                "framework.distributed.parallel_state",
                                "framework.distributed.step_sync", __name__])
    return ctx


def _start_two_ranks(model_dir: Path, *, no_op_all_reduce: bool = False,
                     failing_rank: int | None = None) -> tuple[list[Any], Any]:
    ctx = rank_processes()
    results = ctx.Queue()
    port = free_tcp_port()
    ranks = [ctx.Process(target=_harness_rank, daemon=True,
                         args=(rank, port, str(model_dir), no_op_all_reduce, failing_rank,
                               results))
             for rank in range(2)]
    for process in ranks:
        process.start()
    return ranks, results


def _end_two_ranks(ranks: list[Any], results: Any) -> None:
    for process in reversed(ranks):  # the follower first: it never returns by itself
        process.kill()
        process.join(10)
    results.close()


def run_two_ranks(model_dir: Path, *, no_op_all_reduce: bool) -> list[list[int]]:
    """Rank 0's greedy tokens from a two-rank harness; both processes are ended."""
    ranks, results = _start_two_ranks(model_dir, no_op_all_reduce=no_op_all_reduce)
    try:
        return results.get(timeout=HARNESS_TIMEOUT_S)
    except Empty:
        pytest.fail("the two-rank harness gave no tokens")
    finally:
        _end_two_ranks(ranks, results)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("pp_size", [1, 2])
def test_gemma_3_on_two_ranks_gives_one_rank_s_tokens(pp_size: int, tmp_path: Path) -> None:
    """Gemma's own layers split as Llama's do: q/k norms replicated, heads and MLP rows
    split (TP), or its layers with their two RoPE bases and windows per stage (PP)."""
    model = make_tiny_checkpoint(tmp_path, "gemma3", seed=3)
    with Engine(model_path=str(model), launch_mode="thread", **ENGINE_ARGS) as engine:
        expected = [o["output_ids"] for o in engine.generate(PROMPTS, ONE_PARITY)]
    parallel = {"tp_size": 2} if pp_size == 1 else {"pp_size": 2}
    with Engine(model_path=str(model), **parallel, **ENGINE_ARGS) as engine:
        assert [o["output_ids"] for o in engine.generate(PROMPTS, ONE_PARITY)] == expected


@pytest.mark.timeout(240)
def test_a_mixture_of_experts_on_two_ranks_gives_one_rank_s_tokens(tmp_path: Path) -> None:
    """Qwen2-MoE (a shared expert, a dense layer): each rank holds half of every expert's
    intermediate rows and of the shared expert's, the router whole; one all-reduce per
    sparse block sums the experts' and the shared expert's partial outputs."""
    model = make_tiny_checkpoint(tmp_path, "qwen2_moe", seed=3)
    with Engine(model_path=str(model), launch_mode="thread", **ENGINE_ARGS) as engine:
        expected = [o["output_ids"] for o in engine.generate(PROMPTS, ONE_PARITY)]
        whole = engine.get_server_info()
    with Engine(model_path=str(model), tp_size=2, **ENGINE_ARGS) as engine:
        outputs = [o["output_ids"] for o in engine.generate(PROMPTS, ONE_PARITY)]
        info = engine.get_server_info()
    assert outputs == expected
    for rank in (0, 1):  # every matrix split but the small replicated routers and norms
        held = info[f"param_bytes_rank_{rank}"]
        assert 0.5 * whole["param_bytes_rank_0"] < held <= 0.52 * whole["param_bytes_rank_0"]


@pytest.mark.timeout(240)
def test_the_all_reduce_is_what_makes_the_ranks_agree(model_dir: Path) -> None:
    reference = _greedy_tokens(ModelRunner(_runner_args(str(model_dir), 1), str(model_dir)))
    assert run_two_ranks(model_dir, no_op_all_reduce=False) == reference
    assert run_two_ranks(model_dir, no_op_all_reduce=True) != reference


@pytest.mark.timeout(240)
@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_step_that_fails_on_one_rank_ends_that_rank(model_dir: Path,
                                                      failing_rank: int) -> None:
    """Not contained (the other rank waits inside the step's all-reduce): the rank exits.

    The launcher then stops the server, as for a killed rank
    (``tests/e2e/test_tensor_parallel_server.py``).
    """
    ranks, results = _start_two_ranks(model_dir, failing_rank=failing_rank)
    try:
        ranks[failing_rank].join(HARNESS_TIMEOUT_S)  # a liveness bound, not a timing
        assert ranks[failing_rank].exitcode == 1
        assert results.empty()  # rank 0 drove no run to the end
    finally:
        _end_two_ranks(ranks, results)


@pytest.mark.timeout(240)
def test_fewer_kv_heads_than_ranks_are_replicated(tmp_path: Path) -> None:
    """One key/value head over two ranks: each keeps a copy, the tokens are one rank's."""
    mqa = make_tiny_checkpoint(tmp_path, "llama", seed=5, num_key_value_heads=1)
    with Engine(model_path=str(mqa), launch_mode="thread", **ENGINE_ARGS) as engine:
        expected = [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]
        whole = engine.get_server_info()
    with Engine(model_path=str(mqa), tp_size=2, **ENGINE_ARGS) as engine:
        outputs = [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]
        info = engine.get_server_info()
    assert outputs == expected
    for rank in (0, 1):  # the whole (single) head on each rank, not half of it
        assert info[f"kv_cache_bytes_rank_{rank}"] == whole["kv_cache_bytes_rank_0"]


def _sizing_rank(rank: int, port: int, model_dir: str, host_bytes: list[int],
                 results: Any) -> None:
    """A TP rank that finds ``host_bytes[rank]`` of host memory available and sizes its pool."""
    torch.set_num_threads(1)
    from framework.distributed.parallel_state import init_parallel
    from framework.mem_cache import memory_pool

    memory_pool.available_host_memory = lambda: host_bytes[rank]  # type: ignore[assignment]
    context = init_parallel(ParallelConfig(tp_size=2, dist_init_addr=f"127.0.0.1:{port}"),
                            rank, torch.device("cpu"))
    args = ServerArgs(model_path=model_dir, tp_size=2, device="cpu", dtype="float32",
                      max_running_requests=8, mem_fraction=0.5)
    runner = ModelRunner(args, model_dir, parallel=context)
    results.put((rank, runner.max_total_num_tokens, runner.pools.token_to_kv_pool.size))


@pytest.mark.timeout(240)
def test_ranks_that_find_different_free_memory_size_their_pools_alike(model_dir: Path) -> None:
    """Rank 0 hands out every rank's KV slots, so each pool takes the smallest size found."""
    per_token = ModelRunner(_runner_args(str(model_dir), 1), str(model_dir)) \
        .pools.token_to_kv_pool.bytes_per_token() // 2  # each rank holds half the heads
    # Two ranks share the host; half of each one's share may go to the KV cache.
    host_bytes = [per_token * 4 * 900, per_token * 4 * 700]
    ctx = rank_processes()
    results = ctx.Queue()
    port = free_tcp_port()
    ranks = [ctx.Process(target=_sizing_rank, daemon=True,
                         args=(rank, port, str(model_dir), host_bytes, results))
             for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        sizes = sorted(results.get(timeout=HARNESS_TIMEOUT_S) for _ in ranks)
    finally:
        _end_two_ranks(ranks, results)
    assert sizes == [(0, 700, 700), (1, 700, 700)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("split", ["tp_size", "pp_size"])
def test_two_replicas_of_two_ranks_each_give_one_rank_s_tokens(
    model_dir: Path, one_rank: dict[str, Any], split: str
) -> None:
    """``--dp-size 2`` with ``--tp-size 2`` or ``--pp-size 2``: four ranks in two groups."""
    with Engine(model_path=str(model_dir), dp_size=2, **{split: 2}, **ENGINE_ARGS) as engine:
        # Twice the prompts: round robin sends every other request to each replica.
        outputs = [o["output_ids"] for o in engine.generate(PROMPTS * 2, GREEDY)]
        info = engine.get_server_info()
        ready = dict(engine.components.scheduler_infos)
    assert outputs == one_rank["outputs"] * 2
    assert sorted(ready) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len({payload["pid"] for payload in ready.values()}) == 4
    whole = one_rank["info"]
    assert info["dp_size"] == 2 and info["kv_cache_idle_and_free"] is True, info
    for replica in info["replicas"]:
        assert replica[split] == 2
        assert replica["load"]["routed_requests"] == len(PROMPTS)  # both replicas served
        held = [replica[f"param_bytes_rank_{rank}"] for rank in (0, 1)]
        assert "param_bytes_rank_2" not in replica
        if split == "tp_size":  # every matrix split, the norms replicated: a little over half
            assert all(0.45 <= h / whole["param_bytes_rank_0"] <= 0.55 for h in held)
        else:  # each stage holds its layers (the embedding and the head at either end)
            assert sum(held) >= whole["param_bytes_rank_0"] > max(held)
