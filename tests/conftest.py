"""Shared fixtures: tiny random models of every supported family, and a tiny tokenizer.

Every hidden size is a multiple of 8 so that 2:4 and 4:8 patterns fit every linear layer.
"""

from __future__ import annotations

import os
from pathlib import Path

# Nothing in the tests may reach a model hub; huggingface_hub reads these at import time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402  (Triton reads TRITON_INTERPRET when ``@triton.jit`` runs)

# Without a GPU, Triton kernels run on CPU tensors in Triton's interpreter, chosen when
# ``@triton.jit`` runs: set before any test imports a kernel module. With a CUDA device the
# kernels compile for it, so the ``gpu`` tests run them for real (the interpreter tests then
# skip; TRITON_INTERPRET=1 in the environment still forces the interpreter). Here, not in
# tests/kernels/conftest.py: two conftest modules would both be importable as ``conftest``.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import transformers  # noqa: E402

from benchmarks.allocator import peak_allocated_bytes  # noqa: E402, F401  (tests import it here)
from lmcompress.kernels import cpu_kernels, int4_reference  # noqa: E402

VOCAB = 256

TINY_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    ),
    "mistral": lambda: transformers.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    ),
    "qwen2": lambda: transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    ),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        sliding_window=16,
    ),
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=128,
    ),
    "opt": lambda: transformers.OPTConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        word_embed_proj_dim=32,
    ),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
    ),
}

FAMILY_NAMES = sorted(TINY_CONFIGS)


def make_tiny_model(model_type: str, seed: int = 0, num_layers: int | None = None):
    """A random ``*ForCausalLM`` of the family, in eval mode, fp32."""
    config = TINY_CONFIGS[model_type]()
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 1, 2, 2
    if num_layers is not None:
        for attr in ("num_hidden_layers", "n_layer"):
            if hasattr(config, attr):
                setattr(config, attr, num_layers)
        types = getattr(config, "layer_types", None)  # Gemma3's: one entry a block
        if isinstance(types, list):
            config.layer_types = [types[i % len(types)] for i in range(num_layers)]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def make_qwen3(seed: int = 0) -> transformers.PreTrainedModel:
    """A random two-block Qwen3 (per-head q/k RMS norms), outside ``TINY_CONFIGS``: the shared
    family fixtures do not include it; its tests are in ``compressor/model/test_qwen3.py``."""
    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 1, 2, 2
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def make_odd_llama(vocab_size: int = VOCAB):
    """A one-block Llama whose MLP width (36) is not divisible by 8: 4:8 cannot fit down_proj."""
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=36,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return transformers.AutoModelForCausalLM.from_config(config)


def make_tiny_tokenizer():
    """A byte-level tokenizer with a 256-symbol vocabulary (ids 0-255), BOS/EOS = 1/2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # 256 printable stand-ins for the bytes
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=sorted(alphabet)[0]))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            pre_tokenizers.Split("", behavior="isolated"),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    symbols = sorted(alphabet)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=symbols[1],
        eos_token=symbols[2],
        unk_token=symbols[0],
        pad_token=symbols[2],
    )


@pytest.fixture(params=FAMILY_NAMES)
def family_model(request):
    """(model_type, tiny random model) for every supported family."""
    return request.param, make_tiny_model(request.param)


@pytest.fixture
def tiny_tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture
def tiny_checkpoint(tmp_path):
    """A saved tiny Llama checkpoint directory (safetensors + tokenizer)."""
    path = tmp_path / "tiny-llama"
    model = make_tiny_model("llama")
    model.save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return path


def int4_weight(out, in_features, bits, group_size, symmetric=False, seed=0):
    """Random packed int4 (or 3/8-bit) codes, scales and zero points of one layer (the int4
    kernel tests' weights): ``(qweight, scales, zeros)``."""
    g = torch.Generator().manual_seed(seed)
    groups = int4_reference.groups_of(group_size, in_features)
    q = torch.randint(0, 2**bits, (out, in_features), dtype=torch.uint8, generator=g)
    scales = torch.rand(out, groups, generator=g) / 20 + 1e-3
    if symmetric:
        zeros = torch.full((out, groups), 2 ** (bits - 1), dtype=torch.uint8)
    else:
        zeros = torch.randint(0, 2**bits, (out, groups), dtype=torch.uint8, generator=g)
    return int4_reference.pack_codes(q, bits), scales, zeros


def linear_dtypes(monkeypatch) -> list[set[torch.dtype]]:
    """The dtypes of each ``F.linear`` call's tensors from now on (a list that fills as they
    run): which dtype a matmul ran in, where its values alone may not tell (bf16's own
    ``F.linear`` rounds once from float32 sums)."""
    seen: list[set[torch.dtype]] = []
    linear = torch.nn.functional.linear

    def spy(*args):
        seen.append({a.dtype for a in args if a is not None})
        return linear(*args)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    return seen


# The compiled kernels' tests run wherever a compiler is: a source that fails to build there
# (say, for a CPU the last session did not have) fails them instead of skipping them.
requires_kernels = pytest.mark.skipif(
    not (cpu_kernels.enabled() and cpu_kernels.has_compiler()),
    reason="no C++ compiler here (or LMCOMPRESS_CPU_KERNELS=0)",
)

# compiler flags of a build as on a CPU with AVX2 but not AVX-512 (the kernels' AVX2 loops)
AVX2_ONLY = ["-O3", "-march=native", "-mno-avx512f", "-fopenmp"]


def cpu_flags_or_skip(*required: str) -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``); skips the test where they cannot be read or
    one of ``required`` is missing."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    missing = sorted(set(required) - flags)
    if missing:
        pytest.skip(f"no {', '.join(missing)} here")
    return flags


@pytest.fixture
def kernels_built_with(tmp_path, monkeypatch):
    """``build(flags, cpu)``: the compiled CPU kernels rebuilt with compiler ``flags`` in a cache
    of their own, as on a CPU (``cpu``, the build's identity) with fewer instructions; the
    default library is loaded again after the test."""
    from lmcompress.kernels import cpu_kernels

    def build(flags: list[str], cpu: str):
        monkeypatch.setenv("LMCOMPRESS_CACHE", str(tmp_path))
        monkeypatch.setattr(cpu_kernels, "FLAG_SETS", (flags,))
        monkeypatch.setattr(cpu_kernels, "_cpu_identity", lambda: cpu)
        cpu_kernels.library.cache_clear()
        return cpu_kernels.library()

    yield build
    cpu_kernels.library.cache_clear()


def count_calls(monkeypatch, owner, name: str) -> dict[str, int]:
    """Wrap ``owner.name`` (a function or method) so that each call adds one to the returned
    ``{"n": ...}``; the original still runs."""
    calls = {"n": 0}
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.fixture(scope="session")
def method_jobs(tmp_path_factory):
    """One real quiet job per method, shared by the tests that read them (``method_jobs.py``)."""
    from method_jobs import run_method_jobs

    return run_method_jobs(tmp_path_factory.mktemp("method-jobs"))
