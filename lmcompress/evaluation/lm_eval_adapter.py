"""Run lm-evaluation-harness tasks on an in-memory model, plus local tasks for our corpora.

lm-eval's perplexity tasks (``wikitext`` and the local ``lmcompress_*`` tasks here) report a
different number from ``perplexity.perplexity``; never put the two in one column:

- **Unit.** lm-eval divides the total NLL by words (``word_perplexity``, whitespace-separated
  words of the raw document) or bytes (``byte_perplexity``, ``bits_per_byte``); we divide by
  tokens. For the same total NLL, ``word_ppl = token_ppl ** (tokens / words)``; English BPE has
  ~1.3-1.5 tokens per word, so word perplexity is far larger. The byte metrics do not depend on
  the tokenizer, which makes them the ones to compare across vocabularies.
- **Windows.** lm-eval scores each document on its own: the first window starts with one prefix
  token (BOS, or EOS if there is none) and scores every token of the document, later windows of
  ``max_length`` tokens score only new tokens and carry no BOS, and the partial last window
  counts. We join all documents and score non-overlapping windows of the whole corpus, dropping
  the tail. Families that need BOS in every window (Gemma) get it from us, not from lm-eval.

The model is handed to lm-eval as an instance (``HFLM(pretrained=model)``, lm-eval's public
way to evaluate a model it did not load) and only public methods are overridden: rolling
(perplexity) requests are scored by ``loglikelihood_rolling`` here, which fixes two lm-eval
0.4.13 quirks: a tokenizer that adds BOS by itself (Llama-2, Gemma) made lm-eval score a second
BOS after the prefix token, counting log p(BOS | BOS) as document text; and lm-eval opened one
progress bar per batch of windows. Other requests (multiple choice, generation) are lm-eval's
own. An exported directory with its dense copy needs no adapter at all:
``lm_eval --model hf --model_args pretrained=OUT --tasks ...``.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import json
import logging
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from tqdm.auto import tqdm

from lmcompress.compressor.model.families import FAMILIES
from lmcompress.compressor.util.progress import bar_disabled
from lmcompress.errors import ConfigError, DataError, LmcompressError
from lmcompress.evaluation import corpora
from lmcompress.evaluation.lm_eval_windows import rolling_windows, window_logprobs

logger = logging.getLogger(__name__)

# task name -> corpus name for ``corpora.load_documents``
LOCAL_TASKS: dict[str, str] = {
    "lmcompress_wiki_test": "wiki-test",
    "lmcompress_lee": "lee",
}

# aggregations spelled out, or lm-eval warns about each missing one
_ROLLING_METRICS = (
    ("word_perplexity", "weighted_perplexity"),
    ("byte_perplexity", "weighted_perplexity"),
    ("bits_per_byte", "bits_per_byte"),
)
# lm-eval bootstraps the stderr of median/F1/BLEU/perplexity-like metrics; its default of
# 100,000 draws takes minutes, 1,000 is plenty for an error bar
_BOOTSTRAP_ITERS = 1000


class LmEvalMissingError(LmcompressError, ImportError):
    """lm-eval (the ``eval`` extra) is not installed."""


def local_task_config(name: str, data_file: str | Path, cache_dir: str | Path) -> dict[str, Any]:
    """lm-eval task config for a rolling-loglikelihood task over a JSONL file of ``{"text"}``."""
    return {
        "task": name,
        "dataset_path": "json",  # datasets' packaged builder: works offline
        "dataset_kwargs": {"data_files": {"test": str(data_file)}, "cache_dir": str(cache_dir)},
        "test_split": "test",
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        "doc_to_target": "text",  # a column name: the raw document, no Jinja rendering
        "metric_list": [
            {"metric": metric, "aggregation": aggregation, "higher_is_better": False}
            for metric, aggregation in _ROLLING_METRICS
        ],
        "metadata": {"version": 1.0},
    }


def write_local_tasks(names: list[str], directory: Path) -> None:
    """Write ``<name>.jsonl`` and ``<name>.yaml`` for each local task into ``directory``."""
    for name in names:
        source = LOCAL_TASKS[name]
        docs = [doc for doc in corpora.load_documents(source) if doc.strip()]
        if not docs:
            raise DataError(f"corpus {source!r} has no non-empty documents for task {name!r}")
        data_file = directory / f"{name}.jsonl"
        with open(data_file, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": doc}) + "\n" for doc in docs)
        config = local_task_config(name, data_file, directory / "datasets-cache")
        (directory / f"{name}.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
        logger.debug("local lm-eval task %s: %d documents from %r", name, len(docs), source)


def clean_results(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """lm-eval's ``{task: {"acc,none": x, "alias": ...}}`` -> ``{task: {"acc": x}}``.

    Metric keys lose lm-eval's ``,none`` filter suffix; other filters stay as ``metric/filter``
    (``exact_match/strict-match``). Standard errors are kept as ``<metric>_stderr`` when lm-eval
    computed a number, dropped when it reports ``"N/A"`` (perplexity aggregations). Entries
    that are not metrics (``alias``, ``name``, ``sample_len``) are dropped.
    """
    cleaned = {}
    for task, entries in results.items():
        metrics = {}
        for key, value in entries.items():
            metric, sep, filter_name = key.partition(",")
            if not sep or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            metrics[metric if filter_name == "none" else f"{metric}/{filter_name}"] = float(value)
        cleaned[task] = metrics
    return cleaned


def run_lm_eval(
    model: torch.nn.Module,
    tokenizer,
    tasks: list[str] | str,
    batch_size: int = 1,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    max_length: int | None = None,
) -> dict[str, dict[str, float]]:
    """Evaluate the in-memory ``model`` on lm-eval tasks; returns ``{task: {metric: value}}``.

    Args:
        tasks: lm-eval task/group/tag names, names from ``LOCAL_TASKS``, or both (a string may
            hold several, comma-separated). Tasks whose data lives on the Hugging Face hub fail
            offline with a ``DataError``; unknown names raise ``ConfigError``.
        limit: documents per task (an int) or a fraction of them (a float); lm-eval's ``limit``.
        num_fewshot: overrides the tasks' few-shot count (lm-eval keeps 0 where a task fixes it).
        max_length: context length in tokens; ``None`` lets lm-eval read it from the config
            (``n_positions``, ``max_position_embeddings``, ...) or the tokenizer, else 2048.

    Metric names are cleaned by ``clean_results`` (stderr kept as ``<metric>_stderr`` where
    lm-eval computed one). Global RNG states and the model's train/eval mode are restored.
    """
    if batch_size < 1:
        raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
    local, registered = _resolve(tasks)
    lm_eval = _import_lm_eval()
    registry_manager = _registry_task_manager() if registered else None

    was_training = model.training
    local_manager = None
    try:
        with (
            tempfile.TemporaryDirectory(prefix="lmcompress-lm-eval-") as tmp,
            _quiet_lm_eval(),
            _preserved_rng(model),
        ):
            specs: list[Any] = list(registered)
            if local:
                write_local_tasks(local, Path(tmp))
                local_manager = _task_manager_class()(include_path=tmp, include_defaults=False)
                specs = list(local_manager.load(local)["tasks"].values()) + specs
            lm = _hflm_class()(
                pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length
            )
            output = lm_eval.simple_evaluate(
                model=lm,
                tasks=specs,
                num_fewshot=num_fewshot,
                limit=limit,
                task_manager=registry_manager if registry_manager is not None else local_manager,
                log_samples=False,
                bootstrap_iters=_BOOTSTRAP_ITERS,
            )
    finally:
        model.train(was_training)  # HFLM switches the model to eval mode
    if output is None:  # not rank 0 of a distributed run
        return {}
    results = clean_results(output["results"])
    for task, metrics in results.items():
        logger.info("lm-eval %s: %s", task, ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
    return results


def check_tasks(tasks: list[str] | str) -> None:
    """Raise ``ConfigError`` now for task names :func:`run_lm_eval` would refuse, naming close
    matches, without loading any data set (nor writing the local tasks' corpora).

    Local task names and existing YAML files are checked in no time. Any other name needs
    lm-eval's task index (~13 s on 2 cores to parse its ~15,000 YAML files), built once per
    process: the :func:`run_lm_eval` that follows reuses it. Importing lm-eval costs ~3 s.
    """
    _resolve(tasks)


def _resolve(tasks: list[str] | str) -> tuple[list[str], list[str]]:
    """``(local, registered)`` task names, every registered one checked against lm-eval."""
    names = list(dict.fromkeys(_split_names(tasks)))
    if not names:
        raise ConfigError("no lm-eval tasks given")
    _import_lm_eval()
    local = [name for name in names if name in LOCAL_TASKS]
    registered = [name for name in names if name not in LOCAL_TASKS]  # lm-eval's own, or paths
    if not all(Path(name).is_file() for name in registered):  # a YAML path needs no index
        _check_known(registered, _registry_task_manager().all_tasks)
    return local, registered


def _split_names(tasks: list[str] | str) -> list[str]:
    parts = tasks.split(",") if isinstance(tasks, str) else tasks
    return [part.strip() for part in parts if part.strip()]


def _import_lm_eval():
    try:
        import lm_eval
        import lm_eval.tasks  # noqa: F401
    except ImportError as exc:
        raise LmEvalMissingError(
            f"lm-eval tasks need the lm-eval package ({exc}): pip install 'lmcompress[eval]'"
        ) from exc
    return lm_eval


def _check_known(names: list[str], known: list[str]) -> None:
    """Raise ``ConfigError`` naming every task that is neither registered nor a YAML file."""
    known_set = set(known)
    unknown = [n for n in names if n not in known_set and not Path(n).is_file()]
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, [*known, *LOCAL_TASKS], n=3)
        hints.append(f"{name!r} (did you mean {', '.join(close)}?)" if close else repr(name))
    raise ConfigError(
        f"unknown lm-eval task(s): {'; '.join(hints)}; local tasks: {', '.join(LOCAL_TASKS)}"
    )


@functools.cache
def _task_manager_class():
    from lm_eval.tasks import TaskManager

    class _TaskManager(TaskManager):
        """A TaskManager whose loading failures (mostly data sets on an unreachable hub) are
        one-line ``DataError``s."""

        def load(self, task_list):
            try:
                return super().load(task_list)
            except Exception as exc:  # anything a task's data set loader raises
                names = ", ".join(t for t in task_list if isinstance(t, str))
                message = (str(exc).strip().splitlines() or [""])[0]
                raise DataError(
                    f"lm-eval could not load task(s) {names}: "
                    f"{type(exc).__name__}: {message} (tasks whose data is on the Hugging Face "
                    "hub need a network or a local datasets cache)"
                ) from exc

    return _TaskManager


@functools.cache
def _registry_task_manager():
    # indexing lm-eval's ~15,000 task YAMLs takes ~15 s: do it once per process
    return _task_manager_class()()


@functools.cache
def _hflm_class():
    from lm_eval.models.huggingface import HFLM

    class _HFLM(HFLM):
        """HFLM (built on the in-memory model: ``HFLM(pretrained=model)``) whose rolling
        (perplexity) requests are scored here, through lm-eval's public interface only.

        ``loglikelihood_rolling`` is one of the three methods of lm-eval's model interface;
        lm-eval 0.4.13's own (which the other requests keep using) lets a tokenizer that adds
        BOS by itself score a second BOS after the prefix token, opens one progress bar per
        batch of windows, and holds a batch's whole logits. Here: the document encoded without
        special tokens (the prefix token already is the BOS), one bar over all windows, the
        head run on scored positions only. Numbers otherwise match lm-eval's (tested)."""

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            model_type = getattr(self.model.config, "model_type", None)
            batch_size = self.batch_size  # run_lm_eval gives an int; "auto" is lm-eval's to do
            if self.world_size > 1 or model_type not in FAMILIES or not isinstance(batch_size, int):
                return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)
            windows = []  # (request index, (inputs, targets))
            for index, request in enumerate(requests):
                (text,) = request.args
                tokens = self.tok_encode(text, add_special_tokens=False)
                windows += [
                    (index, window)
                    for window in rolling_windows(tokens, self.prefix_token_id, self.max_length)
                ]
            totals = [0.0] * len(requests)
            bar = tqdm(
                total=len(windows),
                desc="lm-eval windows",
                unit="window",
                disable=bar_disabled(not disable_tqdm),
            )
            with bar:
                for at in range(0, len(windows), batch_size):
                    batch = windows[at : at + batch_size]
                    sums = window_logprobs(self.model, [w for _, w in batch], self.device)
                    for (index, _), logprob in zip(batch, sums, strict=True):
                        totals[index] += logprob
                    bar.update(len(batch))
            for request, total in zip(requests, totals, strict=True):
                self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
            return totals

    return _HFLM


@contextlib.contextmanager
def _quiet_lm_eval():
    """lm-eval logs a warning per task and setting; keep errors only unless we log at DEBUG."""
    import datasets

    lm_eval_logger = logging.getLogger("lm_eval")
    level = lm_eval_logger.level
    if not logger.isEnabledFor(logging.DEBUG):
        lm_eval_logger.setLevel(logging.ERROR)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        lm_eval_logger.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


@contextlib.contextmanager
def _preserved_rng(model: torch.nn.Module):
    """simple_evaluate seeds python, numpy and torch globally; undo that for the caller."""
    device = next(model.parameters()).device
    devices = []  # fork_rng always saves the CPU generator; add the model's GPU
    if device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
