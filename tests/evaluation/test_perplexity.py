import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import FAMILY_NAMES, make_tiny_model, peak_allocated_bytes

from lmcompress.errors import ConfigError, DataError
from lmcompress.evaluation.perplexity import _windows, perplexity


def tiny_llama(vocab: int, hidden: int = 16, layers: int = 1, tied: bool = False):
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def uniform_lm(vocab: int):
    """A real model whose head is zero: every next token has probability 1/V."""
    model = tiny_llama(vocab)
    with torch.no_grad():
        model.lm_head.weight.zero_()
    return model


def successor_lm(vocab: int = 16):
    """A model that predicts token (t + 1) mod V after token t with probability ~1.

    One-hot embeddings (hidden = vocab), a block whose attention and MLP outputs are zero (so
    the residual stream is the embedding), and a head mapping e_t to a logit of ~200 for t + 1.
    """
    model = tiny_llama(vocab, hidden=vocab)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(vocab))
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.layers[0].mlp.down_proj.weight.zero_()
        successor = torch.roll(torch.eye(vocab), 1, dims=0)  # row t+1 picks e_t
        model.lm_head.weight.copy_(50.0 * successor)  # the final norm scales e_t by sqrt(V)
    return model


def recorder(model):
    """Record the input_ids of every forward."""
    seen: list[torch.Tensor] = []
    model.register_forward_pre_hook(
        lambda _m, _args, kwargs: seen.append(kwargs["input_ids"].clone()), with_kwargs=True
    )
    return seen


def plain_perplexity(model, ids, seq_len, stride=None, bos_token_id=None) -> float:
    """The reference: whole-batch logits and one cross-entropy, window by window."""
    body = seq_len - (bos_token_id is not None)
    nll, count = 0.0, 0
    for start, end, first in _windows(ids.numel(), body, stride or body):
        window = ids[start:end][None]
        if bos_token_id is not None:
            window = F.pad(window, (1, 0), value=bos_token_id)
        with torch.no_grad():
            logits = model(input_ids=window).logits[0, :-1].float()  # (T-1, V)
        targets = window[0, 1:].clone()
        targets[: max(first + (bos_token_id is not None) - 1, 0)] = -100
        nll += float(F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum"))
        count += int((targets != -100).sum())
    return math.exp(nll / count)


@pytest.mark.parametrize("vocab", [2, 97, 49152])
@pytest.mark.parametrize("stride", [None, 5])
def test_uniform_logits_give_vocab_size(vocab, stride):
    ids = torch.randint(0, vocab, (200,))
    result = perplexity(uniform_lm(vocab), ids, seq_len=16, stride=stride, batch_size=3)
    assert result.perplexity == pytest.approx(vocab, rel=1e-5)
    assert result.nll == pytest.approx(math.log(vocab), rel=1e-6)


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize(
    ("stride", "bos", "chunk_tokens"), [(None, None, None), (11, None, 7), (None, 1, 5)]
)
def test_same_perplexity_as_the_whole_logits(family, stride, bos, chunk_tokens):
    model = make_tiny_model(family)
    ids = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(0))
    result = perplexity(
        model, ids, seq_len=32, stride=stride, bos_token_id=bos, chunk_tokens=chunk_tokens
    )
    reference = plain_perplexity(model, ids, 32, stride=stride, bos_token_id=bos)
    assert result.perplexity == pytest.approx(reference, rel=1e-6)


def test_a_model_that_knows_the_sequence_gets_perplexity_one():
    vocab = 16
    model = successor_lm(vocab)
    counting = torch.arange(300) % vocab  # each token is the previous one plus 1
    result = perplexity(model, counting, seq_len=32, stride=20)
    assert result.perplexity == pytest.approx(1.0, abs=1e-6)
    shuffled = counting[torch.randperm(300, generator=torch.Generator().manual_seed(0))]
    # on other text the same model is confidently wrong: far worse than uniform (16)
    assert perplexity(model, shuffled, seq_len=32).perplexity > 1e6


def test_max_tokens_limits_the_corpus():
    model = make_tiny_model("llama")
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0))
    full = perplexity(model, ids, seq_len=32)
    short = perplexity(model, ids, seq_len=32, max_tokens=64)
    assert short.windows == 2 and full.windows == 9
    assert short.tokens == 2 * 31
    assert short.perplexity == pytest.approx(plain_perplexity(model, ids[:64], 32), rel=1e-6)


def test_non_overlapping_windows_drop_the_tail_and_score_every_token_once():
    model = uniform_lm(10)
    seen = recorder(model)
    ids = torch.arange(50) % 10
    result = perplexity(model, ids, seq_len=16, batch_size=2)
    assert result.windows == 3  # 50 // 16, tail of 2 tokens dropped
    assert result.tokens == 3 * 15  # each window predicts seq_len - 1 tokens
    assert torch.equal(torch.cat(seen), ids[:48].reshape(3, 16))


def test_strided_windows_score_each_token_once():
    spans = _windows(40, 16, 8)
    assert [(s, e) for s, e, _ in spans] == [(0, 16), (8, 24), (16, 32), (24, 40)]
    result = perplexity(uniform_lm(7), torch.zeros(40, dtype=torch.long), seq_len=16, stride=8)
    assert result.tokens == 39  # every token but the first is predicted exactly once


def test_bos_is_prepended_to_every_window_and_never_scored():
    model = uniform_lm(10)
    seen = recorder(model)
    ids = torch.arange(30) % 9 + 1
    result = perplexity(model, ids, seq_len=8, bos_token_id=0, batch_size=10)
    batch = seen[0]
    assert batch.shape == (4, 8)  # 30 // 7 windows of 7 corpus tokens + BOS
    assert torch.all(batch[:, 0] == 0)
    assert torch.equal(batch[:, 1:], ids[:28].reshape(4, 7))
    assert result.tokens == 4 * 7  # every corpus token is a target, the BOS never


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"seq_len": 1}, ConfigError, "seq_len"),
        ({"seq_len": 8, "stride": 9}, ConfigError, "stride"),
        ({"seq_len": 8, "batch_size": 0}, ConfigError, "batch_size"),
        ({"seq_len": 8, "chunk_tokens": 0}, ConfigError, "chunk_tokens"),
        ({"seq_len": 500}, DataError, "too few"),
    ],
)
def test_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        perplexity(uniform_lm(5), torch.zeros(100, dtype=torch.long), **kwargs)


def test_peak_memory_follows_the_chunk_not_batch_times_sequence_times_vocabulary():
    """Gemma 3's vocabulary (262,144) at batch 4 x 512: the whole logits would be 2.1 GB."""
    vocab, seq_len = 262_144, 512
    model = uniform_lm(vocab)
    ids = torch.randint(0, vocab, (4 * seq_len,), generator=torch.Generator().manual_seed(0))
    whole_logits = 4 * seq_len * vocab * 4  # 2.1 GB

    def peak(batch_size, chunk_tokens=None, n=4 * seq_len, seq_len=seq_len):
        return peak_allocated_bytes(
            lambda: perplexity(
                model,
                ids[:n],
                seq_len,
                batch_size=batch_size,
                chunk_tokens=chunk_tokens,
                progress=False,
            )
        )

    default_chunk = 64 * vocab * 4  # 64 MiB of logits (default_chunk_tokens)
    bound = 4 * default_chunk  # logits + log-softmax of one chunk, with room to spare
    assert bound <= whole_logits / 8
    batch4 = peak(4)
    assert batch4 < bound
    # a 16th of the tokens (one window of 128): the same peak; a quarter of the chunk: a quarter
    assert abs(peak(1, n=128, seq_len=128) - batch4) < default_chunk / 8
    assert peak(1, chunk_tokens=16, n=128, seq_len=128) < batch4 / 3

    def unchunked():  # the previous implementation's logits and loss, on one 192-token window
        with torch.no_grad():
            window = ids[None, :192]
            logits = model(input_ids=window).logits
            F.cross_entropy(logits[0, :-1].float(), window[0, 1:], reduction="sum")

    assert peak_allocated_bytes(unchunked) > bound  # the measurement sees whole logits


@pytest.mark.parametrize("stride", [5, 3, 15])
def test_stride_with_bos_scores_every_covered_token_exactly_once(stride):
    """With a BOS, each window's first corpus token is a target (predicted from the BOS), so
    the windows score every corpus token they cover once: as many tokens as the last window's
    end, counted here from the spans alone; the NLL is the per-window reference's."""
    model = make_tiny_model("llama")
    ids = torch.randint(1, 256, (200,), generator=torch.Generator().manual_seed(0))
    result = perplexity(model, ids, seq_len=16, stride=stride, bos_token_id=0, batch_size=3)
    ends = [start + 15 for start in range(0, 200 - 15 + 1, stride)]  # 15 corpus tokens + BOS
    assert result.windows == len(ends)
    assert result.tokens == ends[-1], f"{result.tokens} scored tokens, {ends[-1]} covered"
    reference = plain_perplexity(model, ids, 16, stride=stride, bos_token_id=0)
    assert result.perplexity == pytest.approx(reference, rel=1e-6)
