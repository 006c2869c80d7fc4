"""Answer extraction, normalisation and exact match for math word problems (GSM8K / MATH).

The usual evaluation conventions: :func:`extract_gsm8k_answer` takes the number after the last
``####`` or "The answer is", else the last number; :func:`extract_math_answer` the content of the
last ``\\boxed{...}`` (or "The answer is"); :func:`normalize_number` and
:func:`normalize_math_answer` normalise like Hendrycks et al.'s ``is_equiv`` (``\\dfrac``→``\\frac``,
``\\left``/``\\right``, units, ``0.5``→``\\frac{1}{2}``, ...); :func:`answers_match` compares.
"""
from __future__ import annotations

import re

import numpy as np

__all__ = [
    "normalize_number",
    "extract_gsm8k_answer",
    "last_boxed",
    "extract_math_answer",
    "normalize_math_answer",
    "answers_match",
    "extract_answer",
]

_NUMBER = re.compile(r"-?\$?\s*\d[\d,]*(?:\.\d+)?|-?\.\d+")


def normalize_number(text: str) -> str | None:
    """Canonical string of a number: commas, ``$``, ``%`` and spaces removed, integral values
    without a fractional part (``"1,234.50"`` → ``"1234.5"``, ``"-3.0"`` → ``"-3"``); None if
    ``text`` is not a number."""
    s = str(text).strip().replace(",", "").replace("$", "").replace("%", "").replace(" ", "")
    s = s.rstrip(".")
    try:
        value = float(s)
    except ValueError:
        return None
    if not np.isfinite(value):
        return None
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value).rstrip("0").rstrip(".")


def _first_number(text: str) -> str | None:
    m = _NUMBER.search(text)
    return normalize_number(m.group(0)) if m else None


def _last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return normalize_number(found[-1]) if found else None


def extract_gsm8k_answer(text: str) -> str | None:
    """The final numeric answer of a GSM8K-style solution, normalised by :func:`normalize_number`.

    Priority: the first number after the last ``####``; else after the last "The answer is"
    (case-insensitive, optional colon); else the last number in the text; None if there is none.
    """
    for marker in (r"####", r"the answer is:?"):
        hits = list(re.finditer(marker, text, flags=re.IGNORECASE))
        if hits:
            value = _first_number(text[hits[-1].end():])
            if value is not None:
                return value
    return _last_number(text)


def last_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` / ``\fbox{...}`` (balanced braces), or of ``\boxed x``."""
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    rest = text[idx:]
    if rest.startswith("\\boxed ") :
        return rest[len("\\boxed "):].split("$")[0].strip()
    start = rest.find("{")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(rest)):
        if rest[i] == "{":
            depth += 1
        elif rest[i] == "}":
            depth -= 1
            if depth == 0:
                return rest[start + 1 : i]
    return None


def extract_math_answer(text: str) -> str | None:
    r"""The final answer of a MATH-style solution: the last ``\boxed{}`` content, else the text
    after the last "The answer is" (MetaMath's format, up to the end of the line), else None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    hits = list(re.finditer(r"the answer is:?", text, flags=re.IGNORECASE))
    if hits:
        ans = text[hits[-1].end():].strip().split("\n")[0].strip()
        return ans.rstrip(".").strip().strip("$").strip() or None
    return None


def _fix_fracs(s: str) -> str:
    r"""``\frac12`` → ``\frac{1}{2}``, ``\frac1{2}`` → ``\frac{1}{2}``."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{") or len(part) < 2:
            out += part
            continue
        a, b, rest = part[0], part[1], part[2:]
        if b == "{":
            out += "{" + a + "}" + b + rest
        else:
            out += "{" + a + "}{" + b + "}" + rest
    return out


def _fix_slash(s: str) -> str:
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    return f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}" if m else s


def _fix_sqrt(s: str) -> str:
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)


def normalize_math_answer(text: str | None) -> str | None:
    r"""Canonical form of a MATH answer for exact match (Hendrycks et al. conventions).

    Removes whitespace, ``\left``/``\right``, ``\!``, ``$``, degree marks, trailing units
    (``\text{...}`` at the end), percent signs and a leading ``x =``; maps ``\tfrac``/``\dfrac``
    to ``\frac``; adds braces to ``\frac12`` and ``\sqrt2``; rewrites ``a/b`` as ``\frac{a}{b}``;
    ``0.5`` → ``\frac{1}{2}``; removes thousands separators and a trailing ``.0``.
    """
    if text is None:
        return None
    s = str(text).strip()
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    s = re.sub(r"\\text\{\s*[a-zA-Z ]*\}$", "", s.strip())  # trailing units
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    if "=" in s and len(s.split("=")[0].strip()) <= 2:
        s = s.split("=", 1)[1]
    s = _fix_sqrt(s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    s = _fix_slash(s)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    return s


def answers_match(pred: str | None, gold: str | None, kind: str) -> bool:
    """Exact match after normalisation; ``kind`` is ``"gsm8k"`` (numbers) or ``"math"`` (LaTeX)."""
    if pred is None or gold is None:
        return False
    if kind == "gsm8k":
        a, b = normalize_number(pred), normalize_number(gold)
        return a is not None and a == b
    a, b = normalize_math_answer(pred), normalize_math_answer(gold)
    if a == b:
        return True
    na, nb = normalize_number(a or ""), normalize_number(b or "")
    return na is not None and na == nb


def extract_answer(text: str, kind: str) -> str | None:
    """The final answer in ``text`` by the extraction rule of ``kind`` (``"gsm8k"`` or ``"math"``)."""
    return extract_gsm8k_answer(text) if kind == "gsm8k" else extract_math_answer(text)

