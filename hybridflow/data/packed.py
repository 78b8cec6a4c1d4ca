"""Tokenized prompts cached on disk: each data file is rendered and tokenized once, into a folder
keyed by (the file's contents; the tokenizer and its chat template; the data.* settings that shape
a prompt). Token ids live in one memory-mapped array, the rest of each
prompt (data source, ground truth, extra info, messages) in a JSON-lines file; later runs read both
instead of tokenizing. No pickle: nothing in the cache can run code when loaded."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from pathlib import Path

import numpy as np

from hybridflow.batch import Prompt
from hybridflow.checkpoint import file_sha256
from hybridflow.config.schema import DataConfig
from hybridflow.data.files import json_default
from hybridflow.errors import UserError

FORMAT = 3  # bump when the layout, the rendering or the row checks change (2: nesting depth, 3: digests)
CACHED_FILES = ("tokens.npy", "offsets.npy", "prompts.jsonl")
# the data.* fields a cached prompt depends on
PROMPT_FIELDS = ("prompt_key", "answer_key", "data_source", "max_prompt_tokens", "overlong_prompts",
                 "on_bad_row", "apply_chat_template", "chat_template_kwargs", "system_prompt")  # fmt: skip


log = logging.getLogger(__name__)


class Damaged(Exception):
    """A cache folder that cannot be used as it is."""


def _file_fingerprint(path: Path) -> str:
    """A hash of the file's bytes, or of every file in a dataset folder (names and bytes). Contents,
    not modification times: a file rewritten within the clock's resolution is still seen as new,
    and hashing runs at disk speed, far faster than tokenizing."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for p in files:
        digest.update(str(p.relative_to(path) if path.is_dir() else "").encode())
        with p.open("rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()


def _tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = [tokenizer.chat_template, tokenizer.all_special_tokens, type(tokenizer).__name__]
    return hashlib.sha256((vocab + json.dumps(extra, default=str)).encode()).hexdigest()


def cache_key(path: Path, tokenizer, config: DataConfig, truth_sources: frozenset[str] = frozenset()) -> str:
    settings = {f: getattr(config, f) for f in PROMPT_FIELDS} | {"truth_sources": sorted(truth_sources)}
    parts = [FORMAT, _file_fingerprint(path), _tokenizer_fingerprint(tokenizer), settings]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:20]


class PackedDataset:
    """The prompts of one data file. `PackedDataset.load(file, tokenizer, data_config, cache_root)`
    reads them from the cache, tokenizing (and caching) on the first use."""

    def __init__(self, directory: Path) -> None:
        """Raises Damaged when a file is missing, unreadable, or not what was written (its sha256)."""
        self.directory = directory
        try:
            header = json.loads((directory / "header.json").read_text(encoding="utf-8"))
            for name in CACHED_FILES:
                if file_sha256(directory / name) != header["sha256"][name]:
                    raise Damaged(f"{name} is not the file that was written")
            self.rows, self.overlong = header["rows"], header["overlong"]
            self.bad, self.unreadable = header.get("bad", []), header.get("unreadable_lines", 0)
            self.tokens = np.load(directory / "tokens.npy", mmap_mode="r")  # [total tokens] int32
            self.offsets = np.load(directory / "offsets.npy")  # [prompts + 1] int64
            with (directory / "prompts.jsonl").open(encoding="utf-8") as f:
                self.meta = [json.loads(line) for line in f]
            if len(self.offsets) != len(self.meta) + 1 or self.offsets[-1] != len(self.tokens):
                raise Damaged("its token offsets do not match its prompts")
        except Damaged:
            raise
        except (OSError, ValueError, KeyError, TypeError) as e:  # (json's errors are ValueErrors)
            raise Damaged(f"{type(e).__name__}: {e}") from e

    @classmethod
    def load(
        cls,
        path: str | Path,
        tokenizer,
        config: DataConfig,
        cache_root: Path,
        *,
        truth_sources: frozenset[str] = frozenset(),
    ) -> PackedDataset:
        from hybridflow.data.prompts import warn_bad_rows, warn_overlong

        path = Path(path).expanduser()
        if not path.exists():
            raise UserError(f"data file not found: {path}")
        key = cache_key(path, tokenizer, config, truth_sources)
        directory = cache_root / "prompts" / f"{path.name}-{key}"
        built = not (directory / "header.json").is_file()  # written last: a folder without it is not used
        if built:
            cls._build(
                path, tokenizer, config, directory, truth_sources
            )  # rows_to_prompts logs overlong ones
        try:
            packed = cls(directory)
        except Damaged as e:  # ours and derived: made again, never trusted
            if built:
                raise UserError(
                    f"the tokenized prompts of {path} written to {directory} read back wrong: {e}"
                ) from e
            log.warning(
                "the tokenized prompts cached in %s are damaged (%s): tokenizing %s again", directory, e, path
            )
            shutil.rmtree(directory, ignore_errors=True)
            cls._build(path, tokenizer, config, directory, truth_sources)
            packed, built = cls(directory), True
        if not built:
            warn_overlong(path, packed.overlong, packed.rows, config.max_prompt_tokens)
        warn_bad_rows(path, packed.bad, packed.rows + packed.unreadable)
        return packed

    @staticmethod
    def _build(
        path: Path, tokenizer, config: DataConfig, directory: Path, truth_sources: frozenset[str]
    ) -> None:
        from hybridflow.data.prompts import read_file_rows, rows_to_prompts

        rows, bad = read_file_rows(path, config)
        unreadable = len(bad)  # lines that never became rows; rows_to_prompts adds the malformed rows
        prompts = rows_to_prompts(
            rows, tokenizer, config, source=str(path), truth_sources=truth_sources, bad_rows=bad
        )
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
        lengths = [len(p.token_ids) for p in prompts]
        np.save(
            tmp / "tokens.npy", np.fromiter((t for p in prompts for t in p.token_ids), np.int32, sum(lengths))
        )
        np.save(tmp / "offsets.npy", np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]))
        with (tmp / "prompts.jsonl").open("w", encoding="utf-8") as f:
            for p in prompts:
                meta = {"index": p.index, "data_source": p.data_source, "ground_truth": p.ground_truth,
                        "extra_info": p.extra_info, "text": p.text, "messages": p.messages}  # fmt: skip
                f.write(json.dumps(meta, ensure_ascii=False, default=json_default) + "\n")
        overlong = len(rows) - len(prompts) - (len(bad) - unreadable)
        header = {"rows": len(rows), "overlong": overlong, "bad": bad, "unreadable_lines": unreadable,
                  "sha256": {name: file_sha256(tmp / name) for name in CACHED_FILES}}  # fmt: skip
        (tmp / "header.json").write_text(json.dumps(header), encoding="utf-8")
        if (directory / "header.json").is_file():  # another process built it meanwhile: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
        else:  # (a folder without its header is damaged: replaced)
            shutil.rmtree(directory, ignore_errors=True)
            tmp.rename(directory)

    def __len__(self) -> int:
        return len(self.meta)

    def prompts(self, index_offset: int = 0) -> list[Prompt]:
        """Every prompt, with Prompt.index counted from `index_offset` (the rows of earlier files)."""
        out = []
        for i, meta in enumerate(self.meta):
            start, end = self.offsets[i], self.offsets[i + 1]
            out.append(
                Prompt(
                    index=index_offset + meta["index"],
                    token_ids=self.tokens[start:end].tolist(),
                    data_source=meta["data_source"],
                    ground_truth=meta["ground_truth"],
                    extra_info=meta["extra_info"],
                    text=meta["text"],
                    messages=meta["messages"],
                )
            )
        return out
