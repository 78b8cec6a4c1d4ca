"""Every sink gets the same metrics: TensorBoard's events read back with its own reader, the offline
W&B run's records decoded, both equal to metrics.jsonl; sample generations in samples.jsonl and in
the sinks' tables."""

import io
import json
import math
import struct
import sys
import time

import pytest
from rl_run import config, read_metrics

from hybridflow.controller.trainer import RLTrainer
from hybridflow.errors import UserError
from hybridflow.tracking.external import _require

SINKS = "trainer.logger=[console,jsonl,tensorboard,wandb]"


def _wandb_records(path):
    """Records of an offline W&B run file: a 7-byte header, then LevelDB-style log records (crc32,
    length, type; 32 KiB blocks) holding protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, chunks = path.read_bytes(), 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunks, pos = chunks + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


@pytest.mark.slow
def _complete_wandb_records(path, deadline_s: float = 60.0):
    """The records of a finished offline run, once its writer has written them all. W&B's writer
    (the wandb-core process) writes the history records just before the final `exit` record, when
    the run finishes; a file read before that has no history at all (the KeyError this test once
    hit on a fresh, loaded machine). So wait for the exit record, with a deadline, not a sleep."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            records = list(_wandb_records(path))
        except Exception:  # a record still being written
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < end, f"{path} has no exit record {deadline_s:.0f} s after the run finished"
        time.sleep(0.2)


def test_every_sink_receives_the_same_metrics_and_samples(setup, tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    overrides = [
        SINKS,
        "trainer.total_training_steps=2",
        "trainer.log_samples_freq=1",
        "trainer.log_samples=3",
    ]
    RLTrainer(config(setup, run, *overrides)).fit()
    expected = {
        m["step"]: {k: v for k, v in m.items() if k != "step" and v is not None} for m in read_metrics(run)
    }
    assert list(expected) == [1, 2] and len(expected[1]) > 40

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    for step, metrics in expected.items():
        for key, value in metrics.items():
            (logged,) = [e.value for e in events.Scalars(key) if e.step == step]
            assert logged == pytest.approx(value, rel=1e-6, abs=1e-30), key  # stored as float32
    assert {"samples/text_summary", "config/text_summary"} <= set(events.Tags()["tensors"])

    (wandb_file,) = run.glob("wandb/offline-run-*/run-*.wandb")
    history, config_keys = {}, set()
    for record in _complete_wandb_records(wandb_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":  # a name with "/" comes as a one-part nested key; tables as several parts
            items = {i.key or i.nested_key[0]: json.loads(i.value_json) for i in record.history.item
                     if i.key or len(i.nested_key) == 1}  # fmt: skip
            history.setdefault(items["_step"], {}).update(
                {k: v for k, v in items.items() if not k.startswith("_")}
            )
        elif kind in ("config", "run"):  # the config comes with the run record or as an update
            update = record.config.update if kind == "config" else record.run.config.update
            config_keys |= {i.key for i in update}
    for step, metrics in expected.items():
        logged = history[step]
        assert logged.keys() == metrics.keys()
        assert all(math.isclose(logged[k], v, rel_tol=1e-12) for k, v in metrics.items())
    assert {"trainer", "actor", "rollout"} <= config_keys  # the resolved config rides along
    assert list(run.glob("wandb/offline-run-*/files/media/table/samples_*.table.json"))

    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 1, 1, 2, 2, 2]
    assert {"prompt", "response", "score", "advantage", "response_length", "finish_reason"} <= samples[
        0
    ].keys()
    assert len({s["prompt"] for s in samples[:3]}) == 3  # each from a different prompt


def test_unknown_or_missing_sinks_are_named(setup, tmp_path):
    with pytest.raises(UserError, match="unknown sink 'mlflow'"):
        RLTrainer(config(setup, tmp_path / "run", "trainer.logger=[console,mlflow]"))
    with pytest.raises(UserError, match="not installed: pip install no_such_tracker"):
        _require("no_such_tracker", "tensorboard")


def test_console_line_is_plain_off_a_terminal_and_bold_on_one(capsys):
    from hybridflow.tracking.sinks import ConsoleSink

    metrics = {
        "rollout/prompts": 8.0,
        "rollout/responses": 64.0,
        "response_length/mean": 41.7,
        "critic/score/mean": 0.41,
        "critic/score/std": 0.2249,
        "actor/kl_loss": 0.02131,
        "actor/pg_loss": 0.18,
        "critic/vf_loss": 0.42,
        "timing_s/step": 6.12,
        "val-core/gsm8k/acc/mean@1": 0.4,
        "other": 1.0,
    }
    ConsoleSink().log(metrics, 3)  # pytest's captured stdout is no terminal
    ConsoleSink(styled=True).log(metrics, 3)
    ConsoleSink().log({"train/loss": 0.25, "val/loss": 0.3, "train/grad_norm": 0.9, "timing_s/step": 0.08}, 5)
    ConsoleSink().log({"val-core/gsm8k/acc/mean@1": 0.4}, 0)
    plain, styled, offline, validation = capsys.readouterr().out.splitlines()
    assert plain == (
        "[step 3] rollout 8 prompts -> 64 responses (avg len 42) | reward mean 0.41 std 0.225 | kl 0.0213 | "
        "loss actor 0.18 critic 0.42 | 6.12 s | gsm8k/acc/mean@1 0.400"
    )
    assert offline == "[step 5] loss 0.25 | val_loss 0.3 | grad 0.9 | 0.08 s"
    assert validation == "[step 0] gsm8k/acc/mean@1 0.400"
    assert styled.replace("\033[1m", "").replace("\033[0m", "") == plain and "\033[1m" in styled


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bars_on_a_terminal_only(setup, tmp_path, monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    RLTrainer(config(setup, tmp_path / "a", "trainer.total_training_steps=2")).fit()
    drawn = terminal.getvalue()
    assert "steps: 100%" in drawn and "2/2" in drawn  # the step bar, with its count and ETA
    assert "generate:" in drawn and "update:" in drawn  # the transient bars of the long phases
    quiet = _Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    RLTrainer(config(setup, tmp_path / "b", "trainer.total_training_steps=1", "trainer.progress=false")).fit()
    assert "steps:" not in quiet.getvalue() and "generate:" not in quiet.getvalue()


def test_a_torn_last_line_is_dropped_and_history_is_cut_in_place(tmp_path):
    """A full disk or a kill mid-write leaves a last line without its end: a resume drops it (the
    same command resumes once space is freed). Lines past the checkpoint are cut off where they
    start, in one truncate call, so a kill during the resume cannot lose the history before them."""
    import os

    from hybridflow.tracking.sinks import restore_last_row, truncate_jsonl

    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "x": s}) + "\n" for s in (1, 2, 3, 4)]
    path.write_text("".join(rows) + '{"step": 5, "x"')
    inode = os.stat(path).st_ino
    truncate_jsonl(path, 3)
    assert path.read_text() == "".join(rows[:3]) and os.stat(path).st_ino == inode  # cut, not rewritten
    restore_last_row(path, 3, {"step": 3, "x": 3})  # already there: not doubled
    assert path.read_text() == "".join(rows[:3])
    path.write_text("".join(rows[:2]) + '{"step": 3, "x')  # torn before the checkpoint's row was out
    truncate_jsonl(path, 3)
    restore_last_row(path, 3, {"step": 3, "x": 3})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    # lines out of order (not one run's appends): the kept ones go to a new file that replaces it
    path.write_text("".join(rows[:2]) + rows[3] + json.dumps({"step": 0, "val": 1}) + "\n")
    truncate_jsonl(path, 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 0]
    assert not list(tmp_path.glob(".*tmp"))


def test_console_logging_alone_still_writes_the_runs_record(setup, tmp_path):
    """trainer.logger=console (verl's scripts often say so): metrics.jsonl and the report are the
    run directory's record, written whatever the logger list says."""
    trainer = RLTrainer(config(setup, tmp_path / "run", "trainer.logger=[console]", "trainer.total_training_steps=1",
                               "trainer.progress=false", "trainer.val_before_train=false"))  # fmt: skip
    trainer.fit()
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1]
    assert (tmp_path / "run" / "report.html").is_file()
