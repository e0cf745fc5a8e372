"""jaxlm.fileio under real processes: directory locks (contention, SIGKILL, other hosts),
atomic directory replacement under SIGKILL at random and at every crash point, JSON
readers that name the file."""

import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from jaxlm import fileio
from jaxlm.fileio import (
    DirectoryLock,
    DirectoryLockedError,
    JSONFileError,
    atomic_directory,
    atomic_write_text,
    read_json,
    read_jsonl,
    recover_directory,
)

FILEIO = Path(fileio.__file__)

# Child processes load jaxlm/fileio.py alone (standard library only): they start in
# milliseconds, so many SIGKILL trials fit in a few seconds.
PRELUDE = textwrap.dedent(f"""
    import importlib.util, os, signal, sys, time
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("fileio", {str(FILEIO)!r})
    fileio = importlib.util.module_from_spec(spec)
    sys.modules["fileio"] = fileio
    spec.loader.exec_module(fileio)
""")


def _child(code: str, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(code), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def _wait_for_line(proc: subprocess.Popen, expected: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.strip() == expected:
            return line
        if not line and proc.poll() is not None:
            raise AssertionError(f"child exited {proc.returncode}: {proc.stderr.read()}")
    raise AssertionError(f"child did not print {expected!r}")


HOLD_LOCK = """
    lock = fileio.DirectoryLock(sys.argv[1], what="training run")
    lock.acquire()
    print("locked", flush=True)
    time.sleep(60)
"""


# --------------------------------------------------------------------------- locks


def test_second_process_is_refused_with_the_holders_details(tmp_path):
    holder = _child(HOLD_LOCK, str(tmp_path / "run"), "--marker-arg")
    try:
        _wait_for_line(holder, "locked")
        with pytest.raises(DirectoryLockedError) as err:
            DirectoryLock(tmp_path / "run", what="training run").acquire()
        msg = str(err.value)
        assert str(tmp_path / "run") in msg
        assert f"PID {holder.pid} on host {socket.gethostname()}" in msg
        assert "started" in msg and "--marker-arg" in msg  # its start time and command
        assert "another training run" in msg and "Wait for it to finish" in msg
        assert str(tmp_path / "run" / ".jaxlm.lock") in msg
        assert err.value.holder.pid == holder.pid
        assert isinstance(err.value, RuntimeError)
    finally:
        holder.kill()
        holder.wait()


HOLD_BESIDE = """
    lock = fileio.DirectoryLock(sys.argv[1], beside=True, what="model being written")
    lock.acquire()
    print("locked", flush=True)
    time.sleep(60)
"""


def test_a_symlink_is_locked_as_the_directory_it_names(tmp_path):
    """A lock beside a symlink was the link's own (.alias.jaxlm.lock), so a second writer went
    through the link while the first held the real directory's."""
    (tmp_path / "model").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "model")
    holder = _child(HOLD_BESIDE, str(tmp_path / "model"))
    try:
        _wait_for_line(holder, "locked")
        with pytest.raises(DirectoryLockedError, match=f"PID {holder.pid}"):
            DirectoryLock(tmp_path / "alias", beside=True).acquire()
    finally:
        holder.kill()
        holder.wait()


def test_a_damaged_start_time_still_names_the_holder():
    from jaxlm.fileio import LockHolder

    holder = LockHolder.from_text('{"pid": 7, "host": "h", "started": NaN, "command": "train"}')
    assert holder.describe() == "PID 7 on host h, start time unknown, command: train"


def test_racing_processes_exactly_one_wins(tmp_path):
    racer = """
        start = float(sys.argv[2])
        while time.time() < start:
            pass
        try:
            lock = fileio.DirectoryLock(sys.argv[1]).acquire()
            print("won", flush=True)
            time.sleep(1.5)
            lock.release()
        except fileio.DirectoryLockedError:
            print("lost", flush=True)
    """
    start = time.time() + 1.0
    procs = [_child(racer, str(tmp_path / "run"), repr(start)) for _ in range(4)]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert sorted(outs) == ["lost", "lost", "lost", "won"], outs


def test_stale_lock_after_sigkill_is_taken_over_with_a_warning(tmp_path, caplog):
    holder = _child(HOLD_LOCK, str(tmp_path / "run"))
    _wait_for_line(holder, "locked")
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (tmp_path / "run" / ".jaxlm.lock").exists()  # the record stays after a kill
    assert fileio.lock_holder(tmp_path / "run").pid == holder.pid
    with caplog.at_level(logging.WARNING, logger="jaxlm.fileio"):
        with DirectoryLock(tmp_path / "run") as lock:
            assert lock.held
            assert json.loads((tmp_path / "run" / ".jaxlm.lock").read_text())["pid"] == os.getpid()
    assert "taking over a stale lock" in caplog.text
    assert f"PID {holder.pid}" in caplog.text and "no longer running" in caplog.text
    assert not (tmp_path / "run" / ".jaxlm.lock").exists()  # released on exit


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _write_record(path: Path, *, pid: int, host: str, started: float | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.time() - 600 if started is None else started
    path.write_text(json.dumps({"pid": pid, "host": host, "started": started,
                                "command": "jaxlm train quickstart", "what": "training run"}))


def test_lock_from_another_host_needs_force(tmp_path, caplog):
    _write_record(tmp_path / "run" / ".jaxlm.lock", pid=4242, host="other-node-7")
    with pytest.raises(DirectoryLockedError) as err:
        DirectoryLock(tmp_path / "run", force_hint="--force").acquire()
    msg = str(err.value)
    assert "on another host" in msg and "other-node-7" in msg and "PID 4242" in msg
    assert "cannot tell whether that process is still running" in msg and "--force" in msg
    with caplog.at_level(logging.WARNING, logger="jaxlm.fileio"):
        with DirectoryLock(tmp_path / "run", force=True):
            pass
    assert "because force was given" in caplog.text


@pytest.mark.parametrize("flock", [True, False])
def test_same_process_shares_its_lock_and_locks_are_per_process_index(tmp_path, monkeypatch, flock):
    if not flock:
        monkeypatch.setattr(fileio, "fcntl", None)
    with DirectoryLock(tmp_path / "run") as outer:
        with DirectoryLock(tmp_path / "run") as inner:
            assert inner.held
        assert (tmp_path / "run" / ".jaxlm.lock").exists()  # still held by outer
        with DirectoryLock(tmp_path / "run", process_index=3) as other:
            assert other.lock_path.name == ".jaxlm.lock.3"
        assert outer.held
    assert not (tmp_path / "run" / ".jaxlm.lock").exists()
    beside = DirectoryLock(tmp_path / "model", beside=True, what="jaxlm convert")
    assert beside.lock_path == tmp_path / ".model.jaxlm.lock"


def test_without_flock_live_pid_blocks_and_dead_pid_is_stale(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(fileio, "fcntl", None)
    lock_file = tmp_path / "run" / ".jaxlm.lock"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        _write_record(lock_file, pid=live.pid, host=socket.gethostname(), started=time.time())
        with pytest.raises(DirectoryLockedError, match=f"PID {live.pid}"):
            DirectoryLock(tmp_path / "run").acquire()
    finally:
        live.kill()
        live.wait()
    dead = _dead_pid()
    _write_record(lock_file, pid=dead, host=socket.gethostname())
    with caplog.at_level(logging.WARNING, logger="jaxlm.fileio"):
        with DirectoryLock(tmp_path / "run"):
            assert json.loads(lock_file.read_text())["pid"] == os.getpid()
    assert f"PID {dead}" in caplog.text and "stale" in caplog.text


def test_without_flock_a_reused_pid_is_stale(tmp_path, monkeypatch, caplog):
    """A record naming a PID that now belongs to another process (this one, as in a container
    where every run gets the same PID, or one started after the record was written) could
    never be taken over: the directory stayed locked for good."""
    monkeypatch.setattr(fileio, "fcntl", None)
    lock_file = tmp_path / "run" / ".jaxlm.lock"
    _write_record(lock_file, pid=os.getpid(), host=socket.gethostname())  # an earlier run's record
    with caplog.at_level(logging.WARNING, logger="jaxlm.fileio"):
        with DirectoryLock(tmp_path / "run"):
            assert json.loads(lock_file.read_text())["started"] > time.time() - 60
    assert "stale" in caplog.text
    if fileio.process_start_time(os.getpid()) is None:
        return  # no /proc here: a live foreign PID is taken as the holder
    later = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_record(lock_file, pid=later.pid, host=socket.gethostname(), started=time.time() - 600)
        with DirectoryLock(tmp_path / "run"):
            assert json.loads(lock_file.read_text())["pid"] == os.getpid()
    finally:
        later.kill()
        later.wait()


def test_process_start_time_is_when_the_process_started():
    if fileio.process_start_time(os.getpid()) is None:
        return  # no /proc on this OS: the lock falls back to the PID alone
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    after = time.time()
    try:
        assert before - 2.0 <= fileio.process_start_time(child.pid) <= after + 2.0
    finally:
        child.kill()
        child.wait()
    assert fileio.process_start_time(_dead_pid()) is None


# --------------------------------------------------------------------------- atomic directories

N_FILES = 6

# Replaces directory argv[1] over and over; each version's files all hold the version
# number, written slowly. With "same": each new version is computed from the old one read
# inside the block (convert M M --overwrite). argv[2]: "random" or a crash point
# "before:<k>" / "after:<k>" (SIGKILL just before / after the k-th os.rename).
REWRITER = f"""
    path = Path(sys.argv[1])
    mode = sys.argv[2]
    if mode != "random":
        when, k = mode.split(":")
        real_rename, calls = os.rename, [0]
        def rename(src, dst):
            calls[0] += 1
            if when == "before" and calls[0] == int(k):
                os.kill(os.getpid(), signal.SIGKILL)
            real_rename(src, dst)
            if when == "after" and calls[0] == int(k):
                os.kill(os.getpid(), signal.SIGKILL)
        os.rename = rename
    print("started", flush=True)
    while True:
        with fileio.atomic_directory(path, overwrite=True) as tmp:
            version = int((path / "version").read_text()) + 1  # read the old inside the block
            for i in range({N_FILES}):
                (tmp / f"part{{i}}").write_text(str(version) * 1000)
                time.sleep(0.004)
            (tmp / "version").write_text(str(version))
"""


def _write_version(path: Path, version: int) -> None:
    path.mkdir(parents=True)
    for i in range(N_FILES):
        (path / f"part{i}").write_text(str(version) * 1000)
    (path / "version").write_text(str(version))


def _check_complete(path: Path) -> int:
    """The version in ``path``; fails unless the directory is complete and unmixed."""
    assert path.is_dir(), f"{path} is missing"
    names = sorted(p.name for p in path.iterdir())
    assert names == sorted([f"part{i}" for i in range(N_FILES)] + ["version"]), names
    version = int((path / "version").read_text())
    for i in range(N_FILES):
        assert (path / f"part{i}").read_text() == str(version) * 1000, f"part{i} mixed into version {version}"
    return version


def test_atomic_directory_survives_sigkill_at_random_moments(tmp_path):
    path = tmp_path / "model"
    _write_version(path, 0)
    rng = random.Random(0)
    versions = [0]
    for trial in range(24):
        proc = _child(REWRITER, str(path), "random")
        _wait_for_line(proc, "started")
        time.sleep(rng.uniform(0.0, 0.12))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        recover_directory(path)  # what the next writer or loader does first
        versions.append(_check_complete(path))
        leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name != "model")
        assert leftovers == [], f"trial {trial}: {leftovers}"
    assert versions == sorted(versions)  # never rolled back past a finished version
    assert versions[-1] > 0  # some trials finished a replacement


@pytest.mark.parametrize("crash", ["before:1", "before:2", "before:3", "after:3"])
def test_atomic_directory_every_crash_point(tmp_path, crash):
    """The swap's renames: staging -> .new, old -> .old, .new -> path; then .old removed."""
    path = tmp_path / "model"
    _write_version(path, 0)
    proc = _child(REWRITER, str(path), crash)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
    actions = recover_directory(path)
    version = _check_complete(path)
    assert version == {"before:1": 0, "before:2": 0, "before:3": 1, "after:3": 1}[crash]
    if crash == "before:3":
        assert any("restored" in a for a in actions), actions
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_atomic_directory_exists_error_and_failed_body(tmp_path):
    path = tmp_path / "out"
    with atomic_directory(path, overwrite=False) as tmp:
        (tmp / "a").write_text("old")
    with pytest.raises(FileExistsError, match=r"out exists; pass --overwrite to replace it"):
        with atomic_directory(path, overwrite=False, hint="pass --overwrite to replace it"):
            pass
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_directory(path, overwrite=True) as tmp:
            (tmp / "a").write_text("new")
            raise RuntimeError("boom")
    assert (path / "a").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="not a directory"):
        with atomic_directory(tmp_path / "file", overwrite=True):
            pass


def test_atomic_directory_refuses_while_another_process_writes(tmp_path):
    writer = _child("""
        with fileio.atomic_directory(sys.argv[1], overwrite=True) as tmp:
            print("writing", flush=True)
            time.sleep(60)
    """, str(tmp_path / "out"))
    try:
        _wait_for_line(writer, "writing")
        with pytest.raises(DirectoryLockedError, match=f"being written by another process \\(PID {writer.pid}"):
            with atomic_directory(tmp_path / "out", overwrite=True):
                pass
    finally:
        writer.kill()
        writer.wait()
    # its staging directory is an orphan now: removed, and the write goes through
    with atomic_directory(tmp_path / "out", overwrite=True) as tmp:
        (tmp / "a").write_text("1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_missing_directory_is_restored_from_a_complete_leftover(tmp_path):
    """Killed between 'old -> .old' and '.new -> path': only the leftovers remain."""
    token = fileio.staging_token()
    _write_version(tmp_path / f"model.old-{token}", 3)
    _write_version(tmp_path / f"model.new-{token}", 4)
    assert "complete, not yet swapped in" in fileio.describe_leftovers(tmp_path / "model")
    recover_directory(tmp_path / "model")
    assert _check_complete(tmp_path / "model") == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    # only the previous version left (path removed by hand afterwards): it comes back
    _write_version(tmp_path / f"model.old-{token}", 5)
    shutil.rmtree(tmp_path / "model")
    recover_directory(tmp_path / "model")
    assert _check_complete(tmp_path / "model") == 5


# --------------------------------------------------------------------------- small files


def test_read_json_names_the_file_line_and_column(tmp_path):
    (tmp_path / "config.json").write_text('{"a": 1,\n "b": ')
    with pytest.raises(JSONFileError, match=r"run config .*config\.json is not valid JSON: .* line 2 column 7"
                                            r".*cut off while being written"):
        read_json(tmp_path / "config.json", what="run config")
    with pytest.raises(FileNotFoundError, match=r"run config not found.*missing\.json"):
        read_json(tmp_path / "missing.json", what="run config")
    atomic_write_text(tmp_path / "config.json", '{"a": 2}')
    assert read_json(tmp_path / "config.json") == {"a": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_read_jsonl_drops_only_a_torn_last_line(tmp_path, caplog):
    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 1}\n{"step": 2}\n\n{"step": 3, "lo')
    with caplog.at_level(logging.WARNING, logger="jaxlm.fileio"):
        got = read_jsonl(f, what="metrics file")
    assert got.records == [{"step": 1}, {"step": 2}] and got.torn_line == 4
    assert f"metrics file {f}: dropped a torn last line 4" in caplog.text
    assert f.read_bytes()[: got.complete_bytes] == b'{"step": 1}\n{"step": 2}\n\n'
    f.write_text('{"step": 1}\n{"step": 2\n{"step": 3}\n')
    with pytest.raises(JSONFileError, match=rf"metrics file {f}: line 2 is not valid JSON"):
        read_jsonl(f, what="metrics file")
    f.write_text('{"step": 1}\n{"step": 2}')  # a complete last line without its newline
    assert read_jsonl(f).records == [{"step": 1}, {"step": 2}]
    assert read_jsonl(tmp_path / "absent.jsonl").records == []
    # a bad last line *with* its newline was not cut off by a kill: an error, not dropped
    f.write_text('{"step": 1,}\n', encoding="utf-8")
    with pytest.raises(JSONFileError, match=rf"metrics file {f}: line 1 is not valid JSON"):
        read_jsonl(f, what="metrics file")
    f.write_text('{"step": 1}\n{"step": 2, "lo\n')
    with pytest.raises(JSONFileError, match="line 2 is not valid JSON"):
        read_jsonl(f)


def test_json_readers_name_the_file_for_huge_integers_and_deep_nesting(tmp_path):
    """json.loads raises a bare ValueError for an integer of over 4300 digits and a
    RecursionError for very deep nesting: the readers name the file (and line)."""
    from jaxlm.data.files import DataError, read_rows
    from jaxlm.fileio import jsonl_lines

    for body in ('{"prompt": "a", "completion": "b", "id": ' + "9" * 5000 + "}", "[" * 100_000 + "]" * 100_000):
        (tmp_path / "x.json").write_text(body)
        with pytest.raises(JSONFileError, match="x.json cannot be read as JSON"):
            read_json(tmp_path / "x.json")
        (tmp_path / "x.jsonl").write_text('{"step": 1}\n' + body + "\n")
        with pytest.raises(JSONFileError, match="line 2 is not valid JSON"):
            read_jsonl(tmp_path / "x.jsonl")
        (tmp_path / "rows.jsonl").write_text('{"prompt": "1+1=", "completion": "2"}\n' + body + "\n")
        with pytest.raises(DataError, match=r"rows.jsonl:2: cannot be read as JSON"):
            read_rows(tmp_path / "rows.jsonl")
    (tmp_path / "r.jsonl").write_bytes(b'{"a": 1}\n{"a": "caf\xe9"}\n')  # Latin-1, not UTF-8
    with pytest.raises(ValueError, match=r"r.jsonl:2: not UTF-8 text"):
        list(jsonl_lines(tmp_path / "r.jsonl"))


def test_atomic_write_text_writes_through_a_symlink_and_keeps_the_mode(tmp_path):
    """A symlink was replaced by a plain file (its target went stale) and a 0o600 file came
    back 0o644 (the temporary file's umask default)."""
    import stat

    from jaxlm.fileio import atomic_write_text

    target = tmp_path / "private.json"
    target.write_text("old")
    os.chmod(target, 0o600)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    atomic_write_text(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "private.json"]  # no temporary left
    long = tmp_path / ("a" * 250 + ".json")  # a legal name: the temporary's must fit too
    atomic_write_text(long, "x")
    assert long.read_text() == "x"


def test_atomic_write_text_errors_name_the_requested_path(tmp_path):
    """The error named the hidden temporary sibling (".a.json.tmp-<pid>-<hex>")."""
    from jaxlm.fileio import atomic_write_text

    missing = tmp_path / "no_such_dir" / "a.json"
    with pytest.raises(FileNotFoundError) as info:
        atomic_write_text(missing, "x")
    assert info.value.filename == str(missing) and ".tmp-" not in str(info.value)
    (tmp_path / "d").mkdir()
    with pytest.raises(IsADirectoryError) as info:
        atomic_write_text(tmp_path / "d", "x")
    assert info.value.filename == str(tmp_path / "d") and ".tmp-" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no temporary left


def test_read_jsonl_skips_a_byte_order_mark(tmp_path):
    """A one-record file starting with a BOM read as empty (its only line dropped as torn)."""
    from jaxlm.fileio import read_jsonl

    path = tmp_path / "m.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}')
    got = read_jsonl(path, warn=False)
    assert got.records == [{"a": 1}] and got.torn_line is None and got.complete_bytes == path.stat().st_size
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\n{"b": 2}\n{"c"')
    got = read_jsonl(path, warn=False)
    assert got.records == [{"a": 1}, {"b": 2}] and got.torn_line == 3
    assert path.read_bytes()[: got.complete_bytes].endswith(b'{"b": 2}\n')


def test_registry_names_a_non_string_name():
    """``None`` or a list as a registry name crashed inside difflib without naming the field."""
    import jaxlm

    for bad in (None, ["softmax"]):
        with pytest.raises(ValueError, match=r"ModelConfig.attention=.* is invalid: must be one of"):
            jaxlm.ModelConfig.tiny(attention=bad)
