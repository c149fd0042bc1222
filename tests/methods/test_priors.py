"""The one-shot priors of learned masks: pure mask functions, and the end-to-end prior through
the layer-wise loop, identical to running the one-shot pruner itself."""

import typing

import pytest
import torch

from lmcompress import MagnitudeConfig, SparseGPTConfig, WandaConfig, compress
from lmcompress.compressor.calibration.observers import HessianAccumulator
from lmcompress.compressor.config import Sparsity
from lmcompress.compressor.model.surgery import LayerSelection, weight_matrix
from lmcompress.methods.magnitude.prior import magnitude_mask
from lmcompress.methods.maskllm.config import Prior
from lmcompress.methods.priors import ONE_SHOT_PRIORS, one_shot_prior_masks
from lmcompress.methods.sparsegpt.solver import sparsegpt_mask, sparsegpt_prune
from lmcompress.methods.wanda.scores import wanda_mask

ONE_SHOT = {
    "magnitude": MagnitudeConfig(sparsity="2:4"),
    "wanda": WandaConfig(sparsity="2:4"),
    "sparsegpt": SparseGPTConfig(sparsity="2:4", update_weights=False),
}


def _data():
    return torch.randint(3, 256, (10, 32), generator=torch.Generator().manual_seed(0))


def test_the_table_covers_every_prior_but_none():
    assert set(ONE_SHOT_PRIORS) == set(typing.get_args(Prior)) - {"none"}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("prior", sorted(ONE_SHOT))
def test_prior_masks_equal_the_one_shot_method(prior, family):
    from conftest import make_tiny_model

    reference = make_tiny_model(family)
    compress(reference, ONE_SHOT[prior], _data())
    expected = {n: weight_matrix(m) != 0 for n, m in LayerSelection().select(reference).items()}

    model = make_tiny_model(family)
    layers = LayerSelection().select(model)
    before = {n: weight_matrix(m).detach().clone() for n, m in layers.items()}
    masks = one_shot_prior_masks(
        model, _data(), layers, prior, lambda _n: Sparsity(2, 4), torch.device("cpu")
    )
    assert masks.keys() == expected.keys()
    for name, keep in masks.items():
        assert keep.dtype == torch.bool
        assert torch.equal(keep, expected[name]), name
        assert torch.all(keep.reshape(-1, 4).sum(1) == 2), name
        assert torch.equal(weight_matrix(layers[name]), before[name]), name  # restored


def test_later_blocks_see_the_pruned_inputs():
    """The SparseGPT prior of block 1 comes from block 0 pruned, not from the dense model."""
    from conftest import make_tiny_model

    model = make_tiny_model("llama")
    layers = LayerSelection().select(model)
    sparsity = Sparsity(2, 4)
    masks = one_shot_prior_masks(model, _data(), layers, "sparsegpt", lambda _n: sparsity, "cpu")
    # block 1's masks from the dense model's Hessians differ somewhere
    H = {n: HessianAccumulator(weight_matrix(m).shape[1]) for n, m in layers.items()}
    hooks = [
        m.register_forward_pre_hook(lambda _m, a, h=H[n]: h.add_batch(a[0]))
        for n, m in layers.items()
    ]
    with torch.no_grad():
        for start in range(0, 10, 8):
            model(input_ids=_data()[start : start + 8])
    for hook in hooks:
        hook.remove()
    dense_masks = {
        n: sparsegpt_mask(weight_matrix(m).detach(), H[n].H, sparsity) for n, m in layers.items()
    }
    block1 = [n for n in layers if ".layers.1." in n]
    assert any(not torch.equal(masks[n], dense_masks[n]) for n in block1)


def _weight_and_inputs(seed=0, out=8, features=16):
    generator = torch.Generator().manual_seed(seed)
    W = torch.randn(out, features, generator=generator)
    X = torch.randn(64, features, generator=generator) * torch.linspace(0.1, 3, features)
    return W, X


def test_magnitude_mask_keeps_the_largest_weights():
    W, _ = _weight_and_inputs()
    keep = magnitude_mask(W, None, Sparsity(2, 4))
    groups, kept = W.abs().reshape(-1, 4), keep.reshape(-1, 4)
    assert torch.all(kept.sum(1) == 2)
    assert torch.all(
        groups[kept].reshape(-1, 2).min(1).values >= groups[~kept].reshape(-1, 2).max(1).values
    )
    unstructured = magnitude_mask(W, None, Sparsity(ratio=0.25))
    assert int((~unstructured).sum()) == W.numel() // 4
    assert W.abs()[unstructured].min() >= W.abs()[~unstructured].max()


def test_wanda_mask_weighs_by_input_norms():
    W, X = _weight_and_inputs()
    norms = X.norm(dim=0)
    keep = wanda_mask(W, norms, Sparsity(2, 4))
    scores = (W.abs() * norms).reshape(-1, 4)
    expected = scores >= scores.topk(2, dim=1).values[:, -1:]
    assert torch.equal(keep.reshape(-1, 4), expected)
    assert not torch.equal(keep, magnitude_mask(W, None, Sparsity(2, 4)))  # norms matter here


def test_unstructured_wanda_mask_ranks_within_each_output_row():
    """Wanda's Eq. 1 compares scores within a row: at 50 % every row keeps exactly half of its
    weights, and those are its own largest scores (brute force: each row sorted alone). Rows of
    very different magnitudes make a layer-wide ranking keep most of one row and little of
    another."""
    W, X = _weight_and_inputs(out=8, features=64)
    W = W * torch.logspace(-2, 2, 8)[:, None]  # row i ~ 10^(4i/7 - 2)
    norms = X.norm(dim=0)
    keep = wanda_mask(W, norms, Sparsity(ratio=0.5))
    assert keep.sum(1).tolist() == [32] * 8, f"kept per row: {keep.sum(1).tolist()}"
    for row, kept in zip(W.abs() * norms, keep, strict=True):
        expected = torch.zeros(64, dtype=torch.bool)
        expected[row.argsort(descending=True)[:32]] = True
        assert torch.equal(kept, expected)


def _sparsegpt_nm_mask_reference(W, H, n, m, percdamp=0.01, update=True):
    """SparseGPT's N:M mask selection (Alg. 1) written the slow, textbook way: no blocks, no
    Cholesky factor, an explicit inverse per column, float64. With the columns before ``j``
    fixed, the inverse Hessian of the remaining ones is ``inv(H[j:, j:])``; its first entry
    gives the saliency ``w² / [H_F⁻¹]_00`` of column ``j`` (OBS) and its first row the update of
    the columns after it (``W[:, j:] -= w_j / [H_F⁻¹]_00 · H_F⁻¹[0]`` where ``w_j`` is pruned).
    At each group's first column the ``m − n`` least salient weights of each row are pruned.
    ``update=False``: the same saliencies on the original weights."""
    W, H = W.double().clone(), H.double().clone()
    H += percdamp * H.diagonal().mean() * torch.eye(H.shape[0], dtype=H.dtype)
    rows, cols = W.shape
    inverses = [torch.linalg.inv(H[j:, j:]) for j in range(cols)]
    keep = torch.ones(rows, cols, dtype=torch.bool)
    for j in range(cols):
        if j % m == 0:
            d = torch.stack([inverses[q][0, 0] for q in range(j, j + m)])  # (m,)
            saliency = W[:, j : j + m].square() / d  # (rows, m)
            for r in range(rows):
                for q in saliency[r].argsort()[: m - n].tolist():
                    keep[r, j + q] = False
        if update:
            pruned = torch.where(keep[:, j], 0.0, W[:, j])  # (rows,)
            W[:, j:] -= torch.outer(pruned / inverses[j][0, 0], inverses[j][0])
    return keep


@pytest.mark.parametrize(("n", "m"), [(2, 4), (1, 4)])
def test_sparsegpt_mask_is_the_obs_selection_of_the_paper(n, m):
    """Against an independent, unblocked float64 implementation of the selection; the updates
    matter here (the mask differs from the one scored on the original weights)."""
    W, X = _weight_and_inputs(out=8, features=32)
    H = 2 * X.double().T @ X.double() / X.shape[0]  # SparseGPT's H = 2/n Σ x xᵀ
    keep = sparsegpt_mask(W, H, Sparsity(n, m))
    expected = _sparsegpt_nm_mask_reference(W, H, n, m)
    assert torch.equal(keep, expected)
    assert torch.all(keep.reshape(-1, m).sum(1) == n)
    assert not torch.equal(keep, _sparsegpt_nm_mask_reference(W, H, n, m, update=False))
    W_new, keep_again = sparsegpt_prune(W, H, Sparsity(n, m), update_weights=False)
    assert torch.equal(keep_again, keep) and torch.equal(W_new, W.masked_fill(~keep, 0))


@pytest.mark.parametrize("prior", sorted(ONE_SHOT_PRIORS))
def test_statistic_from_the_hessian_gives_the_same_mask(prior):
    """The block-wise mode reads each prior's statistic off the Hessian it has: same mask."""
    W, X = _weight_and_inputs(seed=1)
    spec = ONE_SHOT_PRIORS[prior]
    hessian = HessianAccumulator(W.shape[1])
    hessian.add_batch(X)
    from_hessian = spec.mask(W, spec.from_hessian(hessian.H), Sparsity(2, 4))
    if spec.accumulator is None:
        own = spec.mask(W, None, Sparsity(2, 4))
    else:
        acc = spec.accumulator(W.shape[1], W.device)
        acc.add_batch(X)
        own = spec.mask(W, spec.statistic(acc), Sparsity(2, 4))
    assert torch.equal(from_hessian, own)
