import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.errors import UserError
from hybridflow.models import byte_tokenizer, load_causal_lm, save_hf, tiny_model
from hybridflow.models.tiny import FAMILIES


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_byte_tokenizer_round_trips_any_text():
    tok = byte_tokenizer()
    text = "héllo 12+3=15 ✓\n"
    ids = tok(text)["input_ids"]
    assert ids[:5] == [104, 195, 169, 108, 108]  # raw UTF-8 bytes
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_reloads_in_transformers_with_identical_logits(family, tmp_path):
    model, tok = tiny_model(family, seed=3), byte_tokenizer()
    save_hf(model, tok, tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = tok("12 + 7 = ?")["input_ids"]
    assert torch.equal(_logits(model, ids), _logits(reloaded, ids))
    assert AutoTokenizer.from_pretrained(tmp_path)("12 + 7 = ?")["input_ids"] == ids
    # and through our own loader
    ours, ours_tok = load_causal_lm(str(tmp_path))
    assert torch.equal(_logits(ours, ids), _logits(model, ids))
    assert ours_tok.pad_token is not None


def test_generation_stops_at_every_eos_of_the_generation_config(tmp_path):
    """A model whose generation_config names several EOS ids (Qwen2.5-Instruct: <|im_end|> and
    <|endoftext|>) stops at any of them in our engine, as in transformers' generate."""
    from hybridflow.engine import Engine, EngineConfig
    from hybridflow.models import stop_token_ids
    from hybridflow.rollout.hf import HFBackend
    from hybridflow.rollout.sampling import SamplingParams

    hf, tok = tiny_model("qwen2", seed=4), byte_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=12)
    reference = HFBackend(hf, pad_token_id=0, eos_token_ids=[tok.eos_token_id])
    tokens = reference.generate([[5, 9, 200]], greedy)[0].token_ids
    assert len(tokens) == 12  # the tokenizer's EOS alone: no stop
    hf.generation_config.eos_token_id = [tok.eos_token_id, tokens[0]]
    save_hf(hf, tok, tmp_path / "m")
    for impl in ("native", "hf"):
        model, tok = load_causal_lm(str(tmp_path / "m"), impl=impl)
        assert stop_token_ids(model, tok) == [tok.eos_token_id, tokens[0]]
    native, tok = load_causal_lm(str(tmp_path / "m"), impl="native")
    config = EngineConfig(page_size=4, max_context_tokens=64)
    engine = Engine(native, eos_token_ids=stop_token_ids(native, tok), config=config)
    out = engine.generate([[5, 9, 200]], greedy)[0]
    assert out.token_ids == tokens[:1] and out.finish_reason == "stop"


def test_export_refuses_non_empty_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty"):
        save_hf(tiny_model(), byte_tokenizer(), tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_same_seed_same_weights():
    a, b = tiny_model("qwen2", seed=5), tiny_model("qwen2", seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_bad_model_paths(tmp_path):
    with pytest.raises(UserError, match="model path not found"):
        load_causal_lm(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match="has no weights"):
        load_causal_lm(str(tmp_path))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(UserError, match="is not a .gguf file"):
        load_causal_lm(str(other))


def test_gguf_of_unsupported_architecture_is_refused(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "odd.gguf"
    writer = GGUFWriter(str(path), "not-a-real-arch")
    writer.add_tensor("w", np.zeros((2, 2), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UserError, match="architecture 'not-a-real-arch', which transformers cannot load"):
        load_causal_lm(str(path))


def test_unknown_tiny_family():
    with pytest.raises(UserError, match="unknown tiny model family 'gpt9'"):
        tiny_model("gpt9")


@pytest.mark.slow
def test_default_model_loads_from_gguf_and_exports_same_tokens(tmp_path):
    from hybridflow.models.default import default_model_dir

    model, tok = load_causal_lm("default")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (default_model_dir() / "model.safetensors").is_file()  # cached for the next load
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(ids, add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    save_hf(model, tok, tmp_path / "export")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert torch.equal(reloaded.generate(ids, max_new_tokens=12, do_sample=False), out)
    assert "5" in tok.decode(out[0, ids.shape[1] :])


def _custom_code_model(directory):
    """A model directory with its own Python code (config.json's auto_map), as many hub models have."""
    import json

    from hybridflow.models import byte_tokenizer, save_hf, tiny_model

    save_hf(tiny_model("llama", seed=2), byte_tokenizer(), directory, overwrite=True)
    (directory / "configuration_custom.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass CustomConfig(LlamaConfig):\n    model_type = 'hf_custom_llama'\n"
    )
    (directory / "modeling_custom.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_custom import CustomConfig\n\n\n"
        "class CustomForCausalLM(LlamaForCausalLM):\n    config_class = CustomConfig\n"
    )
    config = json.loads((directory / "config.json").read_text())
    config |= {"model_type": "hf_custom_llama", "architectures": ["CustomForCausalLM"],
               "auto_map": {"AutoConfig": "configuration_custom.CustomConfig",
                            "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}}  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_model_trust_remote_code_reaches_every_load_of_a_run(tmp_path):
    """model.trust_remote_code is honoured by the one function every role loads through: without it
    a model with its own code is refused in one line naming the setting; with it an SFT run trains."""
    from hybridflow.config import load_config
    from hybridflow.errors import UserError
    from hybridflow.models.loading import load_model, load_model_config
    from hybridflow.offline import SFTTrainer

    path = _custom_code_model(tmp_path / "custom")
    rows = tmp_path / "sft.jsonl"
    rows.write_text("\n".join(f'{{"prompt": "q{i}", "response": "a{i}"}}' for i in range(8)))
    base = [f"model.path={path}", f"data.train_files=[{rows}]", "sft.batch_size=4", "trainer.total_training_steps=1",
            f"trainer.run_dir={tmp_path / 'run'}", "trainer.logger=[jsonl]", "actor.compute_dtype=float32"]  # fmt: skip
    with pytest.raises(UserError, match="holds its own Python code .* model.trust_remote_code=true"):
        load_model(load_config(None, base).model)
    trusted = load_config(None, [*base, "model.trust_remote_code=true"])
    model, _ = load_model(trusted.model)
    assert type(model).__name__ == "CustomForCausalLM"
    assert load_model_config(trusted.model).model_type == "hf_custom_llama"
    SFTTrainer(trusted).fit()
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count('"step": 1') == 1
