"""The one start-up path (framework.runtime.launch), as the Engine uses it.

Process mode (the default) spawns the Scheduler and the Detokenizer; thread
mode runs them as threads over ``inproc``. A component that fails to start or
dies is reported by name, and nothing is left behind: no child process, no
channel directory.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from framework import Engine
from framework.config import ServerArgs
from framework.runtime.launch import (
    ComponentError,
    ComponentTree,
    plan_components,
    set_torch_threads,
    torch_threads_per_rank,
    usable_cores,
)
from framework.runtime.scheduler import Scheduler
from tests.model_fixtures import make_tiny_checkpoint
from tests.server_harness import own_children

PROMPTS = ["hello", "the quick brown fox jumps over the lazy dog", "def add(a, b):"]
GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
QUIET = {"log_level": "warning"}
# Where StallingScheduler notes that a request reached it (the child inherits the variable).
_MARKER_ENV = "FRAMEWORK_TEST_LAUNCH_MARKER"


class BrokenScheduler(Scheduler):
    """A Scheduler subclass that cannot start (named by dotted path, built in the child)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("broken on purpose")


class StallingScheduler(Scheduler):
    """Takes requests but never runs them; notes in a file that one is waiting."""

    def get_next_batch_to_run(self) -> Any:
        if self.waiting:
            Path(os.environ[_MARKER_ENV]).touch()
        time.sleep(0.01)  # the loop would otherwise spin, as it always has work
        return None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("launch"), "llama", seed=11)


@pytest.fixture(scope="module")
def process_outputs(model_dir: Path) -> dict[str, Any]:
    """One Engine in the default (process) mode: its outputs and what it left behind."""
    before = own_children()
    engine = Engine(model_path=str(model_dir), **QUIET)
    try:
        outputs = engine.generate(PROMPTS, GREEDY)
        info = engine.get_server_info()
        ready = engine.components.scheduler_info
        pids = {h.pid for h in engine.components.handles}
        during = own_children()
    finally:
        engine.shutdown()
    return {"outputs": outputs, "info": info, "ready": ready, "pids": pids, "during": during,
            "before": before, "after": own_children(), "workdir": engine.port_args.workdir}


def test_engine_runs_the_scheduler_in_a_child_process(process_outputs: dict[str, Any]) -> None:
    assert [len(o["output_ids"]) for o in process_outputs["outputs"]] == [12, 12, 12]
    assert process_outputs["info"]["pid"] != os.getpid()
    assert process_outputs["info"]["pid"] in process_outputs["pids"]
    assert process_outputs["pids"] <= process_outputs["during"]  # scheduler and detokenizer
    assert process_outputs["ready"]["model"].vocab_size == 512  # the tiny tokenizer's
    model = process_outputs["ready"]["model"]
    assert model.context_len == process_outputs["info"]["context_length"]


def test_shutdown_leaves_no_child_process_and_no_channel_directory(
    process_outputs: dict[str, Any],
) -> None:
    import multiprocessing

    assert multiprocessing.active_children() == []
    assert process_outputs["after"] <= process_outputs["before"]
    for pid in process_outputs["pids"]:
        assert not Path(f"/proc/{pid}").exists()
    assert not os.path.exists(process_outputs["workdir"])


def test_the_scheduler_process_runs_torch_on_the_rule_s_thread_count(
    process_outputs: dict[str, Any],
) -> None:
    assert process_outputs["ready"]["torch_threads"] == torch_threads_per_rank(usable_cores(), 1)


def test_the_scheduler_process_holds_freed_memory_where_glibc_can(
    process_outputs: dict[str, Any],
) -> None:
    glibc = platform.libc_ver()[0] == "glibc"
    assert process_outputs["ready"]["holds_freed_memory"] is glibc


def test_thread_mode_over_inproc_gives_the_same_greedy_tokens(
    model_dir: Path, process_outputs: dict[str, Any],
) -> None:
    caller_threads = torch.get_num_threads()
    with Engine(model_path=str(model_dir), launch_mode="thread", **QUIET) as engine:
        assert engine.server_args.transport == "inproc"
        outputs = engine.generate(PROMPTS, GREEDY)
        assert engine.get_server_info()["pid"] == os.getpid()
        # The scheduler thread sets its own torch thread count, not the caller's.
        assert torch.get_num_threads() == caller_threads
    assert [o["output_ids"] for o in outputs] == [
        o["output_ids"] for o in process_outputs["outputs"]]


@pytest.mark.parametrize("launch_mode", ["thread", "process"])
def test_an_engine_starts_in_a_fresh_interpreter(model_dir: Path, launch_mode: str) -> None:
    """Nothing imported beforehand: the tokenizer's load overlaps the components' start.

    In thread mode the components import transformers in this very process, so
    the tokenizer is loaded first (two threads importing transformers at once can
    find names missing from its half-initialised lazy module).
    """
    script = (
        "import sys\n"
        "from framework import Engine\n"
        "assert 'transformers' not in sys.modules\n"
        f"with Engine(model_path={str(model_dir)!r}, launch_mode={launch_mode!r},"
        " log_level='warning') as engine:\n"
        "    out = engine.generate('hello', {'max_new_tokens': 3, 'temperature': 0})\n"
        "print(len(out['output_ids']))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "3"


def test_process_mode_refuses_the_inproc_transport(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="inproc transport cannot cross a process boundary"):
        Engine(model_path=str(model_dir), transport="inproc", **QUIET)


@pytest.mark.parametrize("case", ["scheduler_init_raises", "no_weights"])
def test_a_scheduler_that_fails_to_start_is_a_clear_error_and_leaves_nothing(
    case: str, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    if case == "no_weights":
        model = make_tiny_checkpoint(tmp_path, "llama", seed=11)
        for weights in model.glob("*.safetensors"):
            weights.unlink()
        kwargs: dict[str, Any] = {"model_path": str(model)}
        expected = "the scheduler failed to start: no \\*.safetensors files"
    else:
        kwargs = {"model_path": str(model_dir),
                  "scheduler_class": f"{__name__}.BrokenScheduler"}
        expected = "the scheduler failed to start: RuntimeError: broken on purpose"
    # Where PortArgs makes its directory: a short path, as ipc:// socket paths are limited
    # to about 107 bytes (pytest's tmp_path can be longer than that allows).
    channels = Path(tempfile.mkdtemp(prefix="ch-"))
    monkeypatch.setattr(tempfile, "tempdir", str(channels))
    try:
        before = own_children()
        with pytest.raises(ComponentError, match=expected):
            Engine(**kwargs, **QUIET)
        assert own_children() <= before
        assert list(channels.iterdir()) == []
    finally:
        shutil.rmtree(channels, ignore_errors=True)


def test_a_failed_start_in_thread_mode_ends_the_detokenizer_waiting_for_its_class(
        model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The Detokenizer waits for the tokenizer class a Scheduler reports; none ever will, and
    # the stop must end that wait rather than give up on the thread at its deadline.
    before = set(threading.enumerate())
    with caplog.at_level(logging.WARNING, logger="framework.launch"), \
            pytest.raises(ComponentError, match="broken on purpose"):
        Engine(model_path=str(model_dir), launch_mode="thread",
               scheduler_class=f"{__name__}.BrokenScheduler", **QUIET)
    assert "did not stop in time" not in caplog.text
    assert not [t for t in set(threading.enumerate()) - before if t.name == "detokenizer"]


def test_a_tree_stopped_before_it_starts_starts_nothing(model_dir: Path) -> None:
    # A start-up cancelled from another thread (Ctrl-C while the Engine starts) stops the
    # tree while its start() may still be running: nothing may be started after that.
    tree = ComponentTree(ServerArgs(model_path=str(model_dir), **QUIET))
    tree.stop()
    before = own_children()
    with pytest.raises(ComponentError, match="stopped while starting"):
        tree.start()
    assert own_children() <= before
    assert tree.handles and not any(h.is_alive() for h in tree.handles)


@pytest.mark.timeout(120)  # a liveness bound: the failure must come, not hang
def test_a_killed_scheduler_fails_the_waiting_request_by_name(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    marker = tmp_path / "request-waiting"
    monkeypatch.setenv(_MARKER_ENV, str(marker))
    before = own_children()
    engine = Engine(model_path=str(model_dir), torch_threads=2,
                    scheduler_class=f"{__name__}.StallingScheduler", **QUIET)
    try:
        assert engine.components.scheduler_info["torch_threads"] == 2  # --torch-threads wins
        pid = engine.get_server_info()["pid"]

        def kill_once_waiting() -> None:
            deadline = time.monotonic() + 60
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            os.kill(pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_once_waiting, daemon=True)
        killer.start()
        with pytest.raises(RuntimeError, match=r"the scheduler process exited unexpectedly "
                                               r"with code -9 \(killed by SIGKILL\)"):
            engine.generate(PROMPTS[0], GREEDY)
        killer.join()
        assert marker.exists()  # the request had reached the scheduler
        with pytest.raises(RuntimeError, match="scheduler process exited"):
            engine.generate(PROMPTS[0], GREEDY)
    finally:
        engine.shutdown()
    assert own_children() <= before
    assert not os.path.exists(engine.port_args.workdir)


# --------------------------------------------------------------------------- pure functions


def test_a_process_of_its_own_gets_a_bounded_onednn_cache(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
        monkeypatch.delenv(var, raising=False)
    threads = torch.get_num_threads()  # torch is imported here, so its count is set too
    try:
        set_torch_threads(3, own_process=True, needs_torch=False)
        assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "128"
        assert os.environ["OMP_NUM_THREADS"] == "3"
        monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "7")  # the user's choice stays
        set_torch_threads(3, own_process=True, needs_torch=False)
        assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "7"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(("cores", "ranks", "threads"), [
    (1, 1, 1), (2, 1, 1), (3, 1, 2), (16, 1, 15), (16, 2, 7), (16, 4, 3), (9, 8, 1), (4, 8, 1),
])
def test_torch_threads_rule(cores: int, ranks: int, threads: int) -> None:
    assert torch_threads_per_rank(cores, ranks) == threads


def test_plan_gives_every_rank_its_share_and_the_detokenizer_one_thread() -> None:
    specs = plan_components(ServerArgs(), num_ranks=2, cores=9)
    assert [(s.kind, s.rank, s.name, s.torch_threads) for s in specs] == [
        ("scheduler", 0, "scheduler rank 0", 4),
        ("scheduler", 1, "scheduler rank 1", 4),
        ("detokenizer", 0, "detokenizer", 1),
    ]
    one = plan_components(ServerArgs(torch_threads=5), cores=64)
    assert [(s.name, s.torch_threads) for s in one] == [("scheduler", 5), ("detokenizer", 1)]


def test_bad_launch_settings_are_value_errors_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"torch-threads must be in \[1, 1024\], got 0"):
        ServerArgs(torch_threads=0)
    with pytest.raises(ValueError, match="launch_mode"):
        ComponentTree(ServerArgs(launch_mode="fork"))
