"""`hybridflow export`: a checkpoint's trained policy as a transformers directory, its weights those
of the sharded actor state, checked by reloading; bad paths and a non-empty --out are refused."""

import pytest
import torch
from rl_run import config
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.cli import main
from hybridflow.controller.trainer import RLTrainer
from hybridflow.errors import UserError
from hybridflow.models.checkpoint_export import export_checkpoint


@pytest.fixture(scope="module")
def trained(setup, tmp_path_factory):
    run = tmp_path_factory.mktemp("export") / "run"
    trainer = RLTrainer(config(setup, run, "model.impl=native", "trainer.total_training_steps=2"))
    trainer.fit()
    return run, {k: v.detach().clone() for k, v in trainer.workers.worker.actor.model.state_dict().items()}


def test_export_holds_the_trained_weights_and_reloads_in_transformers(trained, tmp_path):
    run, weights = trained
    report = export_checkpoint(run, tmp_path / "out")  # a run directory: its latest checkpoint
    assert report.checkpoint == run / "checkpoints" / "global_step_2" and report.max_logit_diff <= 1e-5
    exported = load_file(tmp_path / "out" / "model.safetensors")
    for name, value in weights.items():
        if name in exported:  # a tied head is stored once
            torch.testing.assert_close(exported[name], value, atol=0, rtol=0, msg=name)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.config.model_type == "qwen2"
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer.chat_template and (tmp_path / "out" / "generation_config.json").is_file()


def test_bad_paths_and_a_non_empty_out_are_refused(trained, tmp_path):
    run, _ = trained
    with pytest.raises(UserError, match="neither a checkpoint"):
        export_checkpoint(tmp_path / "nothing", tmp_path / "out")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.md").write_text("mine")
    with pytest.raises(UserError, match="not empty"):
        export_checkpoint(run, tmp_path / "out")
    assert (tmp_path / "out" / "notes.md").read_text() == "mine"


def test_cli_prints_the_check(trained, tmp_path, capsys):
    run, _ = trained
    assert main(["export", str(run / "checkpoints" / "global_step_2"), "--out", str(tmp_path / "cli")]) == 0
    assert "transformers reloads it with the same logits" in capsys.readouterr().out
    assert main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2
    assert "neither a checkpoint" in capsys.readouterr().err
