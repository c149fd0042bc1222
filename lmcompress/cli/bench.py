"""``compress-model bench CHECKPOINT [OUT ...]``: prefill and decode speed of the dense model (each
dtype) and of compressed outputs in their compressed runtimes, side by side in one process."""

from __future__ import annotations

import json
from collections.abc import Sequence

from lmcompress.cli.terminal import PROG, Parser, setup_logging
from lmcompress.compressor.io.load import RUNTIMES
from lmcompress.compressor.io.speed_report import speed_table
from lmcompress.evaluation.speed import SpeedOptions, parse_prefill
from lmcompress.jobs.bench import bench_job


def bench_parser() -> Parser:
    """The flags of ``compress-model bench``, each help ending with its default."""
    defaults = SpeedOptions()
    parser = Parser(
        prog=f"{PROG} bench",
        description="Tokens/s of a checkpoint and its compressed outputs: prefill, decode at "
        "batch 1 with a KV cache, time to first token, weight bytes; rows interleaved in one "
        "process, median of the repeats.",
    )
    parser.add_argument("checkpoint", help="the dense checkpoint (alias, directory, .gguf, hub id)")
    parser.add_argument("exports", nargs="*", help="directories written by compress-model")
    parser.add_argument(
        "--prefill",
        default="x".join(map(str, defaults.prefill)),
        help="BATCHxTOKENS of the prefill forward (default: %(default)s)",
    )
    parser.add_argument(
        "--decode", type=int, default=defaults.decode, help="new tokens (default: %(default)s)"
    )
    parser.add_argument(
        "--prompt", type=int, default=defaults.prompt, help="prompt tokens (default: %(default)s)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=defaults.repeats,
        help="timed rounds of each row; the table shows their median (default: %(default)s)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=defaults.warmup,
        help="untimed rounds of each row before the timed ones (default: %(default)s)",
    )
    parser.add_argument(
        "--dense-dtypes",
        nargs="+",
        choices=("float32", "bfloat16", "float16"),
        default=list(defaults.dense_dtypes),
        help=f"dtypes of the dense rows (default: {' '.join(defaults.dense_dtypes)})",
    )
    _add_row_arguments(parser, defaults)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument(
        "--device",
        default=defaults.device,
        help="where every row runs: cpu, cuda, cuda:1, ... (default: %(default)s)",
    )
    parser.add_argument(
        "-o",
        "--output",
        help="write speed.json, speed.md and speed.png here (default: not written)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty --output directory (default: off, refuse)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the record as JSON (default: off, a table)"
    )
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="warnings only, no progress bars (default: off)"
    )
    return parser


def _add_row_arguments(parser: Parser, defaults: SpeedOptions) -> None:
    """The flags that say which rows there are and how each export is loaded."""
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also time each row under torch.compile (static KV cache; compiling takes ~1 min "
        "a row on 2 cores); a compiled row is compared with the best compiled dense row "
        "(default: off)",
    )
    parser.add_argument(
        "--lean",
        action="store_true",
        help="also time each row's decoding through lmcompress's lean step (Llama, Mistral, "
        "Qwen2; CPU: the layers' own linears, norms, rotary and attention in a few kernels); a "
        "lean row is compared with the best lean dense row (default: off)",
    )
    parser.add_argument(
        "--runtime",
        nargs="+",
        choices=RUNTIMES,
        default=list(defaults.runtimes),
        help="each export in these runtimes: packed (its compressed form), expanded (packed N:M "
        "layers unpacked once: faster, more memory), dense "
        f"(default: {' '.join(defaults.runtimes)})",
    )
    parser.add_argument(
        "--plain",
        action="store_true",
        help="load each export with plain transformers in each of --dense-dtypes (a smaller "
        "dense model from --method structured or subnet --structure) (default: off)",
    )


def bench_command(argv: Sequence[str]) -> int:
    args = bench_parser().parse_args(argv)
    setup_logging(args.quiet)
    options = SpeedOptions(
        prefill=parse_prefill(args.prefill),
        decode=args.decode,
        prompt=args.prompt,
        repeats=args.repeats,
        warmup=args.warmup,
        dense_dtypes=tuple(args.dense_dtypes),
        device=args.device,
        compile=args.compile,
        runtimes=tuple(args.runtime),
        plain=args.plain,
        lean=args.lean,
    )
    record = bench_job(
        args.checkpoint, args.exports, options, args.output, args.threads, args.overwrite
    )
    print(json.dumps(record, indent=2) if args.json else speed_table(record), end="")
    return 0
