"""Build and load the native CPU attention kernels (``csrc/``) at first use.

The C++ source is compiled once per machine with the C++ compiler found
(``$CXX``, else ``c++``), for this CPU (``-march=native``) and against the
installed torch, into a cache directory keyed by everything that changes the
binary: the source, the flags, torch's version and the CPU. A build goes to a
temporary file that is renamed into place, so processes building at the same
time (tensor-parallel ranks, parallel tests) never see half a library and
never wait on a lock a killed process left behind. Without a compiler, or if
the build fails, ``load_cpu_kernels`` says why and returns ``None``; the
caller falls back to the torch kernels.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
#: ``-ffast-math`` lets the compiler vectorise the softmax's sums
#: (it reorders them, as every batched kernel does); ``-fopenmp`` is needed by
#: ``at::parallel_for``, which then runs on torch's own OpenMP threads.
CXX_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++20")
#: The link is a step of its own, without ``-ffast-math``: given it, a driver (GCC before
#: 13, some Clangs) links ``crtfastmath.o``, whose constructor turns on flush-to-zero and
#: denormals-are-zero for the whole process that loads the library, changing every
#: float computation there, torch's and the caller's.
LINK_FLAGS = ("-shared", "-fopenmp")
#: Where built kernels are kept (default: ``~/.cache/framework/kernels``).
CACHE_ENV = "FRAMEWORK_KERNEL_CACHE"


def cache_dir() -> Path:
    """The directory that holds built kernels."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "framework" / "kernels"


def _cpu_identity() -> str:
    """The CPU's name and instruction-set flags: ``-march=native`` builds for exactly these.

    The name alone is not enough (two generations of one server line share it, one
    with AVX-512 and one without).
    """
    wanted = ("model name", "flags", "Features")  # x86 and Arm spellings
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    seen: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in wanted:
            seen.setdefault(key.strip(), value.strip())
    return "\n".join(f"{key}: {seen[key]}" for key in wanted if key in seen)


def _build_commands(compiler: str, output: Path, obj: Path) -> list[list[str]]:
    """Compile ``SOURCE`` to ``obj``, then link ``obj`` into the library ``output``."""
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    lib_dirs = cpp_extension.library_paths()
    links = [f"-L{path}" for path in lib_dirs] + [f"-Wl,-rpath,{path}" for path in lib_dirs]
    return [
        [compiler, *CXX_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, "-c", str(SOURCE),
         "-o", str(obj)],
        [compiler, *LINK_FLAGS, str(obj), "-o", str(output), *links, "-lc10", "-ltorch_cpu"],
    ]


def library_path(compiler: str) -> Path:
    """Where the kernels built by ``compiler`` for this machine and torch live."""
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CXX_FLAGS + LINK_FLAGS).encode(), compiler.encode(),
                 torch.__version__.encode(), platform.machine().encode(), _cpu_identity().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / f"framework_cpu_{key.hexdigest()[:20]}.so"


def build(compiler: str) -> Path:
    """Compile the kernels unless a build for this machine is cached; the library's path.

    Raises ``RuntimeError`` with the compiler's message when the build fails.
    """
    target = library_path(compiler)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=target.stem, suffix=".so.partial", dir=target.parent)
    os.close(fd)
    obj = partial.removesuffix(".so.partial") + ".o.partial"
    try:
        for command in _build_commands(compiler, Path(partial), Path(obj)):
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    finally:
        for leftover in (partial, obj):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return target


def find_compiler() -> str | None:
    """The C++ compiler to build with: ``$CXX``, else ``c++`` on the path (None: neither)."""
    return shutil.which(os.environ.get("CXX", "c++"))


@functools.cache
def load_cpu_kernels() -> object | None:
    """``torch.ops.framework_cpu`` with the kernels loaded, or ``None`` if they cannot be built.

    Built (or found in the cache) and loaded once per process.
    """
    compiler = find_compiler()
    if compiler is None:
        logger.warning("no C++ compiler found ($CXX or c++): the native CPU attention "
                       "kernels are off, attention runs on the torch backend")
        return None
    try:
        path = build(compiler)
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as error:
        logger.warning("the native CPU attention kernels could not be built, attention "
                       "runs on the torch backend: %s", error)
        return None
    return torch.ops.framework_cpu
