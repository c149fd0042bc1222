"""Low rank block by block (``--sequential``, ``--refit output``): the closed-form re-fit of the
output factor, the first block identical to the one-shot factorisation (its inputs are the dense
ones), the later blocks better on the inputs they really get, the same ranks, and the refusals."""

import pytest
import torch
from conftest import make_tiny_model

from lmcompress import compress
from lmcompress.compressor.model.surgery import LayerSelection, weight_matrix
from lmcompress.errors import ConfigError
from lmcompress.methods.svd import FWSVDConfig, GFWSVDConfig, SVDLLMConfig
from lmcompress.methods.svd.sequential import output_refit


def _data():
    return torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))


def _weight(model, name):
    module = model.get_submodule(name)
    return module.dense_weight() if hasattr(module, "dense_weight") else weight_matrix(module)


def _error(W, W_new, X):
    return float(((W - W_new).detach().double() @ X.double().T).square().sum())


def test_output_refit_is_the_least_squares_output_factor():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(24, 40, generator=g, dtype=torch.float64)
    X = torch.randn(300, 40, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3, 40)
    A = torch.randn(6, 40, generator=g, dtype=torch.float64)
    B = torch.randn(24, 6, generator=g, dtype=torch.float64)
    gram = X.T @ X
    exact = output_refit(W, A, B, gram, damp=0.0)
    lstsq = torch.linalg.lstsq((A @ X.T).T, (W @ X.T).T).solution.T  # (out, r)
    torch.testing.assert_close(exact, lstsq)
    damped = output_refit(W, A, B, gram)
    assert _error(W, lstsq @ A, X) <= _error(W, damped @ A, X) < _error(W, B @ A, X)
    # the damping pulls towards the given B: with a huge one, B stays
    torch.testing.assert_close(output_refit(W, A, B, gram, damp=1e9), B, rtol=1e-6, atol=1e-6)


def _capture_inputs(model, names):
    inputs = {n: [] for n in names}
    hooks = [
        model.get_submodule(n).register_forward_pre_hook(
            lambda _m, args, n=n: inputs[n].append(args[0].reshape(-1, args[0].shape[-1]))
        )
        for n in names
    ]
    with torch.no_grad():
        model(_data())
    for hook in hooks:
        hook.remove()
    return {n: torch.cat(x) for n, x in inputs.items()}


def test_sequential_svd_llm_fits_the_inputs_of_the_compressed_model():
    plain, ours = make_tiny_model("llama"), make_tiny_model("llama")
    dense = {n: weight_matrix(m).detach().clone() for n, m in LayerSelection().select(ours).items()}
    plain_report = compress(plain, SVDLLMConfig(ratio=0.6), _data())
    report = compress(ours, SVDLLMConfig(ratio=0.6, sequential=True), _data())
    assert report.extra["ranks"] == plain_report.extra["ranks"]  # from the dense statistics
    first = [n for n in dense if n.startswith("model.layers.0.")]
    for name in first:  # block 0 sees the dense inputs either way
        torch.testing.assert_close(
            _weight(ours, name), _weight(plain, name),
            rtol=1e-4, atol=1e-5,
        )  # fmt: skip
    # q/k/v of the later blocks: the block's input, the compressed blocks' output. SVD-LLM on
    # the Gram of exactly those inputs is the best rank-r fit to them: no worse than the dense
    # statistics' (each model's own inputs, captured by hooks, not the method's statistics)
    later = [n for n in dense if n.split(".")[-1] in ("q_proj", "k_proj", "v_proj")]
    later = [n for n in later if not n.startswith("model.layers.0.")]
    seen = _capture_inputs(ours, later)
    wins = 0
    for name in later:
        mine = _error(dense[name], _weight(ours, name), seen[name])
        theirs = _error(dense[name], _weight(plain, name), seen[name])
        wins += mine <= theirs * (1 + 1e-6)
    assert wins == len(later), (wins, len(later))


@pytest.mark.parametrize(
    "config",
    [
        SVDLLMConfig(ratio=0.6, refit="output"),
        GFWSVDConfig(ratio=0.6, allocation="greedy", sequential=True, refit="output"),
    ],
)
def test_refit_lowers_every_layers_output_error_and_keeps_the_budget(config):
    model, plain = make_tiny_model("llama"), make_tiny_model("llama")
    layers = LayerSelection().select(model)
    dense = {n: weight_matrix(m).detach().clone() for n, m in layers.items()}
    base = type(config)(ratio=config.ratio, allocation=config.allocation)
    plain_report = compress(plain, base, _data())
    report = compress(model, config, _data())
    assert report.params_kept == plain_report.params_kept
    first = [n for n in dense if n.startswith("model.layers.0.")]  # dense inputs in both
    seen = _capture_inputs(model, first)
    for name in first:
        if report.extra["ranks"][name] is None:
            continue
        mine = _error(dense[name], _weight(model, name), seen[name])
        theirs = _error(dense[name], _weight(plain, name), seen[name])
        # q/k/v: exactly the refit's inputs; the rest see the block's compressed layers.
        # SVD-LLM's truncation is already optimal for these inputs (the refit may only match
        # it, to rounding: 1 + 6e-9 seen); GFWSVD's is not (0.999994 seen on q_proj).
        if name.split(".")[-1] in ("q_proj", "k_proj", "v_proj"):
            bound = 1 + 1e-6 if isinstance(config, SVDLLMConfig) else 1 - 1e-6
            assert mine < theirs * bound, (name, mine, theirs)


def test_sequential_needs_a_method_weighted_by_the_input_gram():
    with pytest.raises(ConfigError, match="--sequential"):
        compress(make_tiny_model("llama"), FWSVDConfig(ratio=0.6, sequential=True), _data())
    with pytest.raises(ConfigError, match="--sequential"):
        compress(
            make_tiny_model("llama"),
            GFWSVDConfig(ratio=0.6, sequential=True, kronecker="nearest"),
            _data(),
        )


def _block_output_error(model, dense_model, block):
    """The relative error of ``block``'s output, each model on its own inputs (the hidden
    states of their own lower blocks), against the dense model's."""
    outs = []
    for m in (model, dense_model):
        captured = []
        hook = m.model.layers[block].register_forward_hook(
            lambda _m, _a, out, captured=captured: captured.append(
                out[0] if isinstance(out, tuple) else out
            )
        )
        with torch.no_grad():
            m(_data())
        hook.remove()
        outs.append(captured[0])
    return float((outs[0] - outs[1]).square().mean() / outs[1].square().mean())


def _assert_same_structure(model, report, plain, plain_report):
    """The trained model has the one-shot run's ranks, budget and module types, and no
    parametrization left."""
    assert report.extra["ranks"] == plain_report.extra["ranks"]
    assert report.params_kept == plain_report.params_kept
    for name in plain_report.extra["ranks"]:
        assert type(model.get_submodule(name)) is type(plain.get_submodule(name)), name
    assert not any(hasattr(m, "parametrizations") for m in model.modules())


@pytest.mark.parametrize("config", [SVDLLMConfig(ratio=0.6), FWSVDConfig(ratio=0.6)])
def test_tuning_trains_the_factor_pairs_on_the_block_error(config):
    """``--tune-steps``: the same ranks and modules, block 0 the one-shot factorisation before
    tuning, and every block's error against the dense model lower after it."""
    model, plain, dense = (make_tiny_model("llama") for _ in range(3))
    plain_report = compress(plain, config, _data())
    tuned = type(config)(ratio=config.ratio, tune_steps=30, tune_lr=1e-3, calib_batch_size=2)
    report = compress(model, tuned, _data())
    _assert_same_structure(model, report, plain, plain_report)
    curves = report.extra["block_curves"]
    assert [c["block"] for c in curves] == [0, 1]
    for curve in curves:
        assert curve["hard_after"] < 0.9 * curve["hard_before"], curve
        assert len(curve["curve"]) == 30
    for block in (0, 1):
        assert _block_output_error(model, dense, block) < _block_output_error(plain, dense, block)


def test_tuning_options_are_checked():
    with pytest.raises(ConfigError, match="tune_steps"):
        SVDLLMConfig(ratio=0.6, tune_steps=-1)
    with pytest.raises(ConfigError, match="tune_lr"):
        SVDLLMConfig(ratio=0.6, tune_steps=2, tune_lr=0.0)
    with pytest.raises(ConfigError, match="distill_steps"):
        GFWSVDConfig(ratio=0.6, distill_steps=-3)


def _kl_from(dense_model, model):
    with torch.no_grad():
        p = torch.log_softmax(dense_model(_data()).logits, -1)
        q = torch.log_softmax(model(_data()).logits, -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def test_distillation_trains_every_factor_pair_towards_the_dense_logits():
    """``--distill-steps``: the one-shot factorisation, then every pair trained end to end on
    the KL from the dense model (the teacher: the same layers switched back to their dense
    weights): the same ranks and modules, a lower KL than the one-shot factors'."""
    model, plain, dense = (make_tiny_model("llama") for _ in range(3))
    plain_report = compress(plain, FWSVDConfig(ratio=0.6), _data())
    report = compress(model, FWSVDConfig(ratio=0.6, distill_steps=16, distill_lr=1e-3), _data())
    _assert_same_structure(model, report, plain, plain_report)
    curve = report.extra["loss_curve"]
    assert len(curve) == 16 and all("kl" in c for c in curve)
    assert _kl_from(dense, model) < 0.8 * _kl_from(dense, plain)
