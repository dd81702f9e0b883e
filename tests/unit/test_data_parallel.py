"""The data-parallel router and balancers, and the launch plan of ``--dp-size``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from framework.comm.inproc import InprocTransport
from framework.config import PortArgs, ServerArgs
from framework.messages import (
    AbortReq,
    ErrorReply,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    LoadLoraAdapterReqInput,
    LoraAdapterReqOutput,
    Message,
    SchedulerMetrics,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    UnloadLoraAdapterReqInput,
    UpdateWeightsFromDiskReqInput,
    UpdateWeightsFromDiskReqOutput,
)
from framework.registry import LOAD_BALANCERS
from framework.runtime.data_parallel import (
    DataParallelRouter,
    LoadBalancer,
    ReplicaChannels,
    ReplicaLoad,
    RoundRobin,
    ShortestQueue,
    check_replies,
    make_load_balancer,
    merge_replies,
    total_metrics,
)
from framework.runtime.launch import ComponentTree, plan_components
from framework.runtime.scheduler_rpc import SchedulerRpc
from framework.sampling_params import SamplingParams


def generate(rid: str, prompt_len: int = 4, max_new_tokens: int = 10) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(
        rid=rid, handle=len(rid), input_text="", input_ids=list(range(prompt_len)),
        sampling_params=SamplingParams(max_new_tokens=max_new_tokens))


def loads(*tokens: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(i, in_flight_tokens=t) for i, t in enumerate(tokens)]


@pytest.fixture
def router() -> Iterator[DataParallelRouter]:
    transport = InprocTransport()
    port_args = [PortArgs.create(transport) for _ in range(3)]
    replicas = [ReplicaChannels.open(i, transport, p, "pickle") for i, p in enumerate(port_args)]
    yield DataParallelRouter(replicas, RoundRobin())
    for replica, channels in zip(replicas, port_args):
        replica.close()
        channels.cleanup()


def test_round_robin_takes_each_replica_in_turn() -> None:
    balancer = RoundRobin()
    assert [balancer.choose(loads(0, 0, 0), generate("r")) for _ in range(7)] == [
        0, 1, 2, 0, 1, 2, 0]


def test_shortest_queue_picks_the_fewest_tokens_and_takes_ties_in_turn() -> None:
    balancer = ShortestQueue()
    assert balancer.choose(loads(50, 7, 30), generate("r")) == 1
    assert balancer.choose(loads(5, 7, 30), generate("r")) == 0
    # All equal (an idle server): every replica in turn, not always the first.
    assert [balancer.choose(loads(0, 0, 0), generate("r")) for _ in range(3)] == [1, 2, 0]


def test_load_balancers_by_name() -> None:
    assert isinstance(make_load_balancer("round_robin"), RoundRobin)
    assert isinstance(make_load_balancer("shortest_queue"), ShortestQueue)
    with pytest.raises(ValueError) as refused:
        make_load_balancer("random")
    assert str(refused.value) == ("--load-balance-method: unknown load balancer 'random'; "
                                  "known: round_robin, shortest_queue")


def test_new_requests_are_placed_and_counted_as_load(router: DataParallelRouter) -> None:
    assert router.targets(generate("a", prompt_len=4, max_new_tokens=10)) == [0]
    assert router.targets(generate("b")) == [1]
    embed = TokenizedEmbeddingReqInput(rid="c", input_text="", input_ids=[1, 2, 3])
    assert router.targets(embed) == [2]
    assert [load.in_flight_tokens for load in router.loads] == [14, 14, 3]
    assert [router.replica_of(rid) for rid in "abc"] == [0, 1, 2]
    router.forget("a")
    assert router.replica_of("a") is None
    assert router.loads[0].in_flight_tokens == 0 and router.loads[0].in_flight_requests == 0
    assert router.loads[0].routed_requests == 1  # what it received, for good


def test_an_abort_reaches_the_replica_holding_the_request_only(
    router: DataParallelRouter,
) -> None:
    for rid in "abc":
        router.targets(generate(rid))
    assert router.targets(AbortReq(rid="b")) == [1]
    assert router.replica_of("b") is None and router.loads[1].in_flight_requests == 0
    # An unknown id (already ended, or never routed) and abort_all go to every replica.
    assert router.targets(AbortReq(rid="b")) == [0, 1, 2]
    assert router.targets(AbortReq(abort_all=True)) == [0, 1, 2]
    assert router.targets(FlushCacheReqInput()) == [0, 1, 2]


def test_a_subclassed_balancer_is_used(router: DataParallelRouter) -> None:
    class Last(LoadBalancer):
        def choose(self, loads: list[ReplicaLoad], msg: object) -> int:  # type: ignore[override]
            return len(loads) - 1

    router.balancer = Last()
    assert router.targets(generate("x")) == [2]


class LastReplica(LoadBalancer):
    """A plugin balancer: always the last replica."""

    def choose(self, loads: Sequence[ReplicaLoad], msg: object) -> int:  # type: ignore[override]
        return len(loads) - 1


def test_a_registered_balancer_is_accepted_and_routes(router: DataParallelRouter,
                                                      request: pytest.FixtureRequest) -> None:
    LOAD_BALANCERS.register("last-test", LastReplica, source="tests")
    request.addfinalizer(lambda: LOAD_BALANCERS.unregister("last-test"))
    server_args = ServerArgs(load_balance_method="last-test", dp_size=3)
    router.balancer = make_load_balancer(server_args.load_balance_method)
    assert isinstance(router.balancer, LastReplica)
    assert [router.targets(generate(rid)) for rid in "ab"] == [[2], [2]]


def test_metrics_add_up_over_replicas(router: DataParallelRouter) -> None:
    def report(running: int, used: int) -> SchedulerMetrics:
        return SchedulerMetrics(num_running_reqs=running, num_waiting_reqs=1,
                                num_used_tokens=used, max_total_tokens=100, token_usage=0.0,
                                gen_throughput=10.0, cache_hit_rate=0.5, timestamp=1.0)

    router.record_metrics(0, report(2, 10))
    total = router.record_metrics(2, report(3, 50))
    assert (total.num_running_reqs, total.num_waiting_reqs) == (5, 2)
    assert total.token_usage == pytest.approx(60 / 200)
    assert total.gen_throughput == 20.0
    assert router.loads[2].as_dict()["metrics"]["num_running_reqs"] == 3
    assert total_metrics([]).num_running_reqs == 0


def test_replies_of_every_replica_are_merged_naming_each() -> None:
    flushed = merge_replies([FlushCacheReqOutput(True, "freed 3"),
                             FlushCacheReqOutput(False, "busy")])
    assert isinstance(flushed, FlushCacheReqOutput)
    assert not flushed.success
    assert flushed.message == "replica 0: freed 3; replica 1: busy"
    one = FlushCacheReqOutput(True, "freed 3")
    assert merge_replies([one]) is one
    with pytest.raises(RuntimeError, match="replica 1: boom"):
        check_replies([one, ErrorReply("boom")])
    with pytest.raises(RuntimeError, match=r"^boom$"):
        check_replies([ErrorReply("boom")])


def test_plan_starts_a_scheduler_and_a_detokenizer_per_replica() -> None:
    specs = plan_components(ServerArgs(dp_size=2), num_ranks=1, cores=9)
    assert [(s.kind, s.replica, s.name, s.torch_threads) for s in specs] == [
        ("scheduler", 0, "scheduler replica 0", 4),
        ("detokenizer", 0, "detokenizer replica 0", 1),
        ("scheduler", 1, "scheduler replica 1", 4),
        ("detokenizer", 1, "detokenizer replica 1", 1),
    ]
    ranks = plan_components(ServerArgs(dp_size=2), num_ranks=2, cores=9)
    assert [(s.name, s.torch_threads) for s in ranks if s.kind == "scheduler"] == [
        ("scheduler replica 0 rank 0", 2), ("scheduler replica 0 rank 1", 2),
        ("scheduler replica 1 rank 0", 2), ("scheduler replica 1 rank 1", 2)]


def test_each_replica_gets_its_own_addresses() -> None:
    tree = ComponentTree(ServerArgs(dp_size=3, transport="shm"))
    try:
        addresses = [getattr(p, name) for p in tree.replica_port_args for name in PortArgs.CHANNELS]
        assert len(set(addresses)) == len(addresses)
        assert tree.tokenizer_port_args == tree.replica_port_args
    finally:
        tree.stop()
    single = ComponentTree(ServerArgs())
    try:
        assert single.tokenizer_port_args is single.port_args
    finally:
        single.stop()


def test_bad_data_parallel_settings_are_value_errors_naming_the_field() -> None:
    with pytest.raises(ValueError, match="dp_size must be at least 1, got 0"):
        ComponentTree(ServerArgs(dp_size=0))
    # An unknown balancer is refused with the arguments, before any component starts.
    with pytest.raises(ValueError, match="--load-balance-method: unknown load balancer"):
        ServerArgs(load_balance_method="random")


class _WeightsReplica:
    """A replica's RPC end that serves weights from a path, and fails to load ``broken``."""

    def __init__(self, broken: frozenset[str] = frozenset()) -> None:
        self.path, self.broken = "old", broken
        self.calls: list[str] = []

    async def call(self, msg: Message, timeout: float) -> Message:
        assert isinstance(msg, UpdateWeightsFromDiskReqInput)
        self.calls.append(msg.model_path)
        previous, ok = self.path, msg.model_path not in self.broken
        if ok:
            self.path = msg.model_path
        return UpdateWeightsFromDiskReqOutput(ok, "loaded" if ok else "cannot read it", 1,
                                              previous_model_path=previous)


def _update(replicas: list[_WeightsReplica], path: str) -> Any:
    channels = [ReplicaChannels(i, None, rpc, None, None, None)  # type: ignore[arg-type]
                for i, rpc in enumerate(replicas)]
    router = DataParallelRouter(channels, RoundRobin())
    return asyncio.run(router.update_weights(UpdateWeightsFromDiskReqInput(model_path=path),
                                             timeout=5.0))


def test_a_weight_update_reaches_every_replica() -> None:
    replicas = [_WeightsReplica(), _WeightsReplica()]
    reply = _update(replicas, "new")
    assert reply.success and reply.num_paused_requests == 2
    assert reply.message == "replica 0: loaded; replica 1: loaded"
    assert [r.path for r in replicas] == ["new", "new"]


def test_replicas_that_loaded_go_back_when_another_could_not() -> None:
    """All or nothing: replica 1 cannot read the new weights, so replica 0 (which loaded
    them) loads its previous ones again, and the answer says so."""
    replicas = [_WeightsReplica(), _WeightsReplica(broken=frozenset({"new"})), _WeightsReplica()]
    reply = _update(replicas, "new")
    assert not reply.success
    assert [r.path for r in replicas] == ["old", "old", "old"]
    assert [r.calls for r in replicas] == [["new", "old"], ["new"], ["new", "old"]]
    assert "replica 1: cannot read it" in reply.message
    assert "replica 0: loaded; another replica failed, so it went back to the weights " \
           "from old" in reply.message
    assert reply.message.endswith("no replica serves the new weights")


def test_a_replica_that_cannot_go_back_is_named() -> None:
    replicas = [_WeightsReplica(broken=frozenset({"old"})),
                _WeightsReplica(broken=frozenset({"new"}))]
    reply = _update(replicas, "new")
    assert not reply.success and [r.path for r in replicas] == ["new", "old"]
    assert reply.message.endswith("the new weights are still served by replica 0")


def test_a_replica_answering_with_an_error_has_failed_the_update() -> None:
    class Raising(_WeightsReplica):
        async def call(self, msg: Message, timeout: float) -> Message:
            return ErrorReply("RuntimeError: boom")

    replicas = [_WeightsReplica(), Raising()]
    reply = _update(replicas, "new")
    assert not reply.success and replicas[0].path == "old"
    assert "replica 1: RuntimeError: boom" in reply.message


class _LoraReplica:
    """A replica's RPC end holding LoRA adapters by name; it cannot load ``broken`` and
    refuses to unload ``busy`` (a request uses it)."""

    def __init__(self, broken: str = "", busy: str = "") -> None:
        self.adapters: set[str] = {"kept"}
        self.broken, self.busy = broken, busy

    async def call(self, msg: Message, timeout: float) -> Message:
        name = msg.lora_name  # type: ignore[attr-defined]
        if isinstance(msg, LoadLoraAdapterReqInput):
            if name == self.broken:
                return LoraAdapterReqOutput(False, "cannot read it")
            self.adapters.add(name)
            return LoraAdapterReqOutput(True, "loaded")
        assert isinstance(msg, UnloadLoraAdapterReqInput)
        if name == self.busy:
            return LoraAdapterReqOutput(False, "in use")
        self.adapters.discard(name)
        return LoraAdapterReqOutput(True, "unloaded")


def _lora_rpc(replicas: list[_LoraReplica]) -> SchedulerRpc:
    channels = [ReplicaChannels(i, None, rpc, None, None, None)  # type: ignore[arg-type]
                for i, rpc in enumerate(replicas)]
    return SchedulerRpc(DataParallelRouter(channels, RoundRobin()), "round_robin", lambda: None)


def test_a_lora_adapter_loads_and_unloads_in_every_replica_or_in_none() -> None:
    replicas = [_LoraReplica(), _LoraReplica(broken="new", busy="kept"), _LoraReplica()]
    rpc = _lora_rpc(replicas)
    loaded = asyncio.run(rpc.load_lora_adapter("new", "/adapters/new"))
    assert not loaded.success and [r.adapters for r in replicas] == [{"kept"}] * 3
    assert loaded.message == ("replica 0: loaded; replica 1: cannot read it; replica 2: "
                              "loaded; undone where it succeeded")
    unloaded = asyncio.run(rpc.unload_lora_adapter("kept", "/adapters/kept"))
    assert not unloaded.success and [r.adapters for r in replicas] == [{"kept"}] * 3
    assert "replica 1: in use" in unloaded.message
    replicas[1].busy = ""
    assert asyncio.run(rpc.unload_lora_adapter("kept", "/adapters/kept")).success
    assert [r.adapters for r in replicas] == [set()] * 3
