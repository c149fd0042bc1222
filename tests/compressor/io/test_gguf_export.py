"""``--export gguf``: a tiny Llama whose decoder linears are 4- or 8-bit symmetric group-32 layers
written as Q4_0 / Q8_0 reads back (the ``gguf`` package's own dequantization) to our weights bit
for bit, and transformers' GGUF loader builds the same model (weights bit for bit, logits to
1e-5) and the same tokenizer; what GGUF cannot hold is one line."""

import numpy as np
import pytest
import torch
import transformers
from torch import nn

from lmcompress.compressor.formats.base import CompressedLinear
from lmcompress.compressor.io.gguf_export import (
    GGUF_FILE,
    family_refusal,
    fp16_scales,
    grid_refusal,
    permute_rows,
    refusal,
    write_gguf,
)
from lmcompress.compressor.model.surgery import replace_modules
from lmcompress.errors import LmcompressError

gguf = pytest.importorskip("gguf")

VOCAB = 300
TEXT = (
    "The quick brown fox jumps over the lazy dog. 12345 apples and 678 pears! "
    "Compression of language models: pruning, quantization, low-rank factors. "
) * 20


class _Coded(CompressedLinear):
    """A stand-in of the spec's symmetric low-bit layer (codes q, zero point 2^(bits-1),
    per-group float32 scales), round to nearest; ``half``: scales rounded to float16 first
    (what an exact Q4_0/Q8_0 export needs)."""

    def __init__(self, linear: nn.Linear, bits: int, group_size: int = 32, half: bool = True):
        W = linear.weight.detach().float()
        out_features, in_features = W.shape
        super().__init__(in_features, out_features)
        self.bits, self.group_size, self.symmetric = bits, group_size, True
        Wg = W.view(out_features, in_features // group_size, group_size)
        zero = 1 << (bits - 1)
        scales = Wg.abs().amax(-1) / (zero - 1)
        if half:
            scales = scales.half().float()
        q = torch.round(Wg / scales.unsqueeze(-1)).clamp(-zero, zero - 1) + zero
        self.register_buffer("codes", q.to(torch.uint8).view(out_features, in_features))
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", torch.full_like(scales, zero, dtype=torch.uint8))
        self.register_buffer("bias", linear.bias)

    def weight_codes(self):
        return self.codes

    def dense_weight(self):
        q = self.codes.float().view(self.out_features, self.scales.shape[1], -1)
        W = (q - self.zeros.float().unsqueeze(-1)) * self.scales.unsqueeze(-1)
        return W.view(self.out_features, self.in_features)

    def forward(self, x):
        return nn.functional.linear(x, self.dense_weight(), self.bias)


def _bpe_tokenizer():
    """A byte-level BPE tokenizer (GPT-2 style, as SmolLM2's) of ``VOCAB`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT], trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
        unk_token="<|endoftext|>", pad_token="<|endoftext|>",
    )  # fmt: skip


def _llama(tie: bool = True):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        rope_theta=10000.0,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms away from 1, so a misplaced norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _four(name):  # noqa: ARG001
    return 4


def _eight(name):  # noqa: ARG001
    return 8


def _mixed(name):
    return 8 if "mlp" in name else 4


def _quantize(model, bits_of=_four, half=True):
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n]
    replace_modules(model, names, lambda n, m: _Coded(m, bits_of(n), half=half))
    return {name: model.get_submodule(name) for name in names}


def _reverse_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """transformers' ``LlamaTensorProcessor._reverse_permute_weights``, restated."""
    dim = weights.shape[0] // heads // 2
    w = weights.reshape(heads, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def _exported(tmp_path, bits_of=_four, tie=True):
    model = _llama(tie)
    quantized = _quantize(model, bits_of)
    tokenizer = _bpe_tokenizer()
    info = write_gguf(model, tmp_path / GGUF_FILE, quantized, tokenizer)
    return model, quantized, tokenizer, info


@pytest.mark.parametrize(
    ("bits_of", "tie"),
    [
        (_four, True),
        (_eight, False),  # an untied head: output.weight written (F32)
        (_mixed, True),  # Q4_0 and Q8_0 mixed
    ],
)
def test_gguf_reads_back_to_our_weights(bits_of, tie, tmp_path):
    model, quantized, _, info = _exported(tmp_path, bits_of, tie)
    assert info["scale_fp16_max_relative_change"] == 0.0  # float16-exact scales: exact export
    reader = gguf.GGUFReader(tmp_path / GGUF_FILE)
    fields = {key: field.contents() for key, field in reader.fields.items()}
    assert fields["general.architecture"] == "llama"
    assert fields["llama.block_count"] == 2 and fields["llama.attention.head_count_kv"] == 2
    assert fields["llama.rope.dimension_count"] == 16
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"
    tensors = {t.name: t for t in reader.tensors}
    assert ("output.weight" in tensors) == (not tie)
    for name, module in quantized.items():
        block, kind = name.split(".")[2], name.rsplit(".", 1)[1]
        gguf_name = {
            "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
            "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
        }[kind]  # fmt: skip
        tensor = tensors[f"blk.{block}.{gguf_name}.weight"]
        assert tensor.tensor_type.name == ("Q4_0" if module.bits == 4 else "Q8_0")
        W = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if kind in ("q_proj", "k_proj"):
            W = _reverse_permute(W, 4 if kind == "q_proj" else 2)
        assert np.array_equal(W, module.dense_weight().numpy()), name
    norm = tensors["blk.0.attn_norm.weight"]
    norm = gguf.quants.dequantize(norm.data, norm.tensor_type)
    assert np.array_equal(norm, model.model.layers[0].input_layernorm.weight.detach().numpy())


def test_transformers_loads_the_same_model_and_tokenizer(tmp_path):
    model, quantized, tokenizer, _ = _exported(tmp_path, _mixed)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=GGUF_FILE, dtype=torch.float32
    ).eval()
    for name, module in quantized.items():
        assert torch.equal(loaded.get_submodule(name).weight, module.dense_weight()), name
    assert torch.equal(loaded.model.norm.weight, model.model.norm.weight)
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)
    ids = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(ids).logits, loaded(ids).logits
    # measured 0.0: the same fp32 weights and ops; the bound leaves room for another matmul order
    assert ((theirs - ours).abs().max() / ours.abs().max()).item() <= 1e-5

    gguf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=GGUF_FILE)
    text = "The lazy fox: 12345 pears!<|im_end|>"
    assert gguf_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert gguf_tokenizer.eos_token == "<|im_end|>"


def test_scales_not_float16_are_rounded_and_the_change_recorded(tmp_path):
    model = _llama()
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n]
    replace_modules(model, names, lambda _, m: _Coded(m, 4, half=False))
    quantized = {name: model.get_submodule(name) for name in names}
    info = write_gguf(model, tmp_path / GGUF_FILE, quantized, _bpe_tokenizer())
    assert 0 < info["scale_fp16_max_relative_change"] <= 2**-11
    half, change = fp16_scales(torch.tensor([1.0, 0.1]))
    assert half.dtype == torch.float16 and 0 < change <= 2**-11


def test_permutation_is_llama_cpp_s():
    """llama.cpp's ``LlamaModel.permute`` restated: reshape (heads, 2, d/2, ...), swap 1 and 2;
    transformers' reverse undoes it."""
    W = torch.arange(8 * 3).reshape(8, 3)
    permuted = permute_rows(W, 2)
    assert permuted[:, 0].tolist() == [0, 6, 3, 9, 12, 18, 15, 21]
    assert np.array_equal(_reverse_permute(permuted.numpy(), 2), W.numpy())


def test_what_gguf_cannot_hold_is_one_line(tmp_path):
    assert "not 3-bit" in grid_refusal(3, 32, True)
    assert "--group-size 32" in grid_refusal(4, 128, True)
    assert "symmetric" in grid_refusal(4, 32, False)
    assert grid_refusal(8, 32, True) is None
    assert "not gpt2" in family_refusal(transformers.GPT2Config())
    assert family_refusal(transformers.LlamaConfig()) is None
    assert "biases" in family_refusal(transformers.LlamaConfig(attention_bias=True))
    scaled = transformers.LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert "rotary scaling" in family_refusal(scaled)

    from lmcompress.compressor.formats.int8 import QuantLinear

    model = _llama()
    layer = QuantLinear.from_linear(model.model.layers[0].mlp.up_proj)
    int8 = {"model.layers.0.mlp.up_proj": layer}
    assert "stored int8" in refusal(model.config, int8)
    with pytest.raises(LmcompressError, match="stored int8"):
        write_gguf(model, tmp_path / GGUF_FILE, int8, _bpe_tokenizer())
    assert not (tmp_path / GGUF_FILE).exists()  # refused before the file is opened


# --- through the int4 formats and save_compressed(exports=("gguf",)) -------------------------


@pytest.mark.parametrize("fp16_exact", [True, False])
def test_save_compressed_writes_the_gguf_transformers_loads_as_our_runtime(fp16_exact, tmp_path):
    """RTN ``int4`` layers (4-bit attention, 8-bit MLP, symmetric, group 32) saved with
    ``exports=("gguf",)``: transformers' GGUF loader gives our runtime's weights bit for bit when
    the scales are float16 numbers (``fp16_exact``: rounded before the codes are fixed, what an
    exact export needs), and else the weights with the scales rounded to float16, within
    ``2^-11`` relative of ours; perplexity on random ids to 1e-5 relative when exact, 1e-3
    otherwise (measured ~1e-5 here)."""
    import json

    from lmcompress.compressor.formats.int4 import Int4Linear
    from lmcompress.compressor.io.load import load_compressed
    from lmcompress.compressor.io.save import save_compressed
    from lmcompress.compressor.report import CompressionReport

    model = _llama()
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n]

    def compress(name, layer):
        layer = Int4Linear.from_linear(layer, bits=_mixed(name), group_size=32, symmetric=True)
        if fp16_exact:
            layer.scales = layer.scales.half().float()
        return layer

    replace_modules(model, names, compress)
    report = CompressionReport(method="test", config={})
    out = save_compressed(
        model, tmp_path / "out", report, tokenizer=_bpe_tokenizer(), exports=("gguf",)
    )
    info = json.loads((out / "compression.json").read_text())["results"]["gguf"]
    assert info["tensor_types"] == {"F32": 6, "Q4_0": 8, "Q8_0": 6}  # tied head: not written
    change = info["scale_fp16_max_relative_change"]
    assert change == 0.0 if fp16_exact else 0 < change <= 2**-11

    ours, _, _ = load_compressed(out, runtime="packed")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, gguf_file=GGUF_FILE, dtype=torch.float32
    ).eval()
    for name in names:
        layer = ours.get_submodule(name)
        W = layer.dense_weight()
        if not fp16_exact:
            codes = layer.weight_codes().float().view(W.shape[0], -1, 32)
            zeros = layer.zeros.float().unsqueeze(-1)
            W = ((codes - zeros) * layer.scales.half().float().unsqueeze(-1)).view(W.shape)
        assert torch.equal(loaded.get_submodule(name).weight, W), name

    ids = torch.randint(3, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))

    def perplexity(m):
        with torch.no_grad():
            logits = m(ids).logits
        nll = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        return nll.exp().item()

    assert perplexity(loaded) == pytest.approx(perplexity(ours), rel=1e-5 if fp16_exact else 1e-3)


def test_save_compressed_refuses_a_gguf_it_cannot_write_before_writing(tmp_path):
    from lmcompress.compressor.formats.int4 import Int4Linear
    from lmcompress.compressor.io.save import save_compressed
    from lmcompress.compressor.report import CompressionReport

    model = _llama()
    name = "model.layers.0.mlp.up_proj"
    replace_modules(model, [name], lambda _, m: Int4Linear.from_linear(m, bits=4, group_size=64))
    with pytest.raises(LmcompressError, match="needs --group-size 32"):
        save_compressed(
            model, tmp_path / "out", CompressionReport(method="test", config={}),
            tokenizer=_bpe_tokenizer(), exports=("gguf",),
        )  # fmt: skip
    assert not (tmp_path / "out").exists()


def test_a_qwen2_model_with_biases_loads_back_unpermuted(tmp_path):
    """Qwen2: GGUF's ``qwen2`` architecture, no Q/K permutation, q/k/v biases written F32."""
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.uniform_(-0.5, 0.5)
    quantized = _quantize(model, _mixed)
    info = write_gguf(model, tmp_path / GGUF_FILE, quantized, _bpe_tokenizer())
    assert info["architecture"] == "qwen2"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=GGUF_FILE, dtype=torch.float32
    ).eval()
    assert loaded.config.model_type == "qwen2"
    for name, module in quantized.items():
        layer = loaded.get_submodule(name)
        assert torch.equal(layer.weight, module.dense_weight()), name
        if module.bias is not None:
            assert torch.equal(layer.bias, module.bias), name
    ids = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(ids).logits, loaded(ids).logits
    assert ((theirs - ours).abs().max() / ours.abs().max()).item() <= 1e-5


@pytest.mark.parametrize(
    ("dtype", "kind"), [(torch.float16, "F16"), (torch.bfloat16, "BF16"), (None, "F32")]
)
def test_a_16_bit_save_dtype_writes_the_other_tensors_in_it(dtype, kind, tmp_path):
    model = _llama(tie=False)
    quantized = _quantize(model)
    info = write_gguf(model, tmp_path / GGUF_FILE, quantized, _bpe_tokenizer(), dtype=dtype)
    # the embeddings and the head; the 5 norms stay F32
    assert info["tensor_types"][kind] == (7 if kind == "F32" else 2)
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / GGUF_FILE).tensors}
    embd = tensors["token_embd.weight"]
    assert embd.tensor_type.name == kind
    read = torch.from_numpy(gguf.quants.dequantize(embd.data, embd.tensor_type).copy())
    expected = model.model.embed_tokens.weight.detach().to(dtype or torch.float32).float()
    assert torch.equal(read.float(), expected)
    assert tensors["output_norm.weight"].tensor_type.name == "F32"
