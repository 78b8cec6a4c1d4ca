"""Held-out GSM8K accuracy against training time, several runs on one plot (issue #32): each
argument is NAME=PATH to a gsm8k_curve.json (bench/real_gsm8k.py, either framework).

    PYTHONPATH=. python bench/plot_gsm8k.py docs/gsm8k_curve.png "hybridflow lr 1e-6=runs/a/gsm8k_curve.json" ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hybridflow.report.figures import accuracy_over_time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("runs", nargs="+", help="NAME=PATH of a gsm8k_curve.json")
    ap.add_argument("--title", default="GSM8K held-out accuracy (test split's first 200, greedy)")
    args = ap.parse_args()
    curves = {}
    for item in args.runs:
        name, _, path = item.partition("=")
        if not path:
            raise SystemExit(f"{item!r}: give NAME=PATH")
        try:
            curves[name] = json.loads(Path(path).read_text())["held_out"]
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(
                f"{path}: not a gsm8k_curve.json with held_out points ({type(e).__name__}: {e})"
            ) from None
    args.out.write_bytes(accuracy_over_time(curves, args.title))
    print(args.out)


if __name__ == "__main__":
    main()
