"""On a CUDA GPU: both attention backends serve, and the compiled kernels hold at real sizes.

Skipped where there is no GPU (the kernels' CPU tests run in Triton's
interpreter instead). ``benchmarks/run_attention_gpu.sh`` runs these before the
benchmark on a GPU machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from framework_triton_attention.common import is_interpreter
from framework_triton_attention.decode import decode_attention
from framework_triton_attention.extend import extend_attention

from framework import Engine
from tests.model_fixtures import make_tiny_checkpoint
from tests.plugins.attention_cases import TOLERANCE, make_case, reference, relative_error
from tests.plugins.greedy_rule import assert_same_greedy

if not torch.cuda.is_available() or is_interpreter():
    pytest.skip("needs a CUDA GPU (and TRITON_INTERPRET unset)", allow_module_level=True)

CUDA = torch.device("cuda")
PROMPTS = ["hello", "the quick brown fox jumps over the lazy dog", "def add(a, b):"]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


def greedy(model_dir: Path, device: str, backend: str) -> list[dict[str, Any]]:
    with Engine(model_path=str(model_dir), device=device, attention_backend=backend,
                dtype="float32", launch_mode="thread") as engine:
        return engine.generate(PROMPTS, GREEDY, return_logprob=True, top_logprobs_num=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("model"), "llama", seed=5)


@pytest.fixture(scope="module")
def cpu_reference(model_dir: Path) -> list[dict[str, Any]]:
    return greedy(model_dir, "cpu", "torch")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_backend_serves_on_cuda_with_the_cpu_tokens(backend: str, model_dir: Path,
                                                    cpu_reference: list) -> None:
    for got, ref in zip(greedy(model_dir, "cuda", backend), cpu_reference, strict=True):
        assert_same_greedy(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernels_at_llama_head_layout(dtype: torch.dtype) -> None:
    # Llama-3-8B's layout: 32 query heads, 8 KV heads, head dim 128.
    case = make_case([0, 700, 2048, 1], [333, 64, 1, 129], 32, 8, 128, dtype, CUDA, 11)
    out = torch.full_like(case.q, float("nan"))
    extend_attention(case.q, case.k, case.v, out, case.k_buffer, case.v_buffer,
                     case.indptr(case.new_lens), case.indptr(case.prefix_lens),
                     case.indices(case.prefix_lens), max(case.new_lens), case.scale)
    assert relative_error(out, reference(case)) <= TOLERANCE[dtype]

    decode = make_case([4095, 1, 900, 3000], [1] * 4, 32, 8, 128, dtype, CUDA, 12,
                       write_new=True)
    seq_lens = [p + 1 for p in decode.prefix_lens]
    out = torch.full_like(decode.q, float("nan"))
    partial_out = torch.full((4, 32, 8, 128), float("nan"), device=CUDA)
    partial_lse = torch.full((4, 32, 8), float("nan"), device=CUDA)
    decode_attention(decode.q, decode.k_buffer, decode.v_buffer, out, decode.indptr(seq_lens),
                     decode.indices(seq_lens), partial_out, partial_lse, 8, decode.scale)
    assert relative_error(out, reference(decode)) <= TOLERANCE[dtype]
