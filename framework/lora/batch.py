"""Which adapter each packed row of one forward pass uses.

A forward packs the new tokens of every request; each request names one
adapter slot (or ``NO_SLOT``). The LoRA kernels want the rows grouped by
slot: ``rows`` lists the packed rows that have an adapter, sorted by slot,
and segment ``i`` of it (``seg_starts[i]``, ``seg_lens[i]``) is the rows of
slot ``seg_slots[i]``. ``padded_index`` places each of those rows in a
``[segments, max_seg_len]`` grid, for kernels that batch the segments.

Everything is computed on the host from per-request lists (which the
scheduler holds there) and moved to the device once, so a forward pass that
uses it makes no host sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: The slot of a request that uses no adapter.
NO_SLOT = -1


@dataclass(frozen=True)
class LoraBatch:
    """The adapter slots of one forward pass's packed rows, grouped for the kernels."""

    #: [n] int64: each packed row's slot, ``NO_SLOT`` for none.
    row_slots: torch.Tensor
    #: [m] int64: the rows with an adapter, sorted by slot (stable).
    rows: torch.Tensor
    #: [k] int64: the distinct slots present, ascending.
    seg_slots: torch.Tensor
    #: [m] int64: ``segment * max_seg_len + position in the segment`` of each row of ``rows``.
    padded_index: torch.Tensor
    #: Host copies of the segments' starts (in ``rows``) and lengths.
    seg_starts: tuple[int, ...]
    seg_lens: tuple[int, ...]
    #: The grouping of the rows the model's last layer keeps past its attention
    #: (``output_rows``, e.g. ``ForwardBatch.logits_rows()``); None: it keeps every row.
    output: LoraBatch | None = None

    @property
    def max_seg_len(self) -> int:
        """The longest segment (0 when no row has an adapter)."""
        return max(self.seg_lens, default=0)

    @classmethod
    def build(cls, request_slots: Sequence[int], new_tokens: Sequence[int],
              device: torch.device | str = "cpu",
              output_rows: Sequence[int] | torch.Tensor | None = None) -> LoraBatch:
        """From each request's slot and its new-token count (prefill: the extend length;
        decode: 1), in the order the requests' rows are packed.

        ``output_rows`` (host-side): the packed rows the forward pass's last layer
        keeps after attention, as the model is given them; None when it keeps all.
        """
        if len(request_slots) != len(new_tokens):
            raise ValueError(f"{len(request_slots)} request slots for {len(new_tokens)} "
                             "new-token counts")
        row_slots = torch.repeat_interleave(torch.tensor(request_slots, dtype=torch.int64),
                                            torch.tensor(new_tokens, dtype=torch.int64))
        output = None
        if output_rows is not None:
            kept = torch.as_tensor(output_rows, dtype=torch.int64).cpu()
            output = cls.of_rows(row_slots[kept], device)
        return cls.of_rows(row_slots, device, output)

    @classmethod
    def of_rows(cls, row_slots: torch.Tensor, device: torch.device | str = "cpu",
                output: LoraBatch | None = None) -> LoraBatch:
        """The grouping of rows whose slots are ``row_slots`` (a host tensor)."""
        with_adapter = torch.nonzero(row_slots != NO_SLOT).flatten()
        rows = with_adapter[torch.argsort(row_slots[with_adapter], stable=True)]
        seg_slots, lens = torch.unique(row_slots[with_adapter], return_counts=True)
        starts = torch.cumsum(lens, 0) - lens
        max_len = int(lens.max()) if len(lens) else 0
        segment_of_row = torch.repeat_interleave(torch.arange(len(seg_slots)), lens)
        padded_index = (segment_of_row * max_len + torch.arange(len(rows))
                        - torch.repeat_interleave(starts, lens))
        return cls(
            row_slots=row_slots.to(device), rows=rows.to(device), seg_slots=seg_slots.to(device),
            padded_index=padded_index.to(device), seg_starts=tuple(starts.tolist()),
            seg_lens=tuple(lens.tolist()), output=output,
        )
