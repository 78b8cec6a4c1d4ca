"""Datasets: file readers, prompt rendering/tokenizing (cached: PackedDataset), built-in tasks, GSM8K/MATH preprocessing."""

from hybridflow.data.files import read_rows, write_rows
from hybridflow.data.packed import PackedDataset
from hybridflow.data.prompts import load_prompts, render_prompt, rows_to_prompts

__all__ = ["PackedDataset", "load_prompts", "read_rows", "render_prompt", "rows_to_prompts", "write_rows"]
