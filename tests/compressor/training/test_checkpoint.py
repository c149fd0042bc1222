"""The resume fingerprint of the training data: token windows are told apart by their bytes,
not only by their count or shape."""

import json

import pytest
import torch
from torch import nn

from lmcompress.compressor.training.checkpoint import data_fingerprint
from lmcompress.compressor.training.trainer import TrainConfig, Trainer
from lmcompress.errors import ConfigError, LmcompressError


def _windows(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (6, 8), generator=torch.Generator().manual_seed(seed))


def test_fingerprint_follows_the_windows_bytes():
    a, b = _windows(0), _windows(1)
    assert a.shape == b.shape and not torch.equal(a, b)
    assert data_fingerprint(a) == data_fingerprint(a.clone())  # same bytes, another tensor
    assert data_fingerprint(a) != data_fingerprint(b)
    assert data_fingerprint(a) != data_fingerprint(a.flip(0))  # same windows, another order
    assert data_fingerprint(a).startswith("6 examples, sha256 ")


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))


def _loss(model, batch, _step):
    loss = (model.scale * batch.float()).square().mean() * 1e-4
    return loss, {"mse": float(loss.detach())}


def _fit(model, tmp_path, windows, resume=False, stop_after=None):
    config = TrainConfig(steps=4, batch_size=2, checkpoint_every=2)
    trainer = Trainer(
        model, {"scale": model.scale}, config, _loss, checkpoint_dir=tmp_path, leave=False
    )
    return trainer.fit(windows, resume=resume, stop_after=stop_after)


def test_resume_on_other_windows_of_the_same_count_is_refused(tmp_path):
    _fit(_Scale(), tmp_path, _windows(0), stop_after=2)
    assert _fit(_Scale(), tmp_path, _windows(0), resume=True).step == 4  # the same data resumes
    _fit(_Scale(), tmp_path / "other", _windows(0), stop_after=2)
    with pytest.raises(ConfigError, match="training data: 6 examples, sha256 ") as err:
        _fit(_Scale(), tmp_path / "other", _windows(1), resume=True)
    assert str(err.value).count("6 examples") == 2, str(err.value)


def test_a_checkpoint_with_malformed_params_is_one_line(tmp_path):
    """``params`` not a mapping (a hand-edited or foreign state.json): refused as corrupt,
    naming the key, before any tensor is read."""
    _fit(_Scale(), tmp_path, _windows(0), stop_after=2)
    state = tmp_path / "trainer_state" / "state.json"
    meta = json.loads(state.read_text())
    meta["params"] = [["scale", [8]]]
    state.write_text(json.dumps(meta))
    with pytest.raises(LmcompressError, match="malformed params") as err:
        _fit(_Scale(), tmp_path, _windows(0), resume=True)
    assert "\n" not in str(err.value)
