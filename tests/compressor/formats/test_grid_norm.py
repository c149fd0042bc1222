"""``grid.norm_error``: the clipping search's ``|e|^2.4`` as ``e² · exp(0.4 · ln|e|)``."""

import torch

from lmcompress.compressor.formats import grid


def test_norm_error_is_the_2_4_power_of_the_magnitude_to_float32_accuracy():
    g = torch.Generator().manual_seed(0)
    e = torch.randn(4096, generator=g) * torch.logspace(-6, 1, 4096)  # magnitudes 1e-6 .. 10
    e[:3] = torch.tensor([0.0, -0.0, -2.5])
    exact = e.double().abs().pow(2.4)
    got = grid.norm_error(e.clone())
    assert got.dtype == torch.float32
    assert got[0] == 0 and got[1] == 0  # ln 0 = -inf, not nan
    assert float(((got.double() - exact).abs() / exact.clamp_min(1e-300))[2:].max()) < 1e-6
    assert torch.equal(grid.norm_error(-e.clone()), got)  # the sign does not matter


def test_norm_error_works_in_place():
    e = torch.tensor([[0.5, -2.0], [1.0, 0.0]])
    out = grid.norm_error(e)
    assert out.data_ptr() == e.data_ptr()
    torch.testing.assert_close(out, torch.tensor([[0.5**2.4, 2.0**2.4], [1.0, 0.0]]))
