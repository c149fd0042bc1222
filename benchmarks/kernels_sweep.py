"""What ``benchmarks.kernels`` measures: the packed 2:4 matmul against dense cuBLAS and
cuSPARSELt at every shape and token count (:func:`kernel_sweep`), and greedy decode of a random
Llama, dense against the packed runtime (:func:`end_to_end`). See ``benchmarks/kernels.py``.

The library's imports here bring Triton in: ``benchmarks.kernels`` imports this module only
once ``TRITON_INTERPRET`` is settled (``--smoke`` on a CPU). What to measure (shapes, token
counts, dtypes, the end-to-end model) is ``benchmarks.kernels``'s table, passed in: this module
imports nothing of it."""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from torch.sparse import to_sparse_semi_structured

from lmcompress.api import compress
from lmcompress.compressor.io.load import load_compressed
from lmcompress.compressor.io.save import save_compressed
from lmcompress.compressor.sparsity import nm_mask
from lmcompress.kernels.reference import pack_nm, packed_nm_nbytes
from lmcompress.methods.magnitude.config import MagnitudeConfig

log = logging.getLogger(__name__)


def timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    """Median seconds of ``fn()``: ``do_bench`` on a GPU (L2 flushed between runs; eager launches,
    so a tiny shape measures the launch overhead too), the wall clock of one run on the CPU
    (smoke: the interpreter, a check that it runs, not a speed)."""
    if device.type == "cuda":
        from triton.testing import do_bench  # triton: imported only where it runs

        return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3

    def wall(fn):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return wall


def semi_structured(W: torch.Tensor) -> tuple[Any, str | None]:
    """``W`` in torch's semi-structured (cuSPARSELt / CUTLASS) form, or ``(None, reason)``."""
    if W.device.type != "cuda":
        return None, "needs CUDA"
    try:
        return to_sparse_semi_structured(W), None
    except (ImportError, RuntimeError, ValueError, NotImplementedError) as err:
        return None, f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"


def measure_shape(
    out_features: int, in_features: int, dtype: torch.dtype, tokens: list[int], device, bench
) -> list[dict[str, Any]]:
    """One weight shape at every token count: dense, ours and cuSPARSELt rows merged per count."""
    # the kernel module last: TRITON_INTERPRET (--smoke) is read when it is first imported
    from lmcompress.kernels.nm_linear_triton import nm_linear_triton

    g = torch.Generator(device=device).manual_seed(out_features * 7 + in_features)
    W = torch.randn(out_features, in_features, device=device, generator=g) / in_features**0.5
    W = (W * nm_mask(W.abs(), 2, 4)).to(dtype)  # (out, in) 2:4
    values, indices = pack_nm(W, 2, 4)
    W_semi, semi_error = semi_structured(W) if dtype != torch.float32 else (None, "fp16/bf16 only")
    size = W.element_size()
    weight_bytes = {
        "dense": W.numel() * size,
        "ours": packed_nm_nbytes((out_features, in_features), 2, 4, dtype),
    }
    if W_semi is not None:  # its compressed values and metadata
        names, _ = W_semi.__tensor_flatten__()
        parts = [getattr(W_semi, name) for name in names]
        weight_bytes["cusparselt"] = sum(t.numel() * t.element_size() for t in parts)
    rows = []
    for count in tokens:
        x = torch.randn(count, in_features, device=device, generator=g).to(dtype)
        row = {"out": out_features, "in": in_features, "tokens": count}
        runs = {
            "dense": lambda x=x: torch.nn.functional.linear(x, W),
            "ours": lambda x=x: nm_linear_triton(x, values, indices, 2, 4, in_features),
        }
        if W_semi is not None:
            runs["cusparselt"] = lambda x=x: torch.nn.functional.linear(x, W_semi)
        else:
            row["cusparselt_error"] = semi_error
        flops = 2 * count * out_features * in_features
        io_bytes = (count * in_features + count * out_features) * size
        y_dense = runs["dense"]().float()
        for name, fn in runs.items():
            # Anything may fail on a first GPU run (a compilation, a shape cuSPARSELt refuses):
            # record it and go on, so that one failure does not cost the whole run.
            try:
                y = fn().float()  # the first call autotunes (ours), untimed
                row[f"{name}_max_rel_err"] = float((y - y_dense).abs().max() / y_dense.abs().max())
                seconds = bench(fn)
            except Exception as err:
                log.exception(
                    "%s failed at (%d, %d), %d tokens", name, out_features, in_features, count
                )
                row[f"{name}_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
                continue
            row[name] = {
                "seconds": seconds,
                "tflops": flops / seconds / 1e12,
                "gbps": (io_bytes + weight_bytes[name]) / seconds / 1e9,
            }
        row["max_rel_err"] = row.get("ours_max_rel_err")  # None: ours failed
        rows.append(row)
        del x, y_dense
    return rows


def kernel_sweep(
    args, models: list[str], device, bench, deadline: float, plan: dict[str, Any]
) -> list[dict[str, Any]]:
    """Every (dtype, model, projection) of ``plan`` (``shapes``, ``tokens``, ``dtypes``: name ->
    torch dtype, ``bf16_models``: the models timed in bf16 outside a smoke run)."""
    shapes, tokens, dtypes = plan["shapes"], list(plan["tokens"]), plan["dtypes"]
    rows = []
    for dtype_name in args.dtypes:
        for model, projections in shapes.items():
            if dtype_name == "bf16" and not args.smoke and model not in plan["bf16_models"]:
                continue
            if model not in models:
                continue
            for projection, (out_features, in_features) in projections.items():
                label = {"dtype": dtype_name, "model": model, "projection": projection}
                if time.monotonic() > deadline:
                    log.warning("time budget spent: %s %s skipped", model, projection)
                    rows.append({**label, "skipped": "time budget"})
                    continue
                log.info(
                    "%s %s %s (%d, %d)", dtype_name, model, projection, out_features, in_features
                )
                for row in measure_shape(
                    out_features, in_features, dtypes[dtype_name], tokens, device, bench
                ):
                    rows.append({**label, **row})
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def decode_speed(model, prompt: torch.Tensor, new_tokens: int, device) -> dict[str, float]:
    """Greedy decode of ``new_tokens`` after ``prompt`` (warmed up once: autotuning, caches)."""

    def run(n):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    with torch.inference_mode():
        run(new_tokens)  # warm-up
        prefill = run(1)
        total = run(new_tokens + 1)
    return {
        "prefill_seconds": prefill,
        "decode_tokens_per_second": new_tokens / max(total - prefill, 1e-9),
    }


def end_to_end(args, device, shape: dict[str, int]) -> dict[str, Any]:
    """Dense vs packed-runtime decode of a random Llama of ``shape`` (LlamaConfig keys)."""
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    config = transformers.LlamaConfig(**shape, max_position_embeddings=512)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    report = compress(model, MagnitudeConfig())  # 2:4 on every decoder linear
    prompt_len, new_tokens = (8, 4) if args.smoke else (64, 128)
    prompt = torch.randint(3, shape["vocab_size"], (1, prompt_len), device=device)
    result: dict[str, Any] = {"config": shape, "dtype": str(dtype).removeprefix("torch.")}
    result.update(prompt_tokens=prompt_len, new_tokens=new_tokens)
    result["dense"] = {
        "weight_bytes": _bytes(model),
        **decode_speed(model, prompt, new_tokens, device),
    }
    with tempfile.TemporaryDirectory() as tmp:
        save_compressed(model, Path(tmp) / "out", report, dense_copy=False)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        packed, _, _ = load_compressed(Path(tmp) / "out", runtime="packed", device=device)
    packed.eval()
    result["packed"] = {
        "weight_bytes": _bytes(packed),
        **decode_speed(packed, prompt, new_tokens, device),
    }
    return result


def _bytes(model: torch.nn.Module) -> int:
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def gpu_info(device) -> dict[str, Any]:
    info = {"device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, sms=props.multi_processor_count, cuda=torch.version.cuda)
        info["memory_gib"] = round(props.total_memory / 2**30, 1)
    try:
        import triton  # optional: the kernel's extra

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info
