"""Build and load the native CPU kernels (``csrc/``) at first use.

The library holds the attention kernel, the fused norm, activation and rotary
layers, and the product of a few rows (``linear_rows``), for float32 and bfloat16, and
by a quantized weight (``int8_rows_a16``, ``int4_rows_a16``, ``fp8_rows``, ...), and a plain Llama
model's decode forward in one call (``llama_decode``, a draft model's).
Its C++ sources are compiled once per machine with the C++ compiler found
(``$CXX``, else ``c++``), for this CPU (``-march=native``) and against the
installed torch, into a cache directory keyed by everything that changes the
binary: the sources and the header they share, the flags, torch's version and
the CPU. Processes that need
the same build at once (tensor-parallel ranks, parallel tests) take turns on an
``flock`` (released when its holder ends, killed or not), so one compiles and
the others find its library; a build goes to a temporary file renamed into
place, so no process ever sees half a library. Without a compiler, or if
the build fails, ``load_cpu_kernels`` says why and returns ``None``; the
caller falls back to the torch kernels.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

from framework.cpuinfo import cpuinfo_fields
from framework.user_cache import user_cache_dir

logger = logging.getLogger(__name__)

#: ``-ffast-math`` lets the compiler vectorise the softmax's and the norm's sums (it
#: reorders them, as every batched kernel does) and SiLU's exponentials; ``-fopenmp`` is
#: needed by ``at::parallel_for``, which then runs on torch's own OpenMP threads.
CXX_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++20")
#: For code that must round exactly as torch's kernels do: no reordering, and no
#: multiply-add contracted into one rounding (``-ffp-contract=off``).
EXACT_CXX_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fopenmp",
                   "-fPIC", "-std=c++20")
_CSRC = Path(__file__).parent / "csrc"
#: The library's sources, each with its compiler flags: the attention kernel, the fused
#: norm and activation, the product of a few rows (float, and quantized weights), the
#: rotary embedding and greedy argmax (exactly torch's), and a plain Llama model's decode
#: forward made of those kernels' calls (``llama_decode``).
SOURCES: tuple[tuple[Path, tuple[str, ...]], ...] = (
    (_CSRC / "paged_attention.cpp", CXX_FLAGS),
    (_CSRC / "layer_ops.cpp", CXX_FLAGS),
    (_CSRC / "linear_rows.cpp", CXX_FLAGS),
    (_CSRC / "quant_rows.cpp", CXX_FLAGS),
    (_CSRC / "exact_ops.cpp", EXACT_CXX_FLAGS),
    (_CSRC / "decode_forward.cpp", CXX_FLAGS),
)
#: The header the sources include (vectors, bfloat16 conversions): part of the build's key.
HEADERS: tuple[Path, ...] = (_CSRC / "vec.h",)
#: The link is a step of its own, without ``-ffast-math``: given it, a driver (GCC before
#: 13, some Clangs) links ``crtfastmath.o``, whose constructor turns on flush-to-zero and
#: denormals-are-zero for the whole process that loads the library, changing every
#: float computation there, torch's and the caller's.
LINK_FLAGS = ("-shared", "-fopenmp")
#: The operators the library registers (``torch.ops.framework_cpu.<name>``).
OPERATORS = ("paged_attention", "write_kv", "rms_norm", "add_rms_norm", "silu_and_mul",
             "linear_rows", "int8_rows_a8", "int4_rows", "int4_rows_a8",
             "int4_rows_a16", "int8_rows_a16", "fp8_rows", "fp8_bfloat16",
             "rotary", "argmax_rows", "llama_decode")
#: The dtypes the kernels compute in (activations, weights and the KV pool alike).
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
#: Where built kernels are kept (default: ``~/.cache/framework/kernels``).
CACHE_ENV = "FRAMEWORK_KERNEL_CACHE"


def cache_dir() -> Path:
    """The directory that holds built kernels."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    return user_cache_dir("kernels")


def _cpu_identity() -> str:
    """The CPU's name and instruction-set flags: ``-march=native`` builds for exactly these.

    The name alone is not enough (two generations of one server line share it, one
    with AVX-512 and one without).
    """
    wanted = ("model name", "flags", "Features")  # x86 and Arm spellings
    seen = cpuinfo_fields(*wanted)
    if not seen:
        return platform.processor()
    return "\n".join(f"{key}: {seen[key]}" for key in wanted if key in seen)


def _build_commands(compiler: str, output: Path, objs: list[Path]) -> list[list[str]]:
    """Compile each of ``SOURCES`` to its ``objs``, then link them into the library ``output``."""
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    lib_dirs = cpp_extension.library_paths()
    links = [f"-L{path}" for path in lib_dirs] + [f"-Wl,-rpath,{path}" for path in lib_dirs]
    compiles = [[compiler, *flags, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, "-c",
                 str(source), "-o", str(obj)]
                for (source, flags), obj in zip(SOURCES, objs, strict=True)]
    link = [compiler, *LINK_FLAGS, *map(str, objs), "-o", str(output), *links, "-lc10",
            "-ltorch_cpu"]
    return [*compiles, link]


def library_path(compiler: str) -> Path:
    """Where the kernels built by ``compiler`` for this machine and torch live."""
    key = hashlib.sha256()
    sources = [source.read_bytes() + " ".join(flags).encode() for source, flags in SOURCES]
    headers = [header.read_bytes() for header in HEADERS]
    for part in (*sources, *headers, " ".join(LINK_FLAGS).encode(), compiler.encode(),
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
    # One build at a time for a target: processes starting together (tensor-parallel ranks,
    # servers side by side) wait for the first build instead of each compiling its own.
    # An flock ends with its holder, so a killed build leaves no lock behind.
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            _build_into(compiler, target)
    return target


def _build_into(compiler: str, target: Path) -> None:
    """Compile and link the kernels into ``target``, through a file renamed into place."""
    fd, partial = tempfile.mkstemp(prefix=target.stem, suffix=".so.partial", dir=target.parent)
    os.close(fd)
    stem = partial.removesuffix(".so.partial")
    objs = [f"{stem}.{source.stem}.o.partial" for source, _ in SOURCES]
    try:
        *compiles, link = _build_commands(compiler, Path(partial), [Path(obj) for obj in objs])
        _run_together(compiles, compiler)  # one compiler per source, on every core
        _run_together([link], compiler)
        os.replace(partial, target)
    finally:
        for leftover in (partial, *objs):
            if os.path.exists(leftover):
                os.unlink(leftover)


def _run_together(commands: list[list[str]], compiler: str) -> None:
    """Run ``commands`` at once and wait for all; ``RuntimeError`` with a failure's message."""
    running = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for command in commands]
    errors = [process.communicate()[1] for process in running]
    for process, error in zip(running, errors, strict=True):
        if process.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {error.strip()[-2000:]}")


def find_compiler() -> str | None:
    """The C++ compiler to build with: ``$CXX``, else ``c++`` on the path (None: neither)."""
    return shutil.which(os.environ.get("CXX", "c++"))


@functools.cache
def load_cpu_kernels() -> SimpleNamespace | None:
    """The kernels, by name (``OPERATORS``), or ``None`` if they cannot be built.

    Each is its operator's one overload (``torch.ops.framework_cpu.<name>.default``):
    called directly, it skips the overload lookup of ``torch.ops.framework_cpu.<name>``,
    a microsecond or two a call, with some fifty calls in a decode step. Built (or
    found in the cache) and loaded once per process.
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
    namespace = torch.ops.framework_cpu
    return SimpleNamespace(**{name: getattr(namespace, name).default for name in OPERATORS})
