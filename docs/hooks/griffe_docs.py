"""griffe extension (mkdocs.yml, ``extensions``): the API page as a reader should see it.

The package's docstrings are written for readers of the source: Sphinx roles
(``:class:`ModelLoadError```) and dataclass fields whose default and help sit in
``field(default=..., metadata={"help": ...})``. Rendered as they are, the page shows the roles
as literal text and every option as a raw ``field(...)`` call. At load time this extension:

- turns each role into a cross-reference (``[`ModelLoadError`][lmcompress.errors.ModelLoadError]``)
  where the target is rendered on the API page, else into inline code, so a strict build never
  meets an unresolvable reference;
- gives each dataclass field its default as its value (``= 128``, ``= TrainingOptions()``) and
  its ``help`` (and ``default_text``) as its docstring: the text ``--help`` shows.

The source stays as it is; ``tests/test_docs.py`` checks the built page for leftovers.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import griffe

API_PAGE = Path(__file__).resolve().parent.parent / "api.md"
DIRECTIVE = re.compile(r"^::: ([\w.]+)$", re.MULTILINE)
FIELD_CALLS = ("field", "dataclasses.field")
ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):`(~?)([^`]+)`")


def _literal(expr: Any) -> Any:
    try:
        return ast.literal_eval(str(expr))
    except (ValueError, SyntaxError):
        return None


def _keywords(call: griffe.ExprCall) -> dict[str, Any]:
    return {arg.name: arg.value for arg in call.arguments if isinstance(arg, griffe.ExprKeyword)}


def _field_default(value: Any) -> tuple[Any, dict[str, Any]] | None:
    """(default expression, metadata) of a ``field(...)`` call, else None."""
    if not isinstance(value, griffe.ExprCall) or str(value.function) not in FIELD_CALLS:
        return None
    keywords = _keywords(value)
    metadata = keywords.get("metadata")
    meta = {}
    if isinstance(metadata, griffe.ExprDict):
        meta = {
            _literal(k): _literal(v) for k, v in zip(metadata.keys, metadata.values, strict=False)
        }
    if "default" in keywords:
        return keywords["default"], meta
    factory = keywords.get("default_factory")
    if factory is None:
        return None, meta
    text = str(factory)
    return (text.removeprefix("lambda: ") if text.startswith("lambda") else f"{text}()"), meta


def _fix_field(attribute: griffe.Attribute) -> None:
    found = _field_default(attribute.value)
    if found is None:
        return
    default, meta = found
    attribute.value = default
    help_text = meta.get("help") or ""
    if meta.get("default_text"):
        help_text = f"{help_text} (default: {meta['default_text']})".strip()
    if help_text and attribute.docstring is None:
        attribute.docstring = griffe.Docstring(help_text, parent=attribute)


class ReadableApi(griffe.Extension):
    """Roles to cross-references, ``field(...)`` to a default and a docstring."""

    def __init__(self) -> None:
        self.documented = set(DIRECTIVE.findall(API_PAGE.read_text()))

    def on_package(self, *, pkg: griffe.Module, **_: Any) -> None:
        rendered = set()
        for path in self.documented:
            try:
                obj = pkg.modules_collection.get_member(path)
            except (KeyError, griffe.AliasResolutionError):
                continue
            target = obj.final_target if obj.is_alias else obj
            rendered |= {path, target.path}
            rendered |= {
                f"{name}.{member}" for name in (path, target.path) for member in target.members
            }
        self.rendered = rendered
        self._walk(pkg, set())

    def _walk(self, obj: griffe.Object, seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        if isinstance(obj, griffe.Attribute) and obj.parent is not None and obj.parent.is_class:
            _fix_field(obj)
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(lambda m: self._reference(obj, m), obj.docstring.value)
        for member in obj.members.values():
            if not member.is_alias:
                self._walk(member, seen)

    def _target(self, obj: griffe.Object, name: str) -> str | None:
        """The full path ``name`` means where ``obj`` is written, if the API page renders it."""
        name = name.removesuffix("()")
        head, _, rest = name.partition(".")
        scope = obj if obj.is_module or obj.is_class else obj.parent
        candidates = [name]
        try:
            resolved = scope.resolve(head) if scope is not None else head
            candidates.insert(0, f"{resolved}.{rest}" if rest else resolved)
        except griffe.NameResolutionError:
            pass
        for candidate in candidates:
            if candidate in self.rendered:
                return candidate
        return None

    def _reference(self, obj: griffe.Object, match: re.Match[str]) -> str:
        tilde, written = match.groups()
        shown = written.rsplit(".", 1)[-1] if tilde else written
        target = self._target(obj, written)
        return f"[`{shown}`][{target}]" if target else f"`{shown}`"
