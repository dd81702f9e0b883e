"""Rounding a weight to its format's grid with the error of each column compensated.

GPTQ's rounding: with ``H = X^T X`` the Gram matrix of the layer's calibration inputs
(rows of ``X`` are input vectors), the input rows are rounded one at a time, most
active first (largest diagonal of ``H``), and each one's rounding error is spread over
the rows not yet rounded through the Cholesky factor of ``H^-1``, so that ``X Q^T``
stays close to ``X W^T`` rather than ``Q`` to ``W``. ``damp`` times the mean diagonal is
added to ``H``'s diagonal to keep it well conditioned.

The layers below a quantized layer are quantized too, so its calibration inputs ``Xq``
differ from the float model's ``Xf``. ``corrected_weight`` first solves for the weight
that best maps ``Xq`` to the float model's outputs ``Xf W^T`` (least squares, pulled
towards ``W`` by the same damping), so that the rounding also absorbs the error the
layers below let through (the asymmetric calibration of GPTAQ).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from framework.layers.quantization.grid import QuantGrid

#: Fits a format's grid to a projection's (checkpoint name, corrected weight, input order).
GridFit = Callable[[str, torch.Tensor, torch.Tensor], QuantGrid]

#: Input rows rounded between two updates of the rows after them (GPTQ's lazy batches).
BLOCK = 128


def damped(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """``hessian`` (float64) with ``damp`` times its mean diagonal added to the diagonal;
    the diagonal of inputs never seen (zero) becomes 1, so it stays invertible."""
    h = hessian.double().clone()
    diagonal = h.diagonal()
    diagonal[diagonal == 0] = 1.0
    diagonal += damp * diagonal.mean()
    return h


def corrected_weight(weight: torch.Tensor, hessian: torch.Tensor, cross: torch.Tensor,
                     damp: float) -> torch.Tensor:
    """The weight ``[out, in]`` that best maps the quantized model's inputs to the float
    model's outputs: ``argmin |Xf W^T - Xq V^T|^2 + d |V - W|^2`` over ``V``.

    Args:
        weight: the float weight ``W``.
        hessian: ``Xq^T Xq``.
        cross: ``Xq^T Xf``.
        damp: the pull towards ``W``, as a fraction of ``hessian``'s mean diagonal.
    """
    h = hessian.double()
    # Inputs never seen have zero rows in both matrices: the pull keeps their weights.
    pull = float(damp * h.diagonal().mean()) or 1.0
    w = weight.double()
    rhs = cross.double() @ w.t() + pull * w.t()
    eye = torch.eye(h.shape[0], dtype=h.dtype)
    return torch.linalg.solve(h + pull * eye, rhs).t().float()


def input_order(hessian: torch.Tensor) -> torch.Tensor:
    """The input rows, most active first (descending diagonal of ``hessian``)."""
    return torch.argsort(hessian.diagonal(), descending=True, stable=True)


def compensate(weight: torch.Tensor, hessian: torch.Tensor, grid: QuantGrid, damp: float
               ) -> torch.Tensor:
    """``weight`` ``[out, in]`` rounded onto ``grid`` input row by input row in
    ``input_order``, each row's error spread over the rows after it; float32 values on
    the grid."""
    order = input_order(hessian)
    h = damped(hessian, damp)[order][:, order]
    # Upper Cholesky factor of H^-1: row k holds how row k's error moves the rows after it.
    factor = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    w = weight.double()[:, order]
    rounded = torch.empty_like(w, dtype=torch.float32)
    columns = w.shape[1]
    for start in range(0, columns, BLOCK):
        end = min(start + BLOCK, columns)
        block = w[:, start:end].clone()
        errors = torch.empty_like(block)
        for j in range(end - start):
            k = start + j
            value = grid.snap(block[:, j:j + 1], order[k:k + 1])
            rounded[:, k:k + 1] = value
            errors[:, j] = (block[:, j] - value[:, 0].double()) / factor[k, k]
            block[:, j + 1:] -= errors[:, j:j + 1] * factor[k:k + 1, k + 1:end]
        w[:, end:] -= errors @ factor[start:end, end:]
    result = torch.empty_like(rounded)
    result[:, order] = rounded
    return result


def calibrated_rounding(name: str, weight: torch.Tensor, hessian: torch.Tensor,
                        cross: torch.Tensor, fit: GridFit, damp: float
                        ) -> tuple[torch.Tensor, QuantGrid]:
    """Checkpoint weight ``name`` corrected towards the float outputs
    (``corrected_weight``), its grid fitted (``fit``, most active inputs first) and the
    corrected weight rounded onto it (``compensate``): the rounded weight and the grid."""
    corrected = corrected_weight(weight, hessian, cross, damp)
    grid = fit(name, corrected, input_order(hessian))
    return compensate(corrected, hessian, grid, damp), grid
