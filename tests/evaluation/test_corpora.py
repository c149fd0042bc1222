"""Corpora: the built-in real text, local files, tokenization and calibration windows."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest
import torch
from conftest import make_tiny_tokenizer

from lmcompress.errors import ConfigError, DataError
from lmcompress.evaluation import corpora, wikitext
from lmcompress.evaluation.corpora import (
    BUILTIN_CORPORA,
    load_documents,
    load_text,
    tokenize,
)

MARKUP = ("[[", "]]", "{{", "}}", "{|", "|}", "<ref", "</", "'''", "thumb|")


def _title(document: str) -> str:
    return document.split("\n", 1)[0]


# --- built-in corpora -------------------------------------------------------------------------


def test_builtin_names():
    assert BUILTIN_CORPORA == ("wiki", "wiki-calib", "wiki-test", "lee")


def test_wiki_is_real_cleaned_prose():
    documents = load_documents("wiki")
    assert 90 <= len(documents) <= 120
    assert 350_000 < sum(len(d.split()) for d in documents) < 500_000
    for document in documents:
        title, blank, body = document.partition("\n\n")
        assert blank and title.strip() == title and len(body.split()) >= wikitext.MIN_WORDS
        assert not [m for m in MARKUP if m in document], title
        assert "\n\n\n" not in document
        assert all(line == line.strip() for line in document.splitlines())
    assert len({_title(d) for d in documents}) == len(documents)


def test_wiki_split_is_disjoint_complete_and_by_title_hash():
    wiki, calib, test = (load_documents(n) for n in ("wiki", "wiki-calib", "wiki-test"))
    assert not set(calib) & set(test)
    assert not {_title(d) for d in calib} & {_title(d) for d in test}
    assert sorted(calib + test) == sorted(wiki)
    assert 0.15 < len(test) / len(wiki) < 0.35
    # The rule is stated in the docs: sha1(title) % 4 == 0 -> test; pinned with known titles.
    for d in wiki:
        digest = hashlib.sha1(_title(d).encode()).digest()
        assert (d in test) == (int.from_bytes(digest[:8], "big") % 4 == 0)
    assert {"Autism", "Alabama", "Algorithm"} <= {_title(d) for d in test}
    assert {"Anarchism", "Aristotle", "Achilles"} <= {_title(d) for d in calib}


def test_wiki_is_deterministic_through_the_disk_cache(tmp_path, monkeypatch):
    before = load_documents("wiki")
    monkeypatch.setenv("LMCOMPRESS_CACHE", str(tmp_path))
    cached = {"articles": [list(a) for a in corpora._wiki_articles()]}
    corpora._wiki_articles.cache_clear()
    # Seed the fresh cache dir with the in-process result so the test does not parse again.
    monkeypatch.setattr(corpora, "parse_wiki_dump", lambda _dump: cached["articles"])
    assert load_documents("wiki") == before
    (cache_file,) = tmp_path.glob("wiki-v*.json")
    corpora._wiki_articles.cache_clear()
    monkeypatch.setattr(corpora, "parse_wiki_dump", lambda _dump: pytest.fail("re-parsed"))
    assert load_documents("wiki") == before
    assert json.loads(cache_file.read_text(encoding="utf-8")) == cached["articles"]


def test_clean_wikitext_keeps_prose_and_drops_markup():
    markup = (
        "{{Infobox person|name=X}}\n'''Ada''' was a ''mathematician''<ref>{{cite book|t=B}}</ref>"
        " from [[London|the capital]].<ref name=a/>\n"
        "[[File:Ada.jpg|thumb|A portrait of [[Ada]]]]\n\n"
        "== Work ==\nShe wrote &ndash; notes on the [[Analytical Engine]].\n"
        '{| class="wikitable"\n|-\n| cell || other\n|}\n'
        "== Awards ==\n{{Navbox|x}}\n"
        "== References ==\n{{reflist}}\n* Some book\n"
        "[[Category:Mathematicians]]\n"
    )
    clean = wikitext.clean_wikitext(markup)
    assert clean == (
        "Ada was a mathematician from the capital.\n\nWork\n\nShe wrote – notes on the "
        "Analytical Engine."
    )


def test_lee_has_300_news_articles():
    documents = load_documents("lee")
    assert len(documents) == 300
    assert documents[0].startswith("Hundreds of people have been forced to vacate their homes")
    assert load_text("lee") == "\n\n".join(documents)


def test_missing_gensim_says_how_to_install(monkeypatch):
    real_find_spec = corpora.importlib.util.find_spec
    monkeypatch.setattr(
        corpora.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "gensim" else real_find_spec(name, *a),
    )
    for name in ("lee", "wiki"):
        with pytest.raises(DataError, match=r"pip install --no-deps gensim==4\.4\.0"):
            corpora._gensim_file(name)
    with pytest.raises(DataError, match="gensim"):
        load_documents("lee")


# --- local files ------------------------------------------------------------------------------


def test_txt_documents_are_separated_by_blank_lines(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("First doc\nstill first.\n\n  \nSecond doc.\n\n\n\nThird.\n", encoding="utf-8")
    assert load_documents(str(path)) == ["First doc\nstill first.", "Second doc.", "Third."]
    assert load_text(str(path)) == "First doc\nstill first.\n\nSecond doc.\n\nThird."


def test_jsonl_reads_the_text_field(tmp_path):
    path = tmp_path / "c.jsonl"
    rows = [{"text": "one", "id": 1}, {"text": "two\nlines"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    assert load_documents(str(path)) == ["one", "two\nlines"]


def test_save_to_disk_dataset_and_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    single = tmp_path / "single"
    datasets.Dataset.from_dict({"text": ["a b", "", "c d"], "n": [1, 2, 3]}).save_to_disk(single)
    assert load_documents(str(single)) == ["a b", "c d"]

    both = tmp_path / "both"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": ["train doc"]}),
            "test": datasets.Dataset.from_dict({"text": ["test doc"]}),
        }
    ).save_to_disk(both)
    assert load_documents(str(both)) == ["test doc"]
    assert load_documents(f"{both}:train") == ["train doc"]
    with pytest.raises(DataError, match=r"no split 'dev' \(has train, test\)"):
        load_documents(f"{both}:dev")

    no_test = tmp_path / "no_test"
    datasets.DatasetDict(
        {
            "validation": datasets.Dataset.from_dict({"text": ["val doc"]}),
            "train": datasets.Dataset.from_dict({"text": ["train doc"]}),
        }
    ).save_to_disk(no_test)
    assert load_documents(str(no_test)) == ["val doc"]

    no_text = tmp_path / "no_text"
    datasets.Dataset.from_dict({"content": ["x"]}).save_to_disk(no_text)
    with pytest.raises(DataError, match=r"no 'text' column \(has content\)"):
        load_documents(str(no_text))


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("empty.txt", "\n \n\n", "is empty"),
        ("empty.jsonl", "\n", "is empty"),
        ("blank_texts.jsonl", '{"text": "  "}\n', "is empty"),
        ("bad.jsonl", '{"text": "ok"}\n{"text": oops}\n', r"line 2: invalid JSON"),
        ("notext.jsonl", '{"text": "ok"}\n\n{"body": "x"}\n', r"line 3: .*'text'"),
        ("data.csv", "text\nhello\n", r"unsupported corpus file type '\.csv'"),
    ],
)
def test_bad_local_files_raise_data_error(tmp_path, name, content, match):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError, match=match) as err:
        load_documents(str(path))
    assert "\n" not in str(err.value)


def test_unknown_name_lists_the_builtins():
    with pytest.raises(DataError, match=r"unknown corpus 'wikitext2'.*wiki, wiki-calib, "):
        load_documents("wikitext2")


def test_missing_file_and_foreign_directory(tmp_path):
    with pytest.raises(DataError, match="corpus file not found"):
        load_documents(str(tmp_path / "nope.txt"))
    with pytest.raises(DataError, match="not a datasets save_to_disk directory"):
        load_documents(str(tmp_path))


# --- tokenization and calibration windows -----------------------------------------------------


def test_tokenize_adds_no_bos_even_where_the_tokenizer_would(tmp_path):
    """A Llama/Gemma-style tokenizer prepends BOS to every call; the corpus ids must not carry
    it (perplexity adds one per window). Oracle: the byte-level tokenizer gives one id per
    UTF-8 byte of the joined text."""
    from tokenizers import processors

    tokenizer = make_tiny_tokenizer()
    bos = tokenizer.bos_token
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.bos_token_id)]
    )
    assert tokenizer("ab")["input_ids"][0] == tokenizer.bos_token_id  # it would add one
    path = tmp_path / "c.txt"
    path.write_text("Hello world.\n\nSecond document here.\n", encoding="utf-8")
    ids = tokenize(tokenizer, str(path))
    assert len(ids) == len(load_text(str(path)).encode()), "a special token was added"


def test_tokenize_matches_the_joined_text_without_length_warnings(tmp_path):
    tokenizer = make_tiny_tokenizer()
    tokenizer.model_max_length = 8  # shorter than the corpus: a plain call would warn
    path = tmp_path / "c.txt"
    path.write_text("Hello world.\n\nSecond document here.\n", encoding="utf-8")
    ids = tokenize(tokenizer, str(path))
    expected = tokenizer(load_text(str(path)), add_special_tokens=False, verbose=False)["input_ids"]
    assert ids.dtype == torch.int64 and ids.dim() == 1
    assert ids.tolist() == expected
    assert not tokenizer.deprecation_warnings  # the too-long warning would have set a flag
    assert torch.equal(tokenize(tokenizer, str(path), max_tokens=5), ids[:5])
    assert torch.equal(tokenize(tokenizer, str(path), max_tokens=0), ids)
    with pytest.raises(ConfigError, match="max_tokens"):
        tokenize(tokenizer, str(path), max_tokens=-1)


def test_tokenize_builtin_corpus(tiny_tokenizer):
    ids = tokenize(tiny_tokenizer, "lee", max_tokens=4096)
    assert ids.shape == (4096,)
    assert tiny_tokenizer.decode(ids[:9]) == "Hundreds "


# --- disk cache -------------------------------------------------------------------------------


def test_cached_json_builds_once_and_survives_a_corrupt_file(tmp_path, caplog):
    path = tmp_path / "sub" / "value.json"
    calls = []

    def build():
        calls.append(1)
        return [["title", "body ü"]]

    assert corpora._cached_json(path, build) == [["title", "body ü"]]
    assert corpora._cached_json(path, build) == [["title", "body ü"]]
    assert len(calls) == 1
    assert sorted(p.name for p in path.parent.iterdir()) == ["value.json"]  # no temp files left
    path.write_text("{truncated", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger=corpora.__name__):
        assert corpora._cached_json(path, build) == [["title", "body ü"]]
    assert len(calls) == 2 and "unreadable cache" in caplog.text
