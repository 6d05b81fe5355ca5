"""Griffe extension: render the package's reStructuredText-flavoured docstrings as Markdown.

The docstrings of ``numpyro_sgmc`` are Sphinx style (``:param x:`` fields, which griffe's
``sphinx`` parser reads) with a few reST constructs that Markdown would otherwise show
verbatim. This extension rewrites them, at documentation build time only (the source is
untouched), once the package is loaded:

* ``.. math::`` blocks become ``$$ ... $$`` blocks (``pymdownx.arithmatex``, MathJax);
* cross-reference roles (``:func:`~numpyro_sgmc.tuner.fisher.information```, ``:class:``,
  ``:mod:``, ``:attr:``, ``:data:``, ``:meth:``, ``:exc:``, ``:obj:``) become mkdocs-autorefs
  links when they name an object of this package, and code spans when they name another
  package (``numpyro``, ``jax``: no inventory is fetched, so the build needs no network); a
  target that is neither, or a link to an object no page renders, is a warning, so an error
  under ``--strict``;
* a paragraph ending in ``::`` (a reST literal block) ends in ``:`` and its indented block
  becomes a fenced Python code block;
* ``docs/theory.md`` (the page the docstrings cite by section) links to
  the Theory page, which keeps its section numbers;
* a ``NamedTuple`` class gets the ``__init__`` its fields define (as griffe's built-in
  dataclass support does for dataclasses), so that its ``:param field:`` entries match a
  signature and the signature is shown.

It is loaded by mkdocstrings (``extensions:`` in ``mkdocs.yml``; the path is relative to
``mkdocs.yml``).
"""

from __future__ import annotations

import re
from typing import Any

from griffe import (
    Alias,
    Attribute,
    Class,
    Extension,
    Function,
    Object,
    Parameter,
    ParameterKind,
    Parameters,
    logger,
)

LIST_ITEM = re.compile(r"^([*+-]|\d+[.)])( +)\S")
FENCE = ("```", "$$")
ROLE = re.compile(r":(func|class|mod|attr|data|meth|exc|obj):`(~?)([^`]+)`")
MATH = re.compile(r"^(\s*)\.\. math::\s*$")
# Roles naming these packages render as code; any other unresolvable target is a warning
# (an error under ``mkdocs build --strict``): a typo, or an object that was renamed.
EXTERNAL = {
    "arviz",
    "blackjax",
    "collections",
    "functools",
    "jax",
    "math",
    "np",
    "numpy",
    "numpyro",
    "optax",
    "scipy",
    "typing",
    "warnings",
}
THEORY = "``docs/theory.md``"
THEORY_LINK = "[theory][sgmc-theory]"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _block(lines: list[str], start: int, base: int) -> tuple[list[str], int]:
    """The lines indented deeper than ``base`` from ``start`` (blank lines kept inside)."""
    end = start
    while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > base):
        end += 1
    while end > start and not lines[end - 1].strip():
        end -= 1
    body = lines[start:end]
    depth = min((_indent(line) for line in body if line.strip()), default=base)
    return [line[depth:] if line.strip() else "" for line in body], end


def _blocks(text: str) -> str:
    """``.. math::`` to ``$$`` blocks; ``::`` literal blocks to fenced code."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        math = MATH.match(line)
        if math or line.rstrip().endswith("::"):
            base = _indent(line)
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            if j < len(lines) and _indent(lines[j]) > base:
                body, end = _block(lines, j, base)
                pad = " " * base
                if math:
                    fence_open, fence_close = "$$", "$$"
                else:
                    head = line.rstrip()[:-2].rstrip()
                    if head.strip():
                        out.append(head + ":" if not head.endswith(":") else head)
                    fence_open, fence_close = "```python", "```"
                out += ["", pad + fence_open, *(pad + b if b else "" for b in body)]
                out += [pad + fence_close, ""]
                i = end
                continue
        out.append(line)
        i += 1
    return "\n".join(out)


def _relist(text: str) -> str:
    """Re-indent reST lists for Python-Markdown, which nests by multiples of 4 spaces.

    reST aligns an item's continuation lines, nested lists and blocks with the item's text
    (3 spaces after ``1. ``, 2 after ``* ``); Markdown needs 4 per level. Each line is shifted
    by its innermost open item's offset; fenced blocks move as one.
    """
    out: list[str] = []
    stack: list[tuple[int, int]] = []  # (reST content indent, Markdown content indent)
    fence_shift: int | None = None
    for line in text.split("\n"):
        stripped = line.strip()
        if not stripped:
            out.append("")
            continue
        k = _indent(line)
        if fence_shift is not None:  # inside a fenced block: move with its opening line
            out.append(" " * max(0, k + fence_shift) + line.lstrip(" "))
            if stripped in FENCE:
                fence_shift = None
            continue
        while stack and k < stack[-1][0]:
            stack.pop()
        md = stack[-1][1] + (k - stack[-1][0]) if stack else k
        body = line.lstrip(" ")
        item = LIST_ITEM.match(body)
        if item:
            stack.append((k + len(item[1]) + len(item[2]), md + 4))
        elif stripped.startswith(FENCE):
            fence_shift = md - k
        out.append(" " * md + body)
    return "\n".join(out)


class RstToMarkdown(Extension):
    """Rewrite the reST parts of every docstring of the loaded package (see the module)."""

    def __init__(self) -> None:
        super().__init__()
        self.unresolved: set[str] = set()  # targets rendered as code (for debugging)
        self.paths: list[str] = []
        self.done: set[str] = set()

    def on_package_loaded(self, *, pkg: Any, **kwargs: Any) -> None:
        self.on_package(pkg=pkg, **kwargs)

    def on_package(self, *, pkg: Any, **kwargs: Any) -> None:
        if pkg.path in self.done:  # older griffe: on_package_loaded
            return
        self.done.add(pkg.path)
        objects = list(_walk(pkg, set()))
        self.paths = [obj.path for obj in objects]
        for obj in objects:
            if isinstance(obj, Class) and _is_namedtuple(obj):
                _add_namedtuple_init(obj)
        for obj in _walk(pkg, set()):
            if obj.docstring is not None:
                obj.docstring.value = self._convert(obj, obj.docstring.value, pkg)

    def _convert(self, obj: Object, text: str, pkg: Any) -> str:
        text = _relist(_blocks(text))
        text = text.replace(THEORY, THEORY_LINK)

        def role(match: re.Match) -> str:
            kind, short, target = match.group(1), match.group(2), re.sub(r"\s+", "", match[3])
            shown = target.rsplit(".", 1)[-1] if short else target
            if kind in ("func", "meth"):
                shown += "()"
            path = _lookup(obj, target, pkg, self.paths)
            if path is None:
                self.unresolved.add(f"{obj.path}: {target}")
                if target.split(".", 1)[0] not in EXTERNAL:
                    logger.warning(
                        "%s: cross-reference :%s:`%s` names no object of the package",
                        obj.path,
                        kind,
                        match[3],
                    )
                return f"`{shown}`"
            return f"[`{shown}`][{path}]"

        return ROLE.sub(role, text)


def _walk(obj: Any, seen: set[str]):
    """Every object defined in the package (aliases to it are visited at their target)."""
    if isinstance(obj, Alias) or obj.path in seen:
        return
    seen.add(obj.path)
    yield obj
    for member in obj.members.values():
        if not isinstance(member, Alias):
            yield from _walk(member, seen)


def _get(pkg: Any, path: str) -> Any:
    parts = path.split(".")
    if parts[0] != pkg.name:
        return None
    found = pkg
    try:
        for part in parts[1:]:
            found = found.members[part]
    except Exception:  # KeyError; or an alias to an outside object, unresolvable here
        return None
    return found


def _lookup(obj: Object, target: str, pkg: Any, paths: list[str]) -> str | None:
    """Canonical path of ``target`` in the package, or ``None``.

    Tried in order: the target as written; its first name resolved in the scope of ``obj``
    (imports included); relative to ``obj``'s module and to the package; and the one object
    of the package whose path ends with ``.target``, if exactly one does.
    """
    candidates = [target]
    head, _, rest = target.partition(".")
    scope = obj
    while scope is not None:
        try:
            resolved = scope.resolve(head)
        except Exception:  # griffe's NameResolutionError: not in this scope
            resolved = None
        if resolved:
            candidates.append(resolved + ("." + rest if rest else ""))
            break
        scope = scope.parent
    module = obj.module
    candidates += [f"{module.path}.{target}", f"{pkg.name}.{target}"]
    suffix = [path for path in paths if path.endswith("." + target)]
    if len(suffix) == 1:
        candidates.append(suffix[0])
    for candidate in candidates:
        found = _get(pkg, candidate)
        if (
            isinstance(found, Attribute)
            and found.docstring is None
            and isinstance(found.parent, Class)
        ):
            found = found.parent  # a NamedTuple field: documented in its class's docstring
        if found is not None:
            try:
                return found.final_target.path if isinstance(found, Alias) else found.path
            except Exception:  # an alias whose target is outside the package
                return None
    return None


def _is_namedtuple(cls: Class) -> bool:
    return any(str(base).rsplit(".", 1)[-1] == "NamedTuple" for base in cls.bases)


def _add_namedtuple_init(cls: Class) -> None:
    """``__init__(self, field, ...)`` from the annotated fields, defaults included."""
    if "__init__" in cls.members:
        return
    params = [Parameter("self", kind=ParameterKind.positional_or_keyword)]
    for name, member in cls.members.items():
        if (
            isinstance(member, Attribute)
            and "instance-attribute" in member.labels
            and "property" not in member.labels
            and not name.startswith("_")
        ):
            default = member.value if "class-attribute" in member.labels else None
            params.append(
                Parameter(
                    name,
                    annotation=member.annotation,
                    kind=ParameterKind.positional_or_keyword,
                    default=default,
                )
            )
    init = Function(
        "__init__",
        parameters=Parameters(*params),
        lineno=cls.lineno,
        endlineno=cls.lineno,
    )
    init.labels.add("namedtuple-init")
    cls.set_member("__init__", init)
