"""benchmarks.subnet_digits: the --quick run (one seed, a few epochs) learns a subnetwork of a
random MLP far better than chance with the library's subnet machinery, and its md and PNG are
redrawn byte for byte from the JSON."""

import json

from benchmarks import subnet_digits
from benchmarks.subnet_digits_plot import epochs_to, render


def test_quick_run_beats_chance_and_renders_from_its_json(tmp_path):
    assert subnet_digits.main(["--quick", "--results-dir", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "subnet_digits.json").read_text())
    rows = payload["rows"]
    paper = next(r for r in rows if r["kind"] == "extracted" and r["target"] is None)
    topk = next(r for r in rows if r["kind"] == "extracted" and r["target"] == 0.5)
    random = next(r for r in rows if r["kind"] == "random" and r["target"] is None)
    dense = next(r for r in rows if r["kind"] == "dense")
    for row in (paper, topk):
        run = row["seeds"]["0"]
        assert run["test_acc"] > 0.4  # chance is 0.1; the weights were never trained
        assert run["test_acc"] > random["seeds"]["0"]["test_acc"] + 0.2
        assert len(run["val_curve"]) == payload["hyperparameters"]["epochs"]
    assert 0.3 < paper["seeds"]["0"]["sparsity"] < 0.7  # emerges from logits starting at 0
    assert topk["seeds"]["0"]["sparsity"] == 0.5  # top-k extraction: exactly the target
    assert dense["seeds"]["0"]["test_acc"] > 0.8
    assert payload["wall_seconds"] > 0 and payload["peak_rss_mb"] > 0

    md, png = (tmp_path / "subnet_digits.md"), (tmp_path / "subnet_digits_curves.png")
    assert md.read_text() == render(payload)
    first = png.read_bytes()
    md.unlink()
    png.unlink()
    assert subnet_digits.main(["--render-only", "--results-dir", str(tmp_path)]) == 0
    assert md.read_text() == render(payload) and png.read_bytes() == first


def test_epochs_to_counts_from_one_against_the_runs_best():
    assert epochs_to([0.1, 0.5, 0.85, 0.95, 0.9]) == 4  # 0.85 < 0.9 × 0.95
    assert epochs_to([0.5, 0.2, 0.5], fraction=1.0) == 1
