"""A griffe extension: the package's docstrings use a few reStructuredText constructs (math roles, math
directives, cross-reference roles, literal-block markers) that Markdown would show verbatim. This turns
them into their Markdown equivalents before mkdocstrings renders the API reference:

* ``:math:`x``` becomes ``\\(x\\)`` and a ``.. math::`` directive a ``$$ … $$`` block (MathJax via
  ``pymdownx.arithmatex``);
* ``:class:`~pkg.mod.Name``` becomes ``Name`` in code font (``pkg.mod.Name`` without the tilde);
* a paragraph ending in ``::`` ends in ``:`` (the indented block after it is already a code block);
* ``Design note: docs/design/NAME.md`` becomes a link to that page (resolved and checked by mkdocs).
"""
from __future__ import annotations

import re

import griffe

_MATH_ROLE = re.compile(r":math:`([^`]+)`")
_XREF_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const):`(~?)([^`]+)`")
_DESIGN_NOTE = re.compile(r"docs/design/([a-z0-9-]+)\.md")
_MATH_DIRECTIVE = re.compile(r"^(?P<indent>[ \t]*)\.\. math::[ \t]*(?P<inline>.*)$")


def _xref(match: re.Match) -> str:
    short, target = match.group(1), match.group(2).strip()
    if "<" in target and target.endswith(">"):  # "text <target>" form
        return f"`{target.split('<', 1)[0].strip()}`"
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def _math_blocks(text: str) -> str:
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = _MATH_DIRECTIVE.match(lines[i])
        if not match:
            out.append(lines[i])
            i += 1
            continue
        indent = match.group("indent")
        body = [match.group("inline").strip()] if match.group("inline").strip() else []
        i += 1
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > len(indent)):
            if lines[i].strip():
                body.append(lines[i].strip())
            elif body:
                break
            i += 1
        out.extend(["", f"{indent}$$", *[f"{indent}{line}" for line in body], f"{indent}$$", ""])
    return "\n".join(out)


def convert(text: str) -> str:
    """Markdown for the reStructuredText constructs listed in the module docstring."""
    text = _math_blocks(text)
    text = _MATH_ROLE.sub(lambda m: "\\(" + m.group(1) + "\\)", text)
    text = _XREF_ROLE.sub(_xref, text)
    text = re.sub(r"(?m)(\S)::[ \t]*$", r"\1:", text)
    return _DESIGN_NOTE.sub(r"[\g<0>](../design/\1.md)", text)


class RstDocstrings(griffe.Extension):
    """Rewrite every loaded docstring with :func:`convert`."""

    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = convert(obj.docstring.value)
