"""Shared pieces of the agent tests: a Hermes-style template on the byte tokenizer, typed tools, and a
scripted model whose turns are given texts."""

import asyncio

from hybridflow.agents import Completion
from hybridflow.batch import Prompt
from hybridflow.models import byte_tokenizer

# ChatML with Hermes tool calls (Qwen2.5's shape): tools in the system turn, results as
# <tool_response> blocks in a user turn
HERMES = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | map(attribute='function.name') | join(', ') }}. "
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# ... and one that drops earlier turns' <think> blocks, as Qwen3's does
STRIPS_THINKING = HERMES.replace(
    "{{ m.content }}<|im_end|>\n{% endif %}",
    "{% if m.role == 'assistant' and not loop.last %}{{ m.content.split('</think>')[-1] }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endif %}",
)


def _tokenizer(template=HERMES):
    tok = byte_tokenizer()
    tok.chat_template = template
    return tok


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


async def slow(seconds: float) -> str:
    """Wait, then answer.

    Args:
        seconds: how long to wait
    """
    await asyncio.sleep(seconds)
    return "done"


def crash(x: int) -> int:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError("the tool broke")


class Scripted:
    """A model whose turns are given texts (each ends with <|im_end|>, as a model's turn does)."""

    max_context_tokens = 4096

    def __init__(self, tok, turns):
        self.tok, self.turns, self.seen = tok, list(turns), []

    async def generate(self, token_ids, *, max_tokens, stop_token_ids=()):
        self.seen.append(list(token_ids))
        ids = self.tok.encode(self.turns.pop(0), add_special_tokens=False)[: max_tokens - 1]
        ids = ids + [self.tok.eos_token_id]
        return Completion(ids, [-0.5] * len(ids), "stop", 0)


def _prompt(text="What is 2 + 3?"):
    return Prompt(0, [], "agent", ground_truth="5", messages=[{"role": "user", "content": text}])


def write_guess_game(tmp_path):
    """A tiny qwen2 policy with the Hermes template, and 16 guess_number rows (verl's schema): the
    model directory and the rows file."""
    import json

    from hybridflow.models import tiny_model
    from hybridflow.models.export import save_hf

    save_hf(tiny_model("qwen2", seed=0), _tokenizer(), tmp_path / "model")
    rows = [
        {"prompt": [{"role": "user", "content": f"Guess my number from 1 to 9 ({i})."}], "data_source": "guess",
         "reward_model": {"ground_truth": str(1 + i % 9)}}
        for i in range(16)
    ]  # fmt: skip
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return tmp_path / "model", tmp_path / "rows.jsonl"


class HungEnvironment:
    """An environment whose step never returns (a hung simulator)."""

    def reset(self, sample):
        return "Guess."

    def step(self, action):
        import threading

        threading.Event().wait()
