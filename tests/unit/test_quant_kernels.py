"""Quantized-linear kernels (reference and CPU) against a float64 product of the weight.

Every kernel and path (torch's packed int8/int4 kernels, widening by blocks, and the native
kernels) must give ``x @ dequantize(w).T + bias`` to float32 accuracy for 1 to 4, 7, 64
and 65 rows, act-order GPTQ included; a repacked weight must still dequantize to
the same matrix.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from framework.layers.quantization import (
    AwqWeight,
    Fp8BlockWeight,
    Fp8Weight,
    GptqWeight,
    Int8Weight,
    QuantizedWeight,
    cpu_kernels,
    quantize_awq,
    quantize_fp8_block,
    quantize_gptq,
)
from framework.layers.quantization.cpu_kernels import (
    CpuFp8Weight,
    CpuInt4Weight,
    CpuInt8ActivationLinear,
    CpuQuantLinear,
)
from framework.layers.quantization.torch_kernels import TorchQuantLinear
from framework.registry import QUANT_LINEAR_BACKENDS
from tests.unit.test_attention_cpu import kernels as native_kernels

OUT, IN = 32, 128


def float_weight(out_features: int = OUT) -> torch.Tensor:
    """A fixed random float weight ``[out_features, IN]``."""
    return torch.randn(out_features, IN, generator=torch.Generator().manual_seed(0))


def fp8_blocks(rows: int, cols: int) -> Fp8BlockWeight:
    """A block-wise FP8 weight of ``rows x cols`` blocks with random block scales."""
    generator = torch.Generator().manual_seed(2)
    scale = torch.rand(-(-OUT // rows), -(-IN // cols), generator=generator) / 100 + 0.001
    codes = (float_weight() * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    return Fp8BlockWeight.from_checkpoint({"weight": codes, "weight_scale_inv": scale},
                                          (rows, cols))


WEIGHTS: dict[str, Callable[[], QuantizedWeight]] = {
    "gptq": lambda: GptqWeight.from_checkpoint(quantize_gptq(float_weight(), 32), 32),
    "gptq-act-order": lambda: GptqWeight.from_checkpoint(
        quantize_gptq(float_weight(), 32, act_order=True), 32),
    "gptq-one-group": lambda: GptqWeight.from_checkpoint(quantize_gptq(float_weight(), -1), -1),
    # 8 outputs: too few for torch's int4 layout, so its path widens nibbles instead.
    "gptq-8-out": lambda: GptqWeight.from_checkpoint(quantize_gptq(float_weight(8), 32), 32),
    "awq": lambda: AwqWeight.from_checkpoint(quantize_awq(float_weight(), 64), 64),
    "fp8-per-channel": lambda: Fp8Weight.from_float(float_weight()),
    "fp8-per-tensor": lambda: Fp8Weight.from_checkpoint({
        "weight": (float_weight() * 50).to(torch.float8_e4m3fn),
        "weight_scale": torch.tensor(0.02)}),
    "fp8-block": lambda: Fp8BlockWeight.from_checkpoint(
        quantize_fp8_block(float_weight(), 32), (32, 32)),
    # Blocks of 24 rows (the last one short: 8) by 32 columns; of 48 columns (the last one
    # short: 32, so the native kernels' groups do not split the features evenly) and of 40
    # (not a multiple of their 16): both widened instead.
    "fp8-block-24x32": lambda: fp8_blocks(24, 32),
    "fp8-block-48": lambda: fp8_blocks(24, 48),
    "fp8-block-40": lambda: fp8_blocks(16, 40),
    "int8": lambda: Int8Weight.from_float(float_weight()),
    # 30 outputs: the native kernels' last features outside their blocks of 2 and 4.
    "int8-30-out": lambda: Int8Weight.from_float(float_weight(30)),
}
KERNELS: dict[str, Callable[[], object]] = {
    "torch": TorchQuantLinear,
    "cpu-packed": lambda: CpuQuantLinear(packed_ops=True, native=False),
    "cpu-widen": lambda: CpuQuantLinear(packed_ops=False, native=False),
    "cpu-native": lambda: CpuQuantLinear(packed_ops=False),
}
#: Row counts: each of the native kernels' blocks of 1 to 4 rows, several blocks, and past
#: their limits (NATIVE_INT8_ROWS, NATIVE_ROWS, INT4_CODES_NATIVE_ROWS).
ROWS = (1, 2, 3, 4, 7, 8, 9, 32, 33, 64, 65)
#: The largest activation code of int4_rows_a8 and int8_rows_a8, and of int4_rows_a16.
INT8_LEVELS, INT16_LEVELS = 127, 32767
#: 4-bit weights whose groups are a multiple of 32 features (int4_rows_a16, int4_rows_a8).
INT4_CODE_WEIGHTS = ("gptq", "gptq-act-order", "gptq-one-group", "gptq-8-out", "awq")


def reference(weight: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``x @ dequantize(w).T + bias`` in float64."""
    return x.double() @ weight.dequantize().double().t() + bias.double()


def rounds_to_int16(kernel: object, prepared: QuantizedWeight, rows: int) -> bool:
    """Whether ``kernel`` multiplies ``rows`` rows by ``prepared`` on int16 activations:
    ``cpu``'s native int8 products and 4-bit ones of groups of 32 features or a multiple
    of them."""
    if type(kernel) is not CpuQuantLinear or kernel.ops is None:
        return False
    codes = isinstance(prepared, Int8Weight) or (
        isinstance(prepared, CpuInt4Weight) and "nibbles" in prepared.tensors
        and prepared.group_size % 32 == 0)
    return codes and rows <= kernel.native_row_limit(prepared)


def expected_product(kernel: object, weight: QuantizedWeight, prepared: QuantizedWeight,
                     x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """What ``kernel`` gives to float32 accuracy: the float64 product of the dequantized
    weight and ``x``, rounded to int16 where the kernel rounds it."""
    if rounds_to_int16(kernel, prepared, x.shape[0]):
        x = rounded_activations(x, prepared, INT16_LEVELS)
    return reference(weight, x, bias)


@pytest.mark.parametrize("kernel_name", sorted(KERNELS))
@pytest.mark.parametrize("weight_name", sorted(WEIGHTS))
def test_kernel_matches_float64_reference(kernel_name: str, weight_name: str) -> None:
    weight = WEIGHTS[weight_name]()
    if kernel_name == "cpu-native":
        native_kernels()  # built (or the test says why not)
    kernel = KERNELS[kernel_name]()
    prepared = kernel.prepare(weight)
    bias = torch.randn(weight.out_features, generator=torch.Generator().manual_seed(1))
    for rows in ROWS:
        x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(rows))
        y = kernel.apply(prepared, x, bias)
        assert y.shape == (rows, weight.out_features) and y.dtype == torch.float32
        torch.testing.assert_close(y.double(), expected_product(kernel, weight, prepared, x, bias),
                                   rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("weight_name", ["gptq-act-order", "awq", "fp8-per-tensor", "fp8-block",
                                         "fp8-block-24x32", "int8"])
def test_few_rows_run_the_native_kernels(monkeypatch: pytest.MonkeyPatch,
                                         weight_name: str) -> None:
    # The other paths refused: up to the native kernels' limit, rows must not need them.
    native_kernels()
    kernel = CpuQuantLinear(packed_ops=False)
    monkeypatch.setattr(kernel, "_apply_torch", lambda *_: pytest.fail("not native"))
    weight = WEIGHTS[weight_name]()
    prepared = kernel.prepare(weight)
    bias = torch.zeros(weight.out_features)
    for rows in range(1, kernel.native_row_limit(prepared) + 1):
        x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(kernel.apply(prepared, x).double(),
                                   expected_product(kernel, weight, prepared, x, bias),
                                   rtol=1e-5, atol=1e-4)


def test_native_kernels_take_every_fp8_code() -> None:
    # All 254 finite E4M3 encodings, normal and subnormal (and two zeros), each times an
    # input of one: K = 16, one step of the kernel.
    finite = [b for b in range(256) if b not in (0x7F, 0xFF)]
    rows = torch.tensor([*finite, 0, 0], dtype=torch.uint8).view(16, 16)
    weight = Fp8Weight.from_checkpoint({"weight": rows.view(torch.float8_e4m3fn),
                                        "weight_scale": torch.tensor(1.0)})
    prepared = CpuQuantLinear(packed_ops=False).prepare(weight)
    ops = native_kernels()
    for column in range(16):
        x = torch.zeros(1, 16)
        x[0, column] = 1.0
        y = ops.fp8_rows(x, prepared.tensors["bits"], prepared.tensors["scale"])
        assert torch.equal(y[0], weight.dequantize()[:, column])


@pytest.mark.parametrize("packed_ops", [True, False])
@pytest.mark.parametrize("weight_name", sorted(WEIGHTS))
def test_cpu_prepare_keeps_the_matrix(packed_ops: bool, weight_name: str) -> None:
    weight = WEIGHTS[weight_name]()
    prepared = CpuQuantLinear(packed_ops=packed_ops).prepare(weight)
    torch.testing.assert_close(prepared.dequantize(), weight.dequantize(), rtol=1e-6, atol=1e-6)


def test_cpu_paths_keep_quantized_bytes() -> None:
    int4 = CpuQuantLinear(packed_ops=True).prepare(WEIGHTS["gptq"]())
    assert isinstance(int4, CpuInt4Weight) and "packed" in int4.tensors
    nibbles = CpuQuantLinear(packed_ops=False).prepare(WEIGHTS["gptq-act-order"]())
    assert nibbles.tensors["nibbles"].dtype == torch.uint8
    assert nibbles.tensors["nibbles"].shape == (OUT, IN // 2)
    fp8 = WEIGHTS["fp8-per-channel"]()
    prepared = CpuQuantLinear().prepare(fp8)
    assert isinstance(prepared, CpuFp8Weight)
    assert prepared.tensors["bits"].data_ptr() == fp8.tensors["weight"].data_ptr()


def test_cpu_fp8_widening_reads_every_byte() -> None:
    # All 254 finite E4M3 encodings, normal and subnormal, through the float16 bit trick.
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    weight = Fp8Weight.from_checkpoint({"weight": codes.view(torch.float8_e4m3fn)[None],
                                        "weight_scale": torch.tensor(1.0)})
    prepared = CpuQuantLinear().prepare(weight)
    assert torch.equal(prepared.dequantize(), weight.dequantize())


@pytest.mark.parametrize("packed_ops", [True, False])
def test_cpu_widening_by_blocks(monkeypatch: pytest.MonkeyPatch, packed_ops: bool) -> None:
    # Blocks of 3 rows (not dividing 32) cover every output of the widening paths, and
    # every input row when a packed int4 weight is read back.
    monkeypatch.setattr(cpu_kernels, "UPCAST_ELEMENTS", 3 * IN)
    kernel = CpuQuantLinear(packed_ops=packed_ops)
    x, bias = torch.randn(5, IN), torch.randn(OUT)
    for name in ("gptq-act-order", "fp8-per-channel", "int8"):
        weight = WEIGHTS[name]()
        prepared = kernel.prepare(weight)
        y = kernel.apply(prepared, x, bias)
        torch.testing.assert_close(y.double(), expected_product(kernel, weight, prepared, x, bias),
                                   rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(prepared.dequantize(), weight.dequantize(), rtol=1e-6,
                                   atol=1e-6)


def test_output_follows_input_dtype_without_bias() -> None:
    weight = WEIGHTS["int8"]()
    x = torch.randn(3, IN)
    for kernel in (TorchQuantLinear(), CpuQuantLinear()):
        y = kernel.apply(kernel.prepare(weight), x.bfloat16(), None)
        assert y.dtype == torch.bfloat16
        expected = x.bfloat16().double() @ weight.dequantize().double().t()
        torch.testing.assert_close(y.double(), expected, rtol=2e-2, atol=5e-2)


def test_unsupported_weights_are_refused() -> None:
    cpu = CpuQuantLinear()
    prepared = cpu.prepare(WEIGHTS["gptq"]())
    with pytest.raises(ValueError, match="does not support 'cpu_int4'"):
        TorchQuantLinear().prepare(prepared)
    with pytest.raises(ValueError, match="from its prepare"):
        cpu.apply(WEIGHTS["gptq"](), torch.randn(1, IN))


def test_registry_names_every_kernel() -> None:
    assert QUANT_LINEAR_BACKENDS.get("torch") is TorchQuantLinear
    assert QUANT_LINEAR_BACKENDS.get("cpu") is CpuQuantLinear
    assert QUANT_LINEAR_BACKENDS.get("cpu_a8") is CpuInt8ActivationLinear


#: Weights the int8-activation kernels take: 4-bit in groups of 32, 64 and 128 features
#: (int4_rows_a8), and int8 (int8_rows_a8).
A8_WEIGHTS = (*INT4_CODE_WEIGHTS, "int8", "int8-30-out")
#: The activation blocks int8_rows_a8 picks from, largest first (one that divides K).
INT8_A8_BLOCKS = (128, 64, 32, 16)


def a8_kernel(weight_name: str) -> tuple[QuantizedWeight, CpuInt8ActivationLinear,
                                         QuantizedWeight]:
    """A weight of ``WEIGHTS``, the ``cpu_a8`` kernel (native) and the weight it prepared."""
    native_kernels()  # built (or the test says why not)
    weight = WEIGHTS[weight_name]()
    kernel = CpuInt8ActivationLinear(packed_ops=False)
    return weight, kernel, kernel.prepare(weight)


def activation_group(prepared: QuantizedWeight) -> int:
    """Features of ``x`` that share a scale next to a prepared weight: a 4-bit weight's
    group, else the largest of ``INT8_A8_BLOCKS`` dividing its input features."""
    if isinstance(prepared, CpuInt4Weight):
        return prepared.group_size
    return next(b for b in INT8_A8_BLOCKS if prepared.in_features % b == 0)


def sorted_groups(t: torch.Tensor, prepared: QuantizedWeight) -> torch.Tensor:
    """``t``'s columns in the prepared weight's sorted input order, by activation group:
    ``[rows, groups, group size]``."""
    perm = prepared.tensors.get("perm")
    if getattr(prepared, "pad_column", False):  # padding rows read a zero column
        t = torch.nn.functional.pad(t, (0, 1))
    ordered = t if perm is None else t[:, perm]
    return ordered.reshape(t.shape[0], -1, activation_group(prepared))


def rounded_activations(x: torch.Tensor, prepared: QuantizedWeight,
                        levels: int = INT8_LEVELS) -> torch.Tensor:
    """``x`` rounded as the integer-activation kernels round it: to integers in
    ``[-levels, levels]`` per row and activation group of the weight's sorted inputs, the
    group's largest ``|x|`` at ``levels``; float64."""
    perm = prepared.tensors.get("perm")
    groups = sorted_groups(x, prepared)
    largest = groups.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(largest > 0, torch.tensor(float(levels)) / largest, torch.zeros(()))
    codes = torch.round(groups * inverse).clamp(-levels, levels)
    rounded = (codes.double() * (largest.double() / levels)).view(x.shape[0], -1)
    if perm is None:
        return rounded
    restored = rounded.new_empty(x.shape[0], x.shape[1] + 1)  # a padding column, dropped
    restored[:, perm] = rounded
    return restored[:, :x.shape[1]]


@pytest.mark.parametrize("weight_name", A8_WEIGHTS)
def test_a8_kernel_multiplies_rounded_activations(weight_name: str) -> None:
    # Up to the native kernels' limit, and past it for int8 weights (torch's int8 GEMM):
    # exactly the dequantized weight times the rounded x (float rounding apart), which
    # differs from x's own product; 4-bit weights past it: x's own product.
    weight, kernel, prepared = a8_kernel(weight_name)
    bias = torch.randn(weight.out_features, generator=torch.Generator().manual_seed(1))
    for rows in ROWS:
        x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(rows))
        y = kernel.apply(prepared, x, bias).double()
        exact = reference(weight, x, bias)
        if (rows > kernel.native_row_limit(prepared)
                and not isinstance(prepared, Int8Weight)):
            torch.testing.assert_close(y, exact, rtol=1e-5, atol=1e-4)
            continue
        expected = reference(weight, rounded_activations(x, prepared), bias)
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4)
        assert (expected - exact).abs().max() > 1e-3


@pytest.mark.parametrize("weight_name", A8_WEIGHTS)
def test_a8_error_is_within_half_an_activation_step(weight_name: str) -> None:
    # Rounding moves each x by at most half its group's step (largest |x| / 127), so an
    # output moves by at most that times the |w| of the group, summed over groups.
    weight, kernel, prepared = a8_kernel(weight_name)
    matrix = weight.dequantize().double()
    group_weight = sorted_groups(matrix.abs(), prepared).sum(-1)
    for rows in (1, 4, 7):
        x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(10 + rows)) * 3
        half_steps = sorted_groups(x, prepared).abs().amax(-1).double() / 254
        bound = half_steps @ group_weight.t()
        error = (kernel.apply(prepared, x).double() - x.double() @ weight.dequantize().double().t())
        assert (error.abs() <= bound + 1e-4).all()


#: FP8 weights: one scale per channel (a tensor's scale read as every channel's), and in
#: blocks (which the bfloat16 GEMM does not take: a block's scale is inside the sum).
A8_FP8_WEIGHTS = ("fp8-per-channel", "fp8-per-tensor", "fp8-block", "fp8-block-48")


def test_native_fp8_bfloat16_widens_every_code_exactly() -> None:
    # All 254 finite E4M3 encodings, normal and subnormal, each to its value times 2^-8.
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)] + [0, 0],
                         dtype=torch.uint8)
    widened = native_kernels().fp8_bfloat16(codes.view(torch.int8).view(16, 16))
    assert widened.dtype == torch.bfloat16 and widened.shape == (16, 16)
    expected = codes.view(torch.float8_e4m3fn).float().view(16, 16) / 256
    assert torch.equal(widened.float(), expected)


@pytest.mark.parametrize("bfloat16_native", [True, False])
@pytest.mark.parametrize("weight_name", A8_FP8_WEIGHTS)
def test_a8_fp8_products_past_the_native_rows_run_in_bfloat16(
        monkeypatch: pytest.MonkeyPatch, weight_name: str, bfloat16_native: bool) -> None:
    # Where the CPU multiplies bfloat16 natively (forced either way here), cpu_a8's FP8
    # products with a scale per channel past 8 rows are x rounded to bfloat16 times the
    # weight, each output rounded to bfloat16 before its scale; fewer rows, FP8 blocks and
    # CPUs without it: x's own product (fp8_rows, or the weight widened to float32).
    monkeypatch.setattr(cpu_kernels, "BFLOAT16_GEMM_IS_NATIVE", bfloat16_native)
    weight, kernel, prepared = a8_kernel(weight_name)
    in_bfloat16 = bfloat16_native and prepared.group_size == -1
    limit = kernel.native_row_limit(prepared)
    assert limit == (cpu_kernels.BFLOAT16_FP8_NATIVE_ROWS if in_bfloat16
                     else cpu_kernels.NATIVE_ROWS)
    zeros = torch.zeros(weight.out_features)
    for rows in ROWS:
        x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(rows)) * 3
        y = kernel.apply(prepared, x).double()
        if rows <= limit or not in_bfloat16:
            torch.testing.assert_close(y, reference(weight, x, zeros), rtol=1e-5, atol=1e-4)
            continue
        expected = reference(weight, x.bfloat16().float(), zeros)
        torch.testing.assert_close(y, expected, rtol=2 ** -8, atol=1e-6)
        unscaled = y / prepared.tensors["scale"].double()
        assert torch.allclose(unscaled, unscaled.bfloat16().double(), rtol=1e-6, atol=0)


def test_a8_int8_activation_blocks_divide_k() -> None:
    # K = 48: blocks of 16 (three per row), each with its own scale.
    ops = native_kernels()
    weight = Int8Weight.from_float(torch.randn(8, 48, generator=torch.Generator().manual_seed(6)))
    prepared = CpuInt8ActivationLinear(packed_ops=False).prepare(weight)
    assert activation_group(prepared) == 16
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(7))
    x[:, 16:32] *= 100  # one block's scale may not round the others
    y = ops.int8_rows_a8(x, prepared.tensors["qweight"], prepared.tensors["scale"])
    expected = reference(weight, rounded_activations(x, prepared), torch.zeros(8))
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-3)
    # Past the native rows, torch's int8 GEMM takes the same blocks.
    many = torch.cat([x] * 5)
    y = cpu_kernels.int8_activation_product(many, prepared.tensors["qweight"],
                                            prepared.tensors["scale"])
    assert y is not None
    torch.testing.assert_close(y.double(), torch.cat([expected] * 5), rtol=1e-5, atol=1e-3)


def test_a8_int8_products_of_features_no_block_divides_widen_the_weight() -> None:
    weight = Int8Weight.from_float(torch.randn(8, 40, generator=torch.Generator().manual_seed(6)))
    kernel = CpuInt8ActivationLinear(packed_ops=False)
    prepared = kernel.prepare(weight)
    x = torch.randn(12, 40, generator=torch.Generator().manual_seed(7))
    assert cpu_kernels.int8_activation_product(x, prepared.tensors["qweight"],
                                               prepared.tensors["scale"]) is None
    torch.testing.assert_close(kernel.apply(prepared, x).double(),
                               reference(weight, x, torch.zeros(8)), rtol=1e-5, atol=1e-4)


def test_a8_kernel_keeps_a_zero_group_at_zero() -> None:
    # A group of zeros has scale 0 and codes 0: no division by zero, its terms vanish.
    weight, _, prepared = a8_kernel("gptq")
    ops = native_kernels()
    x = torch.randn(2, IN, generator=torch.Generator().manual_seed(4))
    x[:, :32] = 0
    y = ops.int4_rows_a8(x, prepared.tensors["nibbles"], prepared.tensors["scales"],
                         prepared.tensors["zero_scales"])
    expected = reference(weight, rounded_activations(x, prepared), torch.zeros(OUT))
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("weight_name", [*INT4_CODE_WEIGHTS, "int8", "int8-30-out"])
def test_cpu_4bit_and_int8_products_multiply_int16_activations(weight_name: str) -> None:
    # cpu's native 4-bit and int8 products round x to int16 per group (int8: per block of
    # up to 128 features): the dequantized weight times
    # the rounded x (float rounding apart); each output within half an activation step
    # (largest |x| / 32767) times the group's |w|, summed over groups, of x's own product.
    # One large feature makes its group's step coarse enough for the rounding to show.
    # Up to 64 rows (a decode step of 64 requests) multiply in integers; int8 weights and
    # 4-bit groups of 128 features or more up to 256 (a short prefill).
    native_kernels()
    weight = WEIGHTS[weight_name]()
    kernel = CpuQuantLinear(packed_ops=False)
    prepared = kernel.prepare(weight)
    group_weight = sorted_groups(weight.dequantize().double().abs(), prepared).sum(-1)
    most = 256 if weight_name in ("int8", "int8-30-out", "gptq-one-group") else 64
    for rows in (1, 4, 7, most):
        x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(20 + rows)) * 3
        x[:, 5] = 1000.0
        y = kernel.apply(prepared, x).double()
        exact = reference(weight, x, torch.zeros(weight.out_features))
        expected = reference(weight, rounded_activations(x, prepared, INT16_LEVELS),
                             torch.zeros(weight.out_features))
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=2e-3)
        assert (expected - exact).abs().max() > 1e-2
        bound = (sorted_groups(x, prepared).abs().amax(-1).double() / (2 * INT16_LEVELS)
                 ) @ group_weight.t()
        assert ((y - exact).abs() <= bound + 2e-3).all()


def test_int16_activations_keep_a_zero_group_at_zero_and_take_large_groups() -> None:
    # A group of zeros has scale 0 and codes 0; a group of K features (one per row) sums
    # in int32 without overflow at the largest codes.
    ops = native_kernels()
    for weight_name in ("gptq", "gptq-one-group"):
        weight = WEIGHTS[weight_name]()
        prepared = CpuQuantLinear(packed_ops=False).prepare(weight)
        x = torch.randn(2, IN, generator=torch.Generator().manual_seed(4))
        x[:, :32] = 0
        x[1, 40] = 1e4  # the rest of its group rounds to few codes
        y = ops.int4_rows_a16(x, prepared.tensors["nibbles"], prepared.tensors["scales"],
                              prepared.tensors["zero_scales"])
        expected = reference(weight, rounded_activations(x, prepared, INT16_LEVELS),
                             torch.zeros(OUT))
        assert torch.isfinite(y).all()
        # Outputs near zero sum terms of 1e4: float32 keeps them to about 1e-3.
        torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-2)


def test_groups_of_16_run_float_activations() -> None:
    # 4-bit groups of 16 run int4_rows on float32 activations, in cpu and cpu_a8 alike.
    native_kernels()
    weight = GptqWeight.from_checkpoint(quantize_gptq(float_weight(), 16), 16)
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(3))
    for kernel in (CpuQuantLinear(packed_ops=False), CpuInt8ActivationLinear(packed_ops=False)):
        y = kernel.apply(kernel.prepare(weight), x)
        torch.testing.assert_close(y.double(), reference(weight, x, torch.zeros(OUT)),
                                   rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("packed_ops", [False, True])
@pytest.mark.parametrize(("start", "length"), [(0, 64), (64, 64), (32, 48)])
def test_a_rank_s_rows_of_an_act_order_weight_pad_their_groups(
        packed_ops: bool, start: int, length: int) -> None:
    # A tensor-parallel rank's input rows of an act-order GPTQ weight hold unequal shares of
    # its groups of 32: each group's rows are padded to the largest share, rounded up to
    # 32, with rows reading a zero column; the products stay those of the rank's part.
    part = WEIGHTS["gptq-act-order"]().narrow_in(start, length)
    g_idx = part.tensors["g_idx"]
    assert len(set(torch.bincount(g_idx.long()).tolist())) > 1  # unequal shares
    kernel = CpuQuantLinear(packed_ops=packed_ops)
    prepared = kernel.prepare(part)
    assert isinstance(prepared, CpuInt4Weight) and prepared.pad_column
    assert prepared.group_size % 32 == 0 and prepared.sorted_features > length
    assert torch.equal(prepared.dequantize(), part.dequantize())
    bias = torch.zeros(OUT)
    for rows in ROWS:
        x = torch.randn(rows, length, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(kernel.apply(prepared, x).double(),
                                   expected_product(kernel, part, prepared, x, bias),
                                   rtol=1e-5, atol=1e-4)


def test_groups_of_unequal_sizes_are_padded_into_equal_runs() -> None:
    # Groups of 127 rows and 1: runs of 128, two of them.
    cpu = CpuQuantLinear()
    tensors = quantize_gptq(float_weight(), 32)
    tensors["g_idx"] = torch.zeros(IN, dtype=torch.int32)
    tensors["g_idx"][-1] = 3
    weight = GptqWeight.from_checkpoint(tensors, 32)
    prepared = cpu.prepare(weight)
    assert prepared.group_size == 128 and prepared.sorted_features == 256
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(cpu.apply(prepared, x).double(),
                               expected_product(cpu, weight, prepared, x, torch.zeros(OUT)),
                               rtol=1e-5, atol=1e-4)
