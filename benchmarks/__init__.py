"""The scripts behind every number the README quotes, and their results (``results/``).

The sweeps are tables (``tables/NAME.yaml``: settings, rows as recipes, baseline, columns,
caption; ``table.py``) run by one program, ``python -m benchmarks.sweep NAME`` (``sweep.py``; its
columns in ``columns.py``); the bespoke measurements are programs, each run as a module from the
repository root (``python -m benchmarks.int8``). They share
one loop (``harness.py``: ``run_table`` runs the jobs, ``--only`` some of them merged into the
results file, writes the JSON after each with the host it ran on, and draws the md and PNG; or
``--render-only``), one job runner (``runner.py``: a process per job, its wall time, peak RSS
and JSON result) and one renderer (``render.py``: the results JSON is the record, the md and PNG
are drawn from it). Each benchmark program holds its job table, what one job does and
``render(payload)``; what a job runs in its own process (the model work, with torch and the
library) is in ``child/``, so a driver's ``--help`` stays cheap:

Tables (``python -m benchmarks.NAME`` is the old name of ``python -m benchmarks.sweep NAME``):

- ``magnitude``: dense vs magnitude pruning;
- ``pruning``: magnitude / Wanda / SparseGPT, ours next to llm-compressor (``peers/``);
- ``recipes``: a two-stage recipe (SparseGPT 2:4 then int8, stored as packed 2:4 int8) beside
  each stage alone: perplexity, stored bytes, wall time and peak RSS;
- ``runtime``: compress, then reload in the packed and the dense runtime (bytes, RSS,
  perplexity), and the README's main job from an empty cache;
- ``int8``: W8A8 (dynamic, static, SmoothQuant), the 8-bit softmax and its bias correction, and
  the compressed-tensors interop check;
- ``memory_estimate``: the memory estimate every job is admitted with against its measured peak
  RSS, for every method on SmolLM2-135M and the tiny families (the stated factor: 1.5);
- ``subnet`` (``results/subnet_smollm2``): subnetwork extraction on SmolLM2 at 50 % and 2:4
  next to SparseGPT, Wanda (copied from ``pruning``) and MaskLLM, with ablations on the first
  blocks;
- ``learned``: learned-mask recipes of one or more stages (each a process of its own) on
  SmolLM2, each divided by SparseGPT measured in the same file (same machine and threads), with
  training tokens, tokens/s, wall and peak RSS;
- ``maskllm``: learned 2:4 masks (the paper's recipe, pooled noise, block-wise) next to the
  one-shot rows copied from ``pruning``; their curves in ``results/maskllm_curves.json``, drawn
  by ``maskllm_plot``;
- ``lowrank``: SVD, ASVD, SVD-LLM, FWSVD and GFWSVD at three ratios, uniform and allocated
  ranks, block by block and distilled, low rank + SparseGPT 2:4 on the residual, and the CLI
  end to end (its row kinds, columns, paragraphs and figure: ``lowrank_rows``; its jobs:
  ``child/lowrank.py``).

Programs:

- ``maskllm_fsdp``: MaskLLM memory per process, data parallel vs FSDP;
- ``int8_speed``: forward speed of fp32, bf16, our int8 runtime and torchao's int8 side by side,
  with a profile of ours (torchao in its own folder: ``PYTHONPATH=.venv-torchao``);
- ``subnet_digits``: ASLP reproduced on an untrained MLP on scikit-learn's digits (extracted vs
  random subnetworks vs the trained network, with and without rescaling, 3 seeds);
- ``streaming``: SparseGPT 2:4 on a random 6.6 GB Llama, streamed block by block against in
  memory: peak RSS over the weight bytes, wall time, bit-for-bit equality of the outputs;
- ``speed``: prefill and batch-1 decode tokens/s of every compressed runtime against the dense
  model at fp32 and bf16 (``compress-model bench``), with issues 22's and 40's goals, and where
  the time goes for each row that misses one (``results/speed_xeon``: the same on an Intel Xeon,
  with the 4-bit exports);
- ``layer_speed``: the compressed layers alone on SmolLM2's decoder-linear shapes, torch
  against the compiled CPU kernels at 1–16 tokens (their crossovers), and low rank's ranks
  rounded for the matmul;
- ``bad_inputs``: issues 10 and 23's bad and hostile inputs on the real model (exit code, time,
  message, what is left behind or changed; kills while saving; two writers of one output; file
  modes and output sizes).
- ``load_checks``: what verifying an export at load costs, for every compressed format and both
  loaders (checks against no-ops, interleaved).
- ``learned_speed``: MaskLLM's end-to-end step time and tokens/s, the fused soft-mask kernel
  against the torch path, interleaved.
- ``int4_speed``: the int4 runtime's layers (decode kernel, blocked prefill) against dense.
- ``gguf_llama_cpp``: our GGUF exports through llama.cpp's own ``llama-perplexity`` and
  ``llama-tokenize`` (built from source; ``--llama-bin``), beside lmcompress under the same
  protocol.
- ``speed_scale``: ``compress-model bench`` on random-weight models of Llama-3.2-1B's and
  Llama-3-8B's shapes (fewer blocks), every runtime eager and compiled, decode as a fraction
  of the bandwidth limit;
- ``head_loss_speed``: forward + backward of the vocabulary-chunked training losses at
  SmolLM2's head shape, gradients computed in the forward against checkpointed chunks,
  interleaved;
- ``ptx_report``: every Triton kernel and autotuning candidate compiled for sm_80 and sm_90 with
  no GPU (Triton's compiler and its ptxas): registers, spills and shared memory.

``kernels`` (GPU only: the packed 2:4 Triton kernel against cuBLAS and cuSPARSELt, and decode
tokens/s) was measured on an H200 (``scripts/gpu_checks.sh``) and re-rendered here from its
JSON; ``--smoke`` runs it in Triton's interpreter (``tests/benchmarks/test_kernels.py``), into a
temporary directory (a smoke run never writes into ``results/``).

``rss_profile`` and ``speed_profile`` are diagnostics, not benchmarks: they write no results
file.
"""

# the programs (the tables: benchmarks.table.table_names())
BENCHMARKS = (
    "maskllm_fsdp",
    "bad_inputs",
    "int8_speed",
    "int4_speed",
    "subnet_digits",
    "streaming",
    "layer_speed",
    "speed",
    "load_checks",
    "learned_speed",
    "kernels",
    "gguf_llama_cpp",
    "ptx_report",
    "speed_scale",
    "head_loss_speed",
)
