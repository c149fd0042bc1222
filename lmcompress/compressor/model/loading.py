"""Load the causal LM to compress and its tokenizer (from a checkpoint that
:mod:`~lmcompress.compressor.model.checkpoint` resolves), or build its skeleton on the meta
device; the dtype and device a job computes in.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import accelerate
import torch
import transformers
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lmcompress.cache import cache_dir
from lmcompress.compressor.model.checkpoint import (
    DEFAULT_CHECKPOINT,
    LOAD_ERRORS,
    alias_gguf,
    checkpoint_kind,
    model_config,
    read_config,
)
from lmcompress.compressor.model.structure import WIDTHS_FIELD
from lmcompress.compressor.util.arguments import path_argument
from lmcompress.compressor.util.fsutil import atomic_dir, disk_full_as_error, format_bytes
from lmcompress.errors import ConfigError, ModelLoadError, first_line

logger = logging.getLogger(__name__)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPES.update(fp32=torch.float32, bf16=torch.bfloat16, fp16=torch.float16)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


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
        raise ConfigError(f"unknown device {device!r}: {first_line(err)}") from err
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
    checkpoint, dtype = path_argument("checkpoint", checkpoint), resolve_dtype(dtype)
    device = check_device(device)
    kind = checkpoint_kind(checkpoint)
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
        model, tokenizer = _load_gguf(alias_gguf(name), trust_remote_code)
        logger.info("caching a safetensors copy of %s in %s", name, target)
        # Another process caching the same model meanwhile: keep its copy, drop ours.
        with disk_full_as_error(target), atomic_dir(target, keep_existing=True) as tmp:
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
        config = read_config(str(target), trust_remote_code, target)
        return _load_pretrained(str(target), config, dtype, trust_remote_code)
    except ModelLoadError as err:
        raise ModelLoadError(f"{err} (delete the cache directory {target} to rebuild it)") from err


def dequantizing_line(
    path: Path, config: transformers.PretrainedConfig, trust_remote_code: bool = False
) -> str:
    """What loading the GGUF ``path`` is about to do, for the log: its size on disk, and the
    parameters its ``config`` describes (counted on the meta skeleton, tied weights once) with
    the float32 bytes they dequantize into; the time it takes grows with both."""
    skeleton = model_skeleton(config, trust_remote_code=trust_remote_code)
    params = sum(p.numel() for p in skeleton.parameters())
    return (
        f"dequantizing {path} ({format_bytes(path.stat().st_size)}): {params:,} parameters "
        f"into float32 ({format_bytes(4 * params)})"
    )


def _load_gguf(
    path: Path, trust_remote_code: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """A dense fp32 model from a GGUF file, its quantized blocks unpacked at load time."""
    kwargs = {"gguf_file": path.name, "trust_remote_code": trust_remote_code}
    source = str(path.parent)
    config = read_config(source, trust_remote_code, path, gguf_file=path.name)
    logger.info("%s", dequantizing_line(path, config, trust_remote_code))
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
    except LOAD_ERRORS as err:
        raise ModelLoadError(f"{path}: could not load the GGUF model: {first_line(err)}") from err
    return model, tokenizer


def _load_pretrained(
    source: str,
    config: transformers.PretrainedConfig,
    dtype: torch.dtype,
    trust_remote_code: bool,
    hub: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Safetensors weights, then tokenizer, of a checkpoint whose config was checked. A
    compressed-tensors checkpoint (an int8 or int4 export's dense copy, llm-compressor's
    output) is dequantized to float weights: what a method compresses."""
    kwargs = {"trust_remote_code": trust_remote_code}
    if getattr(config, WIDTHS_FIELD, None):
        raise ModelLoadError(
            f"{source}: a structured export with per-layer widths ({WIDTHS_FIELD} in "
            "config.json): only lmcompress.load_compressed loads it, not a plain checkpoint load"
        )
    quantized = {}
    if _quant_method(config) == "compressed-tensors":
        quantized["quantization_config"] = transformers.CompressedTensorsConfig(dequantize=True)
    try:
        with held_warnings() as held, warnings.catch_warnings():
            # transformers says the stored quantization_config wins: it does, dequantized
            warnings.filterwarnings("ignore", "You passed `quantization_config`", UserWarning)
            model, info = transformers.AutoModelForCausalLM.from_pretrained(
                source,
                config=config,
                dtype=dtype,
                use_safetensors=True,
                output_loading_info=True,
                **quantized,
                **kwargs,
            )
    except LOAD_ERRORS as err:
        mismatch = [r.getMessage() for r in held if "MISMATCH" in r.getMessage()]
        if mismatch:  # transformers' load report names the weights; its error does not
            line = next(x for x in mismatch[0].splitlines() if "MISMATCH" in x)
            raise ModelLoadError(
                f"{source}: config.json disagrees with the weights: "
                f"{' '.join(line.replace('|', ' ').split())}"
            ) from err
        raise ModelLoadError(f"{source}: corrupt or unreadable weights: {first_line(err)}") from err
    if info["missing_keys"]:  # transformers would leave these randomly initialized
        missing = sorted(info["missing_keys"])
        raise ModelLoadError(
            f"{source}: {len(missing)} weights missing from the checkpoint, e.g. {missing[0]}"
        )
    return model, load_tokenizer(source, hub, kwargs)


def _quant_method(config: transformers.PretrainedConfig) -> str | None:
    quantization = getattr(config, "quantization_config", None)
    if isinstance(quantization, dict):
        return quantization.get("quant_method")
    return getattr(quantization, "quant_method", None)


@contextlib.contextmanager
def held_warnings() -> Iterator[list[logging.LogRecord]]:
    """Hold back what ``transformers`` logs inside the block: given to its handlers as usual
    if the block succeeds, dropped if it fails (the one-line error says what matters; a
    20-line load report before it would not be one line)."""
    root = logging.getLogger("transformers")
    held: list[logging.LogRecord] = []

    class Hold(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            held.append(record)

    handlers, propagate = root.handlers[:], root.propagate
    root.handlers, root.propagate = [Hold()], False
    try:
        yield held
    finally:
        root.handlers, root.propagate = handlers, propagate
    for record in held:  # only reached on success
        root.handle(record)


def load_tokenizer(source: str, hub: bool, kwargs: dict) -> PreTrainedTokenizerBase | None:
    if not hub and not any((Path(source) / name).is_file() for name in _TOKENIZER_FILES):
        logger.warning(
            "%s has no tokenizer: the model can be compressed but not evaluated on text", source
        )
        return None
    try:
        return transformers.AutoTokenizer.from_pretrained(source, **kwargs)
    except LOAD_ERRORS as err:
        raise ModelLoadError(f"{source}: unreadable tokenizer: {first_line(err)}") from err
