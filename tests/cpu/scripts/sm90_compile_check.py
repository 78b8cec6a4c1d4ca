"""Run under TRITON_INTERPRET=1: the interpreter runs kernels that the GPU's compiler may refuse, so
every Triton kernel of hybridflow that a small workload launches here (the exact trainer's forward
and backward, the exact and the fused engines' generation, the matmul's forms) is recorded with the
argument types and constants of each of its launches, then compiled for an H100 (sm_90) by
`triton.compile` in a second process without the interpreter: no GPU needed. Prints one line per
kernel; exits non-zero where one does not compile, or where a kernel of these modules was not launched
(a kernel this workload does not reach is a gap in the check, named)."""

import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def kernel_modules() -> list[str]:
    """hybridflow's modules that define Triton kernels (found by their source: a new one is checked
    without a list to keep)."""
    import hybridflow

    root = Path(hybridflow.__file__).parent
    return sorted(
        ".".join(("hybridflow", *path.relative_to(root).with_suffix("").parts))
        for path in root.rglob("*.py")
        if "@triton.jit" in path.read_text()
    )


def kernels(module) -> dict:
    """The module's launched kernels: its jit functions that its source launches as `name[grid]`."""
    source = inspect.getsource(module)
    launched = set(re.findall(r"\b(\w+)\[", source))
    return {
        name: fn
        for name, fn in vars(module).items()
        if name in launched and hasattr(fn, "add_pre_run_hook") and fn.fn.__module__ == module.__name__
    }


def record() -> tuple[list, list]:
    """-> the kernels expected (module, name), and every launch's (module, kernel, signature,
    constants) while the workload runs, distinct."""
    import torch
    from triton.runtime.jit import mangle_type

    launches: set[str] = set()
    expected = []
    for module_name in kernel_modules():
        module = importlib.import_module(module_name)
        for name, fn in kernels(module).items():
            expected.append((module_name, name))
            params = inspect.signature(fn.fn).parameters
            constant = {p for p, v in params.items() if "constexpr" in str(v.annotation)}

            def hook(*args, _fn=fn, _name=name, _module=module_name, _constant=constant, **kwargs):
                bound = inspect.signature(_fn.fn).bind(*args, **kwargs)
                signature, constants = {}, {}
                for arg, value in bound.arguments.items():
                    value = getattr(value, "value", value)  # (a tl.constexpr)
                    if arg in _constant or value is None:
                        signature[arg], constants[arg] = "constexpr", value
                    else:
                        signature[arg] = mangle_type(value)
                launches.add(json.dumps([_module, _name, signature, constants], sort_keys=True))

            fn.add_pre_run_hook(hook)
    workload(torch)
    return expected, [json.loads(launch) for launch in sorted(launches)]


def workload(torch) -> None:
    """The kernels' callers, small: the engines (exact and fused) generating from a tiny model, the
    exact trainer's forward and backward over packed responses, the matmul's forms."""
    from hybridflow.engine import Engine, EngineConfig
    from hybridflow.kernels.linear import K_CHUNK, linear
    from hybridflow.models import tiny_model
    from hybridflow.models.native import from_hf_model
    from hybridflow.roles.forward import packed_response_logprobs
    from hybridflow.rollout.sampling import SamplingParams

    prompts = [[5, 9, 200, 17, 3, 8], list(range(30, 45))]
    params = [SamplingParams(temperature=0.0, max_tokens=5),
              SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=20, max_tokens=5, seed=1,
                             stop_token_ids=[7, 11])]  # fmt: skip
    for family, exact in (("qwen2", False), ("qwen3", False), ("qwen2", True)):
        model = from_hf_model(tiny_model(family, seed=4))
        config = EngineConfig(page_size=4, max_context_tokens=48, decode_steps=4, share_weights=False,
                              exact_logprobs=exact)  # fmt: skip
        engine = Engine(model, eos_token_ids=[1], config=config)
        runs = [engine.generate(prompts, p) for p in params]
        if exact:  # the trainer on the same kernels, forward and backward (n=2: each prompt packed once)
            model.use_exact_kernels()
            for gens in runs:
                logprobs, _ = packed_response_logprobs(
                    model, [prompts[g.prompt_index] for g in gens], [g.token_ids for g in gens],
                    device=torch.device("cpu"), compute_dtype="bfloat16",
                )  # fmt: skip
                logprobs.sum().backward()
    # what the engine runs only on a GPU: the K/V store, the decode attention split over programs,
    # the weight copy; and the log-prob head's gradient
    from hybridflow.engine.triton_copy import cast_copy_triton
    from hybridflow.engine.triton_decode import paged_decode_attention_triton
    from hybridflow.engine.triton_layer import store_kv
    from hybridflow.models.native.triton_logprobs import chunk_grad_, chunk_stats

    cache = torch.zeros(2, 16, 2, 16, dtype=torch.bfloat16)  # k and v [slots, Hkv, D]
    store_kv(cache[0], cache[1], torch.tensor([3, 9]), *torch.randn(2, 2, 2, 16, dtype=torch.bfloat16))
    table, context = (
        torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
        torch.tensor([30, 9], dtype=torch.int32),
    )
    paged_decode_attention_triton(
        torch.randn(2, 4, 16), *torch.randn(2, 64, 2, 16), table, context, 16, block=16, programs_target=264
    )  # (pages of 16 in blocks of 16: 2 splits)
    cast_copy_triton([torch.zeros(5, dtype=torch.bfloat16)], [torch.randn(5)], block=64, iters=4)
    logits, targets = torch.randn(3, 300), torch.tensor([1, 2, 3])
    chunk_grad_(logits, targets, torch.ones(3), chunk_stats(logits, targets, 1.0)[2], 1.0)
    for dtype in (torch.float32, torch.bfloat16):  # looped and split, pointer and TMA loads
        x, w = torch.randn(100, 2 * K_CHUNK + 8, dtype=dtype), torch.randn(24, 2 * K_CHUNK + 8, dtype=dtype)
        for rows in (100, 7):
            for split in (True, False):
                linear(x[:rows], w, torch.zeros(24, dtype=dtype), split=split)


def compile_all(launches: list) -> int:
    """Each recorded launch compiled for sm_90 -> the number that failed (each printed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hybridflow.kernels.launch import OPTIONS

    failed = 0
    for module_name, name, signature, constants in launches:
        fn = getattr(importlib.import_module(module_name), name)
        try:
            source = ASTSource(fn=fn, signature=signature, constexprs=constants)
            triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(OPTIONS))
            print(f"compiles for sm_90: {module_name}.{name} {sorted(constants.items())}", flush=True)
        except Exception as e:  # noqa: BLE001 (every kernel's result is printed)
            failed += 1
            print(f"FAILED for sm_90: {module_name}.{name} {sorted(constants.items())}: {type(e).__name__}: "
                  f"{str(e)[:2000]}", flush=True)  # fmt: skip
    return failed


if __name__ == "__main__":
    if len(sys.argv) > 1:  # the second process: compile what the first recorded
        with open(sys.argv[1]) as f:
            sys.exit(1 if compile_all(json.load(f)) else 0)
    assert os.environ.get("TRITON_INTERPRET") == "1"
    expected, launches = record()
    missing = sorted({f"{m}.{n}" for m, n in expected} - {f"{m}.{n}" for m, n, *_ in launches})
    print(f"recorded {len(launches)} launch forms of {len(expected) - len(missing)} kernels", flush=True)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as folder:  # (removed whatever the compile process does)
        path = os.path.join(folder, "launches.json")
        with open(path, "w") as f:
            json.dump(launches, f)
        done = subprocess.run([sys.executable, __file__, path], env=env, timeout=1200)
    if missing:
        print(f"not launched by the workload: {', '.join(missing)}")
    sys.exit(1 if done.returncode or missing else 0)
