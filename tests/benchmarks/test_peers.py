"""The llm-compressor peer runner (benchmarks/peers/run_peer.py; its wall time and peak RSS
come from the benchmark runner, tested in test_runner.py).

The end-to-end test needs the peer venv (``benchmarks/peers/setup_llmcompressor.sh``) and is
skipped without it; the rest runs anywhere.
"""

import pytest

from benchmarks.peers import run_peer
from lmcompress.compressor.model.loading import load_model


@pytest.mark.parametrize(
    ("method", "sparsity"),
    [("magnitude", "2:4"), ("wanda", "0.7"), ("wanda", None), ("gptq", "2:4")],
)
def test_run_peer_rejects_unknown_choices_before_any_work(tmp_path, method, sparsity):
    with pytest.raises(ValueError, match=f"{method} {sparsity}"):
        run_peer.run_peer(method, sparsity, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_run_peer_names_the_setup_script_when_the_venv_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="setup_llmcompressor.sh"):
        run_peer.run_peer("wanda", "2:4", tmp_path / "out", venv=tmp_path / "no-venv")


@pytest.mark.real_model
@pytest.mark.skipif(
    not (run_peer.DEFAULT_VENV / "bin" / "python").is_file(),
    reason="no llm-compressor venv (benchmarks/peers/setup_llmcompressor.sh)",
)
def test_run_peer_wanda_2_4_on_smollm2(tmp_path):
    out = tmp_path / "peer"
    record = run_peer.run_peer("wanda", "2:4", out, nsamples=2, seq_len=32)
    check = record["sparsity_check"]
    assert check["ok"] and check["decoder_linears"] == 210 and check["tied_embeddings"]
    assert check["kept_weights_changed"] == 0.0  # Wanda masks, never updates
    assert (check["method"], check["sparsity"], check["nsamples"]) == ("wanda", "2:4", 2)
    assert record["wall_seconds"] > 0 and record["peak_rss_mb"] > 100
    assert (out / "peer_run.json").is_file()

    # Our transformers loads the peer's output; every decoder linear is exactly 2:4 or sparser.
    model, tokenizer = load_model(out)
    assert tokenizer is not None
    for name, module in model.model.layers.named_modules():
        if module.__class__.__name__ == "Linear":
            groups = (module.weight == 0).view(-1, 4).sum(-1)  # zeros per group of 4 inputs
            assert bool((groups >= 2).all()), name
    assert model.lm_head.weight is model.model.embed_tokens.weight
