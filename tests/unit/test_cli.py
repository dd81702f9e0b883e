"""The command line: the generated reference is current, and user errors are one line."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from framework.cli import build_parser, render_cli_reference
from framework.config import ServerArgs
from framework.model_facts import ModelFacts

ROOT = Path(__file__).resolve().parents[2]


def test_docs_cli_reference_is_generated_from_the_parser() -> None:
    assert (ROOT / "docs" / "cli.md").read_text() == render_cli_reference(), (
        "docs/cli.md is stale: run `python -m framework.cli reference > docs/cli.md`"
    )


def test_serve_flags_map_onto_server_args() -> None:
    args = build_parser().parse_args([
        "serve", "--model-path", "/m", "--transport", "shm", "--codec", "msgpack",
        "--stream-interval", "5", "--allow-insecure-pickle", "--mem-fraction", "0.5",
    ])
    server_args = ServerArgs.from_cli_args(args)
    assert server_args == ServerArgs(model_path="/m", transport="shm", codec="msgpack",
                                     stream_interval=5, allow_insecure_pickle=True,
                                     mem_fraction=0.5)


def test_serve_help_is_grouped() -> None:
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for group in ("model:", "server:", "transport:", "runtime:", "extending:", "logging:"):
        assert group in help_text


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "framework.cli", *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def test_a_missing_model_directory_is_a_one_line_error(tmp_path: Path) -> None:
    result = run_cli("serve", "--model-path", str(tmp_path / "nowhere"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    # Named as the flag the user gave, not as the tokenizer path it defaults.
    assert lines[0] == f"framework: error: model path '{tmp_path / 'nowhere'}' does not exist"


@pytest.mark.parametrize(("flags", "words"), [
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size must be at least 1, got 0"),
    (["--api-key="], "--api-key must not be empty"),
    (["--port", "70000"], "--port must be in [0, 65535], got 70000"),
    (["--stream-interval", "0"], "--stream-interval must be at least 1"),
    (["--max-request-bytes", "-1"], "--max-request-bytes must be at least 1"),
    (["--graceful-shutdown-timeout", "nan"], "--graceful-shutdown-timeout must be"),
    (["--max-running-requests", "0"], "--max-running-requests must be at least 1"),
    (["--torch-threads", "100000"], "--torch-threads must be in [1, 1024]"),
    (["--host", "no.such.host.invalid"], "cannot listen on no.such.host.invalid:30000"),
    # Names from a registry are checked with the arguments, before any model loads.
    (["--grammar-backend", "nosuch"],
     "--grammar-backend: unknown grammar backend 'nosuch'; known: none, xgrammar"),
    (["--attention-backend", "nosuch"], "--attention-backend: unknown attention backend "
     "'nosuch'; known: auto, cpu, torch"),
    (["--codec", "nosuch"], "--codec: unknown codec 'nosuch'; known: json, msgpack, pickle"),
    (["--schedule-policy", "nosuch"],
     "--schedule-policy: unknown schedule policy 'nosuch'; known: fcfs, lpm"),
    (["--load-balance-method", "nosuch"], "--load-balance-method: unknown load balancer "
     "'nosuch'; known: round_robin, shortest_queue"),
])
def test_a_value_no_server_could_run_with_is_a_one_line_error(flags: list[str],
                                                              words: str) -> None:
    result = run_cli("serve", *flags)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"framework: error: {words}"), lines


def test_a_port_in_use_is_a_one_line_error_before_the_model_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("serve", "--port", str(port))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"framework: error: cannot listen on 127.0.0.1:{port}: Address already in use"]
    assert "serving" not in result.stdout  # it failed before the banner, and the load


def test_an_unknown_transport_lists_the_known_ones(tmp_path: Path) -> None:
    result = run_cli("bench", "transport", "--transports", "carrier-pigeon", "--quick",
                     "--output", str(tmp_path))
    assert result.returncode == 2
    assert "carrier-pigeon" in result.stderr
    assert "zmq" in result.stderr


def test_a_model_directory_without_weights_is_a_one_line_error(tmp_path: Path) -> None:
    from tests.model_fixtures import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path, "llama")
    for weights in model.glob("*.safetensors"):
        weights.unlink()
    result = run_cli("serve", "--model-path", str(model), "--log-level", "error")
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        f"framework: error: the scheduler failed to start: no *.safetensors files in model "
        f"directory '{model}'"
    ], result.stderr


def test_a_kv_cache_that_host_memory_cannot_hold_is_a_one_line_error(tmp_path: Path) -> None:
    from tests.model_fixtures import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path, "llama")
    result = run_cli("serve", "--model-path", str(model), "--device", "cpu",
                     "--mem-fraction", "1e-12", "--log-level", "error")
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith("framework: error: the scheduler failed to start: no host "
                                "memory left for the KV cache"), result.stderr


def test_the_start_up_banner_suggests_a_route_the_model_serves() -> None:
    from framework.server.app import ServerState
    from framework.server.serve import _startup_banner

    def banner(is_embedding: bool, api_key: str | None = None) -> str:
        args = ServerArgs(model_path="m", api_key=api_key)
        state = ServerState(tokenizer_manager=None, server_args=args,  # type: ignore[arg-type]
                            model_name="m", model_path="m",
                            model=ModelFacts(context_len=16, vocab_size=16,
                                             is_embedding=is_embedding, hidden_size=8))
        return _startup_banner(args, state, "http://127.0.0.1:1", "cpu")

    assert "curl http://127.0.0.1:1/v1/completions" in banner(False)
    assert '"prompt": ' in banner(False)
    embedding = banner(True, api_key="secret")
    assert "curl http://127.0.0.1:1/v1/embeddings" in embedding and '"input": ' in embedding
    assert "$API_KEY" in embedding and "secret" not in embedding


def test_python_dash_m_framework_prints_the_version() -> None:
    from framework import __version__

    result = subprocess.run([sys.executable, "-m", "framework", "--version"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"framework {__version__}"
