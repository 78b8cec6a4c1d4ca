from __future__ import annotations

import json
import shutil
import tempfile

import pytest
import torch
from rl_run import REWARD

from hybridflow.models import byte_tokenizer, save_hf, tiny_model

PEAK_DISK_GB = 10  # the largest test: two checkpoints of the default model's actor and critic


def pytest_report_header(config):
    free = shutil.disk_usage(tempfile.gettempdir()).free / 2**30
    if free < PEAK_DISK_GB:
        return f"WARNING: {free:.1f} GB free under {tempfile.gettempdir()}; the suite needs ~{PEAK_DISK_GB} GB at its peak"
    return None


@pytest.fixture(autouse=True, scope="session")
def _fixed_threads():
    """Every run of the suite with torch's thread count as it started: the start's busy-core check
    (devices.follow_free_cores) would give a run fewer threads while another test process loads the
    machine, and two runs that must agree to the last bit would not. Under pytest-xdist the workers
    share the cores: one worker of two on two cores gets one thread (two each would wait on each
    other's OpenMP barriers)."""
    import os

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
        yield
        return
    if os.environ.get("OMP_NUM_THREADS"):
        yield
        return
    os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    yield
    del os.environ["OMP_NUM_THREADS"]


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """An HF directory holding a tiny random llama and the byte tokenizer."""
    path = tmp_path_factory.mktemp("tiny-llama")
    save_hf(tiny_model("llama", seed=1), byte_tokenizer(), path, overwrite=True)
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    save_hf(tiny_model("qwen2", seed=0), byte_tokenizer(), root / "model")
    rows = [
        {"prompt": f"q{i}", "data_source": "synthetic", "extra_info": {"tag": "RAISE" if i % 16 == 5 else ""}}
        for i in range(64)
    ]
    (root / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (root / "reward.py").write_text(REWARD)
    return root
