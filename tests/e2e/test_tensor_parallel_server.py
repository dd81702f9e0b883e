"""``framework serve --tp-size 2`` / ``--pp-size 2``: one rank's tokens; a dead rank ends it.

The server's two scheduler ranks (gloo on CPU) must answer with the tokens of
one rank, report each rank's share of the memory in ``/get_server_info``,
stop cleanly on SIGTERM, and go down non-zero, naming the rank and leaving no
process behind, when one rank is killed. With ``--nnodes 2`` on one machine
(two process trees, loopback ``--dist-init-addr``) node 0 serves a completion
with node 1's rank, and goes down when node 1 does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from framework import Engine
from framework.comm.zmq import free_tcp_port
from tests.model_fixtures import make_tiny_checkpoint
from tests.server_harness import (
    child_pids,
    scheduler_info,
    start_server,
    still_running,
    wait_until_idle,
)

PROMPTS = ["the quick brown fox", "hello world, this is a test", "def add(a, b):"]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
TP2 = ("--tp-size", "2", "--dtype", "float32")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tp_ckpt"), "llama", seed=11)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    """One rank's greedy tokens for every prompt."""
    with Engine(model_path=str(model_dir), launch_mode="thread", dtype="float32",
                log_level="warning") as engine:
        return [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("split", "overlap"), [
    ("--tp-size", "off"), ("--pp-size", "off"), ("--pp-size", "on")])
def test_two_ranks_serve_one_rank_s_tokens(model_dir: Path, tmp_path: Path,
                                           reference: list[list[int]], split: str,
                                           overlap: str) -> None:
    server = start_server(model_dir, tmp_path, split, "2", "--dtype", "float32",
                          "--overlap-schedule", overlap)
    try:
        children = server.children()
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            response = client.post("/generate", json={"text": PROMPTS,
                                                      "sampling_params": GREEDY})
            assert response.status_code == 200, response.text
            assert [o["output_ids"] for o in response.json()] == reference
            completion = client.post("/v1/completions", json={
                "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0.0})
            assert completion.status_code == 200, completion.text
            info = wait_until_idle(client)
        assert info["kv_cache_idle_and_free"] is True, info
        assert info["overlap_schedule"] is (overlap == "on")
        assert info[split.removeprefix("--").replace("-", "_")] == 2
        assert info["pid_rank_0"] != info["pid_rank_1"]
        assert info["param_bytes_rank_1"] > 0 and "param_bytes_rank_2" not in info
    finally:
        code = server.stop()
    assert code == 0, server.log()
    assert still_running(children) == []


@pytest.mark.timeout(240)  # a liveness bound: the server must go down, not hang
def test_a_killed_rank_ends_the_server_by_name(model_dir: Path, tmp_path: Path) -> None:
    server = start_server(model_dir, tmp_path, *TP2)
    try:
        children = server.children()
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            victim = scheduler_info(client)["pid_rank_1"]
        os.kill(victim, signal.SIGKILL)
        code = server.proc.wait(timeout=60)
    finally:
        server.stop(signal.SIGKILL)
    assert code != 0
    log = server.log()
    assert "the scheduler rank 1 process exited unexpectedly with code -9 (killed by SIGKILL)" \
        in log, log
    assert still_running(children) == []


@pytest.mark.timeout(300)
def test_two_nodes_on_one_machine_serve_and_a_lost_node_ends_node_0(
    model_dir: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    """``--nnodes 2`` as two process trees meeting on a loopback ``--dist-init-addr``."""
    nodes = ("--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_tcp_port()}", *TP2)
    node1_log = (tmp_path / "node1.log").open("w")
    node1 = subprocess.Popen(
        [sys.executable, "-m", "framework.cli", "serve", "--model-path", str(model_dir),
         "--log-level", "warning", "--node-rank", "1", *nodes],
        stdout=node1_log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    server = None
    try:
        server = start_server(model_dir, tmp_path, "--node-rank", "0", *nodes)
        children = server.children() + child_pids(node1.pid)
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            response = client.post("/generate", json={"text": PROMPTS[0],
                                                      "sampling_params": GREEDY})
            assert response.status_code == 200, response.text
            assert response.json()["output_ids"] == reference[0]
            assert scheduler_info(client)["pid_rank_1"] in child_pids(node1.pid)
        node1.send_signal(signal.SIGTERM)
        assert node1.wait(timeout=60) == 0
        # Idle, node 0 learns of it from the ranks' heartbeat and goes down rather than
        # serve without it.
        assert server.proc.wait(timeout=60) != 0
        assert "rank 0 lost contact with the other scheduler ranks" in server.log(), server.log()
        assert still_running(children) == []
    finally:
        node1.kill()
        node1.wait(10)
        node1_log.close()
        if server is not None:
            server.stop(signal.SIGKILL)


@pytest.mark.timeout(300)
def test_two_replicas_of_two_stages_serve_one_rank_s_tokens(
    model_dir: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    server = start_server(model_dir, tmp_path, "--dp-size", "2", "--pp-size", "2",
                          "--dtype", "float32")
    try:
        children = server.children()
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            response = client.post("/generate", json={"text": PROMPTS * 2,
                                                      "sampling_params": GREEDY})
            assert response.status_code == 200, response.text
            assert [o["output_ids"] for o in response.json()] == reference * 2
            info = wait_until_idle(client)
        assert info["dp_size"] == 2 and info["kv_cache_idle_and_free"] is True, info
        for replica in info["replicas"]:
            assert replica["pp_size"] == 2 and replica["load"]["routed_requests"] > 0
            assert replica["pid_rank_0"] != replica["pid_rank_1"]
    finally:
        code = server.stop()
    assert code == 0, server.log()
    assert still_running(children) == []


def _curve_keys(directory: Path) -> Path:
    """Keys both nodes share: their replicas' channels cross machines over tcp://."""
    zmq_auth = pytest.importorskip("zmq.auth")
    directory.mkdir()
    for name in ("server", "client"):
        zmq_auth.create_certificates(str(directory), name)
    return directory


@pytest.mark.timeout(300)
def test_a_replica_on_each_of_two_nodes_serves_and_a_killed_rank_ends_both_nodes(
    model_dir: Path, tmp_path: Path, reference: list[list[int]]
) -> None:
    """``--dp-size 2 --tp-size 2 --nnodes 2``: replica 0 on node 0, replica 1 on node 1,
    whose rank 0 reaches node 0's front over CURVE-secured tcp:// with the msgpack codec."""
    nodes = ("--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_tcp_port()}",
             "--dp-size", "2", "--curve-key-dir", str(_curve_keys(tmp_path / "keys")),
             "--codec", "msgpack", *TP2)
    node1_log_path = tmp_path / "node1.log"
    with node1_log_path.open("w") as node1_log:
        node1 = subprocess.Popen(
            [sys.executable, "-m", "framework.cli", "serve", "--model-path", str(model_dir),
             "--log-level", "warning", "--node-rank", "1", *nodes],
            stdout=node1_log, stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    server = None
    try:
        server = start_server(model_dir, tmp_path, "--node-rank", "0", *nodes)
        children = server.children() + child_pids(node1.pid)
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            response = client.post("/generate", json={"text": PROMPTS * 2,
                                                      "sampling_params": GREEDY})
            assert response.status_code == 200, response.text
            assert [o["output_ids"] for o in response.json()] == reference * 2
            replicas = wait_until_idle(client)["replicas"]
        assert all(r["load"]["routed_requests"] == len(PROMPTS) for r in replicas)
        on_node1 = child_pids(node1.pid)
        assert replicas[1]["pid_rank_0"] in on_node1 and replicas[0]["pid_rank_0"] not in on_node1
        os.kill(replicas[1]["pid_rank_1"], signal.SIGKILL)
        assert node1.wait(timeout=60) != 0
        assert server.proc.wait(timeout=60) != 0
        assert ("the scheduler replica 1 rank 1 process exited unexpectedly with code -9"
                in node1_log_path.read_text()), node1_log_path.read_text()
        assert "lost contact with" in server.log(), server.log()
        assert still_running(children) == []
    finally:
        node1.kill()
        node1.wait(10)
        if server is not None:
            server.stop(signal.SIGKILL)
