"""The sandbox stops a program that loops forever, allocates too much memory, floods its
output, writes outside its directory, spawns a process or opens a socket, scores it as
failing, and the harness (this process) carries on; calls on many inputs keep going past a
failing call."""

import os

import pytest

from jaxlm.sandbox import VIOLATION_EXIT, CallResult, Limits, call_function, run_python

FAST = Limits(timeout_s=3.0, cpu_s=3, memory_mb=256, file_mb=1)


def test_a_well_behaved_program_runs():
    r = run_python("import sys\nprint(sys.stdin.read()[::-1])", stdin="abc", limits=FAST)
    assert r.ok and r.stdout == "cba\n"
    r = run_python("open('note.txt', 'w').write('x')\nprint(open('data/in.txt').read())",
                   files={"data/in.txt": "given"}, limits=FAST)
    assert r.ok and r.stdout == "given\n"
    r = run_python("import sqlite3\nc = sqlite3.connect('notes.db')\nc.execute('create table t (a)')\n"
                   "print(sqlite3.connect(':memory:').execute('select 2').fetchone()[0])", limits=FAST)
    assert r.ok and r.stdout == "2\n"  # a database inside its directory, or in memory
    r = run_python("import os\nd = os.open('.', os.O_RDONLY)\nos.mkdir('sub', dir_fd=d)\n"
                   "fd = os.open('sub/a.txt', os.O_WRONLY | os.O_CREAT, dir_fd=d)\nos.write(fd, b'in')\n"
                   "os.close(fd)\ns = os.open('sub', os.O_RDONLY)\nos.rename('a.txt', 'b.txt', src_dir_fd=s, "
                   "dst_dir_fd=s)\nprint(open('sub/b.txt').read())", limits=FAST)
    assert r.ok and r.stdout == "in\n"  # directory descriptors inside its directory
    # exit() ends a program normally (-S left it undefined); the hash seed is fixed, so a
    # set's repr is the same in every run (-I dropped PYTHONHASHSEED)
    r = run_python('print(hash("abc"), {"a", "b", "c", "d", "e"})\nexit()', limits=FAST)
    assert r.ok and r.returncode == 0 and run_python('print(hash("abc"), {"a", "b", "c", "d", "e"})',
                                                     limits=FAST).stdout == r.stdout
    with pytest.raises(ValueError, match="'program.py' is reserved"):
        run_python("print(1)", files={"program.py": "print(2)"}, limits=FAST)
    for bad in (float("inf"), float("nan"), 0.0):  # inf / NaN failed every call inside setitimer
        with pytest.raises(ValueError, match="call_timeout_s=.* must be a number in"):
            call_function("def f(x):\n    return x", "f", [[1]], call_timeout_s=bad, limits=FAST)


@pytest.mark.parametrize("program, status", [
    ("while True:\n    pass", "timeout"),
    ("x = bytearray(1 << 30)", "memory"),
    ("while True:\n    print('x' * 1000)", "output"),
    ("open('/tmp/jaxlm-sandbox-escape.txt', 'w').write('x')", "violation"),
    ("import os\nos.chdir('/tmp')\nopen('jaxlm-sandbox-escape.txt', 'a')", "violation"),
    ("import os\nos.remove('/tmp/jaxlm-sandbox-escape.txt')", "violation"),
    ("import os\nos.system('true')", "violation"),
    ("import subprocess\nsubprocess.run(['true'])", "violation"),
    ("import socket\nsocket.socket().connect(('127.0.0.1', 9))", "violation"),
    ("try:\n    open('/tmp/jaxlm-sandbox-escape.txt', 'w')\nexcept BaseException:\n    pass\nprint('hid it')",
     "violation"),
    ("raise SystemExit(3)", "error"),
    # the status is the uncaught exception, not a word the program wrote (this read as "memory")
    ("import sys\nsys.stderr.write('MemoryError is a word\\n')\nsys.exit(3)", "error"),
    ("raise ValueError('File too large to parse')", "error"),
    ("raise MemoryError('made up')", "memory"),
    ("raise SystemExit(113)", "error"),  # the violation status, but no stop by the guard
    # paths relative to a directory descriptor outside the sandbox
    ("import os\nd = os.open('/tmp', os.O_RDONLY)\nos.open('jaxlm-sandbox-escape.txt', os.O_WRONLY | os.O_CREAT, "
     "dir_fd=d)", "violation"),
    ("import os\nd = os.open('/tmp', os.O_RDONLY)\nopen('jaxlm-sandbox-escape.txt', 'w', "
     "opener=lambda p, f: os.open(p, f, dir_fd=d))", "violation"),
    ("import os\nd = os.open('/tmp', os.O_RDONLY)\nos.mkdir('jaxlm-sandbox-escape.txt', dir_fd=d)", "violation"),
    ("import os\nopen('a', 'w').close()\nd = os.open('/tmp', os.O_RDONLY)\n"
     "os.rename('a', 'jaxlm-sandbox-escape.txt', dst_dir_fd=d)", "violation"),
    ("import os\nd = os.open('/tmp', os.O_RDONLY)\nos.symlink('x', 'jaxlm-sandbox-escape.txt', dir_fd=d)",
     "violation"),
    ("import os\nd = os.open('/tmp', os.O_RDONLY)\nos.mkfifo('jaxlm-sandbox-escape.txt', dir_fd=d)", "violation"),
    ("import sqlite3\nsqlite3.connect('/tmp/jaxlm-sandbox-escape.txt')", "violation"),  # SQLite opens files itself
    ("import sqlite3\nsqlite3.connect('file:/tmp/jaxlm-sandbox-escape.txt?mode=rwc', uri=True)", "violation"),
    ("import os\nos.mkfifo('/tmp/jaxlm-sandbox-escape.txt')", "violation"),  # no audit event of its own
    # posix.open is os.open under another name (it skipped the dir_fd check)
    ("import posix\nd = posix.open('/tmp', posix.O_RDONLY)\nposix.open('jaxlm-sandbox-escape.txt', "
     "posix.O_WRONLY | posix.O_CREAT, dir_fd=d)", "violation"),
    # a descriptor of a file outside, opened for reading (allowed), then changed through it
    # (the mode it already has: harmless were the guard to miss it)
    ("import os\nfd = os.open('/', os.O_RDONLY)\nos.chmod(fd, os.stat('/').st_mode & 0o7777)", "violation"),
    # SQL opens files too: ATTACH and VACUUM INTO are refused (they wrote outside)
    ("import sqlite3\nsqlite3.connect(':memory:').execute(\"ATTACH DATABASE '/tmp/jaxlm-sandbox-escape.txt' AS x\")",
     "error"),
    ("import sqlite3\nc = sqlite3.connect(':memory:')\nc.execute('create table t (a)')\n"
     "c.execute(\"VACUUM INTO '/tmp/jaxlm-sandbox-escape.txt'\")", "error"),
    # a closed stderr must not turn the stop into an error the program can catch
    ("import os\nos.close(2)\ntry:\n    open('/tmp/jaxlm-sandbox-escape.txt', 'w')\nexcept BaseException:\n"
     "    pass\nprint('hid it')", "violation"),
])
def test_misbehaving_programs_are_stopped(program, status):
    r = run_python(program, limits=FAST)
    assert r.status == status, r
    assert not r.ok
    if status == "violation":
        assert r.returncode == VIOLATION_EXIT and ("sandbox violation" in r.stderr or "os.close(2)" in program)
    assert not os.path.exists("/tmp/jaxlm-sandbox-escape.txt")


def test_descriptors_of_the_programs_own_files_and_pipes_are_allowed():
    r = run_python("import os\nfd = os.open('x.txt', os.O_WRONLY | os.O_CREAT)\nos.chmod(fd, 0o600)\nos.utime(fd)\n"
                   "os.truncate(fd, 0)\nr, w = os.pipe()\nos.write(w, b'x')\nprint(os.read(r, 1).decode())", limits=FAST)
    assert r.ok and r.stdout.strip() == "x", r


def test_calls_fail_one_by_one_and_the_process_survives():
    program = ("def f(x):\n"
               "    if x == 3:\n        while True:\n            pass\n"
               "    if x == 4:\n        return bytearray(1 << 30)\n"
               "    if x == 5:\n        raise ValueError('bad input')\n"
               "    return x * 2\n")
    results, run = call_function(program, "f", [[1], [2], [3], [4], [5], [6]], call_timeout_s=0.3, limits=FAST)
    assert run.ok
    assert [r.ok for r in results] == [True, True, False, False, False, True]
    assert [r.value for r in results if r.ok] == ["2", "4", "12"]
    assert results[2].error == "timeout" and results[3].error == "memory" and "bad input" in results[4].error
    # each input is the list of positional arguments
    results, _ = call_function("def add(a, b):\n    return a + b", "add", [[1, 2], [[3], [4]]], limits=FAST)
    assert [r.value for r in results] == ["3", "[3, 4]"]
    with pytest.raises(ValueError, match="positional arguments"):
        call_function("def f(x):\n    return x", "f", [1])


def test_a_dead_process_fails_every_call():
    results, run = call_function("def f(x):\n    open('/etc/jaxlm-escape', 'w')", "f", [[1], [2]], limits=FAST)
    assert run.status == "violation" and [r.ok for r in results] == [False, False]
    results, _ = call_function("def g(x):\n    return x", "f", [[1]], limits=FAST)
    assert not results[0].ok and "no function 'f'" in results[0].error
    results, _ = call_function("def f(:\n", "f", [[1]], limits=FAST)
    assert "SyntaxError" in results[0].error
    with pytest.raises(ValueError, match="timeout_s"):
        Limits(timeout_s=0)
    # a float resource limit failed every run in setrlimit; an infinite timeout removed the limit
    for bad, match in ((dict(cpu_s=2.5), "cpu_s=2.5"), (dict(memory_mb=256.0), "memory_mb=256.0"),
                       (dict(timeout_s=float("inf")), "timeout_s=inf"), (dict(timeout_s=float("nan")), "nan")):
        with pytest.raises(ValueError, match=match):
            Limits(**bad)


def test_a_caught_timeout_is_still_a_timeout_and_finished_calls_survive_a_death():
    """A candidate whose bare ``except`` catches the per-call alarm is stopped by the next one
    (or reported a timeout if it returns late); calls reported before the process died keep
    their results."""
    program = ("import time\n"
               "def f(x):\n    try:\n        time.sleep(x)\n    except:\n        return None\n    return x\n")
    results, run = call_function(program, "f", [[0], [2], [0]], call_timeout_s=0.3, limits=FAST)
    assert run.ok and [(r.ok, r.value, r.error) for r in results] == [(True, "0", None), (False, None, "timeout"),
                                                                     (True, "0", None)]
    program = "def f(x):\n    if x == 2:\n        open('/etc/jaxlm-escape', 'w')\n    return x\n"
    results, run = call_function(program, "f", [[1], [2], [3]], limits=FAST)
    assert run.status == "violation"
    assert [(r.ok, r.value, r.error) for r in results] == [(True, "1", None), (False, None, "violation"),
                                                           (False, None, "violation")]


def test_undecodable_output_is_replaced_not_raised():
    """Bytes that are not UTF-8 on stdout or stderr come back replaced; the caller survives."""
    run = run_python("import os, sys\nos.write(1, b'ok \\xff')\nsys.stderr.buffer.write(b'caf\\xe9')\n")
    assert run.status == "ok" and run.stdout == "ok \ufffd" and run.stderr == "caf\ufffd"
    calls, run = call_function("import os\ndef f(x):\n    os.write(1, b'\\x80')\n    return x\n", "f", [[1]])
    assert run.status == "ok" and calls == [CallResult(True, "1")]


def test_results_survive_a_chatty_program():
    """A correct function that prints more than `Limits.output_chars` still reports its results."""
    program = "def f(x):\n    for i in range(5000):\n        print('debug line', i)\n    return 2 * x\n"
    calls, run = call_function(program, "f", [[1], [2], [3]])
    assert run.status == "ok" and [(c.ok, c.value) for c in calls] == [(True, "2"), (True, "4"), (True, "6")]
    assert run.stdout.startswith("debug line 0\n")
