"""A stuck phase becomes an error naming the phase, with every thread's stack written down."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from rl_run import config

from hybridflow.controller.watchdog import EXIT_STUCK, PhaseStuck, Watchdog


def waiting_for_a_reply_that_never_comes():
    time.sleep(30)


def test_a_phase_past_its_limit_raises_naming_it_and_writes_the_stacks(tmp_path):
    start = time.monotonic()
    with pytest.raises(PhaseStuck) as stuck, Watchdog(0.5, tmp_path, poll_s=0.05) as dog:
        dog.step = 7
        with dog.phase("gen"), dog.phase("reward"):
            waiting_for_a_reply_that_never_comes()
    assert time.monotonic() - start < 3
    message = str(stuck.value)
    assert message.startswith("step 7: phase reward (in gen) has run") and "trainer.watchdog_s=0.5" in message
    stacks = (tmp_path / "stacks-step7.txt").read_text()
    assert "waiting_for_a_reply_that_never_comes" in stacks and str(tmp_path / "stacks-step7.txt") in message


def test_phases_within_their_limit_and_a_disabled_watchdog_do_nothing(tmp_path):
    with Watchdog(1.0, tmp_path, poll_s=0.05) as dog:
        for _ in range(4):
            with dog.phase("update_actor"):
                time.sleep(0.4)  # 1.6 s in all, each phase under its limit
    with Watchdog(0, tmp_path) as off, off.phase("gen"):
        time.sleep(0.2)
    assert not list(tmp_path.iterdir())


def test_a_main_thread_that_cannot_be_interrupted_is_ended_with_the_line(tmp_path):
    """Signals blocked (as a reward may do), a C-level wait: past the grace period, exit status 3."""
    program = textwrap.dedent(f"""
        import signal, time
        from pathlib import Path
        from hybridflow.controller.watchdog import Watchdog
        with Watchdog(0.5, Path({str(tmp_path)!r}), grace_s=1.0, poll_s=0.05) as dog, dog.phase("validation"):
            signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.Signals))
            time.sleep(30)
    """)
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert run.returncode == EXIT_STUCK and time.monotonic() - start < 20
    assert "step 0: phase validation has run" in run.stderr and "did not stop within 1 s" in run.stderr


HANGING_REWARD = """
import signal, time
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # its own deadline cannot reach it
    time.sleep(120)
    return 0.0
"""


def test_a_run_whose_in_process_reward_ignores_its_alarm_stops_naming_the_reward_phase(setup, tmp_path):
    (tmp_path / "hang.py").write_text(HANGING_REWARD)
    run_dir = tmp_path / "run"
    overrides = [
        f"reward.custom_function_path={tmp_path / 'hang.py'}",
        "trainer.watchdog_s=4",
        "trainer.val_before_train=false",
    ]
    cfg = config(setup, run_dir, *overrides)
    from hybridflow.config import to_yaml

    (tmp_path / "run.yaml").write_text(to_yaml(cfg))
    start = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    run = subprocess.run(
        [sys.executable, "-m", "hybridflow.cli", "train", str(tmp_path / "run.yaml")],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert run.returncode == EXIT_STUCK, run.stderr[-3000:]
    assert time.monotonic() - start < 200
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("hybridflow: error: step 1: phase reward (in step > gen) has run"), last
    assert "compute_score" in (run_dir / "stacks-step1.txt").read_text()
