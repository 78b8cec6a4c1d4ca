"""`hybridflow report RUN_DIR [RUN_DIR ...]`: one self-contained report.html per run (or comparing
several), written by the trainer at the end of every run and on interruption."""

from hybridflow.report.html import write_report

__all__ = ["write_report"]
