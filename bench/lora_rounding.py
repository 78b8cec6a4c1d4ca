"""How far apart the trainer's LoRA forward (bf16(W) x + s B (A x)) and the engine's merged weights
(bf16(W + s B A)) put the probabilities of the same tokens, against bf16's own compute noise (each
side against the merged model in fp32). The embedded SmolLM2-135M on this CPU, bf16 autocast, adapters
of rank 32 on every linear layer with B ~ N(0, scale^2) (scale 1e-3: ~100 Adam steps at lr 1e-5),
scored on the model's own greedy continuations (high-probability tokens, as a sharpened policy's);
and the trainer with model.lora_merged_forward (the merged weight, rounded as the engine's is).

    PYTHONPATH=. python bench/lora_rounding.py
"""

from __future__ import annotations

import copy

import torch

from hybridflow.models import load_causal_lm
from hybridflow.models.lora import apply_lora, lora_modules, merged_model
from hybridflow.models.native import from_hf_model
from hybridflow.roles.forward import packed_response_logprobs

QUESTIONS = [
    "What is 17 times 23?",
    "Name three primes above 50.",
    "Write a haiku about rain.",
    "Explain gravity.",
]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    torch.manual_seed(0)
    hf, tokenizer = load_causal_lm("default", dtype="float32")
    base = from_hf_model(hf).eval()
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        for q in QUESTIONS
    ]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    with torch.no_grad():
        responses = [
            hf.generate(torch.tensor([p]), max_new_tokens=48, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]

    def probs(model, dtype: str) -> torch.Tensor:  # [tokens]
        with torch.no_grad():
            logp, _ = packed_response_logprobs(
                model, prompts, responses, device=torch.device("cpu"), compute_dtype=dtype
            )
        return torch.cat([logp[i, : len(r)] for i, r in enumerate(responses)]).exp()

    def gap(a: torch.Tensor, b: torch.Tensor) -> str:
        d = (a - b).abs()
        return f"mean {d.mean():.4f} max {d.max():.4f}"

    for scale in (1e-3, 3e-3):
        lora = copy.deepcopy(base)
        apply_lora(lora, 32, 64, TARGETS)
        generator = torch.Generator().manual_seed(1)
        for name, p in lora.named_parameters():
            if name.endswith("lora_B"):
                p.data = torch.randn(p.shape, generator=generator) * scale
        merged = merged_model(lora)
        exact, trainer, engine = probs(merged, "float32"), probs(lora, "bfloat16"), probs(merged, "bfloat16")
        for m in lora_modules(lora).values():  # model.lora_merged_forward=true
            m.merged_forward = True
        trainer_merged = probs(lora, "bfloat16")
        print(f"B ~ {scale:g}: trainer (LoRA) vs engine (merged), both bf16: {gap(trainer, engine)} | "
              f"trainer with lora_merged_forward vs engine: {gap(trainer_merged, engine)} | "
              f"bf16 noise: trainer {gap(trainer, exact)}, engine {gap(engine, exact)}")  # fmt: skip


if __name__ == "__main__":
    main()
