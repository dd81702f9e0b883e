"""``KeptDecodeKV``: where decoding requests keep their keys and values from step to step."""

from __future__ import annotations

import torch

from framework.layers.attention.kept_kv import KeptDecodeKV

CPU = torch.device("cpu")
TABLE = torch.arange(32 * 64).view(32, 64)  # a req_to_token table: row r holds r*64 ..


def filled(steps: list) -> list[int]:
    """The request-pool rows gathered from the pool this step."""
    return sorted(s.group.owners[slot] for s in steps if s.fill_slots is not None
                  for slot in s.fill_slots.tolist())


def appended(steps: list) -> int:
    """How many requests only append their new token this step."""
    return sum(0 if s.append_batch_rows is None else len(s.append_batch_rows) for s in steps)


def test_a_newcomer_takes_a_free_slot_and_only_it_is_gathered() -> None:
    kept = KeptDecodeKV(num_kv_heads=2, slack=8, device=CPU)
    assert filled(kept.plan([3, 5], [10, 12], TABLE)) == [3, 5]
    steps = kept.plan([3, 5], [11, 13], TABLE)
    assert filled(steps) == [] and appended(steps) == 2
    slot_of_5 = kept.where[5][1]
    steps = kept.plan([7, 3], [9, 12], TABLE)  # 5 left, 7 joined, 3 goes on
    assert filled(steps) == [7] and appended(steps) == 1
    assert len(kept.groups) == 1 and kept.where[7][1] == slot_of_5  # 5's slot, reused
    (step,) = steps
    slot_3, slot_7 = kept.where[3][1], kept.where[7][1]
    # Each slot takes its request's query: request 3 is batch row 1, request 7 row 0.
    assert step.query_rows[slot_3] == 1 and step.query_rows[slot_7] == 0
    assert dict(zip(step.out_slots.tolist(), step.out_rows.tolist())) == {slot_3: 1, slot_7: 0}
    assert step.mask[slot_3].sum() == 12 and step.mask[slot_7].sum() == 9
    # The KV slots gathered for request 7: its first 9 entries of req_to_token.
    assert step.fill_kv is not None and step.fill_kv.tolist() == [list(range(448, 457))]


def test_unlike_lengths_go_to_their_own_groups_and_an_outgrown_one_moves() -> None:
    kept = KeptDecodeKV(num_kv_heads=1, slack=4, device=CPU)
    steps = kept.plan([0, 1, 2], [10, 11, 40], TABLE)
    assert sorted(sorted(s.group.owners) for s in steps) == [[0, 1], [2]]
    kept.where[0][0].capacity = 11  # request 1's next token does not fit: it moves
    steps = kept.plan([0, 1, 2], [11, 12, 41], TABLE)
    assert filled(steps) == [1] and appended(steps) == 2
    assert kept.where[1][0] is not kept.where[0][0]


def test_a_row_refilled_by_a_prefill_is_gathered_again() -> None:
    kept = KeptDecodeKV(num_kv_heads=1, slack=4, device=CPU)
    kept.plan([4], [6], TABLE)
    kept.evict([4])  # a prefill gave row 4 to a new request of 6 tokens
    assert filled(kept.plan([4], [7], TABLE)) == [4]


def test_many_holes_place_everyone_afresh() -> None:
    kept = KeptDecodeKV(num_kv_heads=1, slack=1000, device=CPU)
    kept.plan(list(range(20)), [30] * 20, TABLE)
    steps = kept.plan([0], [31], TABLE)  # 19 slots left free: more than 2 * 1 + 8
    assert [s.group.slots for s in steps] == [1] and filled(steps) == [0]
    assert list(kept.where) == [0]
