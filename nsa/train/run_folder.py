"""The run folder: named once, created, and held by one writer at a time.

Rank 0 holds `<run>/LOCK` for the whole launch: an exclusive `flock` on the file, which the kernel releases when
the process ends however it ends, plus the owner's pid, host and command written in it, so that a second launch
with the same `train.run_name` stops with a message naming the process that holds the folder. A lock file left
by a process that is gone (killed, machine rebooted) is taken over with a note; one left by another host, where
liveness cannot be checked, is refused with the fix.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..storage import write_error

LOCK = "LOCK"


class RunLock:
    """An exclusive hold on one run folder (rank 0 only)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """Hold the folder or raise UserError naming its holder; returns a note when a stale lock was taken over."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                locked = _try_flock(fd)
            except BaseException:
                os.close(fd)
                raise
            if locked is False:
                owner = _read_owner(fd, wait=True)
                os.close(fd)
                raise UserError(self._busy(owner))
            owner = _read_owner(fd, wait=False)
            if not _same_file(fd, self.path):  # the holder removed the file between our open and flock: retry
                os.close(fd)
                continue
            note = None
            if owner:
                if not self._holder_is_gone(owner, locked):
                    os.close(fd)
                    raise UserError(self._busy(owner))
                note = (f"note: took over {self.path}, left by pid {owner.get('pid')} on {owner.get('host')}, "
                        "which is no longer running")
            _write_owner(fd)
            self._fd = fd
            return note

    def _holder_is_gone(self, owner: dict, flocked: bool | None) -> bool:
        """Whether the process named in a lock file we could open is over. Where flock works, holding it proves
        that no process on this host has the lock; the pid is checked too for filesystems without flock."""
        if owner.get("host") != socket.gethostname():
            return False  # no way to check a process on another machine
        return flocked is True or not _pid_alive(int(owner.get("pid", 0)))

    def _busy(self, owner: dict) -> str:
        run_dir = self.path.parent
        if not owner:
            who = "another process"
        else:
            who = f"pid {owner.get('pid')} on {owner.get('host')} (started {owner.get('started', '?')}: " \
                  f"{owner.get('command', '?')})"
        gone = (f"; if that process is over, delete {self.path}" if owner and owner.get("host") != socket.gethostname()
                else "")
        return (f"run folder {run_dir} is in use by {who}: wait for it to finish or stop it, or choose another "
                f"train.run_name{gone}")

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            if _same_file(self._fd, self.path):
                self.path.unlink()
        except OSError:
            pass
        os.close(self._fd)  # releases the flock
        self._fd = None


def _try_flock(fd: int) -> bool | None:
    """True when we hold the exclusive flock, False when another process does, None where the filesystem has no
    flock (liveness is then judged by pid and host)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
            return None
        raise


def _read_owner(fd: int, wait: bool) -> dict:
    """The lock file's owner record, {} when empty or unreadable; with `wait`, an empty file is read again for a
    second (its holder may be a moment from writing it)."""
    for _ in range(20 if wait else 1):
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 65536).decode("utf-8", "replace")
        if text.strip():
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                return {}
        if wait:
            time.sleep(0.05)
    return {}


def _write_owner(fd: int) -> None:
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]])[:500]}
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, (json.dumps(record) + "\n").encode())
    os.fsync(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class RunFolder:
    """A run folder as this launch found it."""

    path: Path
    created: bool
    """This launch made the folder (so it may remove it again if the run fails before its first step)."""
    lock: RunLock | None = None
    """Held by rank 0 until the launch ends."""
    note: str | None = None
    """Something to tell the user about the claim (a stale lock taken over)."""

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def claim_run_folder(out_dir: Path, run_name: str, default_name: str) -> RunFolder:
    """Create (or reopen, for `run_name`) the run folder under out_dir and lock it; UserError if it is in use or
    cannot be written."""
    try:
        if run_name:
            path = out_dir / run_name
            created = not path.exists()
            path.mkdir(parents=True, exist_ok=True)
        else:
            path, created = new_run_folder(out_dir, default_name), True
        lock = RunLock(path)
        note = lock.acquire()
    except OSError as e:
        raise write_error(e, e.filename or out_dir, "choose a writable train.out_dir") from None
    return RunFolder(path, created, lock, note)


def new_run_folder(out_dir: Path, base: str) -> Path:
    """A folder under out_dir named `base`, or `base-2`, `base-3`, ... when taken; created atomically, so two
    launches at the same second never share one."""
    out_dir.mkdir(parents=True, exist_ok=True)
    name, suffix = base, 1
    while True:
        try:
            (out_dir / name).mkdir()
            return out_dir / name
        except FileExistsError:
            suffix += 1
            name = f"{base}-{suffix}"


def discard_unused(run_dir: Path) -> bool:
    """Remove a run folder that this launch created and that holds no checkpoint (a run that failed before its
    first step); returns whether it did."""
    if (run_dir / "checkpoints").exists():
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    return not run_dir.exists()
