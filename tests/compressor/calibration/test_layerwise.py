import pytest
import torch

from lmcompress.compressor.calibration.layerwise import compress_layerwise
from lmcompress.compressor.model.surgery import LayerSelection, weight_matrix
from lmcompress.compressor.report import LayerReport


class Recorder:
    def __init__(self) -> None:
        self.inputs: list[torch.Tensor] = []

    def add_batch(self, inputs: torch.Tensor) -> None:
        self.inputs.append(inputs.detach().clone())


def _noop(name, module, _acc):
    W = weight_matrix(module)
    return LayerReport(name, tuple(W.shape), W.numel(), W.numel(), 0, 0)


def _data(n=6, t=20):
    return torch.randint(3, 256, (n, t), generator=torch.Generator().manual_seed(0))


def test_every_layer_sees_exactly_its_inputs_of_a_normal_forward(family_model):
    """Capture + block-by-block propagation reproduce the model's own activations."""
    model_type, model = family_model
    layers = LayerSelection().select(model)
    data = _data()
    expected = {name: [] for name in layers}
    handles = [
        module.register_forward_pre_hook(lambda _m, args, _n=name: expected[_n].append(args[0]))
        for name, module in layers.items()
    ]
    with torch.no_grad():
        for start in range(0, len(data), 4):
            model(input_ids=data[start : start + 4], use_cache=False)
    for handle in handles:
        handle.remove()

    recorders = {}

    def make(name, _module):
        recorders[name] = Recorder()
        return recorders[name]

    reports, stats = compress_layerwise(
        model, data, layers, make, _noop, batch_size=4, progress=False
    )
    assert [r.name for r in reports] == list(layers)
    assert stats.blocks == 2 and len(stats.per_block_seconds) == 2
    for name in layers:
        got, want = torch.cat(recorders[name].inputs), torch.cat(expected[name])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{model_type} {name}")


def test_compressed_block_outputs_feed_the_next_block():
    from conftest import make_tiny_model

    model = make_tiny_model("llama")
    layers = LayerSelection().select(model)
    first = "model.layers.0.mlp.down_proj"
    seen = {}

    def make(name, _module):
        seen[name] = Recorder()
        return seen[name]

    def zero_first(name, module, acc):
        if name == first:
            weight_matrix(module).zero_()  # block 0's MLP now adds nothing
        return _noop(name, module, acc)

    compress_layerwise(model, _data(), layers, make, zero_first, batch_size=3, progress=False)
    # Recompute block 1's inputs with the modified model: they must match what the loop fed it.
    expected = []
    handle = model.get_submodule("model.layers.1.self_attn.q_proj").register_forward_pre_hook(
        lambda _m, args: expected.append(args[0])
    )
    with torch.no_grad():
        for start in range(0, 6, 3):
            model(input_ids=_data()[start : start + 3], use_cache=False)
    handle.remove()
    torch.testing.assert_close(
        torch.cat(seen["model.layers.1.self_attn.q_proj"].inputs), torch.cat(expected)
    )


def test_peak_state_does_not_grow_with_depth():
    from conftest import make_tiny_model

    from lmcompress.compressor.calibration.observers import HessianAccumulator

    peaks = {}
    for depth in (2, 4):
        model = make_tiny_model("llama", num_layers=depth)
        layers = LayerSelection().select(model)
        _, stats = compress_layerwise(
            model,
            _data(8, 32),
            layers,
            lambda _n, m: HessianAccumulator(weight_matrix(m).shape[1]),
            _noop,
            batch_size=4,
            progress=False,
        )
        peaks[depth] = stats.peak_state_bytes
    assert peaks[2] > 0
    assert peaks[4] == pytest.approx(peaks[2], rel=0.01)  # one block's state, not the model's


def test_model_is_left_in_its_mode_and_place():
    from conftest import make_tiny_model

    model = make_tiny_model("qwen2")
    model.train()
    compress_layerwise(
        model, _data(), LayerSelection().select(model), lambda *_: Recorder(), _noop, progress=False
    )
    assert model.training
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_exactly_one_of_the_layer_and_block_callbacks():
    from conftest import make_tiny_model

    model = make_tiny_model("llama")
    layers = LayerSelection().select(model)
    with pytest.raises(ValueError, match="exactly one"):
        compress_layerwise(model, _data(), layers, lambda *_: None, progress=False)
    with pytest.raises(ValueError, match="exactly one"):
        compress_layerwise(
            model,
            _data(),
            layers,
            lambda *_: None,
            compress_layer=lambda *_: None,
            compress_block=lambda *_: [],
            progress=False,
        )
