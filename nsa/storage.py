"""Files the user keeps: a full disk, a read-only or forbidden folder, or a damaged file becomes one line that names
the path, the cause and what to do."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from .errors import UserError

LOW_SPACE_BYTES = 1 << 20
"""Free space below which a failed write is blamed on a full disk: PyTorch's own writers report it as a
RuntimeError without an errno."""

_CAUSES = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the filesystem is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}


class DamagedFile(UserError):
    """A file the project wrote earlier (checkpoint piece, run file, shard) cannot be read back."""


def storage_cause(error: BaseException, path: str | Path | None = None) -> str | None:
    """What about the storage made `error` happen ('no space left on the device', 'the filesystem is read-only',
    'permission denied'), or None when the storage is not to blame."""
    if isinstance(error, OSError) and error.errno in _CAUSES:
        return _CAUSES[error.errno]
    if path is not None and free_bytes(path) < LOW_SPACE_BYTES:
        return "no space left on the device"
    return None


def free_bytes(path: str | Path) -> int:
    """Free bytes on the filesystem holding `path` (or its nearest existing parent); a large number if unknown."""
    path = Path(path).absolute()
    for folder in (path, *path.parents):
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                break
    return 1 << 62


def write_error(error: BaseException, path: str | Path, fix: str) -> UserError:
    """A UserError for a failed write of `path`: the storage's fault when it is ('could not write P: no space left
    on the device; FIX'), else the error's own first line."""
    cause = storage_cause(error, path) or _first_line(error)
    return UserError(f"could not write {path}: {cause}; {fix}")


def os_error_message(error: OSError) -> str | None:
    """One line for an OSError that the storage caused (full, read-only, forbidden), naming the path and the fix;
    None for any other error."""
    where = error.filename or "a file"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{_CAUSES[error.errno]} writing {where}: free space, then run the command again"
    if error.errno == errno.EROFS:
        return f"{where} is on a read-only filesystem: choose a writable folder (e.g. train.out_dir=... or --out)"
    if error.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied for {where}: fix its permissions or choose another folder"
    return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")
