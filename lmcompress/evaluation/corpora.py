"""Text corpora for calibration and perplexity: real text that works offline, or local files
(the calibration windows cut from it: :mod:`lmcompress.compressor.calibration.windows`).

The built-in corpora are real English text shipped as test data in the ``gensim`` wheel (``pip
install --no-deps gensim==4.4.0``; the files are read, gensim is never imported):

- ``wiki``: ~100 Wikipedia articles of a MediaWiki XML dump, as ``"Title\\n\\nbody"``. Section
  headings stay as lines (as in WikiText); templates, references, tables, images, category links,
  the trailing "See also"/"References"/... sections, disambiguation pages and articles under
  ``_MIN_WORDS`` words are dropped.
- ``wiki-calib`` / ``wiki-test``: ``wiki`` split by article, ~75% / ~25%, by the SHA-1 of the
  title: the same on every run and machine. Calibrate on one, measure perplexity on the other.
- ``lee``: the Lee corpus, 300 ABC news articles, one per line.

Any other source is a local path: ``.txt`` (documents separated by blank lines), ``.jsonl`` (an
object with a ``"text"`` field per line), or a ``datasets`` ``save_to_disk`` directory (``text``
column; of a ``DatasetDict`` the ``test`` split, else the first; ``path:split`` picks one).

Parsing the dump takes mwparserfromhell ~8 s, so the clean articles are cached in-process and as
JSON under ``$LMCOMPRESS_CACHE`` (else ``$XDG_CACHE_HOME/lmcompress``, else
``~/.cache/lmcompress``), keyed by the dump, the parser version and ``_CACHE_VERSION`` (bump it
when the cleaning changes).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

import mwparserfromhell
import torch

from lmcompress.cache import cache_dir
from lmcompress.compressor.util.arguments import require
from lmcompress.compressor.util.fsutil import atomic_file
from lmcompress.errors import ConfigError, DataError
from lmcompress.evaluation.wikitext import parse_wiki_dump

logger = logging.getLogger(__name__)

BUILTIN_CORPORA: tuple[str, ...] = ("wiki", "wiki-calib", "wiki-test", "lee")

_GENSIM_DATA = {
    "wiki": "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
    "lee": "lee_background.cor",
}
_INSTALL_HINT = "pip install --no-deps gensim==4.4.0"
_CACHE_VERSION = 1
_TEST_BUCKETS = 4  # sha1(title) % 4 == 0 -> wiki-test


def load_documents(source: str) -> list[str]:
    """The documents of a built-in corpus (see ``BUILTIN_CORPORA``) or of a local path."""
    if source in ("wiki", "wiki-calib", "wiki-test"):
        articles = _wiki_articles()
        if source != "wiki":
            want_test = source == "wiki-test"
            articles = [a for a in articles if _is_test_article(a[0]) == want_test]
        return [f"{title}\n\n{body}" for title, body in articles]
    if source == "lee":
        return _nonempty(_read_text(_gensim_file("lee")).splitlines(), source)
    return _load_local(source)


def load_text(source: str) -> str:
    """All documents of ``source`` joined with ``"\\n\\n"`` (the perplexity protocol)."""
    return "\n\n".join(load_documents(source))


def tokenize(tokenizer, source: str, max_tokens: int | None = None) -> torch.Tensor:
    """1-D int64 token ids of ``load_text(source)``, at most ``max_tokens`` (0 or None: all).

    The joined text is tokenized in one call without special tokens (the perplexity code adds
    BOS per window where a family needs it), so the ids are exactly the protocol's;
    ``verbose=False`` silences the "longer than the maximum sequence length" warning.
    """
    require("source", source, str, "a corpus name or a text file's path")
    if max_tokens is not None and max_tokens < 0:
        raise ConfigError(f"max_tokens must be >= 0 (0 means all), got {max_tokens}")
    ids = tokenizer(load_text(source), add_special_tokens=False, verbose=False)["input_ids"]
    token_ids = torch.tensor(ids, dtype=torch.long)[: max_tokens or None]
    if token_ids.numel() == 0:
        raise DataError(f"corpus {source!r} gives no tokens")
    return token_ids


# --- built-in corpora ---------------------------------------------------------------------------


def _gensim_file(name: str) -> Path:
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"the built-in corpus {name!r} needs gensim's test data: {_INSTALL_HINT}")
    package = next(iter(spec.submodule_search_locations))
    path = Path(package, "test", "test_data", _GENSIM_DATA[name])
    if not path.is_file():
        raise DataError(f"gensim has no {path.name} (corpus {name!r}): {_INSTALL_HINT}")
    return path


def _is_test_article(title: str) -> bool:
    digest = hashlib.sha1(title.encode("utf-8")).digest()  # unlike hash(), stable across runs
    return int.from_bytes(digest[:8], "big") % _TEST_BUCKETS == 0


@functools.lru_cache(maxsize=1)
def _wiki_articles() -> tuple[tuple[str, str], ...]:
    """(title, clean body) of every kept article, in dump order."""
    dump = _gensim_file("wiki")
    stat = dump.stat()
    key = f"{dump.name}:{stat.st_size}:{stat.st_mtime_ns}:{mwparserfromhell.__version__}"
    name = f"wiki-v{_CACHE_VERSION}-{hashlib.sha1(key.encode()).hexdigest()[:12]}.json"
    return tuple(map(tuple, _cached_json(cache_dir() / name, lambda: parse_wiki_dump(dump))))


def _cached_json(path: Path, build: Callable[[], list]) -> list:
    """``build()``, memoised as JSON at ``path``. A bad cache is rebuilt, never fatal."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as err:  # truncated or foreign file
        logger.warning("ignoring the unreadable cache %s (%s)", path, err)
    value = build()
    try:
        with atomic_file(path, "w", encoding="utf-8") as handle:  # readers see all or nothing
            json.dump(value, handle, ensure_ascii=False)
    except OSError as err:
        logger.warning("could not write the cache %s (%s)", path, err)
    return value


# --- local files --------------------------------------------------------------------------------


def _load_local(source: str) -> list[str]:
    path = Path(source).expanduser()
    if not path.exists():
        head, colon, split = source.rpartition(":")
        if colon and head and Path(head).expanduser().is_dir():
            return _read_saved_dataset(Path(head).expanduser(), split, source)
        if path.suffix or "/" in source or os.sep in source:
            raise DataError(f"corpus file not found: {source}")
        raise DataError(
            f"unknown corpus {source!r}: not a built-in "
            f"({', '.join(BUILTIN_CORPORA)}) nor an existing file or directory"
        )
    if path.is_dir():
        return _read_saved_dataset(path, None, source)
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return _nonempty(re.split(r"\n[^\S\n]*\n", _read_text(path)), source)
    if suffix == ".jsonl":
        return _read_jsonl(path, source)
    raise DataError(
        f"unsupported corpus file type {suffix or '(none)'!r} for {source}: "
        "use .txt, .jsonl or a datasets save_to_disk directory"
    )


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"corpus file {path} is not UTF-8 text ({err.reason})") from err


def _read_jsonl(path: Path, source: str) -> list[str]:
    texts = []
    for lineno, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{source} line {lineno}: invalid JSON ({err.msg})") from err
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f"{source} line {lineno}: expected an object with a string 'text'")
        texts.append(record["text"])
    return _nonempty(texts, source)


def _read_saved_dataset(path: Path, split: str | None, source: str) -> list[str]:
    try:
        import datasets
    except ImportError as err:
        raise DataError(f"{source}: reading it needs datasets (pip install datasets)") from err
    try:
        dataset = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as err:
        message = f"{source} is a directory but not a datasets save_to_disk directory"
        raise DataError(message) from err
    if isinstance(dataset, datasets.DatasetDict):
        split = split or ("test" if "test" in dataset else next(iter(dataset)))
        if split not in dataset:
            raise DataError(f"{source}: no split {split!r} (has {', '.join(dataset)})")
        dataset = dataset[split]
    elif split:
        raise DataError(f"{source}: {path} holds a single Dataset, it has no splits")
    if "text" not in dataset.column_names:
        raise DataError(f"{source}: no 'text' column (has {', '.join(dataset.column_names)})")
    return _nonempty([t for t in dataset["text"] if isinstance(t, str)], source)


def _nonempty(texts: list[str], source: str) -> list[str]:
    documents = [t.strip() for t in texts if t.strip()]
    if not documents:
        raise DataError(f"corpus {source!r} is empty")
    return documents
