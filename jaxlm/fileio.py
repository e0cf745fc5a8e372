"""Crash-safe file primitives: an exclusive lock on a directory, atomic replacement of a
directory, atomic writes of small files, and JSON / JSON-lines readers whose errors name
the file. Standard library only; the failure model is in docs/reliability.md.

- `DirectoryLock(path)`: one holder per directory (a ``.jaxlm.lock`` file inside it,
  held with ``flock``); a second holder gets `DirectoryLockedError`; a lock left by a
  killed process is detected and taken over with a warning.
- `atomic_directory(path, overwrite=...)`: write into a temporary sibling, then swap it
  into place, so that a kill at any moment leaves the complete old or the complete new
  directory (after `recover_directory`, which every writer and loader calls).
- `atomic_write_text(path, text)`: write a file through a temporary sibling and
  ``os.replace``.
- `read_json(path)`, `read_jsonl(path)`: errors name the file, line and column; a torn
  last line of a jsonl file (a writer killed mid-line) is dropped with a warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import json
import logging
import math
import os
import re
import secrets
import shlex
import shutil
import socket
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # not POSIX: locks use exclusive creation and PID checks only
    fcntl = None

log = logging.getLogger(__name__)

LOCK_FILE = ".jaxlm.lock"
_STAGES = ("tmp", "new", "old")


# --------------------------------------------------------------------------- processes


def _host() -> str:
    return socket.gethostname()


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (a zombie counts as dead)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def process_start_time(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch, from ``/proc``), or None where
    that cannot be read (another OS, no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, StopIteration):
        return None


def _holder_running(holder: LockHolder) -> bool:
    """Whether the process a same-host lock record names still runs. The PID alone is not
    enough: a PID is reused (in a container every run may be PID 1 or 7), so this process's
    own PID in a record it does not hold, or a process that started after the record was
    written, is another process than the holder."""
    if holder.pid == os.getpid():
        return False  # this process's locks are in _HELD; the record is from an earlier process
    if not pid_alive(holder.pid):
        return False
    started = process_start_time(holder.pid)
    return started is None or not math.isfinite(holder.started) or started <= holder.started + 2.0  # /proc's boot time is whole seconds


def _fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or directory, best effort (some filesystems refuse directories)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    _fsync_path(path)


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (so a power loss cannot undo the
    rename that publishes it)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_path(os.path.join(dirpath, name))
        _fsync_path(dirpath)


# --------------------------------------------------------------------------- locks


class DirectoryLockedError(RuntimeError):
    """Another process holds the lock on a directory (or did, on another host)."""

    def __init__(self, message: str, *, path: Path, holder: LockHolder | None = None):
        super().__init__(message)
        self.path = path
        self.holder = holder


@dataclasses.dataclass(frozen=True)
class LockHolder:
    """What a lock file records about the process that holds it."""

    pid: int
    host: str
    started: float
    command: str
    what: str = ""

    @classmethod
    def this_process(cls, what: str) -> LockHolder:
        return cls(pid=os.getpid(), host=_host(), started=time.time(),
                   command=shlex.join(sys.argv) if sys.argv and sys.argv[0] else sys.executable,
                   what=what)

    def to_json(self) -> str:
        started_iso = datetime.datetime.fromtimestamp(self.started).astimezone().isoformat(timespec="seconds")
        return json.dumps({"pid": self.pid, "host": self.host, "started": self.started,
                           "started_iso": started_iso, "command": self.command, "what": self.what})

    @classmethod
    def from_text(cls, text: str) -> LockHolder | None:
        try:
            d = json.loads(text)
            return cls(pid=int(d["pid"]), host=str(d["host"]), started=float(d["started"]),
                       command=str(d.get("command", "")), what=str(d.get("what", "")))
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        try:  # a damaged lock file's start time (NaN, or out of range) must not hide who holds it
            started = datetime.datetime.fromtimestamp(self.started).strftime("%Y-%m-%d %H:%M:%S")
            age = _age(time.time() - self.started)
        except (ValueError, OverflowError, OSError):
            return f"PID {self.pid} on host {self.host}, start time unknown, command: {self.command}"
        return f"PID {self.pid} on host {self.host}, started {started} ({age} ago), command: {self.command}"


def _age(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _read_holder_fd(fd: int) -> tuple[str, LockHolder | None]:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    text = b"".join(chunks).decode("utf-8", "replace")
    return text, LockHolder.from_text(text)


def _read_holder(path: Path) -> tuple[str, LockHolder | None]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return "", None
    return text, LockHolder.from_text(text)


# Locks this process holds, by lock file: a second DirectoryLock on the same file in the
# same process shares the first (a run that locks its directory twice is still one run).
_HELD: dict[str, list] = {}


class DirectoryLock:
    """An exclusive lock on a directory, held for a process's lifetime or a ``with`` block.

    The lock is ``path/.jaxlm.lock``, held with ``fcntl.flock`` (released by the kernel
    when the process dies, also on SIGKILL) and holding JSON with the holder's PID, host,
    start time and command. A second process gets `DirectoryLockedError` naming them. A
    lock file left by a dead process (its flock is free; on a filesystem without flock:
    same host and the PID is not running, or is this process or a process started after
    the lock was written: a reused PID) is taken over with a warning. A lock file from
    another host whose flock is free is not taken over unless ``force=True``: this host
    cannot tell whether that process still runs.

    process_index: in a multi-process JAX run every process locks its own file
    (``.jaxlm.lock`` for process 0, ``.jaxlm.lock.<i>`` for the others), so a second run
    is refused on every process at once, whether the directory is shared or per host.
    beside: lock a directory that is replaced as a whole (`atomic_directory`): the lock
    file is the sibling ``.<name>.jaxlm.lock`` instead of a file inside it.
    force_hint: how the caller passes ``force`` (e.g. ``"--force"``), for the messages.
    """

    def __init__(self, path: str | os.PathLike, *, what: str = "training run", process_index: int = 0,
                 force: bool = False, beside: bool = False, force_hint: str = "force=True"):
        # a symlink is locked as the directory it names (`atomic_directory` writes through it):
        # the link's own lock beside it let a second writer in
        self.path = Path(os.path.realpath(path) if os.path.islink(path) else os.path.abspath(path))
        self.what = what
        self.force = force
        self.force_hint = force_hint
        if beside:
            self.lock_path = self.path.parent / f".{self.path.name}{LOCK_FILE}"
        else:
            self.lock_path = self.path / (LOCK_FILE if process_index == 0 else f"{LOCK_FILE}.{process_index}")
        self._held = False

    @property
    def held(self) -> bool:
        return self._held

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"DirectoryLock({str(self.path)!r}, held={self._held})"

    # ---- acquire / release

    def acquire(self) -> DirectoryLock:
        """Take the lock, or raise `DirectoryLockedError`. Returns ``self``."""
        if self._held:
            return self
        key = str(self.lock_path)
        shared = _HELD.get(key)
        if shared is not None and shared[0] == os.getpid():
            shared[2] += 1
        else:
            self.lock_path.parent.mkdir(parents=True, exist_ok=True)
            me = LockHolder.this_process(self.what)
            fd = None if fcntl is None else self._acquire_flock(me)
            if fd is None:
                fd = self._acquire_exclusive(me)
            _HELD[key] = [os.getpid(), fd, 1]
        self._held = True
        return self

    def release(self) -> None:
        """Give the lock back; the last holder in this process removes the lock file."""
        if not self._held:
            return
        self._held = False
        key = str(self.lock_path)
        shared = _HELD.get(key)
        if shared is None or shared[0] != os.getpid():
            return
        shared[2] -= 1
        if shared[2] > 0:
            return
        del _HELD[key]
        fd = shared[1]
        try:
            if _same_file(fd, self.lock_path):
                os.unlink(self.lock_path)
        except OSError:
            pass
        os.close(fd)

    def _acquire_flock(self, me: LockHolder) -> int | None:
        """flock protocol; None when the filesystem does not support flock."""
        for _ in range(20):
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    _, holder = _read_holder_fd(fd)
                    os.close(fd)
                    raise self._busy_error(holder) from None
                os.close(fd)
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF):
                    return None
                raise
            if not _same_file(fd, self.lock_path):  # released and removed while we opened it
                os.close(fd)
                continue
            text, previous = _read_holder_fd(fd)
            if text.strip():
                if previous is not None and previous.host != me.host and not self.force:
                    os.close(fd)
                    raise self._foreign_error(previous)
                self._warn_takeover(previous, text)
            os.ftruncate(fd, 0)
            os.pwrite(fd, me.to_json().encode(), 0)
            os.fsync(fd)
            return fd
        raise DirectoryLockedError(f"could not lock {self.path}: {self.lock_path} keeps changing", path=self.path)

    def _acquire_exclusive(self, me: LockHolder) -> int:
        """O_CREAT | O_EXCL protocol, for filesystems without flock."""
        for _ in range(20):
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
            except FileExistsError:
                text, previous = _read_holder(self.lock_path)
                if previous is None:
                    try:
                        age = time.time() - self.lock_path.stat().st_mtime
                    except FileNotFoundError:
                        continue
                    if age < 30 and not self.force:  # being written by its creator
                        raise self._busy_error(None) from None
                elif previous.host == me.host and _holder_running(previous):
                    raise self._busy_error(previous) from None
                elif previous.host != me.host and not self.force:
                    raise self._foreign_error(previous) from None
                if self._remove_stale(text):
                    self._warn_takeover(previous, text)
                continue
            os.write(fd, me.to_json().encode())
            os.fsync(fd)
            return fd
        raise DirectoryLockedError(f"could not lock {self.path}: {self.lock_path} keeps changing", path=self.path)

    def _remove_stale(self, stale_text: str) -> bool:
        """Move the stale lock file away; put it back if it changed meanwhile (another
        process took the lock first)."""
        aside = self.lock_path.with_name(f"{self.lock_path.name}.stale-{secrets.token_hex(4)}")
        try:
            os.rename(self.lock_path, aside)
        except FileNotFoundError:
            return False
        text, _ = _read_holder(aside)
        if text != stale_text:
            try:
                os.link(aside, self.lock_path)
            except OSError:
                pass
            os.unlink(aside)
            return False
        os.unlink(aside)
        return True

    # ---- messages

    def _busy_error(self, holder: LockHolder | None) -> DirectoryLockedError:
        who = holder.describe() if holder else "a process that is still writing its details"
        mine = holder is not None and holder.pid == os.getpid() and holder.host == _host()
        extra = " (this process: a second lock on the same directory)" if mine else ""
        return DirectoryLockedError(
            f"{self.path} is in use by another {(holder.what if holder else '') or self.what}: {who}{extra}. "
            f"Wait for it to finish or stop "
            f"it, or use another directory. Lock file: {self.lock_path}",
            path=self.path, holder=holder,
        )

    def _foreign_error(self, holder: LockHolder) -> DirectoryLockedError:
        return DirectoryLockedError(
            f"{self.path} is locked by a {holder.what or self.what} on another host: {holder.describe()}. "
            f"This host ({_host()}) cannot tell whether that process is still running. If it is not, "
            f"delete {self.lock_path} or pass {self.force_hint} to take the lock over.",
            path=self.path, holder=holder,
        )

    def _warn_takeover(self, previous: LockHolder | None, text: str) -> None:
        if previous is None:
            who = f"unreadable lock file ({text[:80]!r})"
        elif previous.host != _host():
            who = f"{previous.describe()}; taken over because force was given"
        else:
            who = f"{previous.describe()}; that process is no longer running"
        log.warning("%s: taking over a stale lock (%s)", self.path, who)


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def lock_holder(path: str | os.PathLike, *, process_index: int = 0) -> LockHolder | None:
    """The holder recorded in ``path``'s lock file (None when there is none). The record
    stays after a kill: whether it is live is decided by `DirectoryLock.acquire`."""
    name = LOCK_FILE if process_index == 0 else f"{LOCK_FILE}.{process_index}"
    return _read_holder(Path(path) / name)[1]


# --------------------------------------------------------------------------- atomic directories

_SAFE_HOST = re.compile(r"[^A-Za-z0-9]")


def _staging_name(path: Path, stage: str, token: str) -> Path:
    return path.with_name(f"{path.name}.{stage}-{token}")


def _staging_re(name: str) -> re.Pattern:
    # <name>.<stage>-<host>-<pid>-<nonce>, optionally followed by a writer's own suffix
    # (e.g. orbax's ``.orbax-checkpoint-tmp-<n>`` beside the staging directory)
    return re.compile(rf"^{re.escape(name)}\.(tmp|new|old)-([A-Za-z0-9_]+)-(\d+)-([0-9a-f]{{8}})(\..+)?$")


@dataclasses.dataclass(frozen=True)
class _Leftover:
    path: Path
    stage: str
    host: str
    pid: int
    suffix: str | None

    @property
    def ours(self) -> bool:
        return self.host == _SAFE_HOST.sub("_", _host())

    @property
    def writer_alive(self) -> bool:
        return not self.ours or pid_alive(self.pid)


def _leftovers(path: Path) -> list[_Leftover]:
    pattern = _staging_re(path.name)
    found = []
    try:
        names = os.listdir(path.parent)
    except FileNotFoundError:
        return []
    for name in names:
        m = pattern.match(name)
        if m:
            found.append(_Leftover(path.parent / name, m.group(1), m.group(2), int(m.group(3)), m.group(5)))
    return found


@contextlib.contextmanager
def _parent_lock(parent: Path) -> Iterator[None]:
    """flock on the parent directory while staging directories are renamed or recovered."""
    fd = None
    if fcntl is not None:
        try:
            fd = os.open(parent, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            if fd is not None:
                os.close(fd)
            fd = None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _remove_staging(tmp: Path) -> None:
    """Remove a staging directory and its writer's siblings (``<tmp>.*``, e.g. orbax's own
    temporary directory)."""
    _remove(tmp)
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(tmp.parent):
            if name.startswith(tmp.name + "."):
                _remove(tmp.parent / name)


def _recover_locked(path: Path) -> list[str]:
    """Recovery under the parent lock: `recover_directory`'s protocol."""
    actions: list[str] = []
    leftovers = _leftovers(path)
    # complete candidates (.new = written and closed; .old = the previous directory)
    complete = [x for x in leftovers if x.stage in ("new", "old") and x.suffix is None]
    if not os.path.lexists(path) and complete:
        def rank(x):  # a finished new version first, then the newest
            try:
                return (x.stage == "new", x.path.stat().st_mtime)
            except FileNotFoundError:
                return (False, -1.0)

        best = max(complete, key=rank)
        complete.remove(best)
        try:
            os.rename(best.path, path)
        except OSError:
            if os.path.lexists(path) or not os.path.lexists(best.path):
                return actions  # another process recovered it first
            raise
        _fsync_dir(path.parent)
        actions.append(f"restored {path} from {best.path.name} "
                       f"({'the new' if best.stage == 'new' else 'the previous'} version)")
    for x in complete:  # superseded: path holds a complete version
        _remove(x.path)
        actions.append(f"removed {x.path.name} ({'an unfinished replacement' if x.stage == 'new' else 'the replaced version'})")
    for x in leftovers:
        if x.stage == "tmp" or x.suffix is not None:
            if x.writer_alive:
                continue
            _remove(x.path)
            actions.append(f"removed {x.path.name} (incomplete, its writer PID {x.pid} is not running)")
    return actions


def recover_directory(path: str | os.PathLike) -> list[str]:
    """Finish or undo an `atomic_directory` swap that a killed process left half done.

    - ``path`` missing and a complete ``<path>.new-*`` or ``<path>.old-*`` beside it:
      the newest complete one (a ``.new`` first) is renamed to ``path``;
    - ``path`` present: leftover ``.new-*`` / ``.old-*`` are removed (``path`` is complete);
    - ``<path>.tmp-*`` (incomplete) whose writer is dead (same host, PID not running)
      are removed; those of live writers or other hosts are left alone.

    Returns what was done, one sentence per action (also logged as warnings).
    """
    path = _resolve(path)
    if not path.parent.is_dir():
        return []
    if not any(True for _ in _leftovers(path)):
        return []
    with _parent_lock(path.parent):
        actions = _recover_locked(path)
    for a in actions:
        log.warning("%s", a)
    return actions


def describe_leftovers(path: str | os.PathLike) -> str:
    """A sentence naming the staging directories beside ``path`` (empty when none), for
    error messages about a missing directory."""
    path = _resolve(path)
    found = _leftovers(path)
    if not found:
        return ""
    parts = []
    for x in sorted(found, key=lambda x: x.path.name):
        state = {"tmp": "incomplete", "new": "complete, not yet swapped in", "old": "the replaced version"}[x.stage]
        owner = f"PID {x.pid}" + ("" if x.ours else f" on host {x.host}")
        parts.append(f"{x.path.name} ({state}; written by {owner}{', still running' if x.ours and pid_alive(x.pid) else ''})")
    return "found beside it: " + "; ".join(parts)


def staging_token() -> str:
    """A fresh ``<host>-<pid>-<nonce>`` naming this process's staging directories."""
    return f"{_SAFE_HOST.sub('_', _host())}-{os.getpid()}-{secrets.token_hex(4)}"


def _resolve(path: str | os.PathLike) -> Path:
    path = Path(os.path.abspath(path))
    return Path(os.path.realpath(path)) if path.is_symlink() else path


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, *, overwrite: bool, hint: str = "pass overwrite=True to replace it",
                     token: str | None = None, primary: bool = True) -> Iterator[Path]:
    """Write a directory so that a kill at any moment leaves the complete old or the
    complete new one. Yields an empty staging directory to write into; on normal exit it
    replaces ``path``.

    Protocol (``T = <host>-<pid>-<nonce>``): 1. write ``<path>.tmp-T``; 2. fsync it and
    rename it to ``<path>.new-T`` (now complete); 3. rename ``path`` to ``<path>.old-T``;
    4. rename ``<path>.new-T`` to ``path``; 5. delete ``<path>.old-T``. Steps 2-5 run
    under an flock on the parent directory. A kill during 1 leaves ``path`` untouched;
    between 3 and 4 ``path`` is briefly missing and `recover_directory` (called by every
    writer and by the loaders) renames ``.new-T`` back into place; other leftovers are
    removed. On an exception inside the block the staging directory is deleted and
    ``path`` is untouched.

    The old directory stays readable until step 3, so the block may read ``path``
    (``convert M M --overwrite``); anything it still needs after the block must have been
    read into memory.

    Raises FileExistsError ``"<path> exists; <hint>"`` when ``path`` exists and not
    ``overwrite`` (checked before and again at the swap), `DirectoryLockedError` when a
    live process on this host is writing the same ``path``.

    Several processes writing one directory together (orbax on several hosts) pass the
    same ``token`` (from `staging_token` on one process, broadcast) and ``primary=True``
    on exactly one of them: only the primary checks, creates the staging directory and
    swaps; the others yield the same staging path and do nothing else, and must wait for
    the primary's swap (a barrier) before they read ``path``.
    """
    path = _resolve(path)
    if not primary:
        if token is None:
            raise ValueError("atomic_directory(primary=False) needs the primary's token")
        if path.exists() and not overwrite:
            raise FileExistsError(f"{path} exists; {hint}")
        yield _staging_name(path, "tmp", token)
        return
    if os.path.lexists(path) and not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a directory; remove it or choose another path")
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_directory(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; {hint}")
    for x in _leftovers(path):
        if x.stage == "tmp" and x.suffix is None and x.ours and x.pid != os.getpid() and pid_alive(x.pid):
            raise DirectoryLockedError(
                f"{path} is being written by another process (PID {x.pid} on this host, into {x.path.name}); "
                f"wait for it to finish, or remove {x.path} if no such process is writing it",
                path=path,
            )
    token = token or staging_token()
    if not re.fullmatch(r"[A-Za-z0-9_]+-\d+-[0-9a-f]{8}", token):
        raise ValueError(f"atomic_directory(token={token!r}): use staging_token()")
    tmp, new, old = (_staging_name(path, stage, token) for stage in _STAGES)
    tmp.mkdir()
    try:
        yield tmp
        if not tmp.is_dir():
            raise FileNotFoundError(f"{tmp}: the staging directory was removed before it was complete")
        _fsync_tree(tmp)
    except BaseException:
        _remove_staging(tmp)
        raise
    with _parent_lock(path.parent):
        _recover_locked(path)
        if path.exists() and not overwrite:
            _remove_staging(tmp)
            raise FileExistsError(f"{path} exists (created while this one was written); {hint}")
        os.rename(tmp, new)
        _fsync_dir(path.parent)
        replaced = False
        if os.path.lexists(path):
            os.rename(path, old)
            replaced = True
        os.rename(new, path)
        _fsync_dir(path.parent)
    if replaced:
        _remove(old)
    _remove_staging(tmp)  # a writer's own siblings of the staging directory, if any


# --------------------------------------------------------------------------- small files


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary sibling and ``os.replace``: readers
    and a kill see the old or the new content, never a torn file. A symlink is written
    through (its target is replaced, the link kept), and an existing file keeps its
    permissions (the temporary file's umask default made a private file world-readable)."""
    path = Path(path)
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    tmp = target.with_name(f".{target.name[:100]}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode) if target.is_file() else None
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        if isinstance(exc, OSError) and exc.filename == str(tmp) and exc.errno is not None:
            # name the file the caller asked for, not the temporary sibling
            raise type(exc)(exc.errno, exc.strerror, str(path)) from exc
        raise
    _fsync_dir(target.parent)
    return path


def strict_json_value(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, inf: not JSON) replaced by None, through
    dicts, lists and tuples, so ``json.dumps(..., allow_nan=False)`` accepts it."""
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        return {k: strict_json_value(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json_value(v) for v in obj]
    return obj


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    """`atomic_write_text` of ``obj`` as strict JSON (non-finite floats written as null),
    creating the parent directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(path, json.dumps(strict_json_value(obj), indent=2, allow_nan=False))


class JSONFileError(ValueError):
    """A JSON or JSON-lines file does not parse; the message names the file and line."""

    def __init__(self, message: str, *, path: Path, line: int | None = None):
        super().__init__(message)
        self.path = path
        self.line = line


def read_json(path: str | os.PathLike, *, what: str = "JSON file") -> Any:
    """Parse a JSON file. FileNotFoundError and `JSONFileError` name ``what`` and the
    file (and the line and column of a syntax error)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"{what} not found", str(path)) from None
    except UnicodeDecodeError as e:
        raise JSONFileError(f"{what} {path} is not UTF-8 text (byte {e.start})", path=path) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        torn = " (the file ends mid-value: it was cut off while being written)" if e.pos >= len(text.rstrip()) else ""
        raise JSONFileError(
            f"{what} {path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}{torn}",
            path=path, line=e.lineno,
        ) from None
    except (ValueError, RecursionError) as e:  # an integer of over 4300 digits, nesting past the recursion limit
        raise JSONFileError(f"{what} {path} cannot be read as JSON: {e}", path=path) from None


@dataclasses.dataclass
class JsonlContents:
    """`read_jsonl`'s result: the records and what was dropped."""

    records: list[Any]
    torn_line: int | None = None  # 1-based number of a dropped torn last line
    complete_bytes: int = 0  # length of the file's valid prefix, ending with a newline


def read_jsonl(path: str | os.PathLike, *, what: str = "JSON-lines file", warn: bool = True) -> JsonlContents:
    """Read a JSON-lines file (one JSON value per line; blank lines are skipped).

    A last line that does not parse and has no newline after it (a writer was killed
    mid-line) is dropped, with a warning naming the file and line. A bad line anywhere else raises `JSONFileError`
    naming the file and line. A missing file reads as empty.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return JsonlContents([], None, 0)
    bom = len(UTF8_BOM) if data.startswith(UTF8_BOM) else 0  # a BOM is not part of the first line
    data = data[bom:]
    lines = data.split(b"\n")
    # the last element is b"" when the file ends with a newline, else an unterminated line
    records: list[Any] = []
    offset = complete = bom  # byte offsets in the file as it is
    last_nonblank = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, raw in enumerate(lines):
        end = offset + len(raw) + (1 if i < len(lines) - 1 else 0)
        if raw.strip():
            try:
                records.append(json.loads(raw.decode("utf-8")))
            except (ValueError, RecursionError) as e:  # JSON and UTF-8 errors, >4300-digit ints, deep nesting
                if i == last_nonblank and i == len(lines) - 1:  # torn: no newline after it
                    if warn:
                        log.warning("%s %s: dropped a torn last line %d (%d bytes, %s); the writer was "
                                    "probably killed while writing it", what, path, i + 1, len(raw),
                                    getattr(e, "msg", e))
                    return JsonlContents(records, i + 1, complete)
                raise JSONFileError(f"{what} {path}: line {i + 1} is not valid JSON: {getattr(e, 'msg', e)}",
                                    path=path, line=i + 1) from None
        if i < len(lines) - 1:
            complete = end
        elif raw.strip():
            complete = end  # a parsed last line without a newline is complete
        offset = end
    return JsonlContents(records, None, complete)


#: the UTF-8 byte-order mark some editors write at the start of a text file
UTF8_BOM = b"\xef\xbb\xbf"


def jsonl_lines(path: str | os.PathLike) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of each non-blank line of a UTF-8 JSON Lines file, split at
    ``\\n`` only (``str.splitlines`` would also split at U+2028, U+2029 and U+0085, which
    ``json.dumps(..., ensure_ascii=False)`` writes raw inside strings). A UTF-8 byte-order mark
    at the start (as Windows editors write one) is not part of the first line."""
    for n, raw in enumerate(Path(path).read_bytes().removeprefix(UTF8_BOM).split(b"\n"), 1):
        try:
            line = raw.decode("utf-8").removesuffix("\r")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}:{n}: not UTF-8 text ({raw[e.start:e.start + 4]!r} at character "
                             f"{e.start}); save the file as UTF-8") from None
        if line.strip():
            yield n, line
