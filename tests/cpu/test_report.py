"""The run report: written by the trainer (at the end, and when a run is interrupted), its figures'
data equal to metrics.jsonl, several runs overlaid, and the page rendered by headless Chromium
without console errors into a screenshot that is not blank."""

import json
import re
import shutil
import subprocess

import pytest
from rl_run import config, read_metrics

from hybridflow.controller.trainer import RLTrainer
from hybridflow.report import write_report

RUN = ["trainer.total_training_steps=3", "trainer.log_samples_freq=1", "trainer.log_samples=2"]


def _figure_data(path) -> dict:
    match = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', path.read_text())
    return json.loads(match.group(1).replace("<\\/", "</"))


@pytest.fixture(scope="module")
def run(setup, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("report") / "run"
    RLTrainer(config(setup, run_dir, *RUN)).fit()
    return run_dir


def test_the_trainer_writes_a_report_whose_figures_hold_the_logged_metrics(run):
    data = _figure_data(run / "report.html")
    metrics = read_metrics(run)
    for title, key in (("Reward and validation accuracy", "critic/score/mean"), ("KL and entropy", "actor/entropy"),
                       ("Response length", "response_length/clip_ratio"), ("Time per phase", "timing_s/update_actor"),
                       ("Throughput", "perf/throughput")):  # fmt: skip
        steps, values = data[title]["run"][key]
        assert steps == [m["step"] for m in metrics if key in m], title
        assert values == [m[key] for m in metrics if key in m], title
    page = (run / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 5
    assert not re.search(r'(src|href)="https?:', page)  # self-contained: nothing fetched to view it
    assert "Step plan" in page and "actor:" in page  # the step plan and the resolved config
    assert page.count("<tr><td>") == 6  # two samples a step, three steps


def test_several_runs_are_overlaid(run, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(run, other)
    data = _figure_data(write_report([run, other], tmp_path / "compare.html"))
    assert set(data["Reward and validation accuracy"]) == {"run", "other"}


def test_an_rl_run_and_an_sft_run_share_one_report(run, tmp_path):
    sft = tmp_path / "sft"
    sft.mkdir()
    rows = [{"step": 1, "train/loss": 2.5}, {"step": 2, "train/loss": 2.0, "val/loss": 2.25}]
    (sft / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = _figure_data(write_report([run, sft], tmp_path / "both.html"))
    assert set(data["Response length"]) == {"run"}  # only the RL run has responses
    assert data["Reward and validation accuracy"]["run"]
    assert data["SFT loss"]["sft"]["train/loss"] == [[1, 2], [2.5, 2.0]]


def test_an_interrupted_run_still_gets_its_report(setup, tmp_path, monkeypatch):
    trainer = RLTrainer(config(setup, tmp_path / "run", *RUN))
    step = trainer.train_step

    def interrupted():
        if trainer.step == 2:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(trainer, "train_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    steps, _ = _figure_data(tmp_path / "run" / "report.html")["Reward and validation accuracy"]["run"][
        "critic/score/mean"
    ]
    assert steps == [1]


@pytest.mark.slow
def test_headless_chromium_renders_the_report(run, tmp_path):
    import matplotlib.image

    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is needed (make test installs it)"
    shot = tmp_path / "report.png"
    result = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--enable-logging=stderr",
         "--window-size=1300,2200", f"--screenshot={shot}", (run / "report.html").as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert not [line for line in result.stderr.splitlines() if "CONSOLE" in line], result.stderr[-2000:]
    pixels = matplotlib.image.imread(shot)[..., :3]  # [H, W, 3] in 0..1
    ink = (pixels.min(axis=-1) < 0.9).mean()  # share of pixels that are not (near) white
    assert 0.02 < ink < 0.9, ink


def test_accuracy_over_time_draws_every_run_on_one_plot(tmp_path):
    """bench/plot_gsm8k.py's figure: two frameworks' curves (one without the lenient score) as PNG."""
    import io
    import json
    import subprocess
    import sys
    from pathlib import Path

    from PIL import Image

    points = [{"step": 0, "train_s": 0.0, "strict": 0.0, "lenient": 0.4},
              {"step": 10, "train_s": 60.0, "strict": 0.5, "lenient": 0.6}]  # fmt: skip
    ours, theirs = tmp_path / "ours.json", tmp_path / "theirs.json"
    ours.write_text(json.dumps({"held_out": points}))
    theirs.write_text(json.dumps({"held_out": [{**p, "lenient": None} for p in points]}))
    out = tmp_path / "curve.png"
    root = Path(__file__).parents[2]
    subprocess.run([sys.executable, str(root / "bench" / "plot_gsm8k.py"), str(out), f"ours={ours}",
                    f"theirs={theirs}"], check=True, env={"PYTHONPATH": str(root), "PATH": ""})  # fmt: skip
    image = Image.open(io.BytesIO(out.read_bytes()))
    assert image.format == "PNG" and image.size[0] > 400
