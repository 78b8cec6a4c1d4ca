"""Files hybridflow writes get the permissions of any file the user writes (their umask): temporary
directories (mkdtemp) and some writers (transformers' save_pretrained) make them private."""

from __future__ import annotations

import os
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def as_user_files(root: Path) -> None:
    """Give `root` and everything below it the user's ordinary modes (0666/0777 less the umask)."""
    mask = _umask()
    os.chmod(root, 0o777 & ~mask)
    for directory, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(Path(directory) / name, 0o777 & ~mask)
        for name in files:
            path = Path(directory) / name
            if not path.is_symlink():
                os.chmod(path, 0o666 & ~mask)
