"""On-disk cache of finished tasks, keyed by task content: a run that stops resumes from it.

One file per task, named by the key and written atomically (a temporary file and a rename),
so a run killed mid-write leaves either the whole result or nothing.
"""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path
from typing import Any

from meshplan.files import write_bytes_atomic

_MISSING = object()


class TaskCache:
    """Finished task values in `folder`, one pickle per task key."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.folder / f"{hashlib.sha256(key.encode()).hexdigest()}.pkl"

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """The cached value of `key`, or `default` (a cache file that cannot be read counts as
        missing: the task runs again and overwrites it)."""
        try:
            with open(self._path(key), "rb") as handle:
                stored_key, value = pickle.load(handle)
        except (OSError, EOFError, pickle.UnpicklingError, ValueError, AttributeError, ImportError):
            return default
        return value if stored_key == key else default

    def has(self, key: str) -> bool:
        return self.get(key) is not _MISSING

    def put(self, key: str, value: Any) -> None:
        write_bytes_atomic(self._path(key), pickle.dumps((key, value), protocol=pickle.HIGHEST_PROTOCOL))

    def __len__(self) -> int:
        return sum(1 for _ in self.folder.glob("*.pkl"))


MISSING = _MISSING
