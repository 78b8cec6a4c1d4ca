"""What a run checks and says at its start and end: resuming another run's checkpoint, a reward
that always fails, GPUs this machine lacks, the LR schedule's unit (training steps, as verl's)."""

import json
import logging

import pytest
from rl_run import config, read_metrics

from hybridflow.controller.trainer import RLTrainer
from hybridflow.errors import UserError
from hybridflow.roles.reward import RewardFunctionFailed

ALWAYS_FAILS = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return [][0]
"""


def test_resume_refuses_another_runs_checkpoint_unless_forced(setup, tmp_path, capsys):
    run = tmp_path / "run"
    RLTrainer(config(setup, run, "trainer.total_training_steps=1")).fit()
    other = tmp_path / "other.jsonl"
    other.write_text((setup / "prompts.jsonl").read_text())
    changed = (
        "trainer.total_training_steps=2",
        f"data.train_files=[{other}]",
        "algorithm.adv_estimator=rloo",
    )
    with pytest.raises(UserError) as e:
        RLTrainer(config(setup, run, *changed))
    message = str(e.value)
    assert "was made by another run" in message and "trainer.resume=force" in message
    assert "data.train_files" in message and "algorithm.adv_estimator: 'grpo' there, 'rloo' now" in message
    trainer = RLTrainer(config(setup, run, *changed, "trainer.resume=force"))
    assert trainer.step == 1  # went on from the checkpoint, as asked
    trainer.close()


def test_a_reward_that_fails_on_every_response_stops_the_run(setup, tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(ALWAYS_FAILS)
    overrides = (f"reward.custom_function_path={reward}", "trainer.total_training_steps=2")
    with pytest.raises(RewardFunctionFailed) as e:
        RLTrainer(config(setup, tmp_path / "run", *overrides)).fit()
    assert "failed on all 32 responses" in str(e.value) and "IndexError: list index out of range" in str(
        e.value
    )
    assert "reward.on_all_errors=warn" in str(e.value)


def test_on_all_errors_warn_goes_on_and_prints_the_first_traceback(setup, tmp_path, caplog):
    reward = tmp_path / "reward.py"
    reward.write_text(ALWAYS_FAILS)
    run = tmp_path / "run"
    overrides = (
        f"reward.custom_function_path={reward}",
        "trainer.total_training_steps=2",
        "reward.on_all_errors=warn",
    )
    with caplog.at_level(logging.WARNING, logger="hybridflow.roles.reward"):
        RLTrainer(config(setup, run, *overrides)).fit()
    warnings = [r.getMessage() for r in caplog.records if "reward function failed" in r.getMessage()]
    assert warnings and "Traceback" in warnings[0] and "IndexError" in warnings[0]
    assert [m["reward/errors"] for m in read_metrics(run)] == [32.0, 32.0]


def test_the_console_line_counts_reward_errors():
    from hybridflow.tracking.sinks import ConsoleSink

    line = ConsoleSink(styled=False).line({"critic/score/mean": 0.0, "reward/errors": 3.0}, 1)
    assert "reward mean 0 (3 errors)" in line


def test_gpus_this_machine_lacks_are_refused_before_any_work(setup, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU machine: the CPU case does not apply")
    with pytest.raises(
        UserError,
        match=r"resources.n_gpus_per_node=8 \(verl: trainer.n_gpus_per_node\) but this machine has 0",
    ):
        RLTrainer(config(setup, tmp_path / "run", "resources.n_gpus_per_node=8"))
    assert not (tmp_path / "run").exists()


def test_warmup_counts_training_steps_whatever_the_mini_batches(setup, tmp_path):
    run = tmp_path / "run"
    overrides = ("trainer.total_training_steps=3", "actor.optim.warmup_steps=2", "actor.sequences_per_update=8",
                 "actor.optim.lr=1e-3")  # fmt: skip
    RLTrainer(config(setup, run, *overrides)).fit()
    rows = read_metrics(run)
    # 4 mini-batches a step; the rate moves once a step: 1/2, then 2/2 of the peak
    assert [r["actor/lr"] for r in rows] == pytest.approx([5e-4, 1e-3, 1e-3])
    assert json.loads((run / "checkpoints" / "global_step_3" / "trainer_state.json").read_text())["step"] == 3


def test_run_ends_with_a_summary(setup, tmp_path, capsys):
    run = tmp_path / "run"
    val = setup / "prompts.jsonl"
    RLTrainer(
        config(
            setup, run, "trainer.total_training_steps=1", f"data.val_files=[{val}]", "data.max_val_prompts=4"
        )
    ).fit()
    out = capsys.readouterr().out
    summary = out[out.index("summary: 1 step(s)") :]
    assert "validation synthetic/reward/mean@1:" in summary and " -> " in summary
    assert f"policy (a transformers directory): {run / 'checkpoints' / 'global_step_1' / 'policy'}" in summary
    assert (
        "each checkpoint costs" in summary
        and "resume state" in summary
        and f"run directory {run}:" in summary
    )


def test_a_second_run_into_the_same_directory_stops_naming_the_first(setup, tmp_path):
    import os

    run = tmp_path / "run"
    first = RLTrainer(config(setup, run, "trainer.total_training_steps=1"))
    with pytest.raises(UserError, match=rf"run directory {run} is in use by the run of pid {os.getpid()}"):
        RLTrainer(config(setup, run, "trainer.total_training_steps=1"))
    first.fit()  # closes, and frees the directory
    RLTrainer(config(setup, run, "trainer.total_training_steps=1")).close()


def test_overwrite_deletes_only_what_hybridflow_wrote(setup, tmp_path):
    run = tmp_path / "run"
    RLTrainer(config(setup, run, "trainer.total_training_steps=1")).fit()
    (run / "checkpoints" / "my_notes.txt").write_text("mine")
    (run / "checkpoints" / "global_step_7").mkdir()  # the user's, named like ours: not in the list
    (run / "checkpoints" / "global_step_7" / "notes.txt").write_text("mine too")
    (run / "inputs").mkdir()
    (run / "inputs" / "my_dataset.jsonl").write_text("{}\n")
    (run / "inputs" / "train.jsonl").write_text("my own train.jsonl\n")
    assert (run / ".hybridflow-written").read_text() == "checkpoints/global_step_1\n"
    RLTrainer(config(setup, run, "trainer.total_training_steps=1"), overwrite=True).close()
    assert not (run / "checkpoints" / "global_step_1").exists() and (run / "metrics.jsonl").read_text() == ""
    assert (run / "checkpoints" / "my_notes.txt").read_text() == "mine"
    assert (run / "checkpoints" / "global_step_7" / "notes.txt").read_text() == "mine too"
    assert (run / "inputs" / "my_dataset.jsonl").read_text() == "{}\n"
    assert (run / "inputs" / "train.jsonl").read_text() == "my own train.jsonl\n"


def test_files_with_our_names_in_a_directory_no_run_started_are_not_replaced(setup, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("my: config\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "mine": 1}\n')
    with pytest.raises(UserError, match="holds config.yaml, metrics.jsonl but no .hybridflow.lock"):
        RLTrainer(config(setup, run, "trainer.total_training_steps=1"))
    assert (run / "config.yaml").read_text() == "my: config\n"
    assert (run / "metrics.jsonl").read_text() == '{"step": 1, "mine": 1}\n'


def test_a_run_directory_from_before_the_written_list_is_trusted_by_name_once(setup, tmp_path):
    """A directory an older hybridflow ran in (lock file, checkpoints, no .hybridflow-written): its
    entries with our names are listed when a run first starts there, so pruning and --overwrite
    still reach them; the user's files beside them stay."""
    run = tmp_path / "run"
    RLTrainer(config(setup, run, "trainer.total_training_steps=1")).fit()
    (run / ".hybridflow-written").unlink()
    (run / "checkpoints" / "notes.txt").write_text("mine")
    RLTrainer(config(setup, run, "trainer.total_training_steps=1"), overwrite=True).close()
    assert not (run / "checkpoints" / "global_step_1").exists()
    assert (run / "checkpoints" / "notes.txt").read_text() == "mine"


@pytest.mark.alone
def test_torchs_threads_follow_the_cores_other_work_leaves_free(monkeypatch):
    """A busy loop on one core takes one of torch's threads (not all of them waiting at every
    barrier); when it ends, the thread comes back. This process's own work is not counted as others'."""
    import subprocess
    import sys
    import time

    import torch

    from hybridflow.devices import FreeCores

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    watcher = FreeCores(every_s=0.0)
    if watcher.cores < 2:
        pytest.skip("needs 2 cores")
    before = torch.get_num_threads()
    try:
        time.sleep(0.5)
        watcher.adjust(force=True)
        if torch.get_num_threads() < watcher.cores:  # something else is running: nothing to compare with
            pytest.skip("the machine is busy with other work")
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(1.0)
            watcher.adjust(force=True)
            assert torch.get_num_threads() == watcher.cores - 1
            end = time.monotonic() + 1.0
            while time.monotonic() < end:  # our own threads busy: still not others' load
                torch.ones(256, 256) @ torch.ones(256, 256)
            watcher.adjust(force=True)
            assert torch.get_num_threads() == watcher.cores - 1
        finally:
            busy.kill()
            busy.wait()
        time.sleep(1.0)
        watcher.adjust(force=True)
        assert torch.get_num_threads() == watcher.cores
    finally:
        torch.set_num_threads(before)


def test_a_run_directory_that_is_a_file_and_a_pickle_as_the_model_are_one_line(setup, tmp_path):
    """trainer.run_dir naming a file, and a pickle at model.path: each one line naming the setting, not
    a NotADirectoryError or a GGUF reader's traceback (the user's file is left as it was)."""
    from hybridflow.cli import main

    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    pickled = tmp_path / "model.pkl"
    pickled.write_bytes(b"\x80\x04K\x01.")
    base = [
        f"model.path={setup / 'model'}",
        f"data.train_files=[{setup / 'prompts.jsonl'}]",
        "trainer.progress=false",
    ]
    assert main(["train", *base, f"trainer.run_dir={taken}"]) == 2
    assert main(["train", *base, f"trainer.run_dir={tmp_path / 'run'}", f"model.path={pickled}"]) == 2
    assert taken.read_text() == "mine"
