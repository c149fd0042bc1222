"""One chunk's NLL and KL with their gradients computed in the forward, for a plain linear head.

Under autograd, :mod:`lmcompress.compressor.model.loss` used to run each chunk of positions
under activation checkpointing: the forward kept only the chunk's inputs and the backward ran
the chunk again (the student's head matmul and log-softmax, the teacher's head matmul and
log-softmax, the KL) before it could differentiate. The losses are the graph's last nodes,
though, and their gradient with respect to the logits has a closed form, so this module
computes it in the forward, while the chunk's logits exist anyway, and keeps only what it
gives the inputs: ``dz @ W`` (positions x hidden, a few hundred numbers a position). The
backward multiplies those by the incoming gradients. Per chunk that saves one student and one
teacher head matmul and both log-softmaxes over the vocabulary; the values and the gradients
are the same as the checkpointed ones up to float rounding (``tests/compressor/model/
test_head_grad.py``). The trick is the "fused linear cross entropy" of Liger-Kernel (Hsu et
al. 2024, arXiv 2410.10989), here with the KL beside the NLL.

With ``z`` a row's logits, ``p = softmax(z)``, ``t`` the teacher's probabilities and ``y`` the
target (summed losses, as in :func:`loss._chunk_losses`):

- ``d NLL / dz = p - onehot(y)`` (0 for a row whose target is ``ignore_index``);
- ``d KL(t || p) / dz = p * sum(t) - t`` (``sum(t)`` is 1 up to rounding; kept, as autograd's
  log-softmax backward keeps it).

Both need the gradient's weight to be known in the forward, which it is not when a caller
adds the two losses with weights of its own; each loss whose gradient is wanted therefore gets
its own ``dz @ W`` (one matmul each), and the backward combines them. A loss whose gradient is
not wanted (the NLL that distillation only logs) is returned without a gradient path and costs
no matmul.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


class HeadLosses(torch.autograd.Function):
    """``(nll, kl)`` of ``hidden`` (n, H) through ``F.linear(hidden, weight, bias)``, summed
    over the rows, in float32; gradients for ``hidden``, ``weight`` and ``bias`` (those that
    require one), precomputed in the forward. ``teacher_logits()`` gives the teacher's (n, V)
    logits (no gradient), called once in the forward; at most three (n, V) float32 tensors live
    at a time."""

    @staticmethod
    def forward(  # noqa: PLR0913 - autograd.Function takes its inputs positionally
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor | None,
        teacher_logits: Callable[[], torch.Tensor] | None,
        ignore_index: int,
        nll_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        wants = ctx.needs_input_grad[:3]  # hidden, weight, bias
        z = F.linear(hidden, weight, bias)
        dtype = z.dtype
        logp = F.log_softmax(z.float(), dim=-1)  # (n, V)
        del z
        nll = (
            logp.new_zeros(())
            if targets is None
            else F.nll_loss(logp, targets, ignore_index=ignore_index, reduction="sum")
        )
        kl = logp.new_zeros(())
        teacher_p = None
        if teacher_logits is not None:
            teacher_logp = F.log_softmax(teacher_logits().float(), dim=-1)
            teacher_p = teacher_logp.exp()
            gap = teacher_logp.sub_(logp)
            kl = gap.mul_(teacher_p).sum()  # what F.kl_div(logp, t, log_target=True) sums
            del gap, teacher_logp
        ctx.grads = {}
        if any(wants):
            p = logp.exp()
            del logp
            if teacher_p is not None:  # p * sum(t) - t
                dz = torch.mul(p, teacher_p.sum(dim=-1, keepdim=True)).sub_(teacher_p)
                del teacher_p
                ctx.grads["kl"] = _input_grads(dz, hidden, weight, dtype, wants)
                del dz
            if targets is not None and nll_grad:  # p - onehot(y), in place of p
                scored = targets != ignore_index
                rows = scored.nonzero().squeeze(1)
                p[rows, targets[rows]] -= 1.0
                p[~scored] = 0.0
                ctx.grads["nll"] = _input_grads(p, hidden, weight, dtype, wants)
        if targets is None or not nll_grad:
            ctx.mark_non_differentiable(nll)
        return nll, kl

    @staticmethod
    def backward(ctx, grad_nll: torch.Tensor, grad_kl: torch.Tensor):
        total: list[torch.Tensor | None] = [None, None, None]
        for name, incoming in (("nll", grad_nll), ("kl", grad_kl)):
            if name not in ctx.grads or incoming is None:
                continue
            for i, grad in enumerate(ctx.grads[name]):
                if grad is not None:
                    term = grad * incoming.to(grad.dtype)
                    total[i] = term if total[i] is None else total[i] + term
        ctx.grads = {}
        return (*total, None, None, None, None)


def _input_grads(
    dz: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    dtype: torch.dtype,
    wants: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(d/d hidden, d/d weight, d/d bias) of a loss whose gradient on the float32 logits is
    ``dz`` (n, V), in the logits' ``dtype`` as the linear's own backward computes them."""
    dz = dz.to(dtype)
    return (
        dz @ weight if wants[0] else None,
        dz.T @ hidden if wants[1] else None,
        dz.sum(dim=0) if wants[2] else None,
    )
