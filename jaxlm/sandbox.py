"""Run untrusted Python (model-written programs, tool code) in a child process with limits.

Each run gets a fresh temporary directory as its working directory and home, a minimal
environment, and POSIX resource limits: address space (``memory_mb``), CPU seconds, file
size and open files; a wall-clock timeout kills its whole process group. Inside the child,
an audit hook (PEP 578) installed before the program runs ends the process at once, with
exit status `VIOLATION_EXIT` (and a word on a pipe only the guard writes to, so a program's
own ``exit(113)`` is not taken for one), when the program tries to write, delete, rename or create a
file outside its directory (SQLite databases and FIFOs included; paths relative to a
directory descriptor, and files changed through a descriptor, are resolved), start a process, open a
network socket or load a C library via ctypes. The program is stopped, not merely refused,
so catching the error cannot hide it.

This contains mistakes and naive misuse (infinite loops, memory blow-ups, stray writes);
it is not a security boundary against a determined adversary (use a container or a VM).

Two entry points: `run_python` (a script, stdin -> stdout) and `call_function` (a function
defined by the program called on many inputs in one process, each call with its own time
limit; results come back as JSON), which is what executing candidates on test suites uses.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap

VIOLATION_EXIT = 113
_RESULT_MARK = "\x1e__sandbox_results__"

_GUARD = r'''
import os as _os, sys as _sys
_ROOT = _os.path.realpath(_os.getcwd())
_WRITE = _os.O_WRONLY | _os.O_RDWR | _os.O_CREAT | _os.O_APPEND | _os.O_TRUNC

def _inside(path, dir_fd=None):
    try:
        if isinstance(path, int):
            return True
        p = _os.fsdecode(path)
        if dir_fd is not None and dir_fd >= 0 and not _os.path.isabs(p):  # relative to that directory
            p = _os.path.join(_os.readlink("/proc/self/fd/%%d" %% dir_fd), p)
        p = _os.path.realpath(p)
    except Exception:
        return False
    return p == _ROOT or p.startswith(_ROOT + _os.sep)

def _inside_fd(fd):  # the file an open descriptor refers to (a pipe or socket is not a path)
    try:
        target = _os.readlink("/proc/self/fd/%%d" %% fd)
    except Exception:
        return False
    return not target.startswith("/") or _inside(target)

def _stop(what):
    try:  # the parent's own channel: only a stop writes there, so an exit status alone is no violation
        _os.write(@VFD@, what.encode("utf-8", "replace"))
    except BaseException:
        pass
    try:  # a closed or full stderr must not turn the stop into a catchable error
        _os.write(2, ("sandbox violation: " + what + "\n").encode("utf-8", "replace"))
    except BaseException:
        pass
    finally:
        _os._exit(%(exit)d)

_PATH_EVENTS = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.chmod", "os.chown", "os.symlink",
                "os.link", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "os.replace"}
# where each event's ``dir_fd`` arguments sit (relative paths are resolved against them);
# os.symlink's first argument is the link's content, resolved against the working directory
_DIR_FDS = {"os.remove": (1,), "os.rmdir": (1,), "os.mkdir": (2,), "os.chmod": (2,), "os.utime": (3,),
            "os.chown": (3,), "os.rename": (2, 3), "os.replace": (2, 3), "os.link": (2, 3),
            "os.symlink": (99, 2)}
_DENIED = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
           "os.kill", "os.killpg", "socket.connect", "socket.bind", "socket.sendto", "ctypes.dlopen",
           "ctypes.dlsym", "os.startfile", "pty.spawn"}

def _hook(event, args):
    if event == "open":
        path, mode, flags = (list(args) + [None, None, None])[:3]
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & _WRITE)
        if writing and not _inside(path):
            _stop("write to %%r outside the sandbox directory" %% (path,))
    elif event in _PATH_EVENTS:
        fds = _DIR_FDS.get(event, ())
        if args and isinstance(args[0], int) and not isinstance(args[0], bool) and not _inside_fd(args[0]):
            _stop("%%s on descriptor %%d, a file outside the sandbox directory" %% (event, args[0]))
        for i, a in enumerate(args[:2]):
            fd = args[fds[i]] if i < len(fds) and fds[i] < len(args) else None
            if isinstance(a, (str, bytes, _os.PathLike)) and not _inside(a, fd if isinstance(fd, int) else None):
                _stop("%%s on %%r outside the sandbox directory" %% (event, a))
    elif event == "sqlite3.connect":  # SQLite opens its file itself, with no open event
        db = args[0] if args else None
        if isinstance(db, (str, bytes, _os.PathLike)):
            path = _os.fsdecode(db)
            if path.startswith("file:"):  # a URI: its path, without the query
                path = path[5:].split("?")[0].split("#")[0]
            if path not in (":memory:", "") and not _inside(path):
                _stop("sqlite3.connect to %%r outside the sandbox directory" %% (db,))
    elif event in _DENIED:
        _stop(event + " is not allowed")

_sys.addaudithook(_hook)
del _hook


def _no_special_files(name):  # os.mkfifo / os.mknod raise no audit event
    def refuse(path, *args, **kwargs):
        if not _inside(path, kwargs.get("dir_fd")):
            _stop("%%s of %%r outside the sandbox directory" %% (name, path))
        return getattr(_posix, name)(path, *args, **kwargs)
    return refuse


def _open_at(path, flags, mode=0o777, *, dir_fd=None):  # the "open" event does not carry dir_fd
    if flags & _WRITE and not _inside(path, dir_fd):
        _stop("write to %%r outside the sandbox directory" %% (path,))
    return _posix_open(path, flags, mode, dir_fd=dir_fd)


def _no_attach(connect):  # SQL's ATTACH and VACUUM INTO open database files with no event
    def guarded(*args, **kwargs):
        con = connect(*args, **kwargs)
        con.setlimit(_sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        return con
    return guarded


try:
    import sqlite3 as _sqlite3
    import sqlite3.dbapi2 as _dbapi2
    _sqlite3.connect = _dbapi2.connect = _no_attach(_dbapi2.connect)
except ImportError:
    pass

import posix as _posix
_posix_open = _posix.open
for _name in ("mkfifo", "mknod"):
    if hasattr(_posix, _name):
        setattr(_os, _name, _no_special_files(_name))
_os.open = _posix.open = _open_at  # posix.open too: os.open is that function
''' % {"exit": VIOLATION_EXIT}

def canonical_repr(v, _open=None):
    """``repr(v)`` with the items of sets and dicts (and of the lists and tuples holding them)
    in sorted order: values equal under ``==`` whose repr differs only by order (a set built in
    another order, a dict with another insertion order) give one text. The sandbox reports
    return values in this form (its source runs in the child), so a tester's expected outputs
    compare with `CallResult.value` as ``canonical_repr(expected)``."""
    t = type(v)
    if t not in (list, tuple, dict, set, frozenset):
        return repr(v)
    _open = set() if _open is None else _open
    if id(v) in _open:  # a container that holds itself, as repr writes it
        return {list: "[...]", dict: "{...}"}.get(t, "...")
    _open.add(id(v))
    try:
        if t is dict:
            pairs = (canonical_repr(k, _open) + ": " + canonical_repr(x, _open) for k, x in v.items())
            return "{" + ", ".join(sorted(pairs)) + "}"
        items = [canonical_repr(x, _open) for x in v]
        if t is list:
            return "[" + ", ".join(items) + "]"
        if t is tuple:
            return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
        body = "{" + ", ".join(sorted(items)) + "}" if items else ""
        return (body or "set()") if t is set else "frozenset(" + body + ")"
    finally:
        _open.discard(id(v))


_CALLER = r'''
import json as _json, signal as _signal, sys as _sys, time as _time, traceback as _tb

class _TimeUp(BaseException):
    pass

def _alarm(signum, frame):
    raise _TimeUp()

_signal.signal(_signal.SIGALRM, _alarm)

@CANON@
_spec = _json.loads(_sys.stdin.read())
_namespace = {"__name__": "candidate"}
def _report(result):  # each call's result as soon as it is known: a process that dies keeps them
    _sys.stdout.flush()
    _sys.stdout.write(@MARK@ + _json.dumps(result) + "\n")
    _sys.stdout.flush()

try:
    exec(compile(open("program.py").read(), "program.py", "exec"), _namespace)
    _fn = _namespace.get(_spec["function"])
    _missing = None if callable(_fn) else "the program defines no function %r" % _spec["function"]
except _TimeUp:
    _fn, _missing = None, "defining the program timed out"
except BaseException as _e:
    _fn, _missing = None, "the program failed to load: %s: %s" % (type(_e).__name__, _e)
for _arg in _spec["inputs"]:
    if _fn is None:
        _report({"ok": False, "error": _missing})
        continue
    _start = _time.monotonic()
    try:
        # the alarm repeats until the call ends: a candidate that catches one meets the next
        _signal.setitimer(_signal.ITIMER_REAL, _spec["timeout_s"], 0.05)
        _value = _fn(*_arg)
        _signal.setitimer(_signal.ITIMER_REAL, 0)
        if _time.monotonic() - _start > _spec["timeout_s"]:  # it caught every alarm and returned late
            _report({"ok": False, "error": "timeout"})
        else:
            _report({"ok": True, "value": canonical_repr(_value)})
    except _TimeUp:
        _signal.setitimer(_signal.ITIMER_REAL, 0)
        _report({"ok": False, "error": "timeout"})
    except MemoryError:
        _signal.setitimer(_signal.ITIMER_REAL, 0)
        _report({"ok": False, "error": "memory"})
    except BaseException as _e:
        _signal.setitimer(_signal.ITIMER_REAL, 0)
        _report({"ok": False, "error": "%s: %s" % (type(_e).__name__, str(_e)[:200])})
'''.replace("@MARK@", repr(_RESULT_MARK)).replace("@CANON@", inspect.getsource(canonical_repr))


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-run limits: wall-clock and CPU seconds, address space (MiB), largest file written
    (MiB), open files, and the stdout/stderr characters kept."""

    timeout_s: float = 5.0
    cpu_s: int = 10
    memory_mb: int = 512
    file_mb: int = 16
    open_files: int = 64
    output_chars: int = 100_000

    def __post_init__(self):
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise ValueError(f"Limits.timeout_s={t!r} is invalid: must be a finite number of seconds > 0")
        for name in ("cpu_s", "memory_mb", "file_mb", "open_files", "output_chars"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"Limits.{name}={v!r} is invalid: must be an int > 0 (a resource limit)")


@dataclasses.dataclass(frozen=True)
class RunResult:
    """What happened: ``status`` is "ok" (exit 0), "error" (non-zero exit), "timeout",
    "memory" (ran out of its address space), "output" (wrote more than ``file_mb`` to a
    file or its output) or "violation" (the guard stopped it)."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _limit(limits: Limits) -> str:
    """The child's first statements: its resource limits (set in the child itself, so the
    parent, often a multithreaded JAX process, never forks with a pre-exec hook)."""
    mb = 1 << 20
    pairs = {"RLIMIT_AS": limits.memory_mb * mb, "RLIMIT_CPU": limits.cpu_s, "RLIMIT_FSIZE": limits.file_mb * mb,
             "RLIMIT_NOFILE": limits.open_files, "RLIMIT_CORE": 0}
    lines = ["import resource as _resource"]
    for name, value in pairs.items():
        hard = value + 1 if name == "RLIMIT_CPU" else value
        lines.append(f"_resource.setrlimit(_resource.{name}, ({value}, {hard}))")
    return "\n".join(lines) + "\ndel _resource\n"


_RESERVED = frozenset({"program.py", ".stdout", ".stderr"})
# exit() / quit() come from `site`, which -S skips: a program ending with exit() raised NameError
_QUIT = "import builtins as _bi, sys as _sy\n_bi.exit = _bi.quit = _sy.exit\ndel _bi, _sy\n"


def _run(script: str, program: str, stdin: str, limits: Limits, files: dict[str, str] | None,
         *, results_mark: str | None = None) -> RunResult:
    """Run ``script`` beside ``program.py``. Output is read as UTF-8 with undecodable bytes
    replaced; stdout keeps its first ``limits.output_chars`` characters (up to the first
    ``results_mark``), then every line that starts with ``results_mark`` (a caller's results,
    one per line, among the program's own output)."""
    work = tempfile.mkdtemp(prefix="jaxlm-sandbox-")
    try:
        with open(os.path.join(work, "program.py"), "w") as f:
            f.write(program)
        for name, text in (files or {}).items():
            if os.path.normpath(name) in _RESERVED:  # it would replace the program or its captured output
                raise ValueError(f"sandbox file name {name!r} is reserved (the program and its output use "
                                 f"{sorted(_RESERVED)})")
            path = os.path.realpath(os.path.join(work, name))
            if not path.startswith(os.path.realpath(work) + os.sep):
                raise ValueError(f"sandbox file name {name!r} points outside the sandbox directory")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
        env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONHASHSEED": "0", "LANG": "C.UTF-8"}
        # output goes to files in the run's directory, so the file-size limit bounds it too
        with open(os.path.join(work, ".stdout"), "w+", encoding="utf-8", errors="replace") as out_f, \
                open(os.path.join(work, ".stderr"), "w+", encoding="utf-8", errors="replace") as err_f:
            stop_r, stop_w = os.pipe()  # the guard's violation channel (see `_stop`)
            guard = _GUARD.replace("@VFD@", str(stop_w))
            try:
                # -s -P -S rather than -I: the environment is built here, and -I would also drop
                # PYTHONHASHSEED (hash order, and every set's repr, would change from run to run)
                proc = subprocess.Popen([sys.executable, "-s", "-P", "-S", "-c",
                                         _limit(limits) + guard + _QUIT + script], cwd=work,
                                        env=env, stdin=subprocess.PIPE, stdout=out_f, stderr=err_f,
                                        start_new_session=True, text=True, pass_fds=(stop_w,))
            except BaseException:
                os.close(stop_r)
                raise
            finally:
                os.close(stop_w)
            timed_out = False
            try:
                proc.communicate(stdin, timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                timed_out = True
            out_f.seek(0)
            full = out_f.read()  # at most Limits.file_mb
            out = full[:limits.output_chars]
            if results_mark is not None and results_mark in full:
                # every result line (a mark, its JSON, a newline), however much the program printed
                results = "".join(results_mark + seg.split("\n", 1)[0] + "\n" for seg in full.split(results_mark)[1:])
                out = out.split(results_mark, 1)[0] + results
            err_f.seek(0)
            err = err_f.read()[-limits.output_chars:]
            os.set_blocking(stop_r, False)
            try:
                stopped = bool(os.read(stop_r, 1))
            except BlockingIOError:
                stopped = False
            finally:
                os.close(stop_r)
        if timed_out:
            return RunResult("timeout", None, out, err)
        rc = proc.returncode
        if rc == 0:
            status = "ok"
        elif rc == VIOLATION_EXIT and (stopped or "sandbox violation: " in err):  # not a bare exit(113)
            status = "violation"
        elif _uncaught(err, r"MemoryError(: .*)?"):  # the traceback's exception, not any mention
            status = "memory"
        elif _uncaught(err, r"OSError: \[Errno \d+\] File too large.*"):
            status = "output"  # Python ignores SIGXFSZ: the write fails with EFBIG
        elif rc in (-signal.SIGXCPU, -signal.SIGKILL):
            status = "timeout"
        elif rc == -signal.SIGXFSZ:
            status = "output"  # wrote more than Limits.file_mb
        else:
            status = "error"
        return RunResult(status, rc, out, err)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _uncaught(err: str, pattern: str) -> bool:
    """Whether the last line of ``err`` (an uncaught exception's ``Type: message``; Python may
    print it without the traceback when memory ran out) matches ``pattern``."""
    lines = [line for line in err.splitlines() if line.strip()]
    return bool(lines) and re.fullmatch(pattern, lines[-1]) is not None


_SCRIPT = 'exec(compile(open("program.py").read(), "program.py", "exec"), {"__name__": "__main__"})\n'


def run_python(program: str, *, stdin: str = "", limits: Limits = Limits(), files: dict[str, str] | None = None
               ) -> RunResult:
    """Run ``program`` as a script (``__name__ == "__main__"``) with ``stdin``; ``files``
    (relative name -> text) are written into its directory first."""
    return _run(_SCRIPT, program, stdin, limits, files)


@dataclasses.dataclass(frozen=True)
class CallResult:
    """One call: ``ok`` with the ``repr`` of the return ``value`` (the items of its sets and
    dicts in sorted order, so values equal under ``==`` by content give one text), or the
    ``error``."""

    ok: bool
    value: str | None = None
    error: str | None = None


def call_function(program: str, function: str, inputs: list, *, call_timeout_s: float = 1.0,
                  limits: Limits = Limits()) -> tuple[list[CallResult], RunResult]:
    """Define ``program`` and call ``function(*args)`` for each ``args`` in ``inputs`` (a list
    of JSON-serialisable positional arguments) in one sandboxed process, each call stopped
    after ``call_timeout_s``. A process that dies (memory, violation, the overall timeout)
    fails every call it did not report."""
    if isinstance(call_timeout_s, bool) or not isinstance(call_timeout_s, (int, float)) \
            or not 0 < call_timeout_s <= 1e6:  # inf / NaN failed every call inside setitimer
        raise ValueError(f"call_timeout_s={call_timeout_s!r} must be a number in (0, 1e6] seconds")
    for i, args in enumerate(inputs):
        if not isinstance(args, (list, tuple)):
            raise ValueError(f"inputs[{i}]={args!r} must be a list of positional arguments (e.g. [x])")
    spec = json.dumps({"function": function, "inputs": list(inputs), "timeout_s": float(call_timeout_s)})
    run = _run(textwrap.dedent(_CALLER), program, spec, limits, None, results_mark=_RESULT_MARK)
    reported: list = []
    for segment in run.stdout.split(_RESULT_MARK)[1:]:
        try:
            r = json.loads(segment.split("\n", 1)[0])
        except json.JSONDecodeError:
            break
        if not isinstance(r, dict) or not isinstance(r.get("ok"), bool):
            break
        reported.append(CallResult(r["ok"], r.get("value"), r.get("error")))
    if len(reported) > len(inputs) or (run.status == "ok" and len(reported) != len(inputs)):
        return [CallResult(False, error="the program's results were unreadable") for _ in inputs], run
    # a process that died (memory, violation, the overall timeout) keeps the calls it reported
    return reported + [CallResult(False, error=run.status) for _ in inputs[len(reported):]], run
