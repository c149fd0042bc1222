"""Bad and hostile inputs to ``compress-model`` on the real model, as a new user would try them.

    python -m benchmarks.bad_inputs                        # every probe
    python -m benchmarks.bad_inputs --only "--seq-len 100000"
    python -m benchmarks.bad_inputs --render-only

Each probe runs the installed CLI in a process of its own, in an empty directory, and records
its exit code, wall time, how many lines it printed on stderr, its last stderr line, and what it
left in the directory (or next to its output) or changed there. Some probes start from a set-up
(:func:`set_up`: a read-only or a 64 kB tmpfs mount, symlinks, a checkpoint whose config
disagrees with its weights, a tampered copy of a real export, a MaskLLM checkpoint), built from
fixtures made once per ``--work`` (:data:`FIXTURES`). The kill probes start a real job, wait
until its output's temporary sibling appears (the save has begun), send SIGKILL or SIGTERM, then
(SIGKILL) run the same job again; the writers probe starts a second job on the output a first
one holds. Writes ``benchmarks/results/bad_inputs.{json,md}``; the probes are the rows of issue
10's table and the inputs of issue 23.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.numpy import load_file, save_file  # numpy: the driver imports no torch

from benchmarks.bad_inputs_processes import (
    make_row,
    run_cli,
    run_kill,
    run_modes,
    run_race,
    run_writers,
)
from benchmarks.harness import add_harness_args, row_table, run_table
from benchmarks.render import markdown_table
from benchmarks.tamperings import EDITS
from lmcompress.cache import cache_dir
from lmcompress.compressor.io.layout import COMPRESSED_TENSORS

NAME = "bad_inputs"
# the probe table, the set-ups' fixtures and the tampering edits
from benchmarks.bad_inputs_probes import (  # noqa: E402
    FIXTURES,
    KILLS,
    LAYER,
    ORDER,
    PROBES,
    RACES,
    STAGES,
    TAMPERED,
    WRITERS,
    Probe,
)


def _cache() -> Path:
    return cache_dir() / "smollm2-135m"


def _fingerprint(path: Path) -> str:
    """Names, sizes and mtimes of everything under ``path``: did anything change?"""
    digest = hashlib.sha256()
    for item in sorted(path.rglob("*")):
        stat = item.stat()
        digest.update(f"{item.relative_to(path)} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def _state(work: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``work`` with its size and mtime: what a probe added or changed."""
    state = {}
    for path in work.rglob("*"):
        stat = path.lstat()
        changes = not path.is_dir() or path.is_symlink()  # a directory: is it there
        state[str(path.relative_to(work))] = (stat.st_size, stat.st_mtime_ns) if changes else 0
    return state


# --- fixtures and set-ups -----------------------------------------------------------------------


def fixture(name: str, args: argparse.Namespace) -> Path:
    """The export (or, for ``maskllm``, the output beside its checkpoint) ``FIXTURES[name]``
    makes, built once per ``--work``."""
    root = args.work / "fixtures"
    out = root / name.replace(":", "-")
    if not out.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        (root / "stages.yaml").write_text(STAGES)
        argv = tuple(a.format(fixtures=root) for a in FIXTURES[name])
        code, _, stderr = run_cli((*argv, "-q", "-o", str(out)), root)
        if code != 0:
            raise RuntimeError(f"fixture {name}: exit {code}: {stderr.strip()[-500:]}")
    return out


def _tamper(export: Path, tensor: str, edit: str) -> None:
    """Edit one value of ``LAYER``'s ``tensor`` in ``export``'s compressed tensors, keeping the
    file's metadata: positions repeated or out of range, a value NaN or inf."""
    file = export / COMPRESSED_TENSORS
    with safe_open(str(file), framework="numpy") as handle:
        metadata = handle.metadata()
    tensors = load_file(file)
    values = tensors[f"{LAYER}.{tensor}"]
    if edit == "repeat":  # the byte's first two 2-bit codes both name position 1
        values[0, 0] = (int(values[0, 0]) & 0xF0) | 0b0101
    elif edit == "0xff":
        values[0, 0] = 0xFF
    else:
        values.flat[3] = float(edit)
    save_file(tensors, str(file), metadata=metadata)


def set_up(setup: str, work: Path, args: argparse.Namespace) -> Callable[[], None] | None:
    """Make what a probe starts from in ``work``; returns the undo (an unmount) or ``None``.
    Raises ``Unavailable`` where this machine cannot (mounts need root)."""
    if setup in ("read-only mount", "64 kB tmpfs"):
        where = work / ("ro" if setup == "read-only mount" else "disk")
        where.mkdir()
        command = ["mount", "-o", "bind,ro", str(where), str(where)]
        if setup == "64 kB tmpfs":
            command = ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)]
        if subprocess.run(command, capture_output=True, check=False).returncode != 0:
            raise Unavailable(f"cannot mount ({setup}) here: needs root")
        return lambda: subprocess.run(["umount", str(where)], check=False)
    if setup == "symlinks":
        os.symlink(work / "nowhere" / "x", work / "dangling")
        os.symlink(work / "loop-b", work / "loop-a")
        os.symlink(work / "loop-a", work / "loop-b")
    elif setup == "mismatched":  # the cached model with a config.json that disagrees
        target = work / "mismatched"
        target.mkdir()
        for item in _cache().iterdir():
            os.symlink(item, target / item.name)
        config = json.loads((_cache() / "config.json").read_text())
        config["intermediate_size"] = config["intermediate_size"] // 2
        (target / "config.json").unlink()
        (target / "config.json").write_text(json.dumps(config))
    elif setup == "binary text":  # every byte value: not UTF-8
        (work / "t.txt").write_bytes(bytes(range(256)) * 16)
    elif setup == "latin-1 text":
        (work / "t.txt").write_bytes(
            "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e. ".encode("latin-1") * 50
        )
    elif setup.startswith("maskllm checkpoint"):
        fixture("maskllm", args)
        shutil.copytree(args.work / "fixtures" / "maskllm-ckpt", work / "ckpt")
        if setup.endswith("truncated"):
            state = work / "ckpt" / "trainer_state" / "state.safetensors"
            state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    elif setup.startswith("schema: "):  # a tampering of benchmarks.tamperings, in its process
        name = setup.removeprefix("schema: ")
        shutil.copytree(fixture(EDITS[name][0] if name in EDITS else "2:4", args), work / "t")
        edit = [sys.executable, "-m", "benchmarks.tamperings", name, str(work / "t")]
        subprocess.run(edit, check=True, cwd=Path(__file__).resolve().parent.parent)
    elif setup.startswith("fixture: "):
        fixture(setup.removeprefix("fixture: "), args)
    elif setup.startswith("tampered: "):
        kind, tensor, edit = TAMPERED[setup.removeprefix("tampered: ")]
        shutil.copytree(fixture(kind, args), work / "t")
        _tamper(work / "t", tensor, edit)
    else:
        raise ValueError(f"unknown set-up {setup!r}")
    return None


class Unavailable(RuntimeError):
    """A set-up this machine cannot make: the probe's row says so."""


def _verdict(probe: Probe, row: dict[str, Any]) -> bool:
    """Exit as expected; an error is one stderr line, leaves nothing, changes no input, takes
    under 20 s."""
    if row["exit"] != probe.expect:
        return False
    if probe.expect == 0:
        return row.get("same_as_uninterrupted", True)
    return (
        row["stderr_lines"] == probe.lines
        and not row["left_behind"]
        and row["seconds"] < 20
        and "\x1b" not in row["message"]  # a path's ANSI escapes reach no terminal raw
    )


def run_probe(name: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    probe = PROBES[name]
    work.mkdir(parents=True)
    for rel, text in probe.files.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(text)
    try:
        undo = set_up(probe.setup, work, args) if probe.setup else None
    except Unavailable as err:
        return {"name": name, "skipped": str(err)}
    fill = {"cache": _cache(), "fixtures": args.work / "fixtures", "work": work}
    argv = tuple(a.format(**fill) for a in probe.argv)
    env = {k: None if v is None else v.format(**fill) for k, v in probe.env.items()}
    before, cache_before = _state(work), _fingerprint(_cache())
    try:
        code, seconds, stderr = run_cli(argv, work, env, probe.python)
        after = _state(work)
    finally:
        if undo:
            undo()
    left = sorted(set(after) - set(before))
    left += sorted(f"{path} (changed)" for path in before if after.get(path) != before[path])
    if _fingerprint(_cache()) != cache_before:
        left.append(f"the input {_cache()} changed")
    row = make_row(name, code, seconds, stderr, left if probe.expect else [])
    if probe.expect == 0 and probe.setup == "maskllm checkpoint":  # resumed = uninterrupted?
        mine = load_file(work / "out" / COMPRESSED_TENSORS)
        theirs = load_file(fixture("maskllm", args) / COMPRESSED_TENSORS)
        row["same_as_uninterrupted"] = mine.keys() == theirs.keys() and all(
            mine[k].dtype == theirs[k].dtype and mine[k].tobytes() == theirs[k].tobytes()
            for k in mine
        )
    row["expect"] = probe.expect
    row["ok"] = _verdict(probe, row)
    return row


def render(payload: dict[str, Any]) -> str:
    rows = []
    for r in payload["results"]:
        if "skipped" in r:
            rows.append([f"`{r['name']}`", "-", "-", "-", f"skipped: {r['skipped']}", "-", "-"])
            continue
        left = ", ".join(r["left_behind"]) or "nothing"
        message = r["message"].replace("|", "\\|")
        if "next_run" in r:
            nxt = r["next_run"]
            message += (
                f"; next run: exit {nxt['exit']}, {' '.join(nxt['warned']) or 'no warning'}, "
                f"left {', '.join(nxt['left_behind']) or 'nothing'}"
            )
        if "modes" in r:
            message = f"umask {r['umask']}: " + ", ".join(f"{k} {v}" for k, v in r["modes"].items())
            left = "-"
            for out, files in r.get("sizes_mb", {}).items():
                big = {k: v for k, v in files.items() if v >= 1}
                message += (
                    f"; {'default' if out == 'out' else '--no-dense-copy'} output "
                    f"{sum(files.values()):.1f} MB ("
                    + ", ".join(f"{k} {v}" for k, v in big.items())
                    + ")"
                )
        if "first_run" in r:
            first = r["first_run"]
            message += (
                f"; the first run: {'still running' if first['still running'] else 'ended'}, "
                f"exit {first['exit after SIGTERM']} after SIGTERM"
            )
        if "same_as_uninterrupted" in r:
            message += f"; resumed = uninterrupted: {r['same_as_uninterrupted']}"
        exit_code = r["exit"] if "expect" not in r else f"{r['exit']} ({r['expect']})"
        ok = "-" if "ok" not in r else ("yes" if r["ok"] else "**no**")
        name = r["name"] if len(r["name"]) < 80 else r["name"][:60] + "…"
        rows.append([f"`{name}`", exit_code, r["seconds"], r["stderr_lines"], message, left, ok])
    header = ["input", "exit (expected)", "s", "stderr lines", "last stderr line", "left behind"]
    header.append("ok")
    good = sum(1 for r in payload["results"] if r.get("ok"))
    judged = sum(1 for r in payload["results"] if "ok" in r)
    return (
        "# Bad inputs on SmolLM2-135M (`python -m benchmarks.bad_inputs`)\n\n"
        f"{good} of {judged} judged rows ok: the expected exit (2 for a bad input, 0 for a legal "
        "one whose result is right); a bad input's error in one stderr line, under 20 s, "
        "leaving nothing and changing no input.\n\n" + markdown_table(header, rows)
    )


def run_row(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One probe, in an empty directory of its own under ``args.work``."""
    where = args.work / f"probe-{ORDER.index(name):02d}"
    if where.exists():  # a rerun (--only) in the same --work
        shutil.rmtree(where)
    if name in PROBES:
        return run_probe(name, where, args)
    if name == WRITERS:
        return run_writers(where)
    if name in RACES:
        return run_race(name, where)
    if name in KILLS:
        return run_kill(name, where)
    return run_modes(where)


def record(_args: argparse.Namespace, rows: list[dict]) -> dict[str, Any]:
    return {"results": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_harness_args(parser, "rerun just these probes (names as in the table)")
    table = row_table(NAME, render, ORDER, run_row, record)
    return run_table(table, parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
