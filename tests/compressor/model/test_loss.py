import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import FAMILY_NAMES, make_tiny_model, peak_allocated_bytes
from torch.nn.utils import parametrize

from lmcompress.compressor.model.loss import (
    chunked_kl,
    chunked_nll,
    default_chunk_tokens,
    distillation_losses,
    final_hidden,
    head_logits,
    nll_from_hidden,
)
from lmcompress.errors import ConfigError

B, T = 3, 20  # 3 x 19 = 57 scored positions: no chunk size below divides it


def _ids(seed: int = 0, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_final_hidden_through_the_head_gives_the_forward_logits(family):
    model = make_tiny_model(family)
    ids = _ids()
    with torch.no_grad():
        reference = model(input_ids=ids, use_cache=False).logits
        hidden = final_hidden(model, ids)
    assert hidden.shape == (B, T, model.get_output_embeddings().in_features)
    torch.testing.assert_close(head_logits(model, hidden), reference, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("chunk_tokens", [1, 7, 64, None])
def test_chunked_nll_equals_the_model_loss(family, chunk_tokens):
    model = make_tiny_model(family)
    ids = _ids()
    with torch.no_grad():
        reference = model(input_ids=ids, labels=ids, use_cache=False).loss
        total = chunked_nll(model, ids, ids, chunk_tokens=chunk_tokens)
        mean = chunked_nll(model, ids, ids, chunk_tokens=chunk_tokens, reduction="mean")
    assert total.dtype == torch.float32
    torch.testing.assert_close(total, reference * B * (T - 1), rtol=1e-6, atol=0)
    torch.testing.assert_close(mean, reference, rtol=1e-6, atol=0)


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_ignore_index_skips_labels(family):
    model = make_tiny_model(family)
    ids = _ids()
    labels = ids.clone()
    labels[0, :12] = -100  # 11 targets of row 0 dropped (label 0 is never a target)
    labels[2, 5] = labels[2, -1] = -100
    with torch.no_grad():
        reference = model(input_ids=ids, labels=labels, use_cache=False).loss
        total = chunked_nll(model, ids, labels, chunk_tokens=5)
        full = chunked_nll(model, ids, ids, chunk_tokens=5)
    scored = B * (T - 1) - 11 - 2
    torch.testing.assert_close(total, reference * scored, rtol=1e-6, atol=0)
    assert not torch.allclose(total, full)  # the ignored tokens did count before


def test_gemma3_final_logit_softcapping_is_applied_per_chunk():
    def model_with(softcap):
        config = transformers.Gemma3TextConfig(
            vocab_size=256,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            final_logit_softcapping=softcap,
        )
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(20)  # logits of a few units, where a cap of 2 bites
        return model

    capped, uncapped = model_with(2.0), model_with(None)
    ids = _ids()
    with torch.no_grad():
        reference = capped(input_ids=ids, labels=ids).loss
        without_cap = uncapped(input_ids=ids, labels=ids).loss
        mean = chunked_nll(capped, ids, ids, chunk_tokens=7, reduction="mean")
    assert abs(float(reference - without_cap)) > 0.1  # the cap changes the loss
    torch.testing.assert_close(mean, reference, rtol=1e-6, atol=0)


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_gradients_equal_the_plain_loss(family):
    model = make_tiny_model(family)
    ids = _ids()
    labels = ids.clone()
    labels[1, :4] = -100
    reference = _grads(model, model(input_ids=ids, labels=labels, use_cache=False).loss)
    chunked = _grads(model, chunked_nll(model, ids, labels, chunk_tokens=7, reduction="mean"))
    assert reference.keys() == chunked.keys()
    head = model.get_output_embeddings().weight
    assert any(p is head for p in model.parameters())  # the head's gradient is compared too
    for name in reference:
        torch.testing.assert_close(chunked[name], reference[name], rtol=1e-5, atol=1e-7)


def test_parametrized_head_is_read_once_per_call():
    """A random parametrization (a sampled mask) on the head: under ``parametrize.cached()``
    the loss and its gradient must use the one sample of the forward, also when a chunk is
    recomputed during the backward (outside the cache)."""

    class RandomMask(torch.nn.Module):
        def forward(self, weight):
            return weight * (torch.rand_like(weight) > 0.3)

    model = make_tiny_model("mistral")  # untied head
    parametrize.register_parametrization(model.lm_head, "weight", RandomMask())
    ids = _ids()
    torch.manual_seed(1)
    with parametrize.cached():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    reference = _grads(model, loss)
    torch.manual_seed(1)
    with parametrize.cached():
        loss = chunked_nll(model, ids, ids, chunk_tokens=7, reduction="mean")
    chunked = _grads(model, loss)
    for name in reference:
        torch.testing.assert_close(chunked[name], reference[name], rtol=1e-5, atol=1e-7)


def _kl_reference(student_logits, teacher_logits):
    return F.kl_div(
        F.log_softmax(student_logits.float(), -1).flatten(0, 1),
        F.log_softmax(teacher_logits.float(), -1).flatten(0, 1),
        log_target=True,
        reduction="batchmean",
    )


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_chunked_kl_equals_kl_div_and_its_gradient(family):
    student, teacher = make_tiny_model(family, seed=0), make_tiny_model(family, seed=1)
    ids = _ids()
    with torch.no_grad():
        teacher_logits = teacher(input_ids=ids).logits
        teacher_hidden = final_hidden(teacher, ids)
    reference = _kl_reference(student(input_ids=ids).logits, teacher_logits)
    expected = _grads(student, reference)
    kl = chunked_kl(
        student, final_hidden(student, ids), teacher_hidden, teacher=teacher, chunk_tokens=7
    )
    # a KL is a small difference of large log-probabilities: float32 summation order (thread
    # count) moves it by ~1e-6 relative
    torch.testing.assert_close(kl, reference, rtol=1e-5, atol=0)
    assert float(kl.detach()) > 1e-3  # two different models: a KL that is not trivially zero
    got = _grads(student, kl)
    assert expected.keys() == got.keys()
    assert not any(p.grad is not None for p in teacher.parameters())
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-7)


def test_distillation_losses_share_one_pass_and_match_both_terms():
    """The MaskLLM use: the teacher is the same model without its perturbation."""
    model = make_tiny_model("gpt_neox")
    ids = _ids()
    with torch.no_grad():
        teacher_logits = model(input_ids=ids).logits
        teacher_hidden = final_hidden(model, ids)
        for p in model.gpt_neox.layers.parameters():
            p.add_(0.05 * torch.randn_like(p))
    out = model(input_ids=ids, labels=ids)
    reference_kl = _kl_reference(out.logits, teacher_logits)
    expected = _grads(model, out.loss + reference_kl)
    nll, kl = distillation_losses(
        model, final_hidden(model, ids), ids, teacher_hidden, chunk_tokens=7
    )
    torch.testing.assert_close(nll, out.loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(kl, reference_kl, rtol=1e-5, atol=0)  # see the KL test above
    got = _grads(model, nll + kl)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-7)


def test_nll_from_hidden_is_chunked_nll_on_given_hidden_states():
    model = make_tiny_model("gemma3_text")
    ids = _ids()
    with torch.no_grad():
        hidden = final_hidden(model, ids)
        assert torch.equal(
            nll_from_hidden(model, hidden, ids, chunk_tokens=3),
            chunked_nll(model, ids, ids, chunk_tokens=3),
        )


def test_default_chunk_is_about_64_mb_of_logits():
    assert default_chunk_tokens(262_144) == 64
    assert default_chunk_tokens(49_152) == 341
    assert default_chunk_tokens(1 << 40) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"chunk_tokens": 0}, "chunk_tokens"), ({"reduction": "none"}, "reduction")],
)
def test_bad_arguments(kwargs, message):
    model = make_tiny_model("llama")
    with pytest.raises(ConfigError, match=message):
        chunked_nll(model, _ids(), _ids(), **kwargs)


def test_training_step_memory_does_not_hold_the_whole_logits():
    """Forward + backward of the chunked loss with a 262,144-token vocabulary keeps a few
    chunks of logits live; the unchunked loss holds (1, T, V) logits and their log-softmax."""
    vocab, chunk = 262_144, 16
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.lm_head.weight.requires_grad_(False)  # like MaskLLM: frozen weights, no (V, H) grads
    ids = torch.randint(0, vocab, (1, 256), generator=torch.Generator().manual_seed(0))
    chunk_bytes = chunk * vocab * 4  # 16 MiB

    def step(loss_fn):
        def run():
            loss_fn().backward()

        return run

    chunked = peak_allocated_bytes(
        step(lambda: chunked_nll(model, ids, ids, chunk_tokens=chunk, reduction="mean"))
    )
    short = ids[:, :128]  # half the window is enough to exceed the bound unchunked
    plain = peak_allocated_bytes(step(lambda: model(input_ids=short, labels=short).loss))
    assert chunked < 6 * chunk_bytes  # ~3 chunks live in the recomputation
    assert plain > 6 * chunk_bytes  # the measurement sees the unchunked logits
