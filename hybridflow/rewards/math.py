"""MATH-style answers: the last \\boxed{} answer, checked with math-verify (symbolic and numeric
equivalence: 1/2 = 0.5 = \\frac{1}{2}, intervals, sets, units), with a LaTeX string normalisation as
the fallback when math-verify cannot parse either side."""

from __future__ import annotations

import logging
import re

from hybridflow.rewards.latex import last_boxed

# our executor enforces timeouts itself, so math-verify's own (signal-based) ones are off; hush its note
logging.getLogger("math_verify").setLevel(logging.ERROR)
_UNITS = re.compile(r"\\(?:text|mbox|mathrm)\{\s*[a-zA-Z ]+\}")


def normalize(answer: str) -> str:
    """A light version of the usual MATH string normalisation (spaces, \\left/\\right, dfrac, units, $)."""
    a = answer.strip().replace("\\!", "").replace("\\left", "").replace("\\right", "").replace("$", "")
    a = a.replace("dfrac", "frac").replace("tfrac", "frac").replace("^\\circ", "").replace("^{\\circ}", "")
    a = _UNITS.sub("", a).replace(" ", "").rstrip(".")
    if a.startswith("x=") or a.startswith("y="):
        a = a[2:]
    return a


def verify(gold: str, pred: str) -> bool | None:
    """True/False from math-verify, or None when it cannot parse one side."""
    try:
        from math_verify import parse, verify
    except ImportError:  # optional at import time; a dependency of the package
        return None
    try:
        gold_parsed = parse(f"${gold}$", parsing_timeout=None)
        pred_parsed = parse(f"${pred}$", parsing_timeout=None)
        if not gold_parsed or not pred_parsed:
            return None
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))
    except Exception:
        return None


def lists_several_candidates(pred: str, gold: str) -> bool:
    """'3 or 5', '3, 5' when the reference is a single value: hedging, not an answer."""
    if re.search(r"\bor\b|\\text\{\s*or\s*\}", pred):
        return True
    return "," in pred and "," not in gold and not re.search(r"\d,\d{3}", pred)


def score(solution_str: str, ground_truth: str, *, guards: bool = True) -> dict:
    pred = last_boxed(solution_str)
    if pred is None or not pred.strip():
        return {"score": 0.0, "pred": None}
    gold = str(ground_truth)
    if guards and lists_several_candidates(pred, gold):
        return {"score": 0.0, "pred": pred}
    verdict = verify(gold, pred)
    if verdict is None:
        verdict = normalize(pred) == normalize(gold)
    return {"score": float(verdict), "pred": pred}
