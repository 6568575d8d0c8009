"""Standard output and error that survive their reader going away.

`nsa train ... | tee log` and Ctrl-C: the terminal's SIGINT ends `tee` too, and the run, which goes on to its
next step boundary to save a checkpoint, would die of BrokenPipeError at its next progress-bar update. Under
`pipe_safe_output()` a write to a closed pipe instead silences that stream for the rest of the process.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import IO, Iterator


class PipeSafeStream:
    """Wraps a text stream: writes and flushes that hit a closed pipe are dropped, and so are all later ones."""

    def __init__(self, stream: IO[str]):
        self._stream = stream
        self.broken = False

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self._stream.write(text)
            except (BrokenPipeError, ConnectionResetError):
                self._silence()
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except (BrokenPipeError, ConnectionResetError):
                self._silence()

    def _silence(self) -> None:
        self.broken = True
        # Point the descriptor at /dev/null, so that the interpreter's last flush at exit (of whatever is still
        # buffered) succeeds instead of printing "Exception ignored ... BrokenPipeError" and exiting 120.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextlib.contextmanager
def pipe_safe_output() -> Iterator[None]:
    """sys.stdout and sys.stderr wrapped in PipeSafeStream for the duration."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = PipeSafeStream(sys.stdout), PipeSafeStream(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
