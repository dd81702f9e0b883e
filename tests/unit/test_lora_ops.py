"""The batched LoRA kernels and ``LoraBatch`` against a float64 loop over rows."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from framework.lora.batch import NO_SLOT, LoraBatch
from framework.lora.ops import cpu_lora_delta, torch_lora_delta
from framework.registry import LORA_BACKENDS

IN, OUT, MAX_RANK = 24, 20, 16
RANKS = (4, 8, 16)  # slots 0, 1, 2; zero-padded to MAX_RANK
KERNELS = [torch_lora_delta, cpu_lora_delta]


def padded_adapters(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stacked ``a``, ``b``, ``scalings`` of three adapters of ranks 4, 8 and 16."""
    generator = torch.Generator().manual_seed(seed)
    a = torch.zeros(len(RANKS), MAX_RANK, IN)
    b = torch.zeros(len(RANKS), OUT, MAX_RANK)
    for slot, rank in enumerate(RANKS):
        a[slot, :rank] = torch.randn(rank, IN, generator=generator)
        b[slot, :, :rank] = torch.randn(OUT, rank, generator=generator)
    return a, b, torch.tensor([0.5, 2.0, 1.25])


def row_loop(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scalings: torch.Tensor,
             row_slots: list[int]) -> torch.Tensor:
    """The definition, row by row in float64."""
    out = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float64)
    for row, slot in enumerate(row_slots):
        if slot != NO_SLOT:
            out[row] = scalings[slot].double() * (b[slot].double() @ (a[slot].double()
                                                                      @ x[row].double()))
    return out


def per_row_slots(slots: list[int], lens: list[int]) -> list[int]:
    return [slot for slot, length in zip(slots, lens, strict=True) for _ in range(length)]


CASES = [
    # (request slots, new tokens per request): a prefill mixing slots, including none
    ([NO_SLOT, 2, 0, 1, 2, NO_SLOT, 0], [3, 5, 1, 4, 2, 6, 7]),
    # a decode step: one token each
    ([1, 0, NO_SLOT, 2, 1, 1, 0, 2], [1] * 8),
    # every row on one adapter
    ([1, 1, 1], [2, 3, 1]),
    # no row on an adapter
    ([NO_SLOT, NO_SLOT], [4, 1]),
]


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.__name__)
@pytest.mark.parametrize(("slots", "lens"), CASES)
def test_kernels_match_a_float64_loop_over_rows(
        kernel: Callable[..., torch.Tensor], slots: list[int], lens: list[int]) -> None:
    a, b, scalings = padded_adapters(seed=len(slots))
    x = torch.randn(sum(lens), IN, generator=torch.Generator().manual_seed(1))
    batch = LoraBatch.build(slots, lens)
    got = kernel(x, a, b, scalings, batch)
    expected = row_loop(x, a, b, scalings, per_row_slots(slots, lens))
    assert got.dtype == x.dtype and got.shape == (x.shape[0], OUT)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


def test_batch_groups_the_rows_by_slot() -> None:
    batch = LoraBatch.build([2, NO_SLOT, 0, 2], [2, 1, 3, 1])
    assert batch.row_slots.tolist() == [2, 2, NO_SLOT, 0, 0, 0, 2]
    assert batch.rows.tolist() == [3, 4, 5, 0, 1, 6]  # slot 0's rows, then slot 2's
    assert batch.seg_slots.tolist() == [0, 2]
    assert (batch.seg_starts, batch.seg_lens) == ((0, 3), (3, 3))
    assert batch.padded_index.tolist() == [0, 1, 2, 3, 4, 5]
    uneven = LoraBatch.build([1, 0], [1, 3])
    assert uneven.padded_index.tolist() == [0, 1, 2, 3]  # slot 0: 3 rows, slot 1: 1 of 3
    assert LoraBatch.build([1, 0, 0], [4, 1, 1]).padded_index.tolist() == [0, 1, 4, 5, 6, 7]
    kept = LoraBatch.build([2, NO_SLOT, 0], [2, 1, 3], output_rows=[1, 2, 5, 0])
    assert kept.output is not None and kept.row_slots.shape == (6,)
    assert kept.output.row_slots.tolist() == [2, NO_SLOT, 0, 2]
    assert kept.output.rows.tolist() == [2, 0, 3]
    with pytest.raises(ValueError, match="2 request slots for 1"):
        LoraBatch.build([0, 1], [1])


def test_kernels_are_registered() -> None:
    assert LORA_BACKENDS.get("torch") is torch_lora_delta
    assert LORA_BACKENDS.get("cpu") is cpu_lora_delta
