"""The report's figures, drawn with matplotlib (Agg, no display) into PNG bytes. Each figure also
returns the series it drew, which the report embeds as JSON beside the image."""

from __future__ import annotations

import io
from collections.abc import Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from hybridflow.report.runs import Run  # noqa: E402

PHASES = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor",
          "update_weights", "testing", "save_checkpoint")  # fmt: skip

Figure = tuple[str, bytes, dict]  # title, PNG, {run: {key: [steps, values]}}


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def _lines(title: str, runs: list[Run], panels: list[tuple[str, list[str]]]) -> Figure | None:
    """One panel per (y label, metric keys), a line per run and key; None when nothing was logged."""
    data = {
        r.name: {k: list(r.series(k)) for _, keys in panels for k in keys if r.series(k)[0]} for r in runs
    }
    panels = [(label, keys) for label, keys in panels if any(k in d for d in data.values() for k in keys)]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 3.6), squeeze=False)
    for ax, (label, keys) in zip(axes[0], panels):
        for run, series in data.items():
            for key in keys:
                if key in series:
                    steps, values = series[key]
                    name = key if len(runs) == 1 else f"{run}: {key}"
                    ax.plot(steps, values, marker="o" if len(steps) < 30 else None, ms=3, label=name)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return title, _png(fig), data


def _validation_keys(runs: list[Run]) -> list[str]:
    return sorted({k for r in runs for k in r.metric_keys() if k.startswith("val-core/") and "/mean@" in k})


def reward(runs: list[Run]) -> Figure | None:
    return _lines(
        "Reward and validation accuracy",
        runs,
        [
            ("score (mean over the batch)", ["critic/score/mean"]),
            ("validation accuracy", _validation_keys(runs)),
        ],
    )


def sft_loss(runs: list[Run]) -> Figure | None:
    return _lines("SFT loss", runs, [("loss per target token", ["train/loss", "val/loss"])])


def kl_and_entropy(runs: list[Run]) -> Figure | None:
    return _lines(
        "KL and entropy",
        runs,
        [
            ("KL", ["actor/kl_loss", "actor/reward_kl_penalty", "actor/ppo_kl"]),
            ("entropy", ["actor/entropy"]),
        ],
    )


def response_length(runs: list[Run]) -> Figure | None:
    """Mean response length with its min-max band, and the share cut at the length limit."""
    keys = [
        "response_length/mean",
        "response_length/min",
        "response_length/max",
        "response_length/clip_ratio",
    ]
    data = {r.name: {k: list(r.series(k)) for k in keys if r.series(k)[0]} for r in runs}
    data = {name: series for name, series in data.items() if "response_length/mean" in series}  # RL runs
    if not data:
        return None
    fig, (ax, clip) = plt.subplots(1, 2, figsize=(12, 3.6))
    for run, series in data.items():
        steps, mean = series["response_length/mean"]
        line = ax.plot(steps, mean, label=f"{run} mean" if len(runs) > 1 else "mean")[0]
        if "response_length/min" in series and "response_length/max" in series:
            ax.fill_between(steps, series["response_length/min"][1], series["response_length/max"][1],
                            color=line.get_color(), alpha=0.15, label="min-max")  # fmt: skip
        if "response_length/clip_ratio" in series:
            clip.plot(*series["response_length/clip_ratio"], label=run)
    ax.set(xlabel="step", ylabel="response tokens")
    clip.set(xlabel="step", ylabel="share cut at max_response_tokens", ylim=(0, 1.05))
    for a in (ax, clip):
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    return "Response length", _png(fig), data


def time_per_phase(runs: list[Run]) -> Figure | None:
    """Seconds per phase of each step, stacked; one panel per run."""
    data = {r.name: {f"timing_s/{p}": list(r.series(f"timing_s/{p}")) for p in PHASES if r.series(f"timing_s/{p}")[0]}
            for r in runs}  # fmt: skip
    runs = [r for r in runs if data[r.name]]
    if not runs:
        return None
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 3.6), squeeze=False)
    for ax, run in zip(axes[0], runs):
        steps = run.series("timing_s/step")[0] or sorted({s for s, _ in data[run.name].values() for s in s})
        bottom = [0.0] * len(steps)
        for key, (s, values) in data[run.name].items():
            height = dict(zip(s, values))
            heights = [height.get(step, 0.0) for step in steps]
            ax.bar(steps, heights, bottom=bottom, label=key.split("/", 1)[1])
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set(xlabel="step", ylabel="seconds", title=run.name if len(runs) > 1 else None)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return "Time per phase", _png(fig), data


def throughput(runs: list[Run]) -> Figure | None:
    return _lines(
        "Throughput",
        runs,
        [("tokens/s per device", ["perf/throughput"]), ("generated tokens/s", ["perf/gen_tokens_per_s"])],
    )


FIGURES: tuple[Callable[[list[Run]], Figure | None], ...] = (
    reward, sft_loss, kl_and_entropy, response_length, time_per_phase, throughput
)  # fmt: skip


def accuracy_over_time(curves: dict[str, list[dict]], title: str) -> bytes:
    """Held-out accuracy against training seconds, one line per run and scorer: `curves` maps a run's
    name to its points ({"train_s", "strict", "lenient"}, bench/real_gsm8k.py's gsm8k_curve.json)."""
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for (name, points), color in zip(curves.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        seconds = [p["train_s"] / 60 for p in points]
        ax.plot(
            seconds, [p["strict"] for p in points], marker="o", ms=3, color=color, label=f"{name}: strict"
        )
        lenient = [p.get("lenient") for p in points]
        if all(v is not None for v in lenient):
            ax.plot(seconds, lenient, ls="--", color=color, alpha=0.6, label=f"{name}: lenient")
    ax.set_xlabel("training minutes (evaluation excluded)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _png(fig)
