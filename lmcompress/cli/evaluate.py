"""``compress-model eval CHECKPOINT_OR_OUT``: perplexity (and lm-eval tasks) of a checkpoint or
of a written output, through the evaluate step every job uses
(:func:`lmcompress.jobs.evaluate.evaluate_checkpoint`)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from lmcompress.cli.summary import say
from lmcompress.cli.terminal import PROG, Parser, setup_logging
from lmcompress.compressor.io.load import RUNTIMES
from lmcompress.jobs.evaluate import EvalOptions, eval_options, evaluate_checkpoint


def eval_parser() -> Parser:
    """The flags of ``compress-model eval``, each help ending with its default."""
    defaults = EvalOptions(checkpoint="")
    parser = Parser(prog=f"{PROG} eval", description="Perplexity of a checkpoint or output dir.")
    parser.add_argument("checkpoint", help="checkpoint, or a directory written by compress-model")
    parser.add_argument(
        "--data",
        "--eval",
        dest="data",
        nargs="+",
        default=list(defaults.data),
        metavar="CORPUS",
        help="corpora to score; --eval and --data are the same flag (--eval as in a "
        f"compression job) (default: {' '.join(defaults.data)})",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=defaults.seq_len,
        help="tokens per eval window (default: %(default)s)",
    )
    parser.add_argument(
        "--eval-tokens",
        type=int,
        default=defaults.eval_tokens,
        help="tokens of each corpus (0 = all) (default: %(default)s)",
    )
    parser.add_argument(
        "--eval-batch-size",
        type=int,
        default=defaults.eval_batch_size,
        help="windows per forward pass (default: %(default)s)",
    )
    parser.add_argument(
        "--lm-eval-tasks",
        nargs="+",
        default=list(defaults.lm_eval_tasks),
        metavar="TASK",
        help="lm-eval tasks to run (default: none)",
    )
    parser.add_argument(
        "--device", default=defaults.device, help="cpu, cuda, cuda:1, ... (default: %(default)s)"
    )
    parser.add_argument(
        "--runtime",
        choices=RUNTIMES,
        help="for a compress-model output: keep compressed layers in their compressed modules "
        "(packed), rebuild plain dense layers (dense), or unpack packed N:M layers once for "
        "speed (expanded, its memory cost logged); ignored for checkpoints (default: packed; "
        "the Python load_compressed defaults to dense)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the results as JSON (default: off)"
    )
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="warnings only, no progress bars (default: off)"
    )
    return parser


def evaluate_command(argv: Sequence[str]) -> int:
    args = eval_parser().parse_args(argv)
    setup_logging(args.quiet)
    results = evaluate_checkpoint(eval_options(**vars(args)))
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    load = results["load"]
    if "runtime" in load:
        ratio = load["ratio_to_dense_fp16"]
        say(
            f"{load['runtime']} runtime: {load['layers']} compressed layers hold "
            f"{load['resident_bytes'] / 2**20:.1f} MiB"
            + (f" ({ratio:.1%} of their dense fp16 bytes)" if ratio is not None else "")
            + f"; peak RSS {load['peak_rss_mib']:.0f} MiB after loading"
        )
    for corpus, res in results["perplexity"].items():
        say(
            f"{corpus}: perplexity {res['perplexity']:.3f} over {res['tokens']} tokens "
            f"({res['seconds']:.1f} s)"
        )
    for name, metrics in results.get("lm_eval", {}).items():
        say(f"lm-eval {name}: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
    return 0
