"""A tiny model learns to use a tool that is the only way to the answer (issue #29's learning test).

The task: answer the hidden digit of the episode (its ground truth). Only the `reveal` tool knows it;
an answer without it is right one time in ten. The model starts from SFT on demonstrations of which
half call the tool (and copy its answer) and half guess: it calls the tool about half the time. GRPO
with `rollout.agent` then raises the rate of (well-formed, successful) tool calls and the reward.

Two choices make this learnable by a 2-layer model in about half a minute on one core: the tool call's
pieces are whole tokens of the tokenizer (a 55-byte call sampled byte by byte at temperature 1 is
rarely well formed), and untied embeddings (with tied ones the copy of the tool's answer was not
learned within 1,000 SFT steps; untied, it is learned in about 500).
"""

import json
import random

import pytest
from rl_run import read_metrics

from hybridflow.config import load_config
from hybridflow.controller.trainer import RLTrainer
from hybridflow.models import byte_tokenizer, tiny_model
from hybridflow.models.export import save_hf
from hybridflow.offline import SFTTrainer

SYSTEM = "Tools: reveal; call as <tool_call>{...}</tool_call>"
# renders the tools as the SFT demonstrations' system turn does: SFT and RL see the same tokens
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n" + SYSTEM + "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL = '<tool_call>{"name": "reveal", "arguments": {}}</tool_call>'
REVEAL = '''from hybridflow.agents.tools import current_sample


def reveal() -> str:
    """Reveal the hidden digit."""
    return current_sample().ground_truth
'''
REWARD = """def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    answer = solution_str.rsplit("</tool_call>", 1)[-1].replace("<|im_end|>", "").strip()
    return float(answer == ground_truth)
"""


def _demonstrations(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        digit = str(rng.randrange(10))
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Digit?"}]
        if rng.random() < 0.5:
            messages += [{"role": "assistant", "content": CALL}, {"role": "tool", "content": digit},
                         {"role": "assistant", "content": digit}]  # fmt: skip
        else:
            messages += [{"role": "assistant", "content": str(rng.randrange(10))}]
        rows.append({"messages": messages})
    return rows


@pytest.mark.slow
def test_grpo_raises_tool_use_where_only_the_tool_knows_the_answer(tmp_path):
    tok = byte_tokenizer()
    tok.chat_template = TEMPLATE
    tok.add_tokens(
        ["<tool_call>", "</tool_call>", '{"name": "reveal", "arguments": {}}', "assistant", "user", "system"]
    )
    save_hf(
        tiny_model("qwen2", seed=0, vocab_size=len(tok), tie_word_embeddings=False), tok, tmp_path / "model"
    )
    (tmp_path / "reveal.py").write_text(REVEAL)
    (tmp_path / "reward.py").write_text(REWARD)
    (tmp_path / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in _demonstrations(16000)))
    prompts = [{"prompt": [{"role": "user", "content": "Digit?"}], "data_source": "hidden",
                "reward_model": {"ground_truth": str(i % 10)}} for i in range(200)]  # fmt: skip
    (tmp_path / "rl.jsonl").write_text("\n".join(json.dumps(r) for r in prompts))
    common = [
        "actor.compute_dtype=float32",
        "trainer.logger=[jsonl]",
        "trainer.progress=false",
    ]
    SFTTrainer(load_config(None, [
        f"model.path={tmp_path / 'model'}", f"data.train_files=[{tmp_path / 'sft.jsonl'}]", "sft.messages_key=messages",
        "sft.batch_size=32", "actor.optim.lr=3e-3", f"trainer.run_dir={tmp_path / 'sft'}",
        "trainer.total_training_steps=500", *common,
    ])).fit()  # fmt: skip
    policy = tmp_path / "sft" / "checkpoints" / "global_step_500" / "policy"
    RLTrainer(load_config(None, [
        f"model.path={policy}", f"data.train_files=[{tmp_path / 'rl.jsonl'}]", "data.max_response_tokens=160",
        "data.prompts_per_step=8", "rollout.samples_per_prompt=8", "rollout.agent.loop=tools",
        f"rollout.agent.tools=[{tmp_path / 'reveal.py'}:reveal]", "rollout.agent.max_turns=2",
        "rollout.agent.max_tokens_per_turn=64", f"reward.custom_function_path={tmp_path / 'reward.py'}",
        "reward.num_workers=0", "actor.optim.lr=1e-3", f"trainer.run_dir={tmp_path / 'rl'}",
        "trainer.total_training_steps=20", "trainer.val_before_train=false", *common,
    ])).fit()  # fmt: skip
    steps = [m for m in read_metrics(tmp_path / "rl") if "agent/episodes" in m]
    calls = [m["agent/tool_calls_mean"] for m in steps]
    reward = [m["critic/score/mean"] for m in steps]
    first, last = sum(calls[:3]) / 3, sum(calls[-3:]) / 3
    first_reward, last_reward = sum(reward[:3]) / 3, sum(reward[-3:]) / 3
    # measured on this 2-core machine (one torch thread): calls 0.53 -> 0.93 a step, reward 0.58 -> 0.90
    # (first three steps -> last three); with the policy loss zeroed calls stay at 0.56 -> 0.57
    assert 0.3 < first < 0.8 and last > 0.85 and last - first > 0.2, calls
    assert last_reward > 0.8 and last_reward - first_reward > 0.2, reward
    assert max(m["agent/tool_failures_mean"] for m in steps) < 0.1  # the calls are well formed and run
    assert all(m["agent/tool_seconds_mean"] < 1.0 for m in steps)
