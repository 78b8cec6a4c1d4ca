"""The real instruct model of ../shared/tools/device-model (Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF)
as a transformers directory in bf16, for GPU runs.

Here (once; loading a tokenizer from the GGUF is slow, the saved one is small enough to carry):
    python bench/real_model.py tokenizer --gguf ~/.cache/hybridflow-assets/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --out .qwen-tok
On the GPU machine, after the pieces are joined into /tmp/model.gguf (needs the gguf wheel):
    python bench/real_model.py model --gguf /tmp/model.gguf --tokenizer .qwen-tok --out /tmp/qwen
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

END_OF_TURN = [151645, 151643]  # <|im_end|> ends an instruct turn; <|endoftext|> the text


def save_tokenizer(gguf: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert tokenizer.chat_template and "<tool_call>" in tokenizer.chat_template, "expected Qwen2.5's template"
    tokenizer.save_pretrained(out)


def save_model(gguf: Path, tokenizer_dir: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from hybridflow.models.export import save_hf

    start = time.time()
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # dequantised already; save_pretrained refuses a "quantised" model
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = GenerationConfig(eos_token_id=END_OF_TURN, pad_token_id=END_OF_TURN[1])
    save_hf(model, AutoTokenizer.from_pretrained(tokenizer_dir), out, overwrite=True)
    print(
        f"{out}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, {time.time() - start:.0f} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["tokenizer", "model"])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.what == "tokenizer":
        save_tokenizer(args.gguf, args.out)
    else:
        save_model(args.gguf, args.tokenizer, args.out)


if __name__ == "__main__":
    main()
