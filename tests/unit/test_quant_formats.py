"""Quantized weight formats against their published checkpoint layouts.

The tests pack and unpack bits themselves, with plain loops over Python ints written
from the layouts' descriptions (not with the package's packing), so a loader and the
dequantizer cannot share a misreading: GPTQ v1 (AutoGPTQ), AWQ GEMM (AutoAWQ), FP8 E4M3
(per tensor, per channel, block-wise) and int8 weight-only. Writers are read back the same
way and must land within their format's rounding bound.
"""

from __future__ import annotations

import pytest
import torch

from framework.layers.quantization import (
    AwqWeight,
    Fp8BlockWeight,
    Fp8Weight,
    GptqWeight,
    Int8Weight,
    quantize_awq,
    quantize_fp8,
    quantize_fp8_block,
    quantize_gptq,
    quantize_int8,
)

#: AWQ GEMM: output column c of a group of eight sits in nibble AWQ_NIBBLE[c].
AWQ_NIBBLE = {0: 0, 2: 1, 4: 2, 6: 3, 1: 4, 3: 5, 5: 6, 7: 7}
IN, OUT, GROUP = 32, 16, 8


def to_int32(bits: int) -> int:
    """An unsigned 32-bit pattern as the signed value an int32 tensor stores."""
    return bits - 2**32 if bits >= 2**31 else bits


def nibble(word: int, position: int) -> int:
    """The 4 bits at ``position`` (0 = lowest) of a stored int32."""
    return ((word % 2**32) >> (4 * position)) & 0xF


def gptq_pack_qweight(q: list[list[int]]) -> torch.Tensor:
    """q[i][o] → int32 [in/8, out], input row 8r + j in nibble j of word (r, o)."""
    words = [[0] * len(q[0]) for _ in range(len(q) // 8)]
    for i, row in enumerate(q):
        for o, value in enumerate(row):
            words[i // 8][o] |= value << (4 * (i % 8))
    return torch.tensor([[to_int32(w) for w in row] for row in words], dtype=torch.int32)


def pack_along_out(values: list[list[int]], nibble_of_column: dict[int, int]) -> torch.Tensor:
    """values[r][c] → int32 [rows, cols/8], column c in nibble nibble_of_column[c % 8]."""
    words = [[0] * (len(values[0]) // 8) for _ in values]
    for r, row in enumerate(values):
        for c, value in enumerate(row):
            words[r][c // 8] |= value << (4 * nibble_of_column[c % 8])
    return torch.tensor([[to_int32(w) for w in row] for row in words], dtype=torch.int32)


SEQUENTIAL = {c: c for c in range(8)}


def gptq_unpack(tensors: dict[str, torch.Tensor]) -> tuple[list[list[int]], list[list[int]]]:
    """The writer's q[i][o] and zero points z[g][o] (stored + 1), read with the test's loops."""
    qweight, qzeros = tensors["qweight"].tolist(), tensors["qzeros"].tolist()
    q = [[nibble(qweight[i // 8][o], i % 8) for o in range(len(qweight[0]))]
         for i in range(8 * len(qweight))]
    z = [[nibble(row[c // 8], c % 8) + 1 for c in range(8 * len(row))] for row in qzeros]
    return q, z


def awq_unpack(packed: torch.Tensor) -> list[list[int]]:
    """An AWQ int32 [rows, cols/8] tensor's values [rows][cols], read with the test's loops."""
    words = packed.tolist()
    return [[nibble(row[c // 8], AWQ_NIBBLE[c % 8]) for c in range(8 * len(row))]
            for row in words]


def reference(q: list[list[int]], z: list[list[int]], s: torch.Tensor,
              group_of: list[int]) -> torch.Tensor:
    """w[o][i] = (q[i][o] - z[g][o]) * s[g][o] with g = group_of[i], in float64."""
    scales = s.double().tolist()
    return torch.tensor([[(q[i][o] - z[group_of[i]][o]) * scales[group_of[i]][o]
                          for i in range(len(q))] for o in range(len(q[0]))],
                        dtype=torch.float64)


def random_ints(rows: int, cols: int, low: int, high: int, seed: int) -> list[list[int]]:
    """A seeded ``rows x cols`` list of integers in ``low..high``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (rows, cols), generator=generator).tolist()


def random_scales(groups: int, seed: int) -> torch.Tensor:
    """Seeded float16 scales ``[groups, OUT]`` in 0.01..0.11."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(groups, OUT, generator=generator) * 0.1 + 0.01).half()


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_known_answer(act_order: bool) -> None:
    groups = IN // GROUP
    q = random_ints(IN, OUT, 0, 15, seed=1)
    zeros = random_ints(groups, OUT, 1, 15, seed=2)  # v1 stores zero - 1: 0..14
    scales = random_scales(groups, seed=3)
    if act_order:
        perm = torch.randperm(IN, generator=torch.Generator().manual_seed(4)).tolist()
        group_of = [0] * IN
        for rank, row in enumerate(perm):
            group_of[row] = rank // GROUP
    else:
        group_of = [i // GROUP for i in range(IN)]
    stored_zeros = [[z - 1 for z in row] for row in zeros]
    tensors = {"qweight": gptq_pack_qweight(q), "qzeros": pack_along_out(stored_zeros, SEQUENTIAL),
               "scales": scales, "g_idx": torch.tensor(group_of, dtype=torch.int32)}
    weight = GptqWeight.from_checkpoint(tensors, GROUP)
    assert weight.shape == (OUT, IN)
    assert weight.int_weight().tolist() == q
    assert weight.zeros().tolist() == zeros
    expected = reference(q, zeros, scales, group_of)
    assert torch.equal(weight.dequantize().double(), expected)


def test_gptq_without_g_idx_uses_sequential_groups() -> None:
    q = random_ints(IN, OUT, 0, 15, seed=5)
    zeros = random_ints(1, OUT, 1, 15, seed=6)
    scales = random_scales(1, seed=7)
    tensors = {"qweight": gptq_pack_qweight(q),
               "qzeros": pack_along_out([[z - 1 for z in zeros[0]]], SEQUENTIAL), "scales": scales}
    weight = GptqWeight.from_checkpoint(tensors, -1)
    assert torch.equal(weight.dequantize().double(), reference(q, zeros, scales, [0] * IN))


def test_awq_known_answer() -> None:
    groups = IN // GROUP
    q = random_ints(IN, OUT, 0, 15, seed=8)
    zeros = random_ints(groups, OUT, 0, 15, seed=9)
    scales = random_scales(groups, seed=10)
    tensors = {"qweight": pack_along_out(q, AWQ_NIBBLE),
               "qzeros": pack_along_out(zeros, AWQ_NIBBLE), "scales": scales}
    weight = AwqWeight.from_checkpoint(tensors, GROUP)
    assert weight.shape == (OUT, IN)
    assert weight.int_weight().tolist() == q
    assert weight.zeros().tolist() == zeros
    expected = reference(q, zeros, scales, [i // GROUP for i in range(IN)])
    assert torch.equal(weight.dequantize().double(), expected)


def e4m3_value(byte: int) -> float:
    """An E4M3 (fn) byte's value: sign, 4 exponent bits (bias 7), 3 mantissa bits."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def fp8_bytes(rows: int, cols: int, seed: int) -> list[list[int]]:
    """Random E4M3 bytes without the NaN encodings (0x7f, 0xff)."""
    values = random_ints(rows, cols, 0, 253, seed)
    return [[v + (v >= 0x7F) for v in row] for row in values]


@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_known_answer(per_channel: bool) -> None:
    raw = fp8_bytes(OUT, IN, seed=11)
    weight_bytes = torch.tensor(raw, dtype=torch.uint8).view(torch.float8_e4m3fn)
    # Scales of few significant bits: the float32 products are then exact.
    scale = torch.arange(1, OUT + 1)[:, None] / 8 if per_channel else torch.tensor(0.75)
    weight = Fp8Weight.from_checkpoint({"weight": weight_bytes, "weight_scale": scale})
    row_scale = scale.reshape(-1).expand(OUT).double().tolist()
    expected = torch.tensor([[e4m3_value(b) * row_scale[o] for b in row]
                             for o, row in enumerate(raw)], dtype=torch.float64)
    assert torch.equal(weight.dequantize().double(), expected)


def test_fp8_block_known_answer() -> None:
    """weight_block_size [8, 12] on a 16 x 32 weight: 2 x 3 blocks, the last column of
    blocks 8 wide; element (o, i) takes the scale of block (o // 8, i // 12)."""
    raw = fp8_bytes(OUT, IN, seed=15)
    weight_bytes = torch.tensor(raw, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale = torch.tensor([[1, 2, 3], [5, 6, 7]]) / 16  # few significant bits: exact products
    weight = Fp8BlockWeight.from_checkpoint({"weight": weight_bytes, "weight_scale_inv": scale},
                                            (8, 12))
    scales = scale.double().tolist()
    expected = torch.tensor([[e4m3_value(b) * scales[o // 8][i // 12] for i, b in enumerate(row)]
                             for o, row in enumerate(raw)], dtype=torch.float64)
    assert torch.equal(weight.dequantize().double(), expected)
    with pytest.raises(ValueError, match=r"must be \[2, 3\], got \[2, 2\]"):
        Fp8BlockWeight.from_checkpoint({"weight": weight_bytes,
                                        "weight_scale_inv": scale[:, :2]}, (8, 12))


def test_int8_known_answer() -> None:
    q = random_ints(OUT, IN, -127, 127, seed=12)
    scale = torch.arange(1, OUT + 1) / 128  # few significant bits: exact float32 products
    weight = Int8Weight.from_tensors({"qweight": torch.tensor(q, dtype=torch.int8),
                                      "scale": scale})
    expected = torch.tensor(q, dtype=torch.float64) * scale.double()[:, None]
    assert torch.equal(weight.dequantize().double(), expected)


def float_weight(out_features: int = OUT, in_features: int = 64, seed: int = 13) -> torch.Tensor:
    """A seeded random float weight ``[out_features, in_features]``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=generator)


def assert_within_half_step(w: torch.Tensor, dequantized: torch.Tensor,
                            element_scales: torch.Tensor) -> None:
    """|error| ≤ scale / 2 per element (float32 rounding aside)."""
    error = (dequantized - w.double()).abs()
    assert bool((error <= element_scales / 2 * (1 + 1e-5) + 1e-7).all()), error.max()


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_writer_round_trip(act_order: bool) -> None:
    w = float_weight()
    tensors = quantize_gptq(w, group_size=16, act_order=act_order)
    assert tensors["qweight"].shape == (64 // 8, OUT) and tensors["qweight"].dtype == torch.int32
    assert tensors["qzeros"].shape == (4, OUT // 8) and tensors["scales"].dtype == torch.float16
    group_of = tensors["g_idx"].tolist()
    # Each group holds group_size rows, in act-order not the sequential ones.
    assert sorted(group_of) == [i // 16 for i in range(64)]
    assert (group_of != [i // 16 for i in range(64)]) == act_order
    q, z = gptq_unpack(tensors)
    dequantized = reference(q, z, tensors["scales"], group_of)
    element_scales = tensors["scales"].double()[tensors["g_idx"].long()].t()
    assert_within_half_step(w, dequantized, element_scales)
    loaded = GptqWeight.from_checkpoint(tensors, 16).dequantize().double()
    assert torch.equal(loaded, dequantized)


def test_gptq_writer_act_order_follows_given_order() -> None:
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(14))
    g_idx = quantize_gptq(float_weight(), group_size=16, act_order=True, perm=perm)["g_idx"]
    for rank, row in enumerate(perm.tolist()):
        assert int(g_idx[row]) == rank // 16


def test_awq_writer_round_trip() -> None:
    w = float_weight() + 0.5  # a skewed range: zero points away from the middle
    tensors = quantize_awq(w, group_size=16)
    assert tensors["qweight"].shape == (64, OUT // 8) and tensors["scales"].shape == (4, OUT)
    q, z = awq_unpack(tensors["qweight"]), awq_unpack(tensors["qzeros"])
    group_of = [i // 16 for i in range(64)]
    dequantized = reference(q, z, tensors["scales"], group_of)
    element_scales = tensors["scales"].double().repeat_interleave(16, 0).t()
    assert_within_half_step(w, dequantized, element_scales)
    loaded = AwqWeight.from_checkpoint(tensors, 16).dequantize().double()
    assert torch.equal(loaded, dequantized)


def test_fp8_writer_round_trip() -> None:
    w = float_weight() * torch.logspace(-3, 1, OUT)[:, None]
    tensors = quantize_fp8(w)
    assert tensors["weight"].dtype == torch.float8_e4m3fn
    assert tensors["weight_scale"].shape == (OUT, 1)
    # The per-channel convention: scale = amax / 448, so each row reaches E4M3's maximum.
    assert torch.equal(tensors["weight"].float().abs().amax(dim=1), torch.full((OUT,), 448.0))
    raw = tensors["weight"].view(torch.uint8).tolist()
    scale = tensors["weight_scale"].double()
    dequantized = torch.tensor([[e4m3_value(b) for b in row] for row in raw],
                               dtype=torch.float64) * scale
    # E4M3 keeps 3 mantissa bits: half a step is 2^-4 of a normal value, 2^-10 below 2^-6.
    bound = torch.maximum(w.double().abs() * 2.0**-4, scale * 2.0**-10) * (1 + 1e-5)
    assert bool(((dequantized - w.double()).abs() <= bound).all())
    assert torch.allclose(Fp8Weight.from_float(w).dequantize().double(), dequantized)


def test_fp8_block_writer_round_trip() -> None:
    # Rows of magnitudes 10^-3..10: each 16 x 16 block gets a scale of its own.
    w = float_weight() * torch.logspace(-3, 1, OUT)[:, None]
    tensors = quantize_fp8_block(w, 16)
    assert tensors["weight"].dtype == torch.float8_e4m3fn
    scale = tensors["weight_scale_inv"].double()
    assert scale.shape == (1, 4)
    raw = tensors["weight"].view(torch.uint8).tolist()
    element_scales = scale.repeat_interleave(16, 1)
    dequantized = torch.tensor([[e4m3_value(b) for b in row] for row in raw],
                               dtype=torch.float64) * element_scales
    # Each block's largest magnitude lands on E4M3's maximum.
    codes = tensors["weight"].float().abs().reshape(OUT, 4, 16)
    assert torch.equal(codes.amax(dim=(0, 2)), torch.full((4,), 448.0))
    bound = torch.maximum(w.double().abs() * 2.0**-4, element_scales * 2.0**-10) * (1 + 1e-5)
    assert bool(((dequantized - w.double()).abs() <= bound).all())
    loaded = Fp8BlockWeight.from_checkpoint(tensors, (16, 16)).dequantize().double()
    assert torch.allclose(loaded, dequantized)  # the loader multiplies in float32


def test_int8_writer_round_trip() -> None:
    w = float_weight()
    tensors = quantize_int8(w)
    assert tensors["qweight"].dtype == torch.int8 and tensors["scale"].shape == (OUT,)
    assert int(tensors["qweight"].abs().max()) == 127
    dequantized = tensors["qweight"].double() * tensors["scale"].double()[:, None]
    assert_within_half_step(w, dequantized, tensors["scale"].double()[:, None].expand_as(w))


@pytest.mark.parametrize("build", [
    lambda: GptqWeight.from_checkpoint({"qweight": torch.zeros(4, 16, dtype=torch.int32),
                                        "scales": torch.ones(4, 16)}, 8),
    lambda: AwqWeight.from_checkpoint({"qweight": torch.zeros(32, 2, dtype=torch.int32),
                                       "qzeros": torch.zeros(3, 2, dtype=torch.int32),
                                       "scales": torch.ones(3, 16)}, 8),
    lambda: Fp8Weight.from_checkpoint({"weight": torch.zeros(4, 4),
                                       "weight_scale": torch.ones(())}),
    lambda: Int8Weight.from_tensors({"qweight": torch.zeros(4, 4, dtype=torch.int8),
                                     "scale": torch.ones(3)}),
])
def test_malformed_checkpoints_are_refused(build) -> None:
    with pytest.raises(ValueError):
        build()
