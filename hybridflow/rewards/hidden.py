"""What model-written code (a code reward, a sandboxed tool) must never see: the run's files, the
data with its answers, the tokenized cache."""

from __future__ import annotations

from hybridflow.models.default import cache_root


def hidden_paths(config) -> tuple[str, ...]:
    from pathlib import Path

    c = config
    cache = cache_root(c.model.cache_dir) if c.data.cache_tokenized else None
    return (
        str(Path(c.trainer.run_dir).resolve()),
        *(str(f) for f in [*c.data.train_files, *c.data.val_files]),
        *([str(cache)] if cache else []),
    )
