"""calibration_windows: seeded windows that are real slices, over SparseGPT's range of starts."""

import pytest
import torch

from lmcompress.compressor.calibration.windows import calibration_windows
from lmcompress.errors import ConfigError, DataError


def test_calibration_windows_are_seeded_real_slices():
    token_ids = torch.arange(1000, 2000)  # every window of a real slice is consecutive
    windows = calibration_windows(token_ids, nsamples=16, seq_len=32, seed=0)
    assert windows.shape == (16, 32) and windows.dtype == torch.int64
    starts = windows[:, 0] - 1000
    assert torch.equal(windows, token_ids[starts[:, None] + torch.arange(32)])
    assert torch.equal(windows, calibration_windows(token_ids, 16, 32, seed=0))
    assert not torch.equal(windows, calibration_windows(token_ids, 16, 32, seed=1))


def test_calibration_window_starts_cover_the_sparsegpt_range():
    # SparseGPT draws starts with random.randint(0, n - seq_len - 1): inclusive on both ends.
    n, seq_len = 20, 16
    windows = calibration_windows(torch.arange(n), nsamples=2000, seq_len=seq_len, seed=3)
    counts = torch.bincount(windows[:, 0], minlength=n - seq_len)
    assert counts.numel() == n - seq_len  # starts in [0, n - seq_len - 1]
    assert (counts > 2000 / (n - seq_len) * 0.8).all()  # roughly uniform
    assert torch.equal(calibration_windows(torch.arange(17), 3, 16), torch.arange(16).repeat(3, 1))


def test_calibration_window_errors():
    with pytest.raises(DataError, match="has 16 tokens; windows of 16 need at least 17"):
        calibration_windows(torch.arange(16), nsamples=1, seq_len=16)
    for nsamples, seq_len in [(0, 8), (4, 0)]:
        with pytest.raises(ConfigError, match="must be >= 1"):
            calibration_windows(torch.arange(100), nsamples=nsamples, seq_len=seq_len)
    with pytest.raises(ConfigError, match="1-D"):
        calibration_windows(torch.arange(100).view(1, 100), nsamples=1, seq_len=8)
