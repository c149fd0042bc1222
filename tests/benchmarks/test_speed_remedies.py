"""``benchmarks.speed``'s "what would close each miss": the rows that miss a goal, by measure,
and only the remedies of the measures they miss."""

from __future__ import annotations

from benchmarks import speed


def _row(name: str, prefill: float, decode: float, tokens: float = 10.0) -> dict:
    return {"name": name, "prefill_vs_best_dense": prefill, "decode_vs_best_dense": decode,
            "decode_tokens_per_s": tokens}  # fmt: skip


def test_missed_goals_by_measure_and_pairs():
    record = {"rows": [
        _row("int4 bf16", 0.95, 1.4, tokens=30.0),  # decode only
        _row("int4", 0.5, 3.0, tokens=31.0),  # prefill only
        _row("2:4 + int4 bf16", 0.95, 2.6, tokens=29.0),  # meets both, slower than int4 bf16
        _row("int8", 1.5, 2.1),  # meets its goals
        {**_row("int4 bf16, int4 head", 0.5, 1.0), "compiled": True},  # compiled: not read
    ]}  # fmt: skip
    missed = speed.missed_goals(record)
    assert missed == {"int4 bf16": {"decode"}, "int4": {"prefill"}, "2:4 + int4 bf16": {"decode"}}
    assert list(missed) == ["int4", "int4 bf16", "2:4 + int4 bf16"]  # GOALS' order, then PAIRS'


def _remedies(missed: dict[str, set[str]], isa: list[str]) -> str:
    bucket = {"prefill_ms": dict.fromkeys(speed.BUCKETS, 1.0)}
    bucket["decode_ms_per_step"] = dict.fromkeys(speed.BUCKETS, 1.0)
    profile = {"prefill": "4x256", "decode_steps": 4, "models": {"dense bfloat16": bucket}}
    text = speed.where_the_time_goes(profile, missed, isa)
    return text.split("What would close each miss:")[1]


def test_avx2_remedies_only_of_the_measures_missed():
    avx2 = ["avx2", "fma"]
    decode = _remedies({"int4 bf16": {"decode"}}, avx2)
    assert "**int4 bf16**: Decode:" in decode and "Prefill:" not in decode
    both = _remedies({"int4 bf16": {"prefill", "decode"}}, avx2)
    assert both.index("Prefill:") < both.index("Decode:")
    assert "Decode:" not in _remedies({"svd 0.8 bf16": {"prefill"}}, avx2)
    # a row with no text for its missed measure gets no line at all
    assert "**int4**" not in _remedies({"int4": {"prefill"}}, avx2)
    # on an AVX-512 host the whole remedy, as written
    whole = _remedies({"int4 bf16": {"decode"}}, ["avx2", "avx512f"])
    assert speed.REMEDIES["int4 bf16"] in whole
