"""What every test shares: a cache of the run's own, tiny checkpoints built once per session,
and the pool of servers and Engines that tests with the same needs share."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.model_fixtures import make_tiny_checkpoint
from tests.server_harness import ServerProcess, SharedPool, private_tmp

# Each run gets a $XDG_CACHE_HOME of its own (built kernels, remembered tokenizer classes),
# set before anything reads it, so that no test depends on what an earlier run left there.
# pytest-xdist's workers, and the servers and Engines the tests start, inherit it from the
# process that made it, which removes it at exit.
_RUN_CACHE_ENV = "FRAMEWORK_TESTS_RUN_CACHE"
_INHERITED = frozenset(os.environ)
if _RUN_CACHE_ENV not in os.environ:
    os.environ[_RUN_CACHE_ENV] = tempfile.mkdtemp(prefix="framework-tests-cache-")
    atexit.register(shutil.rmtree, os.environ[_RUN_CACHE_ENV], True)
os.environ["XDG_CACHE_HOME"] = os.environ[_RUN_CACHE_ENV]
def pytest_sessionstart(session: pytest.Session) -> None:
    """Start building the native CPU kernels for the run, beside the first tests (once, in
    the process that made the run's cache; a server or test that needs them sooner waits
    for this build, on its lock, rather than compiling its own)."""
    if "PYTEST_XDIST_WORKER" in os.environ or _RUN_CACHE_ENV in _INHERITED:
        return
    command = "from framework.layers.attention.native_build import load_cpu_kernels as load; load()"
    # In a process group of its own: a run that ends first stops its compilers too.
    session.config.stash[_KERNEL_BUILD] = subprocess.Popen(
        [sys.executable, "-c", command], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)


def pytest_sessionfinish(session: pytest.Session) -> None:
    build = session.config.stash.get(_KERNEL_BUILD, None)
    if build is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(build.pid, signal.SIGKILL)
        build.wait()


_KERNEL_BUILD = pytest.StashKey[subprocess.Popen]()
# The shared servers several modules use: the modules that name one go to one worker, which
# starts it once; every other module is a unit of its own (as pytest-xdist's loadfile).
SHARED_SERVER_FIXTURES = ("default_server", "tiny_server", "small_context_server")
_ROOT = Path(__file__).resolve().parents[1]


def _module_units() -> dict[str, str]:
    """Module path (as in node ids) -> the shared server fixture it names, read from its text."""
    units = {}
    for path in sorted((_ROOT / "tests").rglob("test_*.py")):
        text = path.read_text(encoding="utf-8")
        for fixture in SHARED_SERVER_FIXTURES:
            if re.search(rf"\b{fixture}\b", text):
                units[path.relative_to(_ROOT).as_posix()] = fixture
    return units


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    units = _module_units()

    class SharedServerScheduling(LoadScopeScheduling):
        """Whole modules to a worker, and the modules of one shared server together."""

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return units.get(module, module)

    return SharedServerScheduling(config, log)


# The tests' own computations (transformers references, Triton's interpreter) run on one
# thread: they are small, and with every core busy with the other worker and the servers,
# a second OpenMP or BLAS thread of theirs mostly waits for a core, each operation
# stalling on it (several times slower). Servers and Engines set their own counts.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
# At most this many shared servers and Engines alive at once in the whole run.
SHARED_CAPACITY = 3


def _worker_share(total: int) -> int:
    """This process's share of ``total`` among pytest-xdist's workers (all of it alone)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    return max(1, total // workers + (index < total % workers))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``make_tiny_checkpoint`` without its directory argument, built once per session for
    each set of arguments: the directory is shared, so a test must not change it."""
    root = tmp_path_factory.mktemp("tiny")
    built: dict[str, Path] = {}

    def make(arch: str, **kwargs: Any) -> Path:
        key = json.dumps([arch, kwargs], sort_keys=True, default=str)
        if key not in built:
            built[key] = make_tiny_checkpoint(root, arch, **kwargs)
        return built[key]

    return make


@pytest.fixture(scope="session")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedPool]:
    """Servers and Engines shared across modules (``shared.server(...)``, ``shared.engine(...)``),
    at most ``SHARED_CAPACITY`` alive at once in the run."""
    pool = SharedPool(tmp_path_factory.mktemp("shared-servers"),
                      capacity=_worker_share(SHARED_CAPACITY))
    yield pool
    pool.close()
    assert not pool.failures, "\n".join(pool.failures)


@pytest.fixture(scope="module")
def default_server(shared: SharedPool) -> Iterator[ServerProcess]:
    """The server of the README's serve command: the embedded model, zmq and pickle."""
    with shared.server(None, "--transport", "zmq", "--codec", "pickle") as server:
        yield server


@pytest.fixture(scope="module")
def tiny_server(shared: SharedPool, tiny_checkpoint: Callable[..., Path]
                ) -> Iterator[ServerProcess]:
    """A tiny Llama served as ``tiny``, with ``/metrics``: for the tests that need no other
    flag (they must not rely on an empty prefix cache: flush it first)."""
    with shared.server(tiny_checkpoint("llama", seed=4), "--served-model-name", "tiny",
                       "--enable-metrics") as server:
        yield server


@pytest.fixture(scope="module")
def small_context_server(shared: SharedPool, tiny_checkpoint: Callable[..., Path]
                         ) -> Iterator[ServerProcess]:
    """A tiny Llama with a 64-token context and a 512-token KV pool: long prompts overflow,
    generated lengths stay short."""
    with shared.server(tiny_checkpoint("llama", seed=4), "--context-length", "64",
                       "--max-total-tokens", "512") as server:
        yield server


@pytest.fixture
def tmp_env() -> Iterator[dict[str, str]]:
    """An environment with a TMPDIR of the test's own (``private_tmp``)."""
    with private_tmp() as env:
        yield env
