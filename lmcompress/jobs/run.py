"""One compression job end to end: load, calibrate, compress, evaluate, export.

The CLI is a thin layer over :func:`run`; benchmarks call it too, so every number the README
quotes comes through the same path a user runs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from lmcompress.api import run_method
from lmcompress.compressor.config import MethodConfig
from lmcompress.compressor.io.save import save_compressed
from lmcompress.compressor.model.checkpoint import DEFAULT_CHECKPOINT
from lmcompress.compressor.model.families import family_of
from lmcompress.compressor.model.loading import load_model
from lmcompress.compressor.options import check_choices, check_types, command_line
from lmcompress.compressor.training import distributed
from lmcompress.errors import ConfigError, LmcompressError
from lmcompress.evaluation.corpora import calibration_windows, tokenize
from lmcompress.evaluation.perplexity import perplexity
from lmcompress.jobs.preflight import preflight
from lmcompress.methods import get_method

if TYPE_CHECKING:
    from torch import nn

    from lmcompress.compressor.method import Stats
    from lmcompress.compressor.report import CompressionReport

logger = logging.getLogger(__name__)

DEFAULT_EVAL_TOKENS = 32_768
SaveDtype = Literal["auto", "float32", "float16", "bfloat16"]
ComputeDtype = Literal["float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class RunOptions:
    """Everything about a job that is not the method's own configuration."""

    checkpoint: str = field(default=DEFAULT_CHECKPOINT, metadata={"help": "model to compress"})
    calib: str = field(default="wiki-calib", metadata={"help": "calibration corpus"})
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
    output: str | None = field(
        default=None, metadata={"help": "output directory", "default_text": "not saved"}
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
        metadata={"help": "start even if the memory estimate exceeds the available memory"},
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
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.seq_len < 2:
            raise ConfigError(f"seq_len must be at least 2, got {self.seq_len}")
        if self.eval_tokens < 0:
            raise ConfigError(f"eval_tokens must be >= 0 (0 = whole split), got {self.eval_tokens}")
        check_choices(self)
        if self.offload_activations is not None and not self.streaming:
            raise ConfigError("--offload-activations works with --streaming only")


def evaluate(
    model, tokenizer, corpora: dict[str, torch.Tensor], options: RunOptions
) -> dict[str, Any]:
    """Perplexity on every eval corpus: ``{corpus: PerplexityResult.to_dict()}``."""
    bos = tokenizer.bos_token_id if family_of(model).needs_bos else None
    return {
        name: perplexity(
            model, ids, options.seq_len, batch_size=options.eval_batch_size, bos_token_id=bos
        ).to_dict()
        for name, ids in corpora.items()
    }


def run(options: RunOptions, config: MethodConfig) -> dict[str, Any]:
    """Run the job; returns the results that the CLI prints and ``compression.json`` records.

    Every check that needs no weights runs first (:func:`lmcompress.jobs.preflight.preflight`), so
    that a bad input fails in about a second: device, checkpoint, output path, lm-eval tasks,
    the method on a meta-device copy of the model, sequence length, memory, corpora."""
    method = get_method(config.method)(config)
    if options.streaming:
        from lmcompress.jobs.streaming import run_streaming

        return run_streaming(options, method)
    preflight(options, method)
    needs_text = (*options.eval, *((options.calib,) if method.needs_calibration else ()))
    start = time.perf_counter()
    model, tokenizer = load_model(
        options.checkpoint,
        dtype=options.dtype,
        device=options.device,
        trust_remote_code=options.trust_remote_code,
    )
    method.validate(model)
    if tokenizer is None and needs_text:
        raise LmcompressError(f"{options.checkpoint} has no tokenizer: cannot read text")
    corpora = {
        name: tokenize(tokenizer, name, options.eval_tokens or None) for name in options.eval
    }
    calib = None
    if method.needs_calibration:
        calib_ids = tokenize(tokenizer, options.calib)
        calib = calibration_windows(calib_ids, options.nsamples, options.seq_len, options.seed)

    results: dict[str, Any] = {
        "options": asdict(options),
        "checkpoint": options.checkpoint,
        # for the model card: the run again, whatever recipe or API call started it
        "command": command_line(
            "compress-model", options.checkpoint, config.method, options, config
        ),
    }
    # Under ``accelerate launch`` every process compresses (a learned method trains on its
    # share of the data); only the main one evaluates and writes the outputs.
    main = distributed.is_main_process()
    if not options.skip_dense and main:
        results["dense"] = evaluate(model, tokenizer, corpora, options)
    report, stats = run_method(method, model, calib, return_stats=True)  # validated above
    if not main:
        results.update(report=report, compressed={}, seconds=time.perf_counter() - start)
        return results
    results["compressed"] = evaluate(model, tokenizer, corpora, options)
    # learned tensors (MaskLLM's logits): for --prior-from and inspection
    return finish_run(
        model, tokenizer, options, report, results, stats if method.stats_in_output else None, start
    )


def finish_run(
    model: nn.Module,
    tokenizer: Any,
    options: RunOptions,
    report: CompressionReport,
    results: dict[str, Any],
    stats: Stats | None,
    start: float,
) -> dict[str, Any]:
    """The end of a job on the main process, once ``results["compressed"]`` is scored: lm-eval
    tasks, summary, timing, the export (``stats`` saved with it), and ``results["report"]``.
    Shared by :func:`run` and multi-stage recipes (:mod:`lmcompress.jobs.recipe`)."""
    if options.lm_eval_tasks:
        from lmcompress.evaluation.lm_eval_adapter import run_lm_eval

        results["lm_eval"] = run_lm_eval(model, tokenizer, list(options.lm_eval_tasks))
    results["summary"] = report.summary()
    results["seconds"] = time.perf_counter() - start
    if options.output:
        save_dtype = None if options.save_dtype == "auto" else getattr(torch, options.save_dtype)
        save_compressed(
            model,
            options.output,
            report,
            tokenizer=tokenizer,
            dtype=save_dtype,
            overwrite=options.overwrite,
            extra=results,
            stats=stats,
            dense_copy=options.dense_copy,
        )
        results["output"] = options.output
    results["report"] = report
    return results
