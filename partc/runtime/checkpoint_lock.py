"""One job per checkpoint directory: a lock file naming its holder, and the owners of
temporary directories.

``partc train`` takes the lock on rank 0 at start-up, before the model is built
(:func:`acquire`): ``root/.lock`` is created exclusively (``O_CREAT | O_EXCL``) holding
JSON ``{"host", "pid", "started", "since"}`` — the holder's host name, process id, the
process's start time (from ``/proc``, so a reused pid is not mistaken for the holder)
and the wall-clock time it was taken. A lock whose holder is gone from this host is
stale and taken over; one held by a live process, or by any process of another host
(whose liveness cannot be seen from here), refuses the job with a
:class:`partc.CheckpointError` naming the holder. The same start-up checks that the
directory is writable, so a read-only directory fails there and not at the first save.

Temporary directories (a save in progress) are named for their owner
(``.tmp-<what>+<host>+<pid>+<hex>``): a save removes its own, and those of this
process or of processes gone from this host (saves that died), never another live
job's.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partc.errors import CheckpointError

LOCK = ".lock"
TMP = ".tmp-"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    now = _start_time(pid)
    return started is None or now is None or now == started


def _me() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": _start_time(os.getpid()), "since": time.time()}


def _holder_gone(holder: dict[str, Any]) -> bool:
    return (holder.get("host") == socket.gethostname()
            and isinstance(holder.get("pid"), int)
            and not _alive(holder["pid"], holder.get("started")))


@dataclass
class DirectoryLock:
    """The lock this process holds on a checkpoint root; :meth:`release` removes it."""

    root: Path

    def release(self) -> None:
        file = self.root / LOCK
        try:
            holder = json.loads(file.read_text())
        except (OSError, ValueError):
            return
        if holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid():
            file.unlink(missing_ok=True)


def check_writable(root: Path) -> None:
    """Make ``root`` if need be and write and remove a file in it, or raise
    CheckpointError naming the directory."""
    probe = root / f"{TMP}probe+{owner_tag()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise CheckpointError(f"the checkpoint directory {root} is not writable "
                              f"({error.strerror or error}): checkpoints could not be saved; "
                              "give a writable --checkpoint-dir", path=str(root)) from None


def acquire(root: str | os.PathLike) -> DirectoryLock:
    """Check ``root`` is writable, take its lock (taking over a stale one) and remove
    the temporary directories of saves that died; raise CheckpointError naming the
    holder when another job holds it."""
    root = Path(root)
    check_writable(root)
    file = root / LOCK
    for _ in range(3):
        try:
            fd = os.open(file, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = read_holder(file)
            if holder == {}:
                continue   # released between our attempt and the read
            if holder is not None and not _holder_gone(holder):
                raise _in_use(root, holder)
            file.unlink(missing_ok=True)   # stale: its holder is gone from this host
            continue
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(_me()) + "\n")
        remove_stale(root)
        return DirectoryLock(root)
    raise CheckpointError(f"could not take {file}: it keeps changing", path=str(file))


def check_free(root: str | os.PathLike) -> None:
    """Refuse, as :func:`acquire` would, a directory that another live job holds; takes
    nothing (a launcher's check before it starts the ranks that take it)."""
    holder = read_holder(Path(root) / LOCK)
    if holder and not _holder_gone(holder):
        raise _in_use(Path(root), holder)


def _in_use(root: Path, holder: dict[str, Any]) -> CheckpointError:
    file = root / LOCK
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return CheckpointError(f"{root} is in use by another job: {file} names host "
                           f"{holder.get('host')} pid {holder.get('pid')} (since {since}); "
                           "one job per checkpoint directory: give this one another "
                           f"--checkpoint-dir, or remove {file} if that job is gone",
                           path=str(file))


def read_holder(file: Path) -> dict[str, Any] | None:
    """The lock file's holder, or None when it is unreadable (a holder that died while
    writing it: stale)."""
    try:
        holder = json.loads(file.read_text())
    except FileNotFoundError:
        return {}   # released between our attempt and this read: try again
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def check_not_foreign(root: Path) -> None:
    """Raise CheckpointError when another live job holds ``root``'s lock (a save of a
    process that took none, in a directory a launcher job holds)."""
    file = root / LOCK
    if not file.is_file():
        return
    holder = read_holder(file) or {}
    mine = holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid()
    if holder and not mine and not _holder_gone(holder):
        raise CheckpointError(f"{root} is in use by another job ({file} names host "
                              f"{holder.get('host')} pid {holder.get('pid')}): this save "
                              "would mix with its checkpoints; save elsewhere",
                              path=str(file))


def owner_tag() -> str:
    return f"{socket.gethostname()}+{os.getpid()}"


def temporary_name(what: str) -> str:
    """A temporary name under a root, owned by this process: ``.tmp-<what>+host+pid+hex``."""
    return f"{TMP}{what}+{owner_tag()}+{uuid.uuid4().hex[:8]}"


def _owner(name: str) -> tuple[str, int] | None:
    parts = name.split("+")
    if len(parts) < 4 or not parts[-2].isdigit():
        return None
    return "+".join(parts[1:-2]), int(parts[-2])


def remove_stale(root: Path) -> None:
    """Remove temporary entries of saves that died: this process's, or those of
    processes gone from this host. Another live job's, and those of other hosts, stay."""
    host, me = socket.gethostname(), os.getpid()
    for path in root.iterdir():
        if not path.name.startswith(TMP):
            continue
        owner = _owner(path.name)
        if owner is None or owner[0] != host:
            continue
        if owner[1] != me and _alive(owner[1], None):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


__all__ = ["DirectoryLock", "acquire", "check_writable", "check_not_foreign",
           "remove_stale", "temporary_name", "read_holder", "LOCK"]
