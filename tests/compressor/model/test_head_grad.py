"""The chunk losses whose gradients are computed in the forward (``head_grad.HeadLosses``)
against plain autograd over the whole logits, and the checkpointed path they replace."""

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_model

import lmcompress.compressor.model.loss as loss_module
from lmcompress.compressor.model.loss import IGNORE_INDEX, Head, _run_chunks, distillation_losses

N, H, V = 23, 16, 97  # 23 rows: chunks of 5 leave a short last one


def _case(dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(dtype).requires_grad_(True)
    weight = (0.3 * torch.randn(V, H, generator=g)).to(dtype).requires_grad_(True)
    b = (0.1 * torch.randn(V, generator=g)).to(dtype).requires_grad_(True) if bias else None
    targets = torch.randint(0, V, (N,), generator=g)
    targets[[0, 7, 22]] = IGNORE_INDEX  # rows that score nothing, one of them the last
    teacher_hidden = torch.randn(N, H, generator=g).to(dtype)
    teacher_weight = (0.3 * torch.randn(V, H, generator=g)).to(dtype)
    return hidden, weight, b, targets, teacher_hidden, teacher_weight


def _reference(hidden, weight, bias, targets, teacher_hidden, teacher_weight):
    """Summed NLL and KL(teacher || student) over the whole (N, V) logits, plain autograd."""
    logp = F.log_softmax(F.linear(hidden, weight, bias).float(), dim=-1)
    with torch.no_grad():
        teacher_logp = F.log_softmax(F.linear(teacher_hidden, teacher_weight).float(), dim=-1)
    nll = F.nll_loss(logp, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    kl = F.kl_div(logp, teacher_logp, log_target=True, reduction="sum")
    return nll, kl


def _grads(loss, *tensors):
    for t in tensors:
        t.grad = None
    loss.backward()
    return [None if t is None else t.grad.clone() for t in tensors]


def _fused(hidden, weight, bias, targets, teacher_hidden, teacher_weight, nll_grad=True):
    teacher_head = Head(teacher_weight, None, None, None)
    return _run_chunks(
        Head(weight, bias, None, None),
        hidden,
        targets,
        teacher_hidden,
        teacher_head,
        5,
        IGNORE_INDEX,
        nll_grad,
    )


@pytest.mark.parametrize(("a", "b"), [(1.0, 0.0), (0.0, 1.0), (0.37, 2.5), (-1.5, 0.25)])
def test_values_and_gradients_equal_plain_autograd(a, b):
    """Each loss alone and weighted sums of both, one weight negative (a sign, a wrong row's
    target, one loss's gradient given to the other, an unscaled backward: each moves a
    gradient here)."""
    case = _case()
    hidden, weight, bias = case[:3]
    nll, kl = _reference(*case)
    expected = _grads(a * nll + b * kl, hidden, weight, bias)
    got_nll, got_kl = _fused(*case)
    torch.testing.assert_close(got_nll, nll, rtol=1e-6, atol=0)
    torch.testing.assert_close(got_kl, kl, rtol=1e-5, atol=0)
    got = _grads(a * got_nll + b * got_kl, hidden, weight, bias)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_ignored_rows_get_no_gradient_from_the_nll():
    hidden, weight, bias, targets, teacher_hidden, teacher_weight = _case()
    nll, _ = _fused(hidden, weight, bias, targets, teacher_hidden, teacher_weight)
    (grad,) = _grads(nll, hidden)
    ignored = targets == IGNORE_INDEX
    assert torch.equal(grad[ignored], torch.zeros_like(grad[ignored]))
    assert bool((grad[~ignored].abs().sum(dim=1) > 0).all())


def test_bfloat16_gradients_as_the_linear_backward_computes_them():
    case = _case(dtype=torch.bfloat16)
    hidden, weight, bias = case[:3]
    nll, kl = _reference(*case)
    expected = _grads(nll + 0.5 * kl, hidden, weight, bias)
    got_nll, got_kl = _fused(*case)
    got = _grads(got_nll + 0.5 * got_kl, hidden, weight, bias)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g, e, rtol=2e-2, atol=2e-2)


def test_nll_without_gradient_leaves_the_kl_gradient_and_has_no_graph():
    case = _case(bias=False)
    hidden, weight = case[:2]
    _, kl = _reference(*case)
    expected = _grads(kl, hidden, weight)
    nll, got_kl = _fused(*case, nll_grad=False)
    assert not nll.requires_grad and nll.grad_fn is None
    got = _grads(got_kl + nll, hidden, weight)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_frozen_weight_gets_no_gradient():
    hidden, weight, bias, targets, teacher_hidden, teacher_weight = _case()
    weight.requires_grad_(False)
    bias.requires_grad_(False)
    nll, kl = _fused(hidden, weight, bias, targets, teacher_hidden, teacher_weight)
    (nll + kl).backward()
    assert weight.grad is None and bias.grad is None and hidden.grad is not None


def test_plain_heads_skip_the_recomputation_and_other_heads_keep_it(monkeypatch):
    """A linear head runs each chunk once (no checkpoint); a softcapped head (Gemma 3) still
    goes through the checkpointed chunks, and both equal the model's own loss gradient."""
    calls = {"checkpoint": 0}
    original = loss_module.checkpoint

    def counting(*args, **kwargs):
        calls["checkpoint"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(loss_module, "checkpoint", counting)
    for family, checkpointed in (("llama", False), ("gemma3_text", True)):
        model = make_tiny_model(family)
        if family == "gemma3_text":
            model.config.final_logit_softcapping = 30.0
        ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            teacher_hidden = loss_module.final_hidden(model, ids) + 0.1
        calls["checkpoint"] = 0
        hidden = loss_module.final_hidden(model, ids)
        nll, kl = distillation_losses(model, hidden, ids, teacher_hidden, chunk_tokens=5)
        (nll + kl).backward()
        assert (calls["checkpoint"] > 0) == checkpointed, family
