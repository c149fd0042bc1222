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


# --- public lm-eval API only; offline; exports through plain lm-eval ---------------------------


def _rolling_requests(docs):
    from lm_eval.api.instance import Instance

    return [
        Instance(request_type="loglikelihood_rolling", doc={}, arguments=(doc,), idx=i)
        for i, doc in enumerate(docs)
    ]


def test_rolling_windows_cover_every_token_once():
    tokens = list(range(100, 171))  # 71 tokens, windows of 32: 32 + 32 + 7 predicted
    windows = lm_eval_adapter.rolling_windows(tokens, prefix_token=1, max_length=32)
    assert [t for _, targets in windows for t in targets] == tokens
    for inputs, targets in windows:
        assert len(inputs) == min(32, len(tokens) + 1) and len(targets) <= len(inputs)
        full = [*inputs, targets[-1]]  # position j of inputs predicts full[j + 1]
        assert full[-len(targets) :] == targets
    assert windows[0][0][0] == 1 and lm_eval_adapter.rolling_windows([], 1, 32) == []


def test_rolling_scores_match_lm_evals_own():
    # A tokenizer that adds no BOS (lm-eval's own scoring is right there): the adapter's rolling
    # scores equal lm-eval 0.4's HFLM.loglikelihood_rolling, over several windows and batches.
    from lm_eval.models.huggingface import HFLM

    model, tok = make_tiny_model("llama"), make_tiny_tokenizer()
    docs = ["Ünïcödé rolls over windows. " * 4, "Short.", "A middle one, forty bytes or so long."]
    requests = _rolling_requests(docs)
    ours = lm_eval_adapter._hflm_class()(
        pretrained=model, tokenizer=tok, batch_size=3, max_length=32
    )
    theirs = HFLM(pretrained=model, tokenizer=tok, batch_size=3, max_length=32)
    expected = theirs.loglikelihood_rolling(requests, disable_tqdm=True)
    assert ours.loglikelihood_rolling(requests) == pytest.approx(expected, rel=1e-5)


def test_adapter_overrides_only_public_lm_eval_methods():
    from lm_eval.models.huggingface import HFLM

    adapter = lm_eval_adapter._hflm_class()
    overridden = {name for name in vars(adapter) if callable(getattr(HFLM, name, None))}
    assert overridden == {"loglikelihood_rolling"}


def test_local_tasks_run_offline(monkeypatch):
    # the real `lee` corpus (shipped in gensim), with every socket refused
    import socket

    def refuse(*_args, **_kwargs):
        raise OSError("network access in an offline test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    model, tok = make_tiny_model("llama"), make_tiny_tokenizer()
    torch.nn.init.zeros_(model.get_output_embeddings().weight)  # logits == 0

    metrics = run_lm_eval(model, tok, ["lmcompress_lee"], limit=2, max_length=64)["lmcompress_lee"]
    assert metrics["byte_perplexity"] == pytest.approx(VOCAB, rel=1e-6)


def test_dense_export_scores_the_same_through_plain_lm_eval(documents, tmp_path):
    # `lm_eval --model hf --model_args pretrained=OUT`: lm-eval loads the export itself
    import lm_eval
    from lm_eval.tasks import TaskManager

    from lmcompress import compress, save_compressed
    from lmcompress.methods.magnitude import MagnitudeConfig

    documents["lee"] = SHORT_DOCS["lee"]
    model, tok = make_tiny_model("llama"), make_tiny_tokenizer()
    report = compress(model, MagnitudeConfig(sparsity="2:4"))
    out = save_compressed(model, tmp_path / "out", report, tokenizer=tok)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    lm_eval_adapter.write_local_tasks(["lmcompress_lee"], tasks)  # as `--include_path` reads

    output = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={out},dtype=float32",
        device="cpu",
        tasks=["lmcompress_lee"],
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        bootstrap_iters=0,
    )
    plain = clean_results(output["results"])["lmcompress_lee"]
    ours = run_lm_eval(model, tok, ["lmcompress_lee"])["lmcompress_lee"]
    assert plain["byte_perplexity"] == pytest.approx(ours["byte_perplexity"], rel=1e-5)
