"""Training checkpoints on disk, and the checks that make a resume explain itself.

A checkpoint is a directory ``trainer_state`` holding ``state.safetensors`` (the trained
parameters ``param.NAME``, the optimiser moments ``opt.NAME.KEY``, the RNG ``rng.torch``;
nothing is pickled) and ``state.json``:

- ``state``: the step, the history and the evaluations so far;
- ``config``: the trainer's result-determining hyperparameters (``TrainConfig.fingerprint``);
- ``options``: the method's (:func:`options_fingerprint`: its flat recipe less the
  bookkeeping options, ``options.BOOKKEEPING``, which a resume may change);
- ``params``: the name and shape of every trained parameter;
- ``data``: what was trained on (:func:`data_fingerprint`).

A resume under other options, parameters or data is refused in one line naming each
difference (``sparsity: 2:4 → 4:8``); a checkpoint that cannot be read (truncated, not JSON,
keys missing) in one line naming the file; both before a tensor is copied anywhere.
:func:`check_resume` runs the same checks on ``state.json`` and the tensor file's header alone
from a method's ``validate``, so a job refuses before the model's weights are read.

Block-wise training keeps one checkpoint per block (``block-0003/trainer_state``, see
:func:`block_dir`); :func:`find_checkpoints` lists every checkpoint under a directory.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from lmcompress.compressor.io.shards import open_safetensors, read_safetensors
from lmcompress.compressor.training.options import BOOKKEEPING
from lmcompress.compressor.util.fsutil import atomic_dir
from lmcompress.errors import ConfigError, LmcompressError, ModelLoadError

CHECKPOINT = "trainer_state"
STATE = "state.json"
TENSORS = "state.safetensors"
META_KEYS = ("state", "config", "options", "params", "data")
_ABSENT = object()
_SHOWN = 6  # differences named in one message; the rest are counted


@dataclass(frozen=True)
class Checkpoints:
    """Where a run keeps its checkpoints (None: nowhere), whether it resumes from them, and
    the method's fingerprint they carry (what a resume must agree with)."""

    directory: str | None = None
    resume: bool = False
    fingerprint: dict[str, Any] | None = None

    @classmethod
    def of(cls, config: Any) -> Checkpoints:
        """A learned method's: from its ``training`` options and its whole config."""
        training = config.training
        return cls(training.checkpoint_dir, training.resume, options_fingerprint(config))


def options_fingerprint(config: Any) -> dict[str, Any]:
    """What of a learned method's config decides its trained state: its flat recipe
    (``config.to_dict()``: the method's options and the training options) less the
    bookkeeping ones (checkpoint directory and interval, evaluation interval, ...)."""
    return {k: v for k, v in config.to_dict().items() if k not in BOOKKEEPING}


def data_fingerprint(data: Any) -> str:
    """The number of examples and, for a tensor (token windows), a digest of its bytes."""
    if isinstance(data, torch.Tensor):
        raw = data.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        return f"{len(data)} examples, sha256 {hashlib.sha256(raw.tobytes()).hexdigest()[:12]}"
    return f"{len(data)} examples"


def block_dir(root: str | Path, index: int) -> Path:
    """Where block ``index`` of a block-wise run keeps its checkpoint."""
    return Path(root) / f"block-{index:04d}"


def find_checkpoints(root: str | Path) -> list[Path]:
    """Every checkpoint under ``root``: the end-to-end one, then each block's, in order."""
    root = Path(root)
    found = [root / CHECKPOINT, *sorted(root.glob(f"block-*/{CHECKPOINT}"))]
    return [path for path in found if path.is_dir()]


def corrupt(path: Path, reason: str) -> LmcompressError:
    return LmcompressError(
        f"checkpoint {path} is corrupt or incomplete ({reason}): delete it or rerun without "
        "--resume"
    )


def write_checkpoint(source: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """``tensors`` and ``meta`` into ``source`` (a ``trainer_state`` directory), atomically."""
    with atomic_dir(source) as tmp:
        save_file(tensors, str(tmp / TENSORS))
        (tmp / STATE).write_text(json.dumps(meta))


def read_meta(source: Path) -> dict[str, Any]:
    """``source/state.json``, every key present (:data:`META_KEYS`)."""
    path = source / STATE
    if not path.is_file():
        raise corrupt(path, "missing")
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise corrupt(path, f"not valid JSON: {err}") from None
    if not isinstance(meta, dict):
        raise corrupt(path, "not a JSON object")
    missing = [key for key in META_KEYS if key not in meta]
    if missing:
        raise corrupt(path, f"no {', '.join(missing)}")
    wrong = [k for k in META_KEYS[:4] if not isinstance(meta[k], dict)]
    if wrong or not isinstance(meta["state"].get("step"), int):
        raise corrupt(path, f"malformed {', '.join(wrong) or 'state'}")
    return meta


def check_tensors(source: Path, meta: dict[str, Any]) -> None:
    """The tensor file's header (no tensor read) holds the RNG state and every parameter of
    ``meta`` in its recorded shape; a truncated file fails here."""
    path = source / TENSORS
    try:
        with open_safetensors(path) as f:
            keys = set(f.keys())
            shapes = {key: list(f.get_slice(key).get_shape()) for key in keys}
    except ModelLoadError as err:
        raise corrupt(path, str(err).removeprefix(f"cannot read {path}: ")) from None
    expected = {f"param.{name}": shape for name, shape in meta["params"].items()}
    missing = [key for key in [*expected, "rng.torch"] if key not in keys]
    if missing:
        raise corrupt(path, f"no {_listed(missing)}")
    other = [f"{k} is {shapes[k]}, {STATE} says {v}" for k, v in expected.items() if shapes[k] != v]
    if other:
        raise corrupt(path, _listed(other))


def read_tensors(source: Path) -> dict[str, torch.Tensor]:
    path = source / TENSORS
    try:
        tensors, _ = read_safetensors(path)
    except ModelLoadError as err:
        raise corrupt(path, str(err).removeprefix(f"cannot read {path}: ")) from None
    return tensors


def check_matches(source: Path, meta: dict[str, Any], expected: dict[str, Any]) -> None:
    """Refuse to resume from ``source`` unless ``meta`` agrees with ``expected`` (any of
    ``options``, ``config``, ``params``, ``data``), naming each difference as ``name: old →
    new``. The trainer's config is derived from the method's options: its differences are
    named only where the options agree (a change of code, or of the block)."""
    changes = []
    for key in ("options", "config"):
        if key in expected and not changes:
            changes = _differences(meta[key], expected[key])
    if not changes and meta["data"] and expected.get("data", meta["data"]) != meta["data"]:
        changes = [f"training data: {meta['data']} → {expected['data']}"]
    if changes:
        raise ConfigError(
            f"checkpoint {source} was written with other options: {_listed(changes, '; ')}; "
            "rerun without --resume or with the same options"
        )
    changes = _differences(meta["params"], expected.get("params", meta["params"]))
    if changes:
        raise ConfigError(
            f"checkpoint {source} holds other parameters ({_listed(changes, '; ')}): rerun "
            "without --resume or with the same options"
        )


def check_resume(config: Any) -> None:
    """A learned method's ``--resume``, from ``state.json`` and the tensor files' headers
    alone: there is a checkpoint to resume from (it is not "resume if possible": a typo in
    ``--checkpoint-dir`` would silently start afresh), each one readable and written under the
    same options as ``config``'s."""
    training = config.training
    if not training.resume:
        return
    sources = find_checkpoints(training.checkpoint_dir)
    if not sources:
        raise ConfigError(
            f"--resume: no checkpoint in {training.checkpoint_dir} (nothing to resume from; "
            "drop --resume to start afresh)"
        )
    options = options_fingerprint(config)
    for source in sources:
        meta = read_meta(source)
        check_matches(source, meta, {"options": options})
        check_tensors(source, meta)


def _differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    current = json.loads(json.dumps(current))  # tuples as lists, as they were saved
    return [
        f"{key}: {_show(saved.get(key, _ABSENT))} → {_show(current.get(key, _ABSENT))}"
        for key in dict.fromkeys([*saved, *current])
        if saved.get(key, _ABSENT) != current.get(key, _ABSENT)
    ]


def _show(value: Any) -> str:
    if value is _ABSENT:
        return "(absent)"
    if value is None:
        return "none"
    return value if isinstance(value, str) else json.dumps(value)


def _listed(items: list[str], sep: str = ", ") -> str:
    more = len(items) - _SHOWN
    return sep.join(items[:_SHOWN]) + (f"{sep}… ({more} more)" if more > 0 else "")
