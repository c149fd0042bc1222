"""``TeacherCache``: the teacher's hidden states of a window computed once when no trained
parameter changes the teacher (GPTQ's distilled scales), the very numbers a fresh forward
gives, one forward a distinct window, the memory bounded."""

from __future__ import annotations

import torch
from conftest import make_tiny_model

from lmcompress import GPTQConfig, compress
from lmcompress.compressor.training import drivers
from lmcompress.compressor.training.teacher import TeacherCache

WINDOWS = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(1))


def _counting(value):
    calls = []

    def compute():
        calls.append(1)
        return value.clone()

    return compute, calls


def test_a_window_is_computed_once_and_windows_are_told_apart_by_every_token():
    cache = TeacherCache()
    a, b = WINDOWS[:1], WINDOWS[:1].clone()
    b[0, -1] += 1  # the last token differs
    compute, calls = _counting(torch.ones(1, 16, 4))
    first = cache.get(a, compute)
    assert cache.get(a.clone(), compute) is first and len(calls) == 1 and cache.hits == 1
    cache.get(b, compute)
    cache.get(a[:, :-1], compute)  # a prefix is another window
    assert len(calls) == 3 and cache.nbytes == 3 * 16 * 4 * 4  # float32 (1, 16, 4) each


def test_beyond_its_bound_the_cache_computes_without_keeping():
    cache = TeacherCache(max_bytes=16 * 4 * 4)  # one window's states
    compute, calls = _counting(torch.ones(1, 16, 4))
    for window in (WINDOWS[:1], WINDOWS[1:2], WINDOWS[:1], WINDOWS[1:2]):
        cache.get(window, compute)
    assert len(calls) == 3 and cache.hits == 1 and cache.nbytes == 16 * 4 * 4


def _distill(monkeypatch, max_bytes: int):
    """GPTQ + 8 distilled-scale steps on 3 windows; the caches the run made."""
    made = []

    class Recorded(TeacherCache):
        def __init__(self) -> None:
            super().__init__(max_bytes)
            made.append(self)

    monkeypatch.setattr(drivers, "TeacherCache", Recorded)
    model = make_tiny_model("llama")
    config = GPTQConfig(group_size=16, distill_steps=8, distill_lr=1e-3)
    report = compress(model, config, data=WINDOWS)
    return model, report, made


def test_distilled_scales_with_the_cache_equal_a_fresh_teacher_every_step(monkeypatch):
    cached, report, made = _distill(monkeypatch, TeacherCache().max_bytes)
    fresh, fresh_report, _ = _distill(monkeypatch, 0)  # nothing kept: a forward every step
    assert len(made) == 1 and made[0].hits == 8 - 3  # 8 steps over 3 windows
    curve = [h["kl"] for h in report.extra["distill_history"]]
    assert curve == [h["kl"] for h in fresh_report.extra["distill_history"]]
    assert len(curve) == 8 and all(kl > 0 for kl in curve)  # a teacher other than the student
    for (name, a), b in zip(cached.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
