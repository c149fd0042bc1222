"""The evaluate step of every job: perplexity on the eval corpora (and lm-eval tasks), for a
compression job's dense and compressed model and for ``compress-model eval`` alike.

:class:`JobText` is the text a job reads: the eval corpora, tokenized once, and the calibration
windows, tokenized when a stage first needs them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lmcompress.compressor.calibration.windows import calibration_windows
from lmcompress.compressor.io.layout import MANIFEST
from lmcompress.compressor.io.load import load_compressed, read_manifest, runtime_bytes
from lmcompress.compressor.model.families import family_of
from lmcompress.compressor.model.loading import load_model
from lmcompress.compressor.util.memory import peak_rss_mib
from lmcompress.errors import ConfigError, LmcompressError
from lmcompress.evaluation.corpora import tokenize
from lmcompress.evaluation.generated import SELF_CORPUS, sample_windows
from lmcompress.evaluation.lm_eval_adapter import run_lm_eval
from lmcompress.evaluation.perplexity import perplexity
from lmcompress.jobs.options import DEFAULT_EVAL_TOKENS, RunOptions
from lmcompress.jobs.preflight import check_eval

logger = logging.getLogger(__name__)

_evaluate_hooks: OrderedDict[int, Callable[[nn.Module], None]] = OrderedDict()  # weakref-able


def register_evaluate_hook(hook: Callable[[nn.Module], None]) -> RemovableHandle:
    """Call ``hook(model)`` as every evaluate step starts (the dense model, each stage, the
    compressed model, ``compress-model eval``): for an instrument that measures a job there,
    such as ``benchmarks/rss_profile.py``'s count of live tensors. ``.remove()`` the handle
    to unregister it (as ``torch.nn.modules.module.register_module_forward_hook``)."""
    handle = RemovableHandle(_evaluate_hooks)
    _evaluate_hooks[handle.id] = hook
    return handle


def evaluate(
    model: nn.Module, tokenizer: Any, corpora: dict[str, torch.Tensor], options: RunOptions
) -> dict[str, Any]:
    """Perplexity on every eval corpus: ``{corpus: PerplexityResult.to_dict()}``."""
    for hook in list(_evaluate_hooks.values()):
        hook(model)
    bos = tokenizer.bos_token_id if family_of(model).needs_bos else None
    return {
        name: perplexity(
            model, ids, options.seq_len, batch_size=options.eval_batch_size, bos_token_id=bos
        ).to_dict()
        for name, ids in corpora.items()
    }


class JobText:
    """The token ids a job reads: ``corpora`` (each eval corpus, tokenized now) and
    :meth:`calibration` (the calibration windows, tokenized on first use; with ``--calib
    self``, sampled from ``model`` on first use, so from the dense model before any stage)."""

    def __init__(
        self,
        tokenizer: Any,
        options: RunOptions,
        evaluates: bool = True,
        model: nn.Module | None = None,
    ) -> None:
        self.tokenizer, self.options, self.model = tokenizer, options, model
        names = options.eval if evaluates else ()
        self.corpora = {
            name: tokenize(tokenizer, name, options.eval_tokens or None) for name in names
        }
        self._windows: torch.Tensor | None = None

    def calibration(self) -> torch.Tensor:
        """``(nsamples, seq_len)`` windows of the calibration corpus (drawn once, by seed)."""
        if self._windows is None:
            options = self.options
            if options.calib == SELF_CORPUS:
                if self.model is None:
                    raise ConfigError("--calib self samples from the model: this job has none")
                self._windows = sample_windows(
                    self.model, self.tokenizer, options.nsamples, options.seq_len, options.seed
                )
                return self._windows
            ids = tokenize(self.tokenizer, options.calib)
            self._windows = calibration_windows(
                ids, options.nsamples, options.seq_len, options.seed
            )
        return self._windows


@dataclass(frozen=True)
class EvalOptions:
    """``compress-model eval``: score a checkpoint or a compress-model output."""

    checkpoint: str
    data: tuple[str, ...] = ("wiki-test",)
    seq_len: int = 512
    eval_tokens: int = DEFAULT_EVAL_TOKENS
    eval_batch_size: int = 4
    lm_eval_tasks: tuple[str, ...] = ()
    device: str = "cpu"
    runtime: str | None = None  # packed (the default for outputs) or dense


def evaluate_checkpoint(options: EvalOptions) -> dict[str, Any]:
    """Load ``options.checkpoint`` (an output in its compressed runtime, or a plain checkpoint)
    and score it: ``{"perplexity", "lm_eval"?, "load", "peak_rss_mib"}``. The same checks
    and the same evaluate step as a compression job."""
    run = RunOptions(
        checkpoint=options.checkpoint,
        eval=tuple(options.data),
        seq_len=options.seq_len,
        eval_tokens=options.eval_tokens,
        eval_batch_size=options.eval_batch_size,
        device=options.device,
    )
    tasks = list(options.lm_eval_tasks)
    check_eval(options.checkpoint, options.device, options.seq_len, tasks, run.eval)
    start = time.perf_counter()
    load: dict[str, Any] = {}
    if (Path(options.checkpoint) / MANIFEST).is_file():
        runtime = options.runtime or "packed"
        model, tokenizer, _ = load_compressed(options.checkpoint, runtime, options.device)
        names = list(read_manifest(options.checkpoint)["compressed_layers"])
        load = {"runtime": runtime, **runtime_bytes(model, names)}
    else:
        if options.runtime:
            logger.warning(
                "--runtime %s ignored: %s is a plain checkpoint",
                options.runtime,
                options.checkpoint,
            )
        model, tokenizer = load_model(options.checkpoint, device=options.device)
    load.update(seconds=round(time.perf_counter() - start, 3), peak_rss_mib=peak_rss_mib())
    if tokenizer is None:
        raise LmcompressError(f"{options.checkpoint} has no tokenizer: cannot read text")
    text = JobText(tokenizer, run)
    results: dict[str, Any] = {"perplexity": evaluate(model, tokenizer, text.corpora, run)}
    if options.lm_eval_tasks:
        results["lm_eval"] = run_lm_eval(model, tokenizer, tasks)
    results.update(load=load, peak_rss_mib=peak_rss_mib())
    return results


def eval_options(**values: Any) -> EvalOptions:
    """:class:`EvalOptions` from the values given (the rest default); lists become tuples."""
    names = {f.name for f in dataclasses.fields(EvalOptions)}
    return EvalOptions(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if k in names}
    )
