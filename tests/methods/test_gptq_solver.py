"""GPTQ's solver against an independent, straightforward implementation of the paper's loop
(column by column, no lazy batches, the inverse Hessian's factor from an explicit inverse), on
small random layers with random Hessians: the codes must be equal, for every option (groups in
order and static under act-order, per row, asymmetric, 3/4/8 bits, block sizes that cut groups,
dead inputs), and the joint N:M mode too. Then the properties: on the grid, at N:M, pruned
exactly 0, RTN worse than GPTQ on the layer's output error."""

from __future__ import annotations

import pytest
import torch

from lmcompress.compressor.config import Sparsity
from lmcompress.compressor.formats import grid
from lmcompress.errors import ConfigError
from lmcompress.methods.gptq.solver import block_step, gptq_quantize
from lmcompress.methods.obs import output_error

ROWS, COLS = 12, 96


def _params(
    x: torch.Tensor, bits: int, sym: bool, half: bool = False, mse: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid of each row of ``x`` (rows, k), written out: float32 scales, as stored
    (``half``: rounded to float16 numbers before the zero point is fitted; ``mse``: the
    reference quantizer's search, ``_mse_params``)."""
    x = x.float()
    maxq = 2**bits - 1
    xmin = x.min(dim=1).values.clamp(max=0)
    xmax = x.max(dim=1).values.clamp(min=0)
    if sym:
        xmax = torch.maximum(-xmin, xmax)
        xmin = -xmax
    empty = (xmin == 0) & (xmax == 0)
    xmin[empty], xmax[empty] = -1.0, 1.0
    scale = (xmax - xmin) / maxq
    if half:
        scale = scale.half().float()
    zero = torch.full_like(scale, 2 ** (bits - 1)) if sym else torch.round(-xmin / scale)
    if mse:
        return _mse_params(x, xmin, xmax, scale, zero, maxq, sym, half)
    return scale, zero


def _mse_params(x, xmin, xmax, scale, zero, maxq, sym, half, norm=2.4, steps=100, shrink=0.8):
    """IST-DASLab/gptq's ``Quantizer.find_params`` with ``mse=True``, as written there: each
    shrink ``p`` of the range tried in turn, a row taking it where its error is smaller."""
    scale, zero = scale.clone(), zero.clone()
    best = torch.full([x.shape[0]], float("inf"))
    for i in range(int(shrink * steps)):
        p = 1 - i / steps
        xmin1, xmax1 = p * xmin, p * xmax
        scale1 = (xmax1 - xmin1) / maxq
        if half:
            scale1 = scale1.half().float()
        zero1 = torch.full_like(scale1, (maxq + 1) // 2) if sym else torch.round(-xmin1 / scale1)
        q = torch.clamp(torch.round(x / scale1[:, None]) + zero1[:, None], 0, maxq)
        err = ((scale1[:, None] * (q - zero1[:, None]) - x).abs() ** norm).sum(1)
        tmp = err < best
        if torch.any(tmp):
            best[tmp] = err[tmp]
            scale[tmp] = scale1[tmp]
            zero[tmp] = zero1[tmp]
    return scale, zero


def reference_gptq(
    W, H, bits, group_size, sym, act_order, percdamp=0.01, nm=None, mask=None, half=False, mse=False
):
    """The paper's Alg. 1 as written, one column at a time (float64)."""
    W, H = W.clone().double(), H.clone().double()
    rows, cols = W.shape
    maxq = 2**bits - 1
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    size = cols if group_size == -1 else group_size
    grids = [_params(W[:, g : g + size], bits, sym, half, mse) for g in range(0, cols, size)]
    perm = torch.argsort(torch.diag(H), descending=True, stable=True) if act_order else None
    perm = torch.arange(cols) if perm is None else perm
    W, H = W[:, perm], H[perm][:, perm]
    keep = None if mask is None else mask[:, perm].clone()
    if nm is not None:
        keep = torch.ones(rows, cols, dtype=torch.bool)
    H += percdamp * torch.mean(torch.diag(H)) * torch.eye(cols, dtype=H.dtype)
    Hinv = torch.linalg.cholesky(torch.linalg.inv(H), upper=True)
    codes = torch.zeros(rows, cols, dtype=torch.uint8)
    for i in range(cols):
        column = int(perm[i])
        if group_size != -1 and not act_order and column % size == 0:  # in order: now
            grids[column // size] = _params(W[:, i : i + size], bits, sym, half, mse)
        scale, zero = (t.double() for t in grids[column // size])
        if nm is not None and i % nm[1] == 0:
            saliency = W[:, i : i + nm[1]] ** 2 / torch.diag(Hinv)[i : i + nm[1]] ** 2
            chosen = saliency.topk(nm[0], dim=1).indices
            keep[:, i : i + nm[1]] = torch.zeros_like(saliency, dtype=torch.bool).scatter(
                1, chosen, True
            )
        q = torch.clamp(torch.round(W[:, i] / scale) + zero, 0, maxq)
        if keep is not None:
            q = torch.where(keep[:, i], q, zero)
        codes[:, column] = q.to(torch.uint8)
        error = (W[:, i] - scale * (q - zero)) / Hinv[i, i]
        W[:, i:] -= error[:, None] * Hinv[i, i:][None, :]
    scales = torch.stack([g[0] for g in grids], dim=1)
    zeros = torch.stack([g[1] for g in grids], dim=1)
    back = torch.argsort(perm)
    return codes, scales, zeros, None if keep is None else keep[:, back]


def _layer(seed: int, dead: bool = True):
    """W (out, in) and a correlated Hessian 2/n XᵀX, float64, one dead input."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(ROWS, COLS, generator=g, dtype=torch.float64)
    mix = torch.randn(COLS, COLS, generator=g, dtype=torch.float64) / COLS**0.5
    X = torch.randn(400, COLS, generator=g, dtype=torch.float64) @ (torch.eye(COLS) + mix)
    X *= torch.rand(COLS, generator=g, dtype=torch.float64) * 3 + 0.1  # uneven diag H
    if dead:
        X[:, 5] = 0
    return W, 2 * X.T @ X / X.shape[0]


CASES = {  # bits, group_size, sym, act_order, blocksize
    "4-bit g16 sym": (4, 16, True, False, 128),
    "4-bit g16 asym act-order": (4, 16, False, True, 128),
    "3-bit per row asym": (3, -1, False, False, 32),
    "8-bit g32 sym act-order": (8, 32, True, True, 20),
    "4-bit g24 asym, block 32 cuts groups": (4, 24, False, False, 32),
    "4-bit g32 sym, block 16 inside groups": (4, 32, True, False, 16),
    "3-bit g48 sym, block 32 not dividing": (3, 48, True, False, 32),
    "4-bit g8 asym act-order, block 7": (4, 8, False, True, 7),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_codes_equal_the_column_by_column_reference(case):
    bits, group_size, sym, act_order, blocksize = CASES[case]
    W, H = _layer(hash(case) % 1000)
    got = gptq_quantize(W, H, bits, group_size, sym, act_order, blocksize=blocksize)
    codes, scales, zeros, _ = reference_gptq(W, H, bits, group_size, sym, act_order)
    assert torch.equal(got.scales, scales.float())
    assert torch.equal(got.zeros, zeros.to(torch.uint8))
    assert torch.equal(got.codes, codes)
    assert got.keep is None
    assert int(got.codes.max()) <= 2**bits - 1
    if sym:
        assert (got.zeros == 2 ** (bits - 1)).all()
    assert (got.weight()[:, 5] == 0).all()  # the dead input


@pytest.mark.parametrize(("sym", "act_order"), [(True, False), (False, True), (False, False)])
def test_float16_scales_equal_the_reference_with_its_scales_rounded_first(sym, act_order):
    """``half_scales``: each group's scale rounded to a float16 number before its zero point
    and codes (in order: when the group is reached), so every stored scale is one."""
    W, H = _layer(11)
    W = W * 1e-3  # small weights: scales far from float16's grid of round numbers
    got = gptq_quantize(W, H, 4, 16, sym, act_order, blocksize=40, half_scales=True)
    codes, scales, zeros, _ = reference_gptq(W, H, 4, 16, sym, act_order, half=True)
    assert torch.equal(got.scales, got.scales.half().float())
    assert torch.equal(got.scales, scales.float())
    assert torch.equal(got.zeros, zeros.to(torch.uint8))
    assert torch.equal(got.codes, codes)
    plain = gptq_quantize(W, H, 4, 16, sym, act_order, blocksize=40)
    assert not torch.equal(plain.scales, got.scales)


@pytest.mark.parametrize(
    ("bits", "group_size", "sym", "act_order", "half"),
    [(4, 16, True, False, False), (4, 16, False, True, False), (3, -1, False, False, True)],
)
def test_mse_clipping_equals_the_reference_quantizer_search(bits, group_size, sym, act_order, half):
    """``mse``: every group's range from the reference's search (in order: on the columns as
    updated when the group is reached; act-order: static), and it clips: some groups take a
    narrower range than their min and max, none a wider one."""
    W, H = _layer(23)
    W[:, 7] *= 6  # an outlier column: its groups gain by clipping it
    got = gptq_quantize(
        W, H, bits, group_size, sym, act_order, blocksize=40, mse=True, half_scales=half
    )
    codes, scales, zeros, _ = reference_gptq(
        W, H, bits, group_size, sym, act_order, half=half, mse=True
    )
    assert torch.equal(got.scales, scales.float())
    assert torch.equal(got.zeros, zeros.to(torch.uint8))
    assert torch.equal(got.codes, codes)
    minmax = gptq_quantize(W, H, bits, group_size, sym, act_order, blocksize=40, half_scales=half)
    if act_order or group_size == -1:  # static grids: the same weights, compared directly
        assert (got.scales <= minmax.scales).all()
        assert (got.scales < minmax.scales).any()
    assert output_error(W, got.weight(), H) < output_error(W, minmax.weight(), H)


@pytest.mark.parametrize("sym", [True, False])
def test_mse_grid_keeps_the_full_range_where_it_is_best_and_never_errs_more(sym):
    """The search includes ``p = 1`` and keeps it on ties (a row already on its grid), and no
    row's ``Σ |x̂ − x|^2.4`` exceeds its min-max grid's; a row with an outlier clips it."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 32, generator=g)
    x[0] = torch.arange(32).float().remainder(16).sub(8) * 0.25  # asymmetric: on its grid
    x[1, 3] = 6.0  # an outlier (a far larger one costs more clipped than rounded)
    plain = grid.grid_params(x, 4, sym)
    fitted = grid.grid_params(x, 4, sym, mse=True)

    def err(params):
        s, z = (t[:, None] for t in params)
        return (grid.on_grid(x, s, z, 4) - x).abs().pow(2.4).sum(1)

    assert (err(fitted) <= err(plain)).all()
    if not sym:  # a symmetric grid's top code is 7.5 steps short of its range: none is exact
        assert float(err(plain)[0]) == 0 and fitted[0][0] == plain[0][0]
    assert fitted[0][1] < plain[0][1] and int((fitted[0] < plain[0]).sum()) > 16
    assert (fitted[0] <= plain[0] * (1 + 1e-6)).all() and (fitted[0] >= 0.2 * plain[0]).all()


@pytest.mark.parametrize("group_size", [16, -1])
@pytest.mark.parametrize("sym", [True, False])
def test_joint_nm_equals_the_reference_lands_on_the_grid_and_at_nm(group_size, sym):
    W, H = _layer(3)
    got = gptq_quantize(W, H, 4, group_size, sym, sparsity=Sparsity(n=2, m=4), blocksize=32)
    codes, _, _, keep = reference_gptq(W, H, 4, group_size, sym, False, nm=(2, 4))
    assert torch.equal(got.keep, keep)
    assert torch.equal(got.codes, codes)
    assert (got.keep.view(ROWS, -1, 4).sum(-1) == 2).all()  # exactly 2 of every 4 kept
    weight = got.weight()
    assert (weight[~got.keep] == 0).all()  # pruned: exactly 0
    assert (weight.view(ROWS, -1, 4) != 0).sum(-1).max() <= 2
    # on the grid: each weight the (correctly rounded) integer multiple (q - z) of its step
    steps = grid.expand(got.scales, COLS).double()
    offsets = got.codes.double() - grid.expand(got.zeros, COLS).double()
    assert torch.equal(weight, (offsets * steps).float())
    assert offsets.abs().max() <= 15 and (offsets[~got.keep] == 0).all()


def test_a_fixed_mask_is_kept_even_under_act_order():
    W, H = _layer(4)
    mask = torch.rand(ROWS, COLS, generator=torch.Generator().manual_seed(0)) > 0.5
    got = gptq_quantize(W, H, 4, 16, False, act_order=True, mask=mask, blocksize=24)
    codes, _, _, keep = reference_gptq(W, H, 4, 16, False, True, mask=mask)
    assert torch.equal(got.keep, mask) and torch.equal(keep, mask)
    assert torch.equal(got.codes, codes)
    assert (got.weight()[~mask] == 0).all()


def test_unstructured_joint_prunes_the_ratio_of_every_block():
    W, H = _layer(5, dead=False)
    got = gptq_quantize(W, H, 4, 16, True, sparsity=Sparsity(ratio=0.5), blocksize=32)
    assert got.keep.sum() == ROWS * COLS // 2
    assert all(got.keep[:, i : i + 32].sum() == ROWS * 16 for i in range(0, COLS, 32))
    assert (got.weight()[~got.keep] == 0).all()


def test_float32_solver_is_as_good_as_the_float64_one():
    """One code rounded the other way changes every later code of its row, so the float32
    codes differ; the error they make does not."""
    W, H = _layer(6)
    exact = gptq_quantize(W, H, 4, 16, False).weight()
    fast = gptq_quantize(W.float(), H.float(), 4, 16, False).weight()
    ratio = output_error(W, fast, H) / output_error(W, exact, H)
    assert 0.97 < ratio < 1.03


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_round_to_nearest_on_the_layer_output_error(bits, act_order):
    W, H = _layer(7)
    H = H.float()
    W = W.float()
    gptq = gptq_quantize(W, H, bits, 16, True, act_order=act_order).weight()
    scales, zeros = grid.group_params(W, bits, 16, True)
    rtn = grid.expand(scales, COLS) * (
        grid.quantize_groups(W, scales, zeros, bits).float() - grid.expand(zeros, COLS)
    )
    assert output_error(W, gptq, H) < 0.8 * output_error(W, rtn, H)


def test_lazy_blocks_start_every_group_on_current_columns():
    assert block_step(128, 128, True, 0) == 128
    assert block_step(128, 32, True, 0) == 128
    assert block_step(32, 24, True, 0) == 24
    assert block_step(16, 64, True, 0) == 16
    assert block_step(32, 48, True, 0) == 48
    assert block_step(30, 8, True, 4) == 24
    assert block_step(30, 8, False, 4) == 28


BAD = {
    "bits 5": ({"bits": 5}, "bits must be one of 3, 4, 8"),
    "group not dividing": ({"group_size": 10}, "does not divide the weight's 96"),
    "group 0": ({"group_size": 0}, "does not divide"),
    "act-order with N:M": (
        {"act_order": True, "sparsity": Sparsity(n=2, m=4), "group_size": 16},
        "cannot choose an N:M mask",
    ),
    "group not a multiple of M": (
        {"group_size": 6, "sparsity": Sparsity(n=2, m=4)},
        "not a multiple of M=4",
    ),
    "N:M not fitting": ({"sparsity": Sparsity(n=2, m=5), "group_size": -1}, "multiple of M=5"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_options_are_one_line_config_errors(case):
    options, message = BAD[case]
    W, H = _layer(0)
    with pytest.raises(ConfigError, match=message) as info:
        gptq_quantize(W, H, **options)
    assert "\n" not in str(info.value)
