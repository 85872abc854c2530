"""The run's log: each message printed whole (steps are checked side by side, from threads) and, while a run writes
one, copied to its log file (python -m verify --out DIR: DIR/verify.log)."""
from __future__ import annotations

import contextlib
import threading
from pathlib import Path


class Log:
    """`log(message)`: print it and, inside `with log.to(path):`, write it to that file too; one message at a time."""

    def __init__(self):
        self._lock = threading.Lock()
        self._file = None

    def __call__(self, msg: str = "") -> None:
        with self._lock:
            print(msg, flush=True)
            if self._file:
                self._file.write(msg + "\n")
                self._file.flush()

    @contextlib.contextmanager
    def to(self, path: Path):
        """Copy every message to `path` (created, or emptied) until the block ends."""
        with open(path, "w") as f:
            self._file = f
            try:
                yield self
            finally:
                with self._lock:
                    self._file = None


log = Log()
