"""The one sweep program: every table of ``benchmarks/tables/`` (``benchmarks.table``), run,
rerun in part, or redrawn.

    python -m benchmarks.sweep magnitude                      # every row of a table
    python -m benchmarks.sweep magnitude --only dense "magnitude 2:4" --results-dir /tmp/r
    python -m benchmarks.sweep magnitude --set eval_tokens=4096   # a setting changed
    python -m benchmarks.sweep --render-only                  # redraw every table's md
    python -m benchmarks.sweep lowrank --merge /tmp/a /tmp/b  # rows run side by side, merged

A row is one ``compress-model`` process (``benchmarks.runner``: its wall time and peak RSS):
``compress-model --config ROW.yaml`` (the row's recipe, written to the work directory) plus the
table's settings as flags (:func:`job_flags`), its output's ``compression.json`` read back; an
``eval`` row scores the checkpoint itself (``compress-model eval CHECKPOINT --json``); a
``peer`` row prunes with llm-compressor (``benchmarks.peers.run_peer``, in its venv). With
``score: apart`` every output is scored by ``compress-model eval OUT --json`` in a process of
its own (and the row's wall and RSS are the compression's alone). A ``learned`` row is a recipe
row that also keeps the method's training record (``benchmarks.learned_rows``). The results are
``benchmarks/results/NAME.{json,md}``: ``settings`` and ``results`` (one record a row,
:func:`record_of`), drawn by :func:`render` (``benchmarks.columns``).
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from benchmarks.columns import CAPTION_VARIABLES, Context, perplexity, row_name
from benchmarks.harness import (
    add_harness_args,
    add_merge_arg,
    merge_results,
    row_table,
    run_table,
)
from benchmarks.learned_rows import keep_curves, learned_of, record_of_rows, run_stages
from benchmarks.lowrank_rows import KINDS as LOWRANK_KINDS
from benchmarks.lowrank_rows import run_lowrank
from benchmarks.notes import NOTES
from benchmarks.plots import PLOTS
from benchmarks.render import RESULTS_DIR, markdown_table
from benchmarks.runner import CLI, PYTHON, ROOT, STDOUT, Job, Run, run_job, slug
from benchmarks.sections import SECTIONS
from benchmarks.table import SETTINGS, Row, Table, TableError, load_table, table_names

Record = dict[str, Any]
PEER_VENV = ROOT / ".venv-llmc"  # benchmarks/peers/setup_llmcompressor.sh makes it


def resolve_checkpoint(name: str, work: Path) -> str:
    """A checkpoint setting as compress-model takes it: ``tiny:FAMILY`` is a random tiny
    checkpoint of that family and ``cached:smollm2`` SmolLM2's directory in the cache (both
    from ``benchmarks.child.memory_estimate``, once per work directory); else as written."""
    source, _, rest = name.partition(":")
    if source not in ("tiny", "cached"):
        return name
    made = _tiny_checkpoints(work)
    return str(work / "tiny" / rest) if source == "tiny" else made[rest]


@functools.cache
def _tiny_checkpoints(work: Path) -> Record:
    command = (PYTHON, "-m", "benchmarks.child.memory_estimate", str(work / "tiny"))
    return run_job(Job("tiny checkpoints", command, STDOUT), work).result


def job_flags(settings: Record, scores: bool) -> list[str]:
    """The table's settings as ``compress-model`` flags (``scores``: the job evaluates)."""
    flags = [str(settings.get("checkpoint", "smollm2-135m"))]
    for key, flag in (("nsamples", "--nsamples"), ("seq_len", "--seq-len"), ("calib", "--calib"),
                      ("seed", "--seed")):  # fmt: skip
        if key in settings:
            flags += [flag, str(settings[key])]
    if settings.get("streaming"):  # a streamed job evaluates nothing (--eval is refused)
        return [*flags, "--streaming"]
    flags += ["--eval", *settings.get("corpora", ())] if scores else ["--eval"]
    if scores and "eval_tokens" in settings:
        flags += ["--eval-tokens", str(settings["eval_tokens"])]
    if settings.get("skip_dense"):
        flags.append("--skip-dense")
    if settings.get("dense_copy") is False:
        flags.append("--no-dense-copy")
    if "save_dtype" in settings:
        flags += ["--save-dtype", str(settings["save_dtype"])]
    return flags


def score_job(name: str, path: str | Path, settings: Record) -> Job:
    """``compress-model eval PATH --json`` on the table's corpora."""
    command = (*CLI, "eval", str(path), "--data", *settings.get("corpora", ("wiki-test",)))
    tokens = ("--eval-tokens", str(settings.get("eval_tokens", 32768)))
    return Job(f"eval {name}", (*command, *tokens, "--json", "-q"), STDOUT)


def _measured(run: Run) -> Record:
    return {"wall_seconds": run.wall_seconds, "peak_rss_mb": run.peak_rss_mb}


def _what(row: Row) -> Record:
    """method / sparsity / tool of a row, as the tables show them."""
    if row.kind == "eval":
        return {"method": "dense", "sparsity": "-", "tool": "-"}
    recipe = row.recipe if isinstance(row.recipe, dict) else {}
    tool = "llm-compressor" if row.kind == "peer" else "lmcompress"
    method = recipe.get("method") or "+".join(s["method"] for s in recipe.get("stages", []))
    sparsity = str(recipe.get("sparsity", "-"))
    if "bits" in recipe:  # a quantization row: its grid, beside any sparsity
        grid = f"w{recipe['bits']} g{recipe.get('group_size', 128)}"
        sparsity = grid if sparsity == "-" else f"{sparsity} + {grid}"
    return {"method": method or "recipe", "sparsity": sparsity, "tool": tool}


def run_row(row: Row, settings: Record, work: Path, peer_venv: Path, keep: bool = False) -> Record:
    """One row's record: its job, and its scoring and reloads where those are jobs of their own
    (``keep``: leave its output in the work directory, for a row that reads it)."""
    apart = settings.get("score", "in-job") == "apart"
    if "checkpoint" in settings:
        settings = {**settings, "checkpoint": resolve_checkpoint(str(settings["checkpoint"]), work)}
    record: Record = {"name": row.name, **_what(row)}
    if row.kind == "int8_interop":
        source = work / "outputs" / slug(row.source or "")
        command = (PYTHON, "-m", "benchmarks.child.int8_interop", str(source))
        command += (str(settings.get("eval_tokens", 32768)), *settings.get("corpora", ()))
        run = run_job(Job(row.name, command, STDOUT), work)
        return {"name": row.name, **run.result, "wall_seconds": run.wall_seconds}
    if row.kind == "eval":
        checkpoint = settings.get("checkpoint", "smollm2-135m")
        run = run_job(score_job(row.name, checkpoint, settings), work)
        scored = {} if apart else _measured(run)
        return {**record, **scored, "ppl": run.result["perplexity"]}
    if row.kind in LOWRANK_KINDS:
        return run_lowrank(
            row.name, row.kind, row.recipe, settings, work, lambda job: run_job(job, work)
        )
    if row.kind == "stages":
        run_stage = lambda job: run_job(job, work)  # noqa: E731
        stages = run_stages(row.name, row.recipe, settings, work, run_stage, _compress_job)
        return {**record, "baseline": row.baseline, "note": row.note, **stages}
    out = work / "outputs" / slug(row.name)
    if row.kind == "peer":
        peer = run_job(_peer_job(row, out, settings, peer_venv), work).result
        record.update({k: round(peer[k], 1) for k in ("wall_seconds", "peak_rss_mb")})
    else:
        job = (_readme_job if row.kind == "readme" else _compress_job)(row, out, settings, work)
        try:
            run = run_job(job, work)
        finally:  # a readme row's own empty cache (downloads, conversions): not left in /tmp
            if "LMCOMPRESS_CACHE" in job.env:
                shutil.rmtree(job.env["LMCOMPRESS_CACHE"], ignore_errors=True)
        record.update(_measured(run))
        record.update(record_of(run.result, out))
        if row.kind == "learned":
            record.update(learned_of(run.result, row.recipe), note=row.note)
        if row.kind == "readme":
            record["command"] = "compress-model " + " ".join(_as_flags(row.recipe))
    if apart:
        record["ppl"] = run_job(score_job(row.name, out, settings), work).result["perplexity"]
    if settings.get("reload") and row.kind == "recipe":
        record["reload"] = {r: _reload(row, out, r, settings, work) for r in settings["reload"]}
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    return record


def _reload(row: Row, out: Path, runtime: str, settings: Record, work: Path) -> Record:
    """``compress-model eval OUT --runtime RUNTIME --json``: the output reloaded and scored."""
    job = score_job(f"{row.name} {runtime}", out, settings)
    run = run_job(Job(job.name, (*job.command, "--runtime", runtime), STDOUT), work)
    return {
        "perplexity": run.result["perplexity"],
        "load": run.result["load"],
        "process_peak_rss_mb": run.peak_rss_mb,
        "wall_seconds": run.wall_seconds,
    }


def _as_flags(recipe: Record | str | None) -> list[str]:
    """A one-method recipe as the flags a person types (``{method: wanda}`` -> --method wanda)."""
    pairs = (recipe if isinstance(recipe, dict) else {}).items()
    return [part for key, value in pairs for part in (f"--{key.replace('_', '-')}", str(value))]


def _readme_job(row: Row, out: Path, settings: Record, _work: Path) -> Job:
    """The recipe as flags, from an empty cache (model download or GGUF conversion and corpus
    cleaning included), with no other setting than the table's eval_tokens."""
    tokens = ("--eval-tokens", str(settings.get("eval_tokens", 32768)))
    command = (*CLI, *_as_flags(row.recipe), *tokens, "-o", str(out), "-q")
    cache = {"LMCOMPRESS_CACHE": tempfile.mkdtemp(prefix="lmcompress-cache-")}
    return Job(row.name, command, out / "compression.json", env=cache)


def _compress_job(row: Row, out: Path, settings: Record, work: Path) -> Job:
    recipe = row.recipe
    if isinstance(recipe, dict):  # the row's recipe as a file compress-model --config reads
        path = work / "recipes" / f"{slug(row.name)}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        recipe = str(path)
    scores = settings.get("score", "in-job") != "apart"
    command = (*CLI, "--config", recipe, *job_flags(settings, scores), "-o", str(out), "-q")
    return Job(row.name, command, out / "compression.json")


def _peer_job(row: Row, out: Path, settings: Record, venv: Path) -> Job:
    recipe = row.recipe if isinstance(row.recipe, dict) else {}
    command = [PYTHON, "-m", "benchmarks.peers.run_peer", "--method", recipe.get("method"),
               "--out", str(out), "--venv", str(venv),
               "--model", settings.get("checkpoint", "smollm2-135m")]  # fmt: skip
    # pruning rows name a sparsity; quantization rows (gptq) their bits and group size
    for key, flag in (("sparsity", "--sparsity"), ("bits", "--bits"),
                      ("group_size", "--group-size"), ("observer", "--observer")):  # fmt: skip
        if key in recipe:
            command += [flag, str(recipe[key])]
    for key, flag in (("nsamples", "--nsamples"), ("seq_len", "--seq-len"), ("seed", "--seed"),
                      ("calib", "--calib")):  # fmt: skip
        if key in settings:
            command += [flag, str(settings[key])]
    return Job(row.name, command, STDOUT)


def record_of(manifest: Record, out: Path) -> Record:
    """What a row keeps of its output's ``compression.json``: the scores (``ppl``, ``dense``),
    the report's summary, the stored formats and bytes, and each stage's scores."""
    results, record = manifest.get("results", {}), {}
    if results.get("compressed"):
        record["ppl"] = results["compressed"]
    if results.get("dense"):
        record["dense"] = results["dense"]
    record["summary"] = manifest["report"]["summary"]
    extra = manifest["report"].get("extra", {})
    if "softmax" in extra:  # int8's 8-bit softmax and its bias
        record["softmax"] = extra["softmax"]
    if "sizes" in extra:  # a structured extraction: its new widths and what it kept
        keys = ("sizes", "removal", "kept_fraction", "blocks_removed")
        record["structure"] = {k: extra[k] for k in keys if k in extra}
    record["formats"] = sorted({e["format"] for e in manifest["compressed_layers"].values()})
    if (out / "compressed.safetensors").is_file():
        record["compressed_file_bytes"] = (out / "compressed.safetensors").stat().st_size
    if "memory_estimate" in results:  # what the job was admitted with
        record["estimate_bytes"] = results["memory_estimate"]["total"]
        record["estimate_parts"] = results["memory_estimate"]["parts"]
    if results.get("stages"):
        record["stages"] = [
            {"method": s["method"], "ppl": s["compressed"], "seconds": round(s["seconds"], 1)}
            for s in results["stages"]
        ]
    return record


def _caption(text: str, settings: Record, payload: Record) -> str:
    """``text`` filled from ``settings`` and the :data:`CAPTION_VARIABLES` it names."""
    named = {k: v(payload, settings) for k, v in CAPTION_VARIABLES.items() if f"{{{k}" in text}
    return text.format(**settings, **named).strip()


def render(table: Table, payload: Record) -> str:
    """The md of a results file: the caption (settings of the file over the table's), then a
    line per row (``dense_line`` first; a line per runtime it is reloaded in, with ``reload``;
    and per earlier stage, with ``stage_rows`` or ``stage_lines``), then each section, then the
    table's ``notes``; rows ``copy:`` copied (``baselines``) first."""
    results = [*payload.get("baselines", []), *payload["results"]]
    legacy = {k: payload[k] for k in SETTINGS if k in payload}  # lowrank.json: at the top
    settings = {**table.settings, **legacy, **payload.get("settings", {})}
    rows = {row_name(r): r for r in results}
    corpora = tuple(settings.get("corpora", ()))
    context = Context(rows, table.baselines, table.baseline, corpora, settings)
    lines, columns = [], table.columns
    dense = rows.get(table.baseline or "", {}).get("dense")
    if table.dense_line and dense:
        line = {"name": table.dense_line, "ppl": dense}
        lines.append([c.cell(line, context) if c.in_stage_rows else "-" for c in columns])
    hidden = {r.name for r in table.rows if not r.line}
    for r in (r for r in results if row_name(r) not in hidden):
        runtimes = settings.get("reload")
        for line in [{**r, "runtime": rt} for rt in runtimes] if runtimes else [r]:
            lines.append([c.cell(line, context) for c in columns])
        for index, stage in enumerate(r.get("stages", [])[:-1] if table.stage_rows else [], 1):
            sub = {**stage, "name": f"↳ after stage {index} ({stage['method']})"}
            lines.append([c.cell(sub, context) if c.in_stage_rows else "" for c in columns])
        for index, stage in enumerate(r.get("stages", [])[:-1] if table.stage_lines else [], 1):
            if all(perplexity(stage, c) for c in corpora):  # a stage scored: a line of its own
                sub = {**stage, "name": f"{row_name(r)} (stage {index})", "stage": index}
                sub.update({k: r.get(k) for k in ("sparsity", "threads")})
                lines.append([c.cell(sub, context) for c in columns])
    text = _caption(table.caption, settings, payload) + "\n\n"
    text += markdown_table([c.header for c in columns], lines)
    for section in table.sections:
        found = [r for r in results if row_name(r) in section.rows]
        if not found:
            continue
        after = ""
        if section.render:
            header, cells, after = SECTIONS[section.render](found, context)
        else:
            header = [c.header for c in section.columns]
            cells = [[c.cell(r, context) for c in section.columns] for r in found]
        first = {**settings, **table.row(section.rows[0]).settings}
        text += "\n" * section.gap + _caption(section.caption, first, payload) + "\n\n"
        text += markdown_table(header, cells) + after
    main = [r for r in payload["results"] if row_name(r) not in hidden]
    return text + (NOTES[table.notes](payload, main) if table.notes else "")


def harness_table(table: Table, args: argparse.Namespace):
    """The table as :func:`benchmarks.harness.run_table` runs it: each row with the table's
    settings, then its own, then those of ``--set`` (which the results file records)."""
    settings = {**table.settings, **args.settings}
    names = [r.name for r in table.rows]
    sources = {r.source for r in table.rows}

    def run(name: str, args: argparse.Namespace) -> Record:
        row = table.row(name)
        keep = name in sources  # a later row reads its output
        ours = {**settings, **row.settings, **args.settings}
        record = run_row(row, ours, args.work, args.peer_venv, keep)
        curves = args.results_dir / f"{table.file}_curves.json" if table.curves else None
        return keep_curves(record, curves)  # in FILE_curves.json (curves: true), by row

    def record(args: argparse.Namespace, rows: list[Record]) -> Record:
        return record_of_rows(table.copy, settings, args.results_dir, rows)

    def draw(payload: Record) -> str:
        return render(table, payload)

    def plot(payload: Record, results_dir: Path, path: Path) -> None:
        PLOTS[table.plot or ""](payload, results_dir, path, list(settings.get("corpora", ())))

    drawn = plot if table.plot else None
    return row_table(table.file, draw, names, run, record, plot=drawn, key=row_name)


def _setting(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: KEY=VALUE expected")
    return key, yaml.safe_load(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tables", nargs="*", metavar="TABLE", help="benchmarks/tables/TABLE.yaml "
                        "(--render-only: default every table)")  # fmt: skip
    parser.add_argument("--set", type=_setting, nargs="+", default=[], metavar="KEY=VALUE",
                        dest="settings", help="a setting of the table (a YAML value)")  # fmt: skip
    parser.add_argument("--skip-peers", action="store_true",
                        help="run no peer row (those of the results file are kept)")  # fmt: skip
    parser.add_argument("--peer-venv", type=Path, default=PEER_VENV, help="llm-compressor's venv")
    add_harness_args(parser, "rerun just these rows (names as in the table)")
    add_merge_arg(parser)
    args = parser.parse_args(argv)
    args.settings = dict(args.settings)
    unknown = sorted(set(args.settings) - set(SETTINGS))
    if unknown:
        parser.error(
            f"--set: unknown setting(s) {', '.join(unknown)} (known: {', '.join(SETTINGS)})"
        )
    names = args.tables or (table_names() if args.render_only else [])
    if len(names) != 1 and not args.render_only:
        parser.error("name one table to run or merge (tables: " + ", ".join(table_names()) + ")")
    status = 0
    for name in names:
        try:
            table = load_table(name)
        except TableError as err:
            parser.error(str(err))
        if args.skip_peers:
            only = args.only or [r.name for r in table.rows]
            args.only = [r.name for r in table.rows if r.kind != "peer" and r.name in only]
            if not args.only:
                parser.error("--skip-peers leaves no row to run")
        ran = harness_table(table, args)
        if args.merge:
            merged = args.results_dir or RESULTS_DIR
            rows = [r.name for r in table.rows]

            def empty(results_dir: Path, table: Table = table) -> Record:
                settings = {**table.settings, **args.settings}
                return record_of_rows(table.copy, settings, results_dir, [])

            merge_results(merged, args.merge, table.file, rows, empty, ran.render, ran.plot)
            continue
        status |= run_table(ran, args, parser)
    return status


def alias(module: str, table: str) -> None:
    """``python -m benchmarks.TABLE``, the old name of ``python -m benchmarks.sweep TABLE``."""
    if module == "__main__":
        sys.exit(main([table, *sys.argv[1:]]))


if __name__ == "__main__":
    sys.exit(main())
