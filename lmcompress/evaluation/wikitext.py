"""Plain prose from MediaWiki markup: what ``corpora`` makes of the Wikipedia dump.

mwparserfromhell parses the wikitext; non-prose nodes (templates, references, tables, images,
category links, the trailing "See also"/"References"/... sections) are pruned from the tree
before ``strip_code``; small regexes only normalise whitespace and leftover quote marks.
"""

from __future__ import annotations

import bz2
import logging
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import mwparserfromhell
from mwparserfromhell.nodes import ExternalLink, Heading, Tag, Text, Wikilink
from mwparserfromhell.wikicode import Wikicode

logger = logging.getLogger(__name__)

MIN_WORDS = 50  # shorter clean articles are stubs, or lists whose content lived in tables

# Not prose. strip_code() keeps the text of <ref> and of tables, and the captions of images.
_DROP_TAGS = {
    "ref",
    "references",
    "table",
    "gallery",
    "math",
    "chem",
    "ce",
    "timeline",
    "imagemap",
    "score",
    "syntaxhighlight",
    "source",
    "pre",
    "code",
}
_DROP_LINK_NAMESPACES = {"file", "image", "media", "category"}
_DROP_SECTIONS = {
    "see also",
    "references",
    "notes",
    "footnotes",
    "citations",
    "sources",
    "bibliography",
    "further reading",
    "external links",
    "notes and references",
}
# What mwparserfromhell leaves as literal text where the markup is malformed; a line starting
# with "|" or "!" is a row of a table it could not parse.
_LEFTOVER_MARKUP = ("[[", "]]", "{{", "}}", "{|", "|}", "<ref", "</", "/>")


def parse_wiki_dump(dump: Path) -> list[list[str]]:
    logger.info("cleaning the Wikipedia dump %s (once; the result is cached)", dump.name)
    articles = []
    with bz2.open(dump) as stream:
        for _, element in ET.iterparse(stream):
            if element.tag.rpartition("}")[2] != "page":
                continue
            page = {child.tag.rpartition("}")[2]: child for child in element}
            title = page["title"].text or ""
            # Main namespace only; redirects and disambiguation pages (lists of links) are no prose.
            is_prose = not title.endswith("(disambiguation)") and "redirect" not in page
            if page["ns"].text == "0" and is_prose:
                wikitext = next(c for c in page["revision"] if c.tag.endswith("}text")).text
                body = clean_wikitext(wikitext or "")
                if len(body.split()) >= MIN_WORDS:
                    articles.append([title, body])
            element.clear()  # keep memory flat while streaming
    logger.info("kept %d Wikipedia articles", len(articles))
    return articles


def clean_wikitext(wikitext: str) -> str:
    """Plain prose of an article's wikitext (see the module docstring for what is dropped)."""
    lines = []
    for line in _strip_wikitext(wikitext).splitlines():
        if _has_markup(line):
            # Where the markup around it is malformed mwparserfromhell leaves a construct as
            # text; parsed on its own the paragraph mostly comes out clean, else it is dropped.
            line = _strip_wikitext(line)
            if _has_markup(line):
                continue
        lines.append(line)
    text = "\n".join(lines)
    text = re.sub(r"(?m)^[ \t]*[:;*#]+", "", text)  # markers of lists the parser missed
    text = re.sub(r"(?<=\w)'''(?=s\b)", "'", text)  # unparsed ''Title'''s: apostrophe + italics
    text = re.sub(r"''+", "", text)  # other unpaired bold/italic quotes
    text = re.sub(r" ?\(\s*\)", "", text)  # parentheses emptied by dropped templates
    text = re.sub(r"[^\S\n]+", " ", text)
    text = "\n".join(line.strip() for line in text.splitlines())
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def _has_markup(line: str) -> bool:
    return line.lstrip().startswith(("|", "!")) or any(m in line for m in _LEFTOVER_MARKUP)


def _strip_wikitext(wikitext: str) -> str:
    code = mwparserfromhell.parse(wikitext)
    _prune(code)
    return code.strip_code(normalize=True, collapse=True)


@dataclass
class _SectionState:
    """Where the walk through an article stands. Shared across nesting levels, because
    malformed markup (an unclosed ``''``) can swallow section headings into a tag."""

    skipping: bool = False  # inside a dropped section ("References", ...)
    pending: Heading | None = None  # a heading waiting for its section's first text


def _prune(code: Wikicode, state: _SectionState | None = None) -> None:
    """Drop non-prose nodes of ``code`` in place, recursing into what ``strip_code`` renders.

    A heading is emitted only once its section shows some text, so a section that held only
    tables or templates leaves no orphan heading behind.
    """
    state = _SectionState() if state is None else state
    kept = []
    for node in code.nodes:
        if isinstance(node, Heading):
            title = node.title.strip_code().strip()
            if node.level <= 2:
                state.skipping = title.lower() in _DROP_SECTIONS
            state.pending = None if state.skipping or not title else node
            continue
        if state.skipping or _is_junk(node):
            continue
        inner = {Tag: "contents", Wikilink: "text", ExternalLink: "title"}.get(type(node))
        if inner and getattr(node, inner) is not None:
            _prune(getattr(node, inner), state)
        if state.pending is not None and Wikicode([node]).strip_code().strip():
            kept += [Text("\n"), state.pending, Text("\n")]
            state.pending = None
        kept.append(node)
    code.nodes = kept


def _is_junk(node) -> bool:
    if isinstance(node, Tag):
        return str(node.tag).strip().lower() in _DROP_TAGS
    if isinstance(node, Wikilink):
        namespace, colon, _ = str(node.title).partition(":")
        return bool(colon) and namespace.strip().lower() in _DROP_LINK_NAMESPACES
    return False
