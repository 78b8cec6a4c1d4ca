"""Checkpoints that cannot surprise: a manifest of sizes and sha256 is checked before resuming (a
damaged checkpoint is skipped for the one before it, never silently used), and a planted pickle in
a checkpoint is refused without running it. Malformed data rows are reported and skipped, or stop
the run at the first."""

import json
import logging
import os
import pickle
import re
from pathlib import Path

import pytest

from hybridflow.checkpoint import latest_checkpoint, load_checkpoint_state, save_checkpoint
from hybridflow.config import DataConfig
from hybridflow.data import load_prompts
from hybridflow.errors import UserError
from hybridflow.models import byte_tokenizer


def _save(run_dir, step):
    def write_models(directory):
        (directory / "actor_state").mkdir()
        (directory / "actor_state" / "weights.bin").write_bytes(bytes(range(256)) * 64)

    return save_checkpoint(run_dir, step, write_models=write_models, optim_state={"lr": 1.0},
                           trainer_state={"step": step}, config_yaml="a: 1\n", keep_last=3)  # fmt: skip


def test_a_damaged_checkpoint_is_skipped_for_the_one_before_it(tmp_path, caplog):
    first, second = _save(tmp_path, 1), _save(tmp_path, 2)
    assert latest_checkpoint(tmp_path) == second
    weights = second / "actor_state" / "weights.bin"
    data = bytearray(weights.read_bytes())
    data[100] ^= 1  # one flipped bit, same size
    weights.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint(tmp_path) == first
    assert (
        "global_step_2" in caplog.text and "actor_state/weights.bin does not match its sha256" in caplog.text
    )
    assert weights.exists()  # kept for the user to look at
    (first / "optim.pt").write_bytes(b"short")
    with pytest.raises(UserError, match="every checkpoint .* is damaged .*weights.bin"):
        latest_checkpoint(tmp_path)


def test_a_missing_or_truncated_file_is_named(tmp_path, caplog):
    _save(tmp_path, 1)
    second = _save(tmp_path, 2)
    os.remove(second / "config.yaml")
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint(tmp_path).name == "global_step_1"
    assert "config.yaml is missing" in caplog.text


@pytest.mark.parametrize(
    "manifest, problem",
    [
        (None, "it has no manifest.json, so its files cannot be verified"),
        ("{}", "manifest.json lists no files"),
        ("[1, 2]", "manifest.json is malformed"),
        ('{"optim.pt": {"bytes": "many"}}', "manifest.json is malformed"),
        ("{not json", "manifest.json unreadable"),
    ],
)
def test_a_checkpoint_that_cannot_be_verified_is_skipped_unless_asked(tmp_path, caplog, manifest, problem):
    first, second = _save(tmp_path, 1), _save(tmp_path, 2)
    if manifest is None:
        os.remove(second / "manifest.json")
    else:
        (second / "manifest.json").write_text(manifest)
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint(tmp_path) == first
    assert problem in caplog.text
    assert latest_checkpoint(tmp_path, unverified=True) == second  # trainer.resume_unverified=true


def test_a_file_the_manifest_does_not_list_is_named(tmp_path, caplog):
    first, second = _save(tmp_path, 1), _save(tmp_path, 2)
    (second / "actor_state" / "extra.pt").write_bytes(b"planted")
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint(tmp_path) == first
    assert "actor_state/extra.pt is not in its manifest.json" in caplog.text


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_planted_pickle_is_refused_not_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    checkpoint = _save(tmp_path, 1)
    (checkpoint / "optim.pt").write_bytes(pickle.dumps({"lr": _Payload()}))
    with pytest.raises(UserError, match="optim.pt holds more than tensors"):
        load_checkpoint_state(checkpoint)
    assert not (tmp_path / "PWNED").exists()


class _ByGetattr:
    """Pickles as getattr(target, name), as Python 3.11.2 pickles an enum member."""

    def __init__(self, target, name):
        self.target, self.name = target, name

    def __reduce__(self):
        return (getattr, (self.target, self.name))


def test_checkpoint_metadata_takes_enum_members_pickled_by_getattr_and_nothing_else(tmp_path):
    """DCP's .metadata names its memory-format enum; Python 3.11.2 (Debian's python3, an ordinary
    user's venv) pickles it as getattr(_MEM_FORMAT_ENCODING, name): every resume was refused there."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from hybridflow.parallel.checkpoint import check_metadata

    (tmp_path / ".metadata").write_bytes(
        pickle.dumps([_ByGetattr(_MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT")])
    )
    check_metadata(tmp_path)
    from pathlib import PosixPath

    for planted in (_ByGetattr(PosixPath, "cwd"), _ByGetattr(_MEM_FORMAT_ENCODING, "__class__")):
        (tmp_path / ".metadata").write_bytes(pickle.dumps([planted]))
        with pytest.raises(UserError, match="refused, not loaded"):
            check_metadata(tmp_path)


def _bad_file(tmp_path):
    good = {"prompt": "ok", "reward_model": {"ground_truth": "1"}}
    lines = [
        json.dumps(good).encode(),
        json.dumps({"question": "x"}).encode(),  # row 1: no prompt column
        json.dumps({"prompt": 7, "reward_model": {"ground_truth": "1"}}).encode(),  # row 2: wrong type
        json.dumps({"prompt": "  ", "reward_model": {"ground_truth": "1"}}).encode(),  # row 3: empty
        b'{"prompt": "caf\xe9"}',  # line 5: not UTF-8
        json.dumps({"prompt": "no answer"}).encode(),  # row 4: no ground truth
        json.dumps(
            {"prompt": "x" * 500, "reward_model": {"ground_truth": "1"}}
        ).encode(),  # overlong: filtered
        json.dumps(good).encode(),
    ]
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.mark.parametrize("cached", [False, True])
def test_bad_rows_are_reported_and_skipped_or_stop_at_the_first(tmp_path, caplog, cached):
    path = _bad_file(tmp_path)
    tok = byte_tokenizer()
    cache = tmp_path / "cache" if cached else None
    with pytest.raises(UserError, match=r"bad.jsonl:5: not valid UTF-8 JSON"):
        load_prompts([str(path)], tok, DataConfig(max_prompt_tokens=100), cache_root=cache)
    skip = DataConfig(max_prompt_tokens=100, on_bad_row="skip", apply_chat_template=False, data_source="math")
    for _ in range(2 if cached else 1):  # the second load reads the cache and reports again
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            prompts = load_prompts(
                [str(path)], tok, skip, cache_root=cache, truth_sources=frozenset({"math"})
            )
        assert [p.text for p in prompts] == ["ok", "ok"]
        report = caplog.text
        assert "skipped 5 bad rows of 8" in report
        for reason in ("line 5: not valid UTF-8 JSON", "row 1: has no 'prompt' key", "row 2: 'prompt' must be",
                       "row 3: 'prompt' is an empty string", "row 4: no ground truth"):  # fmt: skip
            assert reason in report, (reason, report)
        assert "filtered 1 of 7 prompts longer than data.max_prompt_tokens=100" in report


HOSTILE = [
    "x" * 1_000_000 + " #### 2",  # a megabyte of text
    "\u202e#### 2\u202c\u200b\ufeff",  # bidi override, zero-width space, BOM
    "\x00\x07\x1b[31m#### 2\x1b[0m",  # NUL, bell, terminal escapes
    "🤖" * 1000 + "\\boxed{2}",
    "\ud800 lone surrogate #### 2",
    "e\u0301" * 5000,  # combining accents
]


@pytest.mark.slow
def test_hostile_responses_do_not_break_scoring_logging_or_the_report(tmp_path):
    import time

    from hybridflow.config.schema import RewardConfig
    from hybridflow.report import write_report
    from hybridflow.rewards.executor import RewardExecutor
    from hybridflow.rewards.loading import builtin_function
    from hybridflow.tracking.samples import append_samples

    executor = RewardExecutor(builtin_function, num_workers=1, timeout_s=5.0,
                              options={"guards": True, "max_response_chars": RewardConfig().max_response_chars})  # fmt: skip
    items = [(source, text, "2", {}) for source in ("openai/gsm8k", "math", "arithmetic") for text in HOSTILE]
    start = time.perf_counter()
    outcomes = executor.score(items)
    executor.close()
    assert len(outcomes) == len(items) and time.perf_counter() - start < 60
    assert all(o.score in (0.0, 1.0) for o in outcomes)
    assert outcomes[0].score == 0.0  # a megabyte-long answer earns nothing under the guards

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "critic/score/mean": 0.5}) + "\n")
    rows = [{"step": 1, "data_source": "math", "prompt": "p\u202e", "response": text, "score": 0.0, "advantage": 0.0,
             "response_length": len(text), "finish_reason": "length"} for text in HOSTILE]  # fmt: skip
    append_samples(run / "samples.jsonl", rows)
    lines = (run / "samples.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["response"] for line in lines] == HOSTILE
    page = write_report([run]).read_text(encoding="utf-8")
    assert "lone surrogate" in page and "\x1b" not in page and "\u202e#### 2" not in page


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


@pytest.mark.trials
def test_a_long_run_keeps_memory_and_open_files_flat(setup, tmp_path):
    """300 steps of a tiny run: host memory and open files after step 300 stay where they were at
    step 50 (within allocator noise), so a days-long run does not creep."""
    from rl_run import config

    from hybridflow.controller.trainer import RLTrainer

    trainer = RLTrainer(config(setup, tmp_path, "trainer.total_training_steps=300", "data.prompts_per_step=2",
                               "rollout.samples_per_prompt=2", "data.max_response_tokens=4",
                               "trainer.log_samples_freq=25", "trainer.progress=false",
                               # the synthetic reward raises on 1 prompt in 16: a step can draw only those
                               "reward.on_all_errors=warn"))  # fmt: skip
    trainer.fit(50, close=False)
    rss, fds = _rss_mb(), len(os.listdir("/proc/self/fd"))
    trainer.fit(300, close=False)
    grown, fds_after = _rss_mb() - rss, len(os.listdir("/proc/self/fd"))
    trainer.close()
    assert trainer.step == 300
    assert grown < 40, f"RSS grew {grown:.1f} MB over 250 steps"
    assert fds_after <= fds + 2, (fds, fds_after)


def test_planted_pickles_in_sharded_state_are_refused_not_run(tmp_path, monkeypatch):
    """DCP unpickles its .metadata and loads non-tensor items with weights_only=False: a payload in
    either is refused before it could run, and an honest checkpoint still round-trips."""
    import torch

    from hybridflow.parallel.checkpoint import load_model_weights, load_sharded, save_sharded

    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    save_sharded(model, optimizer, tmp_path / "state")
    fresh = torch.nn.Linear(3, 2)
    load_sharded(fresh, torch.optim.AdamW(fresh.parameters()), tmp_path / "state")
    assert torch.equal(fresh.weight, model.weight)
    (tmp_path / "state" / ".metadata").write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(UserError, match=r"\.metadata: refused, not loaded"):
        load_model_weights(tmp_path / "state", dict(model.state_dict()))
    with pytest.raises(UserError, match=r"\.metadata: refused"):
        load_sharded(fresh, torch.optim.AdamW(fresh.parameters()), tmp_path / "state")
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("writer", ["os", "safetensors", "torch.save"])
def test_a_save_that_fails_half_way_says_why_and_keeps_the_previous_checkpoint(tmp_path, writer):
    """Each writer says a full disk its own way (an OSError; safetensors' SafetensorError; torch.save's
    RuntimeError over the OSError): one line, the previous checkpoint named intact."""
    import errno

    first = _save(tmp_path, 1)

    def disk_fills(directory):
        (directory / "actor_state").mkdir()
        (directory / "actor_state" / "part").write_bytes(b"x" * 1000)
        full = OSError(errno.ENOSPC, "No space left on device", str(directory / "actor_state" / "part"))
        if writer == "os":
            raise full
        if writer == "safetensors":
            raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")
        raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0") from full

    with pytest.raises(
        UserError,
        match=r"global_step_2 could not be written .*No space left on device.*global_step_1 is intact",
    ):
        save_checkpoint(tmp_path, 2, write_models=disk_fills, optim_state={}, trainer_state={"step": 2},
                        config_yaml="", keep_last=1)  # fmt: skip
    assert latest_checkpoint(tmp_path) == first  # complete, verified, and the only one
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["global_step_1"]
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("a user's file")
    with pytest.raises(UserError, match="cannot create .*file-not-dir/checkpoints"):
        _save(blocked, 1)
    assert blocked.read_text() == "a user's file"


def test_keep_last_deletes_only_the_runs_own_checkpoints(tmp_path):
    notes = tmp_path / "checkpoints" / "my-notes"
    notes.mkdir(parents=True)
    (notes / "keep.txt").write_text("mine")
    theirs = tmp_path / "checkpoints" / "global_step_0"  # named like ours, complete-looking, not ours
    theirs.mkdir()
    (theirs / "trainer_state.json").write_text("{}")
    for step in (1, 2, 3, 4, 5):
        _save(tmp_path, step)  # keep_last=3
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["global_step_0", "global_step_3", "global_step_4", "global_step_5", "my-notes"]
    assert (notes / "keep.txt").read_text() == "mine" and (theirs / "trainer_state.json").read_text() == "{}"
    assert (tmp_path / ".hybridflow-written").read_text().split() == [
        f"checkpoints/global_step_{s}" for s in (3, 4, 5)
    ]


DIES_IN_SAVE = """
import os, sys
from pathlib import Path
from hybridflow.checkpoint import save_checkpoint

made = []

def kill_right_after_the_folder_exists(event, args):  # the audit event after its mkdir
    if made:
        os._exit(9)
    if event == "os.mkdir" and ".tmp-global_step_2-" in os.fspath(args[0]):
        made.append(args[0])

sys.addaudithook(kill_right_after_the_folder_exists)
save_checkpoint(Path(sys.argv[1]), 2, write_models=print, optim_state={}, trainer_state={}, config_yaml="",
                keep_last=3)
"""


def test_a_save_killed_the_moment_its_folder_exists_is_cleaned_by_the_next(tmp_path):
    import subprocess
    import sys

    _save(tmp_path, 1)
    died = subprocess.run([sys.executable, "-c", DIES_IN_SAVE, str(tmp_path)], capture_output=True, text=True)
    assert died.returncode == 9, died.stderr
    [leftover] = (tmp_path / "checkpoints").glob(".tmp-global_step_2-*")
    assert f"checkpoints/{leftover.name}" in (tmp_path / ".hybridflow-written").read_text().split()
    _save(tmp_path, 2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["global_step_1", "global_step_2"]
    assert (tmp_path / ".hybridflow-written").read_text().split() == ["checkpoints/global_step_1",
                                                                    "checkpoints/global_step_2"]  # fmt: skip


KILLED_SCRIPT = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from rl_run import config
from hybridflow.controller.trainer import RLTrainer

if __name__ == "__main__":
    RLTrainer(config(Path({setup!r}), Path({run!r}), "trainer.total_training_steps=5", "trainer.save_freq=1")).fit()
"""
COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "response_length/mean")


def _start_run(setup, run, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "train.py"
    script.write_text(KILLED_SCRIPT.format(tests=str(Path(__file__).parent), setup=str(setup), run=str(run)))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)  # fmt: skip


def _wait(condition, process, timeout=240):
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the moment to kill never came"
        time.sleep(0.001)


def test_a_kill_between_a_save_and_its_metrics_leaves_no_step_missing(setup, tmp_path):
    """Found by the SIGKILL trial: a run killed after checkpoint N was written but before step N's
    metrics were logged resumed at N + 1 with no row for N. The checkpoint now keeps the row."""
    from rl_run import config, read_metrics

    from hybridflow.controller.trainer import RLTrainer

    settings = ("trainer.total_training_steps=3", "trainer.save_freq=1", "trainer.progress=false")
    RLTrainer(config(setup, tmp_path, *settings)).fit(max_steps=2)
    rows = read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:-1]))  # killed there
    RLTrainer(config(setup, tmp_path, *settings)).fit()
    after = read_metrics(tmp_path)
    assert [r["step"] for r in after] == [1, 2, 3]
    assert after[1] == {k: v for k, v in rows[1].items() if k != "timing_s/save_checkpoint"}


@pytest.mark.trials
def test_sigkill_anywhere_then_resume_ends_as_the_uninterrupted_run(setup, tmp_path, monkeypatch, request):
    """SIGKILL (no handler can run) while a checkpoint is half-written, then twice more at random
    moments of later steps; each time the same command resumes from the latest complete checkpoint,
    and the run ends with the uninterrupted run's metrics and weights (CPU, fixed seed). Every run
    uses the same torch thread count: left to the start's busy-core check, a loaded machine gives
    one run fewer threads, and results then differ in the last bits."""
    import random
    import signal
    import time

    import torch

    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    monkeypatch.setenv("OMP_NUM_THREADS", str(threads))  # the subprocesses' start, and no busy-core check
    before = torch.get_num_threads()
    request.addfinalizer(lambda: torch.set_num_threads(before))
    torch.set_num_threads(threads)
    from rl_run import config, read_metrics
    from safetensors.torch import load_file

    from hybridflow.controller.trainer import RLTrainer

    straight = tmp_path / "straight"
    RLTrainer(config(setup, straight, "trainer.total_training_steps=5", "trainer.save_freq=1")).fit()
    run = tmp_path / "killed"
    metrics = run / "metrics.jsonl"
    process = _start_run(setup, run, tmp_path)  # killed while its second checkpoint is being written
    _wait(lambda: any((run / "checkpoints").glob(".tmp-global_step_2-*")), process)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert latest_checkpoint(run).name == "global_step_1"  # the half-written one is never picked up
    rng = random.Random(0)
    for done in (2, 3):  # resumed, then killed at a random moment after step `done` was logged
        process = _start_run(setup, run, tmp_path)
        _wait(lambda n=done: metrics.is_file() and metrics.read_text().count("\n") >= n, process)
        time.sleep(rng.uniform(0.0, 0.3))  # in generation, update or a save
        process.send_signal(signal.SIGKILL)
        process.wait()
    out, err = _start_run(setup, run, tmp_path).communicate(timeout=240)
    assert "Traceback" not in err, err
    rows = read_metrics(run)
    assert [m["step"] for m in rows] == [1, 2, 3, 4, 5]
    expected = read_metrics(straight)[-1]
    for key in COMPARED:
        assert rows[-1][key] == pytest.approx(expected[key], rel=1e-6, abs=1e-9), key
    final = "checkpoints/global_step_5/policy/model.safetensors"
    a, b = load_file(straight / final), load_file(run / final)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not list((run / "checkpoints").glob(".tmp-*"))  # what the killed save left is gone


def test_a_kill_while_the_written_list_is_rewritten_does_not_block_the_resume(tmp_path):
    from hybridflow.controller.run_dir import LOCK, check_run_dir

    _save(tmp_path, 1)
    (tmp_path / LOCK).write_text("")
    (tmp_path / ".hybridflow-written.tmp").write_text("checkpoints/glob")  # half a rewrite, killed
    check_run_dir(tmp_path, resume="auto", overwrite=False)  # resumable, not "files it did not write"
    _save(tmp_path, 2)
    assert not (tmp_path / ".hybridflow-written.tmp").exists()


@pytest.mark.slow
def test_a_disk_that_fills_mid_run_stops_in_one_line_and_the_same_command_resumes(setup, tmp_path):
    """A real small disk (a tmpfs in a mount namespace of the test's own): the run stops at the save
    that does not fit with one line naming the intact checkpoint (exit 2); once there is room, the
    same command resumes from it and finishes."""
    import os
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    disk = tmp_path / "disk"
    disk.mkdir()
    train = [
        sys.executable, "-m", "hybridflow.cli", "train", f"model.path={setup / 'model'}",
        f"data.train_files=[{setup / 'prompts.jsonl'}]", "data.max_response_tokens=8", "data.prompts_per_step=8",
        "rollout.samples_per_prompt=2", "actor.compute_dtype=float32", f"reward.custom_function_path={setup / 'reward.py'}",
        "reward.num_workers=0", f"trainer.run_dir={disk / 'run'}", "trainer.total_training_steps=3",
        "trainer.save_freq=1", "trainer.progress=false", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
    ]  # fmt: skip
    command = " ".join(f"'{a}'" for a in train)
    script = f"""
        set -u
        mount -t tmpfs -o size=2600k tmpfs {disk}
        {command} > {tmp_path}/first.out 2> {tmp_path}/first.err; echo $? > {tmp_path}/first.rc
        mount -o remount,size=64m {disk}
        {command} > {tmp_path}/second.out 2> {tmp_path}/second.err; echo $? > {tmp_path}/second.rc
        ls {disk}/run/checkpoints > {tmp_path}/kept
    """
    userns = [] if os.geteuid() == 0 else ["--map-root-user"]
    done = subprocess.run(["unshare", "--mount", *userns, "sh", "-c", script], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})  # fmt: skip
    if done.returncode != 0 and "Operation not permitted" in done.stderr:
        pytest.skip(f"no mount namespace here: {done.stderr.strip()}")
    first_err = (tmp_path / "first.err").read_text().strip().splitlines()
    assert (tmp_path / "first.rc").read_text().strip() == "2", first_err[-5:]
    assert re.search(
        r"hybridflow: error: .*(No space left on device|are free).*global_step_1 is intact", first_err[-1]
    )
    assert (tmp_path / "second.rc").read_text().strip() == "0", (tmp_path / "second.err").read_text()[-2000:]
    assert "resumed from" in (tmp_path / "second.out").read_text()
    assert (tmp_path / "kept").read_text().split() == ["global_step_3"]


def test_files_a_run_rewrites_are_whole_or_as_they_were(tmp_path, monkeypatch):
    """config.yaml, step_plan.txt, report.html, the written list: rewritten beside the file and renamed
    over it. A failure (a kill, a full disk) before the rename leaves the old file whole, and what it
    leaves beside it does not make the run directory look like someone else's."""
    from hybridflow.controller.run_dir import LOCK, check_run_dir
    from hybridflow.run_manifest import write_text_atomic

    path = tmp_path / "config.yaml"
    write_text_atomic(path, "lr: 1\n")

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("hybridflow.run_manifest.os.replace", full_disk)
    with pytest.raises(OSError):
        write_text_atomic(path, "lr: 2\n")
    assert path.read_text() == "lr: 1\n" and not (tmp_path / ".config.yaml.tmp").exists()
    monkeypatch.undo()
    (tmp_path / LOCK).write_text("")
    (tmp_path / ".config.yaml.tmp").write_text("lr: ")  # what a kill between write and rename leaves
    check_run_dir(tmp_path, resume="auto", overwrite=False)
