"""``compress-model``: compress a checkpoint, list methods, or score a model.

    compress-model [CHECKPOINT] --method magnitude --sparsity 2:4 -o OUT
    compress-model methods
    compress-model eval CHECKPOINT_OR_OUT --data wiki-test [--runtime packed|dense]

Exit codes: 0 success; 2 a user error (one line on stderr, nothing written); 130 interrupted
(Ctrl-C, SIGINT); 143 terminated (SIGTERM). An interrupted or terminated run cleans up what it
was writing, exactly as on an error.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from lmcompress.errors import ConfigError, LmcompressError

PROG = "compress-model"


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process was so that the same clean-up as for Ctrl-C runs
    (temporary output directories removed, nothing half-written left behind)."""


def _raise_terminated(signum: int, _frame: Any) -> NoReturn:
    raise Terminated(signal.Signals(signum).name)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (exit 2) instead of usage + message."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def _load_recipe(path: str) -> dict[str, Any]:
    import yaml

    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"recipe {path} not found")
    try:
        recipe = yaml.safe_load(file.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ConfigError(
            f"recipe {path} is not valid YAML/JSON: {str(err).splitlines()[0]}"
        ) from None
    if not isinstance(recipe, dict):
        raise ConfigError(f"recipe {path} must be a mapping of option names to values")
    return {str(k).replace("-", "_"): v for k, v in recipe.items()}


@dataclass(frozen=True)
class JobFlags:
    """What :func:`run_job` needs besides the parsed flags: the recipe the flags override, the
    method's config class, and which flags are the job's and which the method's."""

    recipe: dict[str, Any]
    config_class: type
    run_fields: list[str]
    method_fields: list[str]


def add_job_arguments(
    parser: argparse.ArgumentParser, argv: Sequence[str], prog: str = PROG
) -> JobFlags:
    """Define a compression job's flags on ``parser``: the job's (:class:`RunOptions`) and the
    options of the method ``argv`` names (``--method``, else the recipe's, else magnitude).

    ``compress-model`` and ``optimum-cli lmcompress`` both build their parser here, so the two
    take the same options. Raises ``ConfigError`` for an unknown method or unreadable recipe.
    """
    from lmcompress.cli.flags import add_dataclass_flags
    from lmcompress.jobs.run import RunOptions
    from lmcompress.methods import METHODS, get_method

    # First pass: which method (from the flag or the recipe) decides which flags exist.
    pre = _Parser(add_help=False)
    pre.add_argument("--method")
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    recipe = _load_recipe(known.config) if known.config else {}
    if "stages" in recipe and known.method:
        raise ConfigError("--method does not go with a multi-stage recipe: its stages name them")
    method_name = known.method or recipe.get("method") or "magnitude"
    config_class = get_method(method_name).config_class

    parser.description = (
        "Compress a Hugging Face causal LM, score it beside the dense one, and write it as "
        "safetensors (with a model card, README.md, and report.png)."
    )
    parser.epilog = (
        f"The options above are {method_name}'s; each method has its own: "
        f"`{prog} --method NAME --help`, or `{PROG} methods` for all of them. Other commands: "
        f"`{PROG} eval OUT` scores a written output. Exit codes: 0 done, 2 a bad input (one "
        "line, nothing written), 130 interrupted, 143 terminated."
    )
    parser.add_argument(
        "checkpoint",
        nargs="?",
        default=argparse.SUPPRESS,
        help="local dir, .gguf file, hub id, or smollm2-135m (default)",
    )
    parser.add_argument(
        "--method",
        default=method_name,
        choices=list(METHODS),
        help=f"compression method (default: magnitude; this help: {method_name})",
    )
    parser.add_argument("--config", help="YAML/JSON recipe; flags override it")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings only")
    run_group = parser.add_argument_group("job")
    run_fields = add_dataclass_flags(
        run_group, RunOptions, skip=("checkpoint",), aliases={"output": "-o"}
    )
    method_group = parser.add_argument_group(f"{method_name} options")
    method_fields = add_dataclass_flags(method_group, config_class)
    return JobFlags(recipe, config_class, run_fields, method_fields)


def run_job(args: dict[str, Any], flags: JobFlags) -> int:
    """Run the job that ``args`` (the flags :func:`add_job_arguments` defined, as a dict)
    describe, and print its summary."""
    from lmcompress.compressor.options import option_fields
    from lmcompress.compressor.training import distributed
    from lmcompress.jobs.run import RunOptions, run

    args = dict(args)
    _setup_logging(args.pop("quiet"))
    if "stages" in flags.recipe:  # a multi-stage recipe (lmcompress.jobs.recipe)
        from lmcompress.cli.recipe import run_stages_job

        return run_stages_job(args, flags)
    recipe = dict(flags.recipe)
    for group in {o.path[0] for o in option_fields(flags.config_class) if len(o.path) > 1}:
        if isinstance(recipe.get(group), dict):  # an option group as a mapping: flatten it
            recipe.update({str(k).replace("-", "_"): v for k, v in recipe.pop(group).items()})
    unknown = set(recipe) - set(flags.run_fields) - set(flags.method_fields)
    unknown -= {"method", "checkpoint"}
    if unknown:
        raise ConfigError(
            f"recipe has unknown option(s) for method {args['method']!r}: "
            f"{', '.join(sorted(unknown))}"
        )
    merged = {**recipe, **args}
    run_keys = (*flags.run_fields, "checkpoint")
    options = RunOptions(**{k: merged[k] for k in run_keys if k in merged})
    config = flags.config_class.from_dict(
        {k: merged[k] for k in flags.method_fields if k in merged}
    )
    results = run(options, config)
    if distributed.is_main_process():  # one summary, not one per process
        _print_summary(results)
    return 0


def _compress(argv: Sequence[str]) -> int:
    parser = _Parser(prog=PROG)
    flags = add_job_arguments(parser, argv)
    return run_job(vars(parser.parse_args(argv)), flags)


def _print_summary(results: dict[str, Any]) -> None:
    report = results["report"]
    summary = report.summary()
    print(f"\n{report.method} on {results['checkpoint']}: {_changed_options(report)}")
    if results["compressed"]:
        print(f"{'corpus':<14}{'dense ppl':>12}{'compressed ppl':>16}{'tokens':>9}")
    else:
        print("no corpus scored (--eval with none)")
    for corpus, res in results["compressed"].items():
        dense = results.get("dense", {}).get(corpus)
        dense_text = f"{dense['perplexity']:.3f}" if dense else "-"
        print(f"{corpus:<14}{dense_text:>12}{res['perplexity']:>16.3f}{res['tokens']:>9}")
    kept = summary["params_kept"] / max(summary["params_compressed_layers"], 1)
    dtype = results["options"]["dtype"]
    print(
        f"{summary['layers']} layers compressed in {results['seconds']:.1f} s: {kept:.1%} of "
        f"their weights kept; their compressed form takes "
        f"{summary['bytes_compressed'] / max(summary['bytes_dense'], 1):.1%} of their dense "
        f"{dtype} bytes (values plus their metadata: N:M positions or scales)"
    )
    for name, metrics in results.get("lm_eval", {}).items():
        print(f"lm-eval {name}: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
    if results.get("output"):
        print(f"saved to {results['output']}: {_output_sizes(Path(results['output']))}")


def _changed_options(report: Any) -> str:
    """The options that differ from the method's defaults, as ``--flag value`` text."""
    from lmcompress.methods import get_method

    defaults = get_method(report.method).config_class().to_dict()
    changed = []
    for key, value in report.config.items():
        if key == "method" or defaults.get(key) == value:
            continue
        text = " ".join(map(str, value)) if isinstance(value, list) else str(value)
        changed.append(f"{key}={text}")
    return ", ".join(changed) or "default options"


def _output_sizes(out: Path) -> str:
    """``"730.1 MB in all: compressed form 190.2 MB, dense copy 540.0 MB ..."``."""
    from lmcompress.compressor.io.layout import COMPRESSED_TENSORS

    def size(paths: list[Path]) -> float:
        return sum(p.stat().st_size for p in paths if p.is_file()) / 1e6

    total = size(list(out.rglob("*")))
    compressed = size([out / COMPRESSED_TENSORS])
    dense = size([p for p in out.glob("*.safetensors") if p.name != COMPRESSED_TENSORS])
    text = f"{total:.1f} MB in all"
    if compressed:
        text += f"; compressed form {compressed:.1f} MB ({COMPRESSED_TENSORS})"
    manifest = json.loads((out / "compression.json").read_text())
    interop = (manifest.get("interop") or {}).get("layout")
    if dense and compressed and not manifest.get("dense_copy", True):
        text += f"; the other parameters {dense:.1f} MB (no dense copy)"
    elif dense and compressed and interop:
        text += f"; model.safetensors {dense:.1f} MB in the {interop} layout"
    elif dense and compressed:
        text += (
            f"; dense copy {dense:.1f} MB for plain transformers (--no-dense-copy leaves it out)"
        )
    return text + "; per-layer detail in compression.json"


def _methods(argv: Sequence[str]) -> int:
    from lmcompress.cli.flags import describe
    from lmcompress.methods import METHODS

    parser = _Parser(prog=f"{PROG} methods", description="List methods and their options.")
    parser.parse_args(argv)
    for name, method_class in METHODS.items():
        doc = (method_class.config_class.__doc__ or "").strip().splitlines()[0]
        print(f"{name}: {doc}")
        for flag, default, help_text in describe(method_class.config_class):
            print(f"  {flag:<22} {default:<14} {help_text}")
    return 0


def _eval(argv: Sequence[str]) -> int:
    from lmcompress.jobs.run import RunOptions, evaluate

    parser = _Parser(prog=f"{PROG} eval", description="Perplexity of a checkpoint or output dir.")
    parser.add_argument("checkpoint", help="checkpoint, or a directory written by compress-model")
    parser.add_argument("--data", nargs="+", default=["wiki-test"], help="corpora to score")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--eval-tokens", type=int, default=RunOptions.eval_tokens)
    parser.add_argument("--eval-batch-size", type=int, default=4)
    parser.add_argument("--lm-eval-tasks", nargs="+", default=[])
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--runtime",
        choices=("packed", "dense"),
        help="for a compress-model output: keep compressed layers in their compressed modules "
        "(packed, the default) or rebuild plain dense layers (dense); ignored for checkpoints",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("-q", "--quiet", action="store_true")
    args = parser.parse_args(argv)
    _setup_logging(args.quiet)
    options = RunOptions(
        checkpoint=args.checkpoint,
        eval=tuple(args.data),
        seq_len=args.seq_len,
        eval_tokens=args.eval_tokens,
        eval_batch_size=args.eval_batch_size,
        device=args.device,
    )
    from lmcompress.jobs.preflight import check_eval

    check_eval(args.checkpoint, args.device, args.seq_len, args.lm_eval_tasks, options.eval)
    from lmcompress.compressor.io.layout import MANIFEST
    from lmcompress.compressor.io.load import load_compressed, read_manifest, runtime_bytes
    from lmcompress.compressor.model.loading import load_model
    from lmcompress.evaluation.corpora import tokenize

    start = time.perf_counter()
    load: dict[str, Any] = {}
    if (Path(args.checkpoint) / MANIFEST).is_file():
        runtime = args.runtime or "packed"
        model, tokenizer, _ = load_compressed(args.checkpoint, runtime=runtime, device=args.device)
        names = list(read_manifest(args.checkpoint)["compressed_layers"])
        load = {"runtime": runtime, **runtime_bytes(model, names)}
    else:
        if args.runtime:
            logging.getLogger(__name__).warning(
                "--runtime %s ignored: %s is a plain checkpoint", args.runtime, args.checkpoint
            )
        model, tokenizer = load_model(args.checkpoint, device=args.device)
    load.update(seconds=round(time.perf_counter() - start, 3), peak_rss_mib=_peak_rss_mib())
    if tokenizer is None:
        raise LmcompressError(f"{args.checkpoint} has no tokenizer: cannot read text")
    corpora = {
        name: tokenize(tokenizer, name, options.eval_tokens or None) for name in options.eval
    }
    results: dict[str, Any] = {"perplexity": evaluate(model, tokenizer, corpora, options)}
    if args.lm_eval_tasks:
        from lmcompress.evaluation.lm_eval_adapter import run_lm_eval

        results["lm_eval"] = run_lm_eval(model, tokenizer, args.lm_eval_tasks)
    results.update(load=load, peak_rss_mib=_peak_rss_mib())
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    if "runtime" in load:
        ratio = load["ratio_to_dense_fp16"]
        print(
            f"{load['runtime']} runtime: {load['layers']} compressed layers hold "
            f"{load['resident_bytes'] / 2**20:.1f} MiB"
            + (f" ({ratio:.1%} of their dense fp16 bytes)" if ratio is not None else "")
            + f"; peak RSS {load['peak_rss_mib']:.0f} MiB after loading"
        )
    for corpus, res in results["perplexity"].items():
        print(
            f"{corpus}: perplexity {res['perplexity']:.3f} over {res['tokens']} tokens "
            f"({res['seconds']:.1f} s)"
        )
    for name, metrics in results.get("lm_eval", {}).items():
        print(f"lm-eval {name}: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
    return 0


def _peak_rss_mib() -> float:
    """Peak resident set size of this process so far, in MiB.

    On Linux this is ``VmHWM`` of the process's own address space: ``getrusage``'s
    ``ru_maxrss`` survives ``execve``, so a process started by a large one (a test runner, a
    benchmark driver) would report its parent's peak instead of its own.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 2**10, 1)  # kB
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)


def _setup_logging(quiet: bool) -> None:
    logging.basicConfig(
        level=logging.WARNING if quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


COMMANDS = {"methods": _methods, "eval": _eval}


def quiet_environment(argv: Sequence[str]) -> None:
    """``-q``: no progress bars. tqdm reads TQDM_DISABLE once, when it is imported: call this
    before anything imports it (transformers, if imported already, is told directly)."""
    if "-q" in argv or "--quiet" in argv:
        os.environ["TQDM_DISABLE"] = "1"
        transformers = sys.modules.get("transformers")
        if transformers is not None:  # imported already (optimum-cli does): tell it directly
            transformers.utils.logging.disable_progress_bar()


def guarded(prog: str, command: Callable[..., int], *args: Any) -> int:
    """``command(*args)`` with the CLI's exit codes: a user error is one line on stderr and 2,
    Ctrl-C 130, SIGTERM 143 (raised where the process was, so clean-up runs as for Ctrl-C)."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:  # not the main thread (main() called from a worker): leave it alone
        previous = None
    try:
        return command(*args)
    except LmcompressError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except Terminated:
        print(f"{prog}: terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_environment(argv)
    command = COMMANDS.get(argv[0]) if argv else None
    if command:
        return guarded(PROG, command, argv[1:])
    return guarded(PROG, _compress, argv)


if __name__ == "__main__":
    sys.exit(main())
