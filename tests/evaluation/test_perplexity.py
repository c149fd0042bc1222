import math

import pytest
import torch
from torch import nn

from lmcompress.errors import ConfigError, DataError
from lmcompress.evaluation.perplexity import _windows, perplexity


class UniformLM(nn.Module):
    """Zero logits everywhere: every next token has probability 1/V."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, **_):
        return type("Out", (), {"logits": torch.zeros(*input_ids.shape, self.vocab)})()


class Recorder(UniformLM):
    """Uniform model that records the batches it sees."""

    def __init__(self, vocab: int) -> None:
        super().__init__(vocab)
        self.seen: list[torch.Tensor] = []

    def forward(self, input_ids, **kw):
        self.seen.append(input_ids.clone())
        return super().forward(input_ids, **kw)


@pytest.mark.parametrize("vocab", [2, 97, 49152])
@pytest.mark.parametrize("stride", [None, 5])
def test_uniform_logits_give_vocab_size(vocab, stride):
    ids = torch.randint(0, vocab, (200,))
    result = perplexity(UniformLM(vocab), ids, seq_len=16, stride=stride, batch_size=3)
    assert result.perplexity == pytest.approx(vocab, rel=1e-5)
    assert result.nll == pytest.approx(math.log(vocab), rel=1e-6)


def test_non_overlapping_windows_drop_the_tail_and_score_every_token_once():
    model = Recorder(10)
    ids = torch.arange(50) % 10
    result = perplexity(model, ids, seq_len=16, batch_size=2)
    assert result.windows == 3  # 50 // 16, tail of 2 tokens dropped
    assert result.tokens == 3 * 15  # each window predicts seq_len - 1 tokens
    seen = torch.cat(model.seen)
    assert torch.equal(seen, ids[:48].reshape(3, 16))


def test_strided_windows_score_each_token_once():
    spans = _windows(40, 16, 8)
    assert [(s, e) for s, e, _ in spans] == [(0, 16), (8, 24), (16, 32), (24, 40)]
    result = perplexity(UniformLM(7), torch.zeros(40, dtype=torch.long), seq_len=16, stride=8)
    assert result.tokens == 39  # every token but the first is predicted exactly once


def test_bos_is_prepended_to_every_window_and_never_scored():
    model = Recorder(10)
    ids = torch.arange(30) % 9 + 1
    result = perplexity(model, ids, seq_len=8, bos_token_id=0, batch_size=10)
    batch = model.seen[0]
    assert batch.shape == (4, 8)  # 30 // 7 windows of 7 corpus tokens + BOS
    assert torch.all(batch[:, 0] == 0)
    assert torch.equal(batch[:, 1:], ids[:28].reshape(4, 7))
    assert result.tokens == 4 * 7  # every corpus token is a target, the BOS never


def test_real_model_beats_uniform_and_max_tokens_limits():
    from conftest import make_tiny_model

    model = make_tiny_model("llama")
    ids = torch.randint(0, 256, (300,))
    full = perplexity(model, ids, seq_len=32)
    short = perplexity(model, ids, seq_len=32, max_tokens=64)
    assert short.windows == 2 and full.windows == 9
    assert math.isfinite(full.perplexity) and full.perplexity > 1


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"seq_len": 1}, ConfigError, "seq_len"),
        ({"seq_len": 8, "stride": 9}, ConfigError, "stride"),
        ({"seq_len": 8, "batch_size": 0}, ConfigError, "batch_size"),
        ({"seq_len": 500}, DataError, "too few"),
    ],
)
def test_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        perplexity(UniformLM(5), torch.zeros(100, dtype=torch.long), **kwargs)
