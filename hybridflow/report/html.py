"""report.html: one self-contained page (figures inlined as PNG, no scripts, no network) with the
curves of one run or several overlaid, sample generations, the step plan and the resolved config.
The data behind every figure is embedded as JSON (`<script type="application/json"
id="report-data">`), so what a figure shows can be checked against metrics.jsonl."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from hybridflow.report.figures import FIGURES
from hybridflow.report.runs import Run, load_run
from hybridflow.run_manifest import write_text_atomic

STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1280px; color: #1d232a; }
h1 { font-size: 22px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #dde; }
img { max-width: 100%; } pre { background: #f5f6f8; padding: 10px; white-space: pre-wrap; font-size: 12px; }
table { border-collapse: collapse; font-size: 12px; width: 100%; }
td, th { border: 1px solid #dde; padding: 4px 6px; vertical-align: top; text-align: left; }
td.text { white-space: pre-wrap; max-width: 460px; font-family: ui-monospace, monospace; }
.summary span { display: inline-block; margin-right: 22px; }
"""
SAMPLE_ROWS = 12  # the latest generations shown per run
TEXT_CHARS = 800


def _summary(run: Run) -> str:
    last = run.steps[-1] if run.steps else {}
    facts = [("steps", last.get("step")), ("last score", last.get("critic/score/mean")),
             ("last response length", last.get("response_length/mean")),
             ("step time (s)", last.get("timing_s/step"))]  # fmt: skip
    spans = "".join(
        f"<span><b>{name}</b> {value:.4g}</span>"
        if isinstance(value, float)
        else f"<span><b>{name}</b> {value}</span>"
        for name, value in facts
        if value is not None
    )
    return f'<p class="summary"><b>{html.escape(run.name)}</b>: {spans}</p>'


def shown(text: str) -> str:
    """Model-written text made safe to show: cut to TEXT_CHARS, control and bidi characters and lone
    surrogates written as visible escapes (a response cannot restyle the page or reorder its text)."""
    cut = text if len(text) <= TEXT_CHARS else text[:TEXT_CHARS] + f" … ({len(text):,} characters)"
    visible = "".join(f"\\u{ord(ch):04x}" if _hidden(ch) else ch for ch in cut)
    return html.escape(visible)


def _hidden(ch: str) -> bool:
    code = ord(ch)
    return (
        (code < 32 and ch not in "\n\t")
        or 0x7F <= code < 0xA0
        or 0x202A <= code <= 0x202E
        or 0x2066 <= code <= 0x2069
        or 0xD800 <= code <= 0xDFFF
        or code in (0x200E, 0x200F, 0xFEFF)
    )


def _samples(run: Run) -> str:
    rows = run.samples[-SAMPLE_ROWS:]
    if not rows:
        return "<p>no samples logged (trainer.log_samples_freq=0?)</p>"
    body = "".join(
        f"<tr><td>{r['step']}</td><td>{html.escape(str(r['data_source']))}</td><td>{r['score']:.3g}</td>"
        f"<td>{r['advantage']:.3g}</td><td>{r['response_length']}</td><td>{r['finish_reason']}</td>"
        f'<td class="text">{shown(r["prompt"])}</td><td class="text">{shown(r["response"])}</td></tr>'
        for r in rows
    )
    head = "".join(
        f"<th>{h}</th>"
        for h in ("step", "source", "score", "advantage", "length", "finish", "prompt", "response")
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def render(runs: list[Run]) -> str:
    figures = [f for f in (make(runs) for make in FIGURES) if f is not None]
    parts = [f"<h1>hybridflow report: {html.escape(', '.join(r.name for r in runs))}</h1>"]
    parts += [_summary(r) for r in runs]
    for title, png, _ in figures:
        image = base64.b64encode(png).decode()
        parts.append(
            f'<h2>{html.escape(title)}</h2><img alt="{html.escape(title)}" src="data:image/png;base64,{image}">'
        )
    for run in runs:
        label = f" — {html.escape(run.name)}" if len(runs) > 1 else ""
        parts.append(f"<h2>Sample generations{label}</h2>{_samples(run)}")
        if run.step_plan:
            parts.append(f"<h2>Step plan{label}</h2><pre>{html.escape(run.step_plan)}</pre>")
        if run.config_yaml:
            parts.append(
                f"<h2>Config{label}</h2><details><summary>resolved config</summary>"
                f"<pre>{html.escape(run.config_yaml)}</pre></details>"
            )
    data = json.dumps({title: series for title, _, series in figures}).replace("</", "<\\/")
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>hybridflow report</title>'
        f"<style>{STYLE}</style></head><body>{''.join(parts)}"
        f'<script type="application/json" id="report-data">{data}</script></body></html>'
    )


def write_report(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    """Render the runs into `out` (default: the first run's report.html)."""
    runs = [load_run(d) for d in run_dirs]
    path = Path(out) if out is not None else Path(run_dirs[0]) / "report.html"
    write_text_atomic(path, render(runs))  # a kill mid-write leaves the previous report
    return path
