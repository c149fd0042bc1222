"""What a job is, besides the method's own configuration: :class:`RunOptions` (checkpoint,
calibration and evaluation text, output), checked on construction like every config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lmcompress.compressor.model.checkpoint import DEFAULT_CHECKPOINT
from lmcompress.compressor.options import check_choices, check_types
from lmcompress.errors import ConfigError, shown

DEFAULT_EVAL_TOKENS = 32_768
SaveDtype = Literal["auto", "float32", "float16", "bfloat16"]
ComputeDtype = Literal["float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class RunOptions:
    """Everything about a job that is not the method's own configuration."""

    checkpoint: str = field(default=DEFAULT_CHECKPOINT, metadata={"help": "model to compress"})
    calib: str = field(
        default="wiki-calib",
        metadata={
            "help": "calibration corpus: a built-in one, a local file, or 'self' (text sampled "
            "from the model itself, LLM-QAT's data-free recipe)"
        },
    )
    nsamples: int = field(default=128, metadata={"help": "calibration windows"})
    seq_len: int = field(default=512, metadata={"help": "tokens per calibration/eval window"})
    seed: int = field(default=0, metadata={"help": "seed of the calibration windows"})
    eval: tuple[str, ...] = field(default=("wiki-test",), metadata={"help": "corpora to score"})
    eval_tokens: int = field(
        default=DEFAULT_EVAL_TOKENS, metadata={"help": "tokens of each eval corpus (0 = all)"}
    )
    eval_batch_size: int = field(default=4, metadata={"help": "windows per forward pass"})
    skip_dense: bool = field(default=False, metadata={"help": "do not score the dense model"})
    lm_eval_tasks: tuple[str, ...] = field(default=(), metadata={"help": "lm-eval tasks to run"})
    bench: bool = field(
        default=False,
        metadata={
            "help": "after saving, time the export against the dense model (compress-model "
            "bench's table) and add it to the model card"
        },
    )
    output: str | None = field(
        default=None, metadata={"help": "output directory", "default_text": "not saved"}
    )
    export: Literal["gguf"] | None = field(
        default=None,
        metadata={
            "help": "also write the output as one file another engine runs: gguf = OUT/model.gguf "
            "for llama.cpp (llama/qwen2 models whose layers are 4- or 8-bit, symmetric, "
            "--group-size 32: Q4_0/Q8_0; float16 scales)",
            "default_text": "none",
        },
    )
    overwrite: bool = field(default=False, metadata={"help": "replace a non-empty output dir"})
    save_dtype: SaveDtype = field(
        default="auto", metadata={"help": "dtype of the saved weights (auto: the model's)"}
    )
    dtype: ComputeDtype = field(default="float32", metadata={"help": "compute dtype"})
    device: str = field(default="cpu", metadata={"help": "cpu, cuda, cuda:1, ..."})
    trust_remote_code: bool = field(default=False, metadata={"help": "run a checkpoint's code"})
    dense_copy: bool = field(
        default=True,
        metadata={
            "help": "also write dense weights that plain transformers loads (--no-dense-copy: "
            "the compressed layers only in their compressed form; SmolLM2 2:4 at fp32: 343 MB "
            "instead of 767 MB)"
        },
    )
    force: bool = field(
        default=False,
        metadata={
            "help": "start even if the memory estimate exceeds the available memory, or what "
            "the job writes exceeds a filesystem's free space"
        },
    )
    streaming: bool = field(
        default=False,
        metadata={
            "help": "models larger than memory: one decoder block in memory at a time, read "
            "from the checkpoint's safetensors and written to -o as it is done (magnitude, "
            "wanda, sparsegpt; a local checkpoint directory; no evaluation)"
        },
    )
    offload_activations: str | None = field(
        default=None,
        metadata={
            "help": "with --streaming: keep the calibration activations between blocks in "
            "files under this directory instead of in memory",
            "metavar": "DIR",
            "default_text": "in memory",
        },
    )

    def __post_init__(self) -> None:
        check_types(self)  # a recipe's values can be of any type: names the key if one is wrong
        for name in ("nsamples", "seq_len", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {shown(getattr(self, name))}")
        if self.seq_len < 2:
            raise ConfigError(f"seq_len must be at least 2, got {shown(self.seq_len)}")
        if self.eval_tokens < 0:
            raise ConfigError(
                f"eval_tokens must be >= 0 (0 = whole split), got {shown(self.eval_tokens)}"
            )
        check_choices(self)
        if self.bench and not self.output:
            raise ConfigError("--bench times the saved export: add -o OUT")
        if self.export and not self.output:
            raise ConfigError(f"--export {self.export} writes into the output: add -o OUT")
        if self.export and self.streaming:
            raise ConfigError(f"--export {self.export} needs the model in memory: not --streaming")
        if self.offload_activations is not None and not self.streaming:
            raise ConfigError("--offload-activations works with --streaming only")
