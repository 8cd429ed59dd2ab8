"""Griffe extension for the docs build: syncbn's reST-flavoured docstrings as Markdown.

The docstrings follow PyTorch's conventions (Google sections plus ``Example::``,
``Shape:``, ``.. math::`` and Sphinx roles such as ``:class:`~syncbn.SyncBatchNorm```).
mkdocstrings renders Markdown, so before a docstring is parsed this rewrites:

* ``:class:`~syncbn.x.Y``` and friends into a cross-reference to the API page
  (public ``syncbn`` names) or inline code (private and foreign names);
* ``:math:`...``` into inline code and ``.. math::`` blocks into code blocks;
* ``Example::``/``Examples::`` into the Google ``Examples:`` section;
* ``Shape:`` into a bold label followed by its list;
* a paragraph ending in ``::`` (a reST literal block follows) into one ending in ``:``.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`(~?)([^`]+)`")
_MATH = re.compile(r":math:`([^`]+)`")
_GREEK = {
    "gamma": "γ",
    "beta": "β",
    "mu": "μ",
    "sigma": "σ",
    "epsilon": "ε",
    "sum": "Σ",
    "cdot": "·",
    "times": "×",
    "alpha": "α",
    "lambda": "λ",
}


def _tex(expr: str) -> str:
    """Plain text for the small TeX subset the docstrings use (fractions, roots, Greek letters)."""
    previous = None
    while previous != expr:
        previous = expr
        expr = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1) / (\2)", expr)
        expr = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", expr)
        expr = re.sub(r"\\(?:mathrm|text|mathbf)\{([^{}]*)\}", r"\1", expr)
        expr = re.sub(r"\\hat\s*\{?(\w)\}?", "\\1\u0302", expr)
    expr = re.sub(r"\\([a-zA-Z]+)", lambda m: _GREEK.get(m.group(1), m.group(1)), expr)
    return expr.replace("_", "")


def _role(match: re.Match[str]) -> str:
    tilde, target = match.group(1), match.group(2).strip()
    shown = target.rsplit(".", 1)[-1] if tilde else target
    if target.startswith("syncbn.") and not any(part.startswith("_") for part in target.split(".")):
        return f"[`{shown}`][{target}]"
    return f"`{shown}`"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _blocks(text: str) -> str:
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        base = _indent(line)
        if stripped in ("Example::", "Examples::"):
            out.append(" " * base + "Examples:")
            i += 1
            continue
        if stripped == ".. math::" or stripped == "Shape:":
            body: list[str] = []
            j = i + 1
            while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > base):
                body.append(lines[j])
                j += 1
            while body and not body[-1].strip():
                body.pop()
            content = [b for b in body if b.strip()]
            inner = min((_indent(b) for b in content), default=base)
            dedented = [b[inner:] if b.strip() else "" for b in body]
            pad = " " * base
            if stripped == ".. math::":
                out += [pad + "```text", *[pad + _tex(d) for d in dedented if d], pad + "```"]
            else:
                out += [pad + "**Shape:**", "", *[pad + d for d in dedented]]
            out.append("")
            i = j
            continue
        if stripped.endswith("::") and not stripped.startswith(".."):
            out.append(line[: len(line) - 1])
            i += 1
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def convert(text: str) -> str:
    """The Markdown form of one docstring."""
    text = _MATH.sub(lambda m: f"`{_tex(m.group(1))}`", text)
    text = _ROLE.sub(_role, text)
    return _blocks(text)


class ReSTToMarkdown(griffe.Extension):
    """Rewrite every docstring before mkdocstrings parses it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = convert(obj.docstring.value)
