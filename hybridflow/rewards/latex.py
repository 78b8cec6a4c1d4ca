"""Pull boxed answers out of LaTeX text, matching nested braces."""

from __future__ import annotations


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} or \\fbox{...} (nested braces kept), or None.

    >>> last_boxed(r"so \\boxed{1} then \\boxed{\\frac{1}{2}}")
    '\\\\frac{1}{2}'
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    if rest.startswith("\\boxed "):  # "\boxed 5" form, no braces
        return rest[len("\\boxed ") :].split("$")[0].strip() or None
    brace = rest.find("{")
    if brace < 0:
        return None
    depth = 0
    for i in range(brace, len(rest)):
        if rest[i] == "{":
            depth += 1
        elif rest[i] == "}":
            depth -= 1
            if depth == 0:
                return rest[brace + 1 : i]
    return None
