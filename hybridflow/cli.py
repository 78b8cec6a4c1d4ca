"""`hybridflow` command line: train, sft, dpo, kto, plan, generate, serve, export, report, config
(show, --explain) and data (make, preprocess). Bad input prints one line and exits 2."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from hybridflow import __version__
from hybridflow.controller.watchdog import EXIT_STUCK, PhaseStuck
from hybridflow.errors import UserError

log = logging.getLogger("hybridflow")


def _prompts_from_file(path: str) -> list:
    from hybridflow.data.files import read_rows

    rows = read_rows(path)
    for i, row in enumerate(rows):
        if "prompt" not in row:
            raise UserError(f"{path}: row {i} has no 'prompt' key (keys: {', '.join(sorted(row)) or 'none'})")
    if not rows:
        raise UserError(f"{path} has no prompts")
    return [row["prompt"] for row in rows]


def cmd_generate(args: argparse.Namespace) -> None:
    from hybridflow.data.prompts import check_prompt, render_prompt
    from hybridflow.models import load_causal_lm, stop_token_ids
    from hybridflow.rollout import HFBackend, SamplingParams

    if args.out and Path(args.out).exists():
        raise UserError(f"output file {args.out} exists; choose another path")
    raw = list(args.prompt or []) + (_prompts_from_file(args.prompts_file) if args.prompts_file else [])
    if not raw:
        raise UserError("give --prompt TEXT or --prompts-file FILE.jsonl")
    where = args.prompts_file or "--prompt"
    checked = [check_prompt(p, f"{where}: prompt {i}", "prompt") for i, p in enumerate(raw)]

    impl = {"native": "native", "hf": "hf"}.get(args.backend, "auto")
    model, tok = load_causal_lm(args.model, dtype=args.dtype, impl=impl)
    from hybridflow.devices import follow_free_cores, resolve_device

    device = resolve_device(args.device)
    if device.type == "cpu" and (note := follow_free_cores(start=True)):
        print(note, flush=True)
    model.to(device)
    texts = [render_prompt(p, tok, chat=args.chat, system_prompt=args.system_prompt) for p in checked]
    prompt_ids = [tok(t, add_special_tokens=not args.chat)["input_ids"] for t in texts]
    eos = stop_token_ids(model, tok)
    if args.backend == "vllm":
        from hybridflow.models.default import default_model_dir
        from hybridflow.rollout.vllm import VLLMBackend

        path = default_model_dir() if args.model == "default" else Path(args.model)
        if not path.is_dir():
            raise UserError(f"--backend vllm needs an HF model directory; {args.model} is not one")
        context = max(map(len, prompt_ids)) + args.max_tokens + 1
        backend = VLLMBackend(
            str(path), eos_token_ids=eos, max_model_len=context, dtype=args.dtype, seed=args.seed
        )
    elif hasattr(model, "hidden_states"):  # our model: the built-in engine
        from hybridflow.engine import EngineConfig, build_engine

        context = max(map(len, prompt_ids)) + args.max_tokens + 1
        backend = build_engine(model, eos_token_ids=eos, device=device, config=EngineConfig(max_context_tokens=context),
                               sequences=len(prompt_ids) * args.n)  # fmt: skip
    else:
        backend = HFBackend(model, pad_token_id=tok.pad_token_id, eos_token_ids=eos)
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    start = time.perf_counter()
    generations = backend.generate(prompt_ids, params)
    seconds = time.perf_counter() - start

    records = [
        {
            "prompt": texts[g.prompt_index],
            "completion": tok.decode(g.token_ids, skip_special_tokens=True),
            "finish_reason": g.finish_reason,
            "num_tokens": len(g.token_ids),
        }
        for g in generations
    ]
    if args.out:
        with open(args.out, "x", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    else:
        for g, r in zip(generations, records):
            print(
                f"--- prompt {g.prompt_index} ({r['finish_reason']}, {r['num_tokens']} tokens)\n{r['completion']}"
            )
    tokens = sum(len(g.token_ids) for g in generations)
    print(f"generated {tokens} tokens in {seconds:.2f} s ({tokens / max(seconds, 1e-9):.1f} tok/s)")


def cmd_serve(args: argparse.Namespace) -> None:
    from hybridflow.serve.server import build_engine, serve

    if not 0 < args.port < 65536:
        raise UserError(f"--port {args.port} is not a port number (1-65535)")
    if args.api_processes < 1:
        raise UserError(f"--api-processes {args.api_processes}: give at least 1")
    if args.max_model_len < 2:
        raise UserError(f"--max-model-len {args.max_model_len} is too small; give at least 2 tokens")
    engine, tokenizer = build_engine(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_context=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    api_key = args.api_key or os.environ.get("HYBRIDFLOW_API_KEY") or None
    name = args.served_model_name or args.model
    serve(engine, tokenizer, model_name=name, host=args.host, port=args.port, api_key=api_key,
          api_processes=args.api_processes)  # fmt: skip


def _recipe_and_overrides(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    # The optional recipe is positional, so a first `key=value` lands there: it is an override.
    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe:
        recipe, overrides = None, [recipe, *overrides]
    name = getattr(args, "config_name", None)
    if name is None:
        if getattr(args, "config_path", None) is not None:
            raise UserError("--config-path needs --config-name (the YAML in it, as Hydra's)")
        return recipe, overrides
    if recipe is not None:
        raise UserError(f"give the recipe once: {recipe!r} or --config-name {name!r}, not both")
    # Hydra's way (verl's commands): --config-path DIR --config-name NAME is DIR/NAME.yaml
    path = Path(args.config_path or ".") / name
    return str(path if path.suffix in (".yaml", ".yml") else path.with_suffix(".yaml")), overrides


def _hydra_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config-path",
        help="with --config-name: the recipe is CONFIG_PATH/CONFIG_NAME.yaml (Hydra's, as verl's commands give it)",
    )
    parser.add_argument("--config-name", help="see --config-path")


def _resolve(args: argparse.Namespace):
    """The config a command runs: the same base rules for train, plan and config show (a bare
    command is the demo; overrides alone start from hybridflow's defaults, or verl's for verl keys)."""
    from hybridflow.config.loader import resolve_config

    recipe, overrides = _recipe_and_overrides(args)
    resolved = resolve_config(recipe, overrides, bare_is_demo=True)
    if getattr(args, "quiet", False):
        resolved.config.trainer.progress = False
    return resolved


def _announce(resolved, *, comment: str = "") -> None:
    print(f"{comment}config base: {resolved.base}", flush=True)
    for note in resolved.notes:
        print(f"{comment}note: {note}", flush=True)


def cmd_config_show(args: argparse.Namespace) -> None:
    from hybridflow.config import to_yaml

    resolved = _resolve(args)
    _announce(resolved, comment="# ")
    if args.explain is not None:
        from hybridflow.config.explain import explain

        print(explain(resolved.config, args.explain or None))
        return
    print(to_yaml(resolved.config), end="")


def cmd_plan(args: argparse.Namespace) -> None:
    from hybridflow.controller.setup import check_config
    from hybridflow.controller.worker_models import check_parallel_sizes
    from hybridflow.plan.layout import choose_layout
    from hybridflow.plan.memory import GIB, estimate, model_hf_config, plan_inputs

    resolved = _resolve(args)
    _announce(resolved)
    gpu = int(args.gpu_memory_gib * GIB) if args.gpu_memory_gib else None
    shape, gpu_bytes, workers = plan_inputs(resolved.config, gpu_bytes=gpu)
    # what training refuses is said here, not planned: its config checks (on the planned workers),
    # then what the workers would refuse of the parallel sizes
    check_config(resolved.config, workers)
    hf_config = model_hf_config(resolved.config)
    check_parallel_sizes(resolved.config, workers, hf_config)
    print(estimate(resolved.config, shape, gpu_bytes=gpu_bytes, workers=workers).report())
    choice = choose_layout(resolved.config, shape, gpu_bytes=gpu_bytes, workers=workers, hf_config=hf_config)
    print(choice.report())


def cmd_train(args: argparse.Namespace) -> None:
    from hybridflow.controller.restarts import fit_with_restarts

    resolved = _resolve(args)
    _announce(resolved)
    fit_with_restarts(resolved.config, overwrite=args.overwrite)


def cmd_offline(args: argparse.Namespace) -> None:
    from hybridflow import offline
    from hybridflow.config.loader import resolve_config

    trainer = {"sft": offline.SFTTrainer, "dpo": offline.DPOTrainer, "kto": offline.KTOTrainer}[args.command]
    recipe, overrides = _recipe_and_overrides(args)
    if recipe is None and not overrides:
        raise UserError(
            f"hybridflow {args.command}: give a recipe (e.g. arithmetic_sft) or key=value settings "
            "(at least data.train_files=...)"
        )
    resolved = resolve_config(
        recipe,
        [*overrides, *(("trainer.progress=false",) if args.quiet else ())],
        command=args.command,
    )
    _announce(resolved)
    trainer(resolved.config, overwrite=args.overwrite).fit()


def cmd_report(args: argparse.Namespace) -> None:
    from hybridflow.report import write_report

    print(write_report(args.runs, args.out))


def cmd_export(args: argparse.Namespace) -> None:
    from hybridflow.models.checkpoint_export import export_adapter, export_checkpoint

    export = export_adapter if args.adapter_only else export_checkpoint
    print(export(args.checkpoint, args.out, overwrite=args.overwrite))


def cmd_data_make(args: argparse.Namespace) -> None:
    from hybridflow.data.tasks import make_task

    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"output directory {out} is not empty; choose another")
    spec = {}
    if args.task == "arithmetic":
        spec = dict(
            min_operands=args.min_operands,
            max_operands=args.max_operands,
            max_digits=args.max_digits,
            operators=args.operators,
        )
    paths = make_task(
        args.task, out, train_size=args.train_size, test_size=args.test_size, seed=args.seed, **spec
    )
    for split, path in paths.items():
        print(f"{split}: {path}")


def cmd_data_preprocess(args: argparse.Namespace) -> None:
    from hybridflow.data.preprocess import preprocess

    print(preprocess(args.dataset, args.input, args.out, split=args.split))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridflow", description="RL post-training of LLMs (HybridFlow).")
    parser.add_argument("--version", action="version", version=f"hybridflow {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="sample completions from a model")
    gen.add_argument("--model", default="default", help="'default', an HF model directory, or a .gguf file")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument(
        "--prompts-file", help="jsonl/json/parquet rows with a 'prompt' key (string or messages)"
    )
    gen.add_argument("--n", type=int, default=1, help="samples per prompt")
    gen.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument(
        "--chat", action=argparse.BooleanOptionalAction, default=True, help="apply the chat template"
    )
    gen.add_argument("--system-prompt")
    gen.add_argument(
        "--backend",
        choices=["auto", "native", "hf", "vllm"],
        default="auto",
        help="native: the built-in engine (auto picks it for Llama/Mistral/Qwen); hf: transformers generate",
    )
    gen.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    gen.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    gen.add_argument("--out", help="write completions as jsonl here instead of printing")
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API (the built-in engine)"
    )
    srv.add_argument(
        "model", nargs="?", default="default", help="'default', an HF model directory, or a .gguf file"
    )
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", help="the name clients use (default: the model argument)")
    srv.add_argument("--max-model-len", type=int, default=4096, help="longest prompt + completion, in tokens")
    srv.add_argument(
        "--api-key", help="require `Authorization: Bearer KEY` (default: $HYBRIDFLOW_API_KEY, else none)"
    )
    srv.add_argument(
        "--api-processes", type=int, default=1,
        help="HTTP front processes on the port (their CPU per request in parallel; the engine is one)",
    )  # fmt: skip
    srv.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    srv.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    srv.add_argument(
        "--gpu-memory-utilization", type=float, default=0.8, help="share of free GPU memory for the KV cache"
    )
    srv.set_defaults(func=cmd_serve)

    train = sub.add_parser(
        "train", help="RL training (PPO, GRPO, ...) from a recipe; no recipe runs the demo"
    )
    train.add_argument("recipe", nargs="?", help="recipe YAML (or built-in recipe name)")
    train.add_argument(
        "overrides", nargs="*", help="key=value overrides, e.g. trainer.total_training_steps=10"
    )
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="start over: delete this run's earlier checkpoints and metrics",
    )
    train.add_argument("--quiet", action="store_true", help="no progress bar (trainer.progress=false)")
    _hydra_options(train)
    train.set_defaults(func=cmd_train)

    for name, about in (
        ("sft", "supervised fine-tuning (chat messages or prompt/response rows)"),
        ("dpo", "DPO and variants on preference pairs (prompt/chosen/rejected rows)"),
        ("kto", "KTO on completions labelled desirable or not (prompt/completion/label rows)"),
    ):
        offline = sub.add_parser(name, help=about)
        offline.add_argument(
            "recipe", nargs="?", help="recipe YAML (or built-in recipe name, e.g. arithmetic_sft); or none"
        )
        offline.add_argument(
            "overrides", nargs="*", help="key=value overrides, e.g. trainer.total_training_steps=10"
        )
        offline.add_argument(
            "--overwrite", action="store_true", help="start over: delete this run's earlier files"
        )
        offline.add_argument("--quiet", action="store_true", help="no progress bar (trainer.progress=false)")
        offline.set_defaults(func=cmd_offline)

    plan = sub.add_parser(
        "plan", help="estimate peak GPU memory per training phase for a recipe, with suggestions"
    )
    plan.add_argument("recipe", nargs="?", help="recipe YAML (or built-in recipe name); none: the demo")
    plan.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.n_gpus_per_node=2")
    plan.add_argument(
        "--gpu-memory-gib", type=float, help="memory of one GPU (default: this machine's GPU, else 80)"
    )
    _hydra_options(plan)
    plan.set_defaults(func=cmd_plan)

    report = sub.add_parser(
        "report", help="write a self-contained HTML report of a run, or of several runs overlaid"
    )
    report.add_argument("runs", nargs="+", help="run directories (trainer.run_dir); several are compared")
    report.add_argument("--out", help="the HTML file (default: RUN_DIR/report.html of the first run)")
    report.set_defaults(func=cmd_report)

    export = sub.add_parser(
        "export", help="a checkpoint's trained policy as a transformers directory, checked by reloading it"
    )
    export.add_argument(
        "checkpoint", help="a checkpoint (RUN_DIR/checkpoints/global_step_N) or a run directory (its latest)"
    )
    export.add_argument("--out", required=True, help="the directory to write (must be empty or new)")
    export.add_argument("--overwrite", action="store_true", help="replace the files of a non-empty --out")
    lora = export.add_mutually_exclusive_group()
    lora.add_argument(
        "--merge-lora", action="store_true", help="a LoRA run: adapters merged into the weights (the default)"
    )
    lora.add_argument(
        "--adapter-only", action="store_true", help="a LoRA run: only its adapters, in PEFT's format"
    )
    export.set_defaults(func=cmd_export)

    config = sub.add_parser("config", help="inspect configuration").add_subparsers(
        dest="action", required=True
    )
    show = config.add_parser("show", help="print the resolved config of a recipe with overrides")
    show.add_argument("recipe", nargs="?", help="recipe YAML (or built-in recipe name)")
    show.add_argument("overrides", nargs="*", help="key=value overrides, e.g. actor.optim.lr=1e-6")
    show.add_argument(
        "--explain", nargs="?", const="", metavar="KEY",
        help="each field (of KEY: a field or a section) with its value, default and description",
    )  # fmt: skip
    _hydra_options(show)
    show.set_defaults(func=cmd_config_show)

    data = sub.add_parser("data", help="make or preprocess datasets").add_subparsers(
        dest="action", required=True
    )
    make = data.add_parser("make", help="write a built-in task's train/test parquet files")
    make.add_argument("task", choices=["arithmetic", "countdown"])
    make.add_argument("--out", required=True)
    make.add_argument("--train-size", type=int, default=2000)
    make.add_argument("--test-size", type=int, default=200)
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--min-operands", type=int, default=2, help="arithmetic only")
    make.add_argument("--max-operands", type=int, default=2, help="arithmetic only")
    make.add_argument("--max-digits", type=int, default=2, help="arithmetic only")
    make.add_argument("--operators", default="+-", help="arithmetic only: subset of +-*")
    make.set_defaults(func=cmd_data_make)
    pre = data.add_parser("preprocess", help="convert a local GSM8K/MATH file to the native schema")
    pre.add_argument("dataset", choices=["gsm8k", "math"])
    pre.add_argument("--input", required=True)
    pre.add_argument("--out", required=True, help=".parquet or .jsonl")
    pre.add_argument("--split", default="train")
    pre.set_defaults(func=cmd_data_preprocess)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse stops filling a positional list at the first option: `train demo --overwrite a=1` left
    # a=1 unrecognized; an override after an option is still an override
    stray = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*(args.overrides or []), *extra]
    # other libraries' progress bars (weights loading, shard writing) would flood a log; ours remain
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        args.func(args)
    except UserError as e:
        if args.debug:
            raise
        print(f"hybridflow: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hybridflow: interrupted", file=sys.stderr)
        return 130
    except PhaseStuck as e:
        if args.debug:
            raise
        print(f"hybridflow: error: {e}", file=sys.stderr)
        return EXIT_STUCK
    return 0


if __name__ == "__main__":
    sys.exit(main())
