"""SIGTERM / Ctrl-C: the first lets the step finish, saves a checkpoint and exits 0 with how to go
on (and the run then resumes from it); a second one stops at once, leaving only complete checkpoints."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = """
import signal
import sys
from pathlib import Path
signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal gives it (a background job ignores it)
sys.path.insert(0, {tests!r})
from rl_run import config
from hybridflow.controller.trainer import RLTrainer

if __name__ == "__main__":
    RLTrainer(config(Path({setup!r}), Path({run!r}), "trainer.total_training_steps=" + sys.argv[1])).fit()
"""


def _start(setup, run, steps, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent), setup=str(setup), run=str(run)))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    return subprocess.Popen([sys.executable, str(script), str(steps)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip


def _wait_for_steps(run, count, process, timeout=240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = run / "metrics.jsonl"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= count:
            return
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    raise AssertionError("the run did not reach its steps")


def _group_members(pgid: int, wait_s: float) -> list[str]:
    """The command lines of processes still in process group `pgid`, after up to `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        members = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.getpgid(int(pid)) == pgid:
                    members.append(
                        Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
                    )
            except (ProcessLookupError, FileNotFoundError, PermissionError):
                continue
        if not members or time.monotonic() > deadline:
            return members
        time.sleep(0.2)


def _steps(run):
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_sigterm_saves_and_exits_0_then_the_run_resumes(setup, tmp_path):
    run = tmp_path / "run"
    process = _start(setup, run, 1000, tmp_path)
    _wait_for_steps(run, 2, process)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=240)
    assert process.returncode == 0, err
    stopped = _steps(run)[-1]
    assert f"stopped by SIGTERM after step {stopped}" in out and "without --overwrite" in out
    assert (run / "checkpoints" / f"global_step_{stopped}" / "trainer_state.json").is_file()
    process = _start(setup, run, stopped + 2, tmp_path)  # the same run, two steps more
    out, err = process.communicate(timeout=240)
    assert process.returncode == 0, err
    assert _steps(run) == list(range(1, stopped + 3))


def test_a_second_ctrl_c_stops_at_once(setup, tmp_path):
    run = tmp_path / "run"
    process = _start(setup, run, 1000, tmp_path)
    _wait_for_steps(run, 2, process)
    process.send_signal(signal.SIGINT)
    # the second only once the first was handled: two signals pending at once are delivered as one
    for line in process.stdout:
        if "finishing this step" in line:
            break
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=240)
    assert process.returncode != 0 and "KeyboardInterrupt" in err
    assert "stopped by SIGINT" not in out
    for checkpoint in (run / "checkpoints").glob("global_step_*"):
        assert (checkpoint / "trainer_state.json").is_file()  # complete, or not there at all


def test_a_signal_the_process_ignores_stays_ignored():
    """nohup or a background job ignores SIGINT: a run started there must not start answering it."""
    from hybridflow.controller.graceful_stop import GracefulStop

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with GracefulStop():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN  # still caught, to stop cleanly
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_sigterm_to_the_whole_process_group_with_reward_workers(setup, tmp_path):
    """What Slurm and systemd send: SIGTERM to every process of the group, the reward workers too.
    They ignore it (the trainer decides); the step finishes, a checkpoint is saved, exit 0, and no
    worker outlives the run."""
    run = tmp_path / "run"
    script = tmp_path / "train.py"
    script.write_text(
        SCRIPT.format(tests=str(Path(__file__).parent), setup=str(setup), run=str(run)).replace(
            '"trainer.total_training_steps=" + sys.argv[1])',
            '"trainer.total_training_steps=" + sys.argv[1], "reward.num_workers=2")',
        )
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    process = subprocess.Popen([sys.executable, str(script), "1000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env, start_new_session=True)  # fmt: skip
    _wait_for_steps(run, 2, process)
    os.killpg(process.pid, signal.SIGTERM)
    out, err = process.communicate(timeout=240)
    assert process.returncode == 0, err
    stopped = _steps(run)[-1]
    assert f"stopped by SIGTERM after step {stopped}" in out
    assert (run / "checkpoints" / f"global_step_{stopped}" / "trainer_state.json").is_file()
    left = _group_members(process.pid, wait_s=10)
    assert not left, f"processes outlived the run: {left}"
