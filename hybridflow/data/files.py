"""Read dataset rows from parquet, jsonl/json, or `datasets.save_to_disk` directories."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridflow.errors import UserError


def read_rows(path: str | Path, *, bad_lines: list[str] | None = None) -> list[dict[str, Any]]:
    """All rows of one dataset file as dicts. Raises UserError naming the file (and line) at fault;
    with `bad_lines`, a jsonl line that is not a UTF-8 JSON object is recorded there and skipped."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"data file not found: {p}")
    if p.is_dir():
        return _read_hf_dir(p)
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        return _read_parquet(p)
    if suffix == ".jsonl":
        return _read_jsonl(p, bad_lines)
    if suffix == ".json":
        return _read_json(p)
    raise UserError(
        f"data file {p} has unknown format {suffix!r}; use .parquet, .jsonl, .json or a dataset dir"
    )


def json_default(value: Any) -> Any:
    """JSON for what rows hold besides JSON types: numpy arrays and scalars (parquet, `datasets`),
    dates."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "isoformat"):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


def write_rows(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write rows as parquet or jsonl (by suffix)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), p)
    elif p.suffix == ".jsonl":
        with p.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False, default=json_default) + "\n")
    else:
        raise UserError(f"cannot write {p}: use a .parquet or .jsonl path")
    return p


def _read_parquet(p: Path) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(p).to_pylist()
    except Exception as e:
        raise UserError(f"cannot read parquet file {p}: {str(e).splitlines()[0]}") from e


def _read_jsonl(p: Path, bad_lines: list[str] | None = None) -> list[dict]:
    rows = []
    with p.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
                problem = (
                    None if isinstance(row, dict) else f"expected a JSON object, got {type(row).__name__}"
                )
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                problem = f"not valid UTF-8 JSON ({e})"
            except RecursionError:
                problem = "JSON nested too deeply to read"
            if problem is None:
                rows.append(row)
            elif bad_lines is None:
                raise UserError(f"{p}:{number}: {problem}")
            else:
                bad_lines.append(f"line {number}: {problem}")
    return rows


def _read_json(p: Path) -> list[dict]:
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{p}: not valid JSON ({e})") from e
    except RecursionError:
        raise UserError(f"{p}: JSON nested too deeply to read") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise UserError(f"{p}: expected a list of objects (or {{'data': [...]}})")
    return data


def _read_hf_dir(p: Path) -> list[dict]:
    try:
        import datasets
    except ImportError as e:
        raise UserError(
            f"{p} is a directory; reading datasets directories needs `pip install datasets`"
        ) from e
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:
        raise UserError(f"cannot load dataset directory {p}: {str(e).splitlines()[0]}") from e
    if isinstance(ds, datasets.DatasetDict):
        if len(ds) != 1:
            raise UserError(f"{p} holds splits {list(ds)}; point at one split's directory")
        ds = next(iter(ds.values()))
    return ds.to_list()
