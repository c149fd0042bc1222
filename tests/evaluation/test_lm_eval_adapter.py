"""lm-eval adapter: local rolling-perplexity tasks on tiny models, closed forms, errors."""

from __future__ import annotations

import importlib
import math
import re
import sys
import types

import pytest
import torch

pytest.importorskip("lm_eval")

from conftest import VOCAB, make_tiny_model, make_tiny_tokenizer  # noqa: E402

from lmcompress.errors import ConfigError, DataError  # noqa: E402
from lmcompress.evaluation import lm_eval_adapter  # noqa: E402
from lmcompress.evaluation.lm_eval_adapter import clean_results, run_lm_eval  # noqa: E402

SHORT_DOCS = {  # every document shorter than the tiny model's 128 positions
    "wiki-test": [
        "The cat sat on the mat.",
        "Zürich is a city in Switzerland.\nIt lies on a lake.",
        "   ",  # blank: the adapter drops it
        "One more line, with  two spaces.",
    ],
    "lee": ["The Prime Minister spoke on Tuesday.", "Rain fell across the state overnight."],
}


def _words(doc: str) -> int:
    return len(re.split(r"\s+", doc))  # lm-eval's word count


def _bytes(doc: str) -> int:
    return len(doc.encode("utf-8"))


@pytest.fixture
def documents(monkeypatch):
    """Point ``corpora.load_documents`` at in-memory documents; returns the dict to fill."""
    name = "lmcompress.evaluation.corpora"
    try:
        corpora = importlib.import_module(name)
    except ImportError:  # corpora.py not written yet: a stand-in module
        corpora = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, corpora)
    docs: dict[str, list[str]] = {}
    monkeypatch.setattr(corpora, "load_documents", lambda source: list(docs[source]), raising=False)
    return docs


def _bos_tokenizer():
    """The tiny tokenizer, but adding BOS by itself (as Llama-2 and Gemma tokenizers do)."""
    from tokenizers import processors

    tok = make_tiny_tokenizer()
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tok.bos_token} $A", special_tokens=[(tok.bos_token, tok.bos_token_id)]
    )
    return tok


@torch.no_grad()
def _document_nll(model, tok, doc: str) -> float:
    """-log p(doc | BOS), summed over the document's tokens: one window, as lm-eval scores it."""
    ids = torch.tensor([[tok.bos_token_id, *tok(doc, add_special_tokens=False).input_ids]])
    logprobs = torch.log_softmax(model(ids).logits[0, :-1].double(), dim=-1)  # (T, V)
    return -logprobs.gather(1, ids[0, 1:, None]).sum().item()


def test_local_tasks_match_direct_nll(documents):
    documents.update(SHORT_DOCS)
    model, tok = make_tiny_model("llama"), make_tiny_tokenizer()
    model.train()  # the adapter must give it back in train mode
    rng = torch.random.get_rng_state()

    results = run_lm_eval(
        model,
        tok,
        "lmcompress_wiki_test, lmcompress_lee",
        batch_size=2,
        max_length=model.config.max_position_embeddings,
    )

    assert model.training
    assert torch.equal(torch.random.get_rng_state(), rng)  # lm-eval's seeding is undone
    assert set(results) == {"lmcompress_wiki_test", "lmcompress_lee"}
    model.eval()
    for task, source in lm_eval_adapter.LOCAL_TASKS.items():
        metrics = results[task]
        assert set(metrics) == {"word_perplexity", "byte_perplexity", "bits_per_byte"}
        assert all(math.isfinite(v) and v > 0 for v in metrics.values())
        docs = [d for d in SHORT_DOCS[source] if d.strip()]
        nll = sum(_document_nll(model, tok, d) for d in docs)
        n_bytes, n_words = sum(map(_bytes, docs)), sum(map(_words, docs))
        assert metrics["byte_perplexity"] == pytest.approx(math.exp(nll / n_bytes), rel=1e-4)
        assert metrics["word_perplexity"] == pytest.approx(math.exp(nll / n_words), rel=1e-4)
        assert metrics["byte_perplexity"] == pytest.approx(2 ** metrics["bits_per_byte"], rel=1e-9)


@pytest.mark.parametrize("tokenizer_adds_bos", [False, True])
def test_uniform_logits_give_vocab_size_per_byte(documents, tokenizer_adds_bos):
    # One token per byte and uniform logits: every byte costs ln V, so byte perplexity is V
    # exactly, over several rolling windows, and a tokenizer's own BOS is not scored.
    long_doc = "Ünïcödé rolls over windows. " * 12  # 384 bytes: 12 windows of 32
    scored = [long_doc, "Short one.\n"]
    documents["lee"] = [*scored, "a b c d e f g h i j"]  # limit=2 leaves this one out
    tok = _bos_tokenizer() if tokenizer_adds_bos else make_tiny_tokenizer()
    assert (tok("x").input_ids[0] == tok.bos_token_id) is tokenizer_adds_bos
    model = make_tiny_model("llama")
    torch.nn.init.zeros_(model.get_output_embeddings().weight)  # logits == 0

    metrics = run_lm_eval(model, tok, ["lmcompress_lee"], limit=2, max_length=32)["lmcompress_lee"]

    ratio = sum(map(_bytes, scored)) / sum(map(_words, scored))
    assert metrics["byte_perplexity"] == pytest.approx(VOCAB, rel=1e-6)
    assert metrics["bits_per_byte"] == pytest.approx(math.log2(VOCAB), rel=1e-6)
    assert metrics["word_perplexity"] == pytest.approx(VOCAB**ratio, rel=1e-5)


def test_unknown_task_names_are_config_errors(documents):
    documents.update(SHORT_DOCS)
    model, tok = make_tiny_model("llama"), make_tiny_tokenizer()
    with pytest.raises(ConfigError, match=r"'lmcompress_wiki_tset' \(did you mean lmcompress_wiki"):
        run_lm_eval(model, tok, ["lmcompress_lee", "lmcompress_wiki_tset", "no_such_task_xyz"])
    with pytest.raises(ConfigError, match="no_such_task_xyz"):
        run_lm_eval(model, tok, "no_such_task_xyz")


def test_local_and_lm_eval_tasks_mix(documents, tmp_path):
    # Any lm-eval task spec goes through lm-eval's own task index; a YAML path is one that
    # works offline.
    import yaml

    documents["lee"] = ["Rain fell across the state overnight."]
    data = tmp_path / "docs.jsonl"
    data.write_text('{"text": "A user task of its own."}\n', encoding="utf-8")
    config = lm_eval_adapter.local_task_config("user_json_task", data, tmp_path / "cache")
    (tmp_path / "user_json_task.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    model, tok = make_tiny_model("llama"), make_tiny_tokenizer()
    torch.nn.init.zeros_(model.get_output_embeddings().weight)  # logits == 0

    results = run_lm_eval(
        model, tok, ["lmcompress_lee", str(tmp_path / "user_json_task.yaml")], num_fewshot=0
    )

    assert set(results) == {"lmcompress_lee", "user_json_task"}
    for metrics in results.values():
        assert metrics["byte_perplexity"] == pytest.approx(VOCAB, rel=1e-6)


def test_hub_task_offline_is_a_data_error(monkeypatch):
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # never touch the network
    model, tok = make_tiny_model("llama"), make_tiny_tokenizer()
    with pytest.raises(DataError, match=r"could not load task\(s\) wikitext: .*Hub") as info:
        run_lm_eval(model, tok, ["wikitext"], limit=1)
    assert "\n" not in str(info.value)


def test_blank_corpus_is_a_data_error(documents):
    documents["lee"] = ["", "  \n"]
    with pytest.raises(DataError, match="'lee' has no non-empty documents"):
        run_lm_eval(make_tiny_model("llama"), make_tiny_tokenizer(), ["lmcompress_lee"])


def test_missing_lm_eval_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'lmcompress\[eval\]'"):
        run_lm_eval(make_tiny_model("llama"), make_tiny_tokenizer(), ["lmcompress_lee"])


def test_clean_results_names():
    raw = {
        "gsm8k": {
            "alias": "gsm8k",
            "exact_match,strict-match": 0.25,
            "exact_match_stderr,strict-match": 0.01,
            "exact_match,flexible-extract": 0.5,
        },
        "wikitext": {
            "name": "wikitext",
            "sample_len": 62,
            "word_perplexity,none": 30.5,
            "word_perplexity_stderr,none": "N/A",
            "bits_per_byte,none": 1,
        },
    }
    assert clean_results(raw) == {
        "gsm8k": {
            "exact_match/strict-match": 0.25,
            "exact_match_stderr/strict-match": 0.01,
            "exact_match/flexible-extract": 0.5,
        },
        "wikitext": {"word_perplexity": 30.5, "bits_per_byte": 1.0},
    }


# --- check_tasks: the names alone, before any model or data ------------------------------------


class _FakeIndex:
    all_tasks = ["wikitext", "hellaswag", "lambada_openai"]


@pytest.fixture
def fake_index(monkeypatch):
    """lm-eval's task index (~13 s to build) replaced by three names; counts the builds."""
    builds = []
    monkeypatch.setattr(
        lm_eval_adapter, "_registry_task_manager", lambda: builds.append(1) or _FakeIndex
    )
    return builds


def test_check_tasks_local_names_need_no_index_and_no_corpus(fake_index, documents):
    lm_eval_adapter.check_tasks(["lmcompress_lee", "lmcompress_wiki_test"])
    lm_eval_adapter.check_tasks("lmcompress_lee, lmcompress_wiki_test")
    assert fake_index == [] and documents == {}  # no index, no corpus read


def test_check_tasks_yaml_path_needs_no_index(fake_index, tmp_path):
    (tmp_path / "mine.yaml").write_text("task: mine\n")
    lm_eval_adapter.check_tasks([str(tmp_path / "mine.yaml"), "lmcompress_lee"])
    assert fake_index == []


@pytest.mark.parametrize(
    ("names", "fragments"),
    [
        (["lmcompress_wiki_tset"], ["'lmcompress_wiki_tset' (did you mean lmcompress_wiki_test"]),
        (["wikitxt", "lmcompress_lee"], ["'wikitxt' (did you mean wikitext?)"]),
        (["hellaswag", "zzz_qqq"], ["unknown lm-eval task(s): 'zzz_qqq';", "local tasks:"]),
    ],
)
def test_check_tasks_names_close_matches(fake_index, names, fragments):
    with pytest.raises(ConfigError) as info:
        lm_eval_adapter.check_tasks(names)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message
    assert "hellaswag" not in message.split(";")[0]  # known names are not reported
    assert fake_index == [1]


@pytest.mark.parametrize("names", [[], "", " , "])
def test_check_tasks_needs_a_name(names):
    with pytest.raises(ConfigError, match="no lm-eval tasks given"):
        lm_eval_adapter.check_tasks(names)


def test_check_tasks_against_lm_evals_own_index(monkeypatch):
    import datasets

    def refuse(*_args, **_kwargs):
        raise AssertionError("a data set was loaded")

    monkeypatch.setattr(datasets, "load_dataset", refuse)
    lm_eval_adapter.check_tasks(["wikitext", "lmcompress_lee"])  # data on the hub: not fetched
    with pytest.raises(ConfigError, match=r"'wikitxt' \(did you mean wikitext"):
        lm_eval_adapter.check_tasks(["wikitxt"])
