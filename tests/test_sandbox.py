"""The python tool's sandbox under attack: programs a model could write, run through ``run_python`` in its default
(``bwrap``) mode. Each attempt asserts that its EFFECT did not happen (a file outside stays absent or unchanged, a
canary's content is not in the output, a process is still alive or gone), not merely that something raised. Where an
effect is observable outside the sandbox, the same program is also run unsandboxed (``control``) to show that it does
produce the effect there: the check can fail.

No skip for missing isolation: where bubblewrap or user namespaces are missing, ``check_sandbox`` fails these tests
naming what to install (``scripts/install.sh`` installs bubblewrap as root), as the python tool itself refuses to
start. Runs as root (CI) with the root path and, as uid 65534, the unprivileged one."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from rlspmd.agent.sandbox import WORKDIR, check_sandbox, interpreter, run_python

ROOT = Path(__file__).resolve().parents[1]
LIMITS = dict(timeout_s=10.0, memory_mb=256, cpu_s=5, max_output_chars=4000)
PYTHON = interpreter().executable  # the base interpreter the sandbox runs, at the same path inside it


@pytest.fixture(scope="module", autouse=True)
def isolation_available():
    check_sandbox("bwrap")  # a ValueError naming what is missing fails every test here


@functools.lru_cache(maxsize=1)
def shell_inside() -> bool:
    """Whether the sandbox has a /bin/sh (not bound today: a route through a shell then stops at the shell, and its
    effect is checked all the same; the unsandboxed control, with the host's shell, shows the effect)."""
    return run("import os; print(os.path.exists('/bin/sh'))").output.strip() == "True"


def run(code: str, **overrides):
    return run_python(code, **{**LIMITS, **overrides})


def control(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """The same program, unsandboxed (same interpreter, same flags): what the sandbox must prevent does happen here."""
    cwd.mkdir(exist_ok=True)
    return subprocess.run([PYTHON, "-I", "-S", "-c", code], cwd=cwd, capture_output=True, text=True, timeout=60)


def processes_with(marker: str) -> list[int]:
    """Host pids whose command line contains ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def describe(pid: int) -> str:
    """What a leftover process is (for a failure message)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            keep = ("Name", "State", "PPid", "Uid", "NSpid")
            return " ".join(line.strip() for line in f if line.startswith(keep))
    except OSError:
        return f"{pid}: gone"


def snapshot(d: Path) -> dict:
    """Every entry under ``d`` with its type, size, mode, mtime and content hash: a change anywhere shows."""
    out = {}
    for p in sorted(d.rglob("*")):
        st = p.lstat()
        out[str(p)] = (
            stat.S_IFMT(st.st_mode),
            st.st_size,
            st.st_mode,
            st.st_mtime_ns,
            p.read_bytes() if stat.S_ISREG(st.st_mode) else None,
        )
    return out


@pytest.fixture
def run_dir(tmp_path):
    """Stands for the run's checkpoint/data directory: a checkpoint with a canary, next to nothing else."""
    d = tmp_path / "run"
    d.mkdir()
    canary = f"CANARY-{uuid.uuid4().hex}"
    (d / "ckpt.pt").write_text(f"ground truth: {canary}")
    os.chmod(d, 0o777)  # even world-writable: the sandbox must not reach it at all
    os.chmod(d / "ckpt.pt", 0o666)
    return d, canary


# Every route the standard library and its C modules offer to start a process; the started program announces
# itself, then tries to write into the run directory. `shell`: needs /bin/sh, which the sandbox may not have.
SPAWN = {
    "subprocess": (False, "import subprocess, sys; subprocess.run([sys.executable, '-c', INNER])"),
    "subprocess_shell": (
        True,
        "import subprocess, sys; subprocess.run(f'{sys.executable} -c \"{INNER}\"', shell=True)",
    ),
    "os_system": (True, "import os, sys; os.system(f'{sys.executable} -c \"{INNER}\"')"),
    "os_popen": (True, "import os, sys; print(os.popen(f'{sys.executable} -c \"{INNER}\"').read())"),
    "posix_spawn": (
        False,
        "import os, sys; os.waitpid(os.posix_spawn(sys.executable, [sys.executable, '-c', INNER], {}), 0)",
    ),
    "posix_spawnp": (
        False,
        "import os, sys; os.waitpid(os.posix_spawnp(sys.executable, [sys.executable, '-c', INNER], {}), 0)",
    ),
    "spawnv": (False, "import os, sys; os.spawnv(os.P_WAIT, sys.executable, [sys.executable, '-c', INNER])"),
    "execv": (False, "import os, sys; os.execv(sys.executable, [sys.executable, '-c', INNER])"),
    "execve": (False, "import os, sys; os.execve(sys.executable, [sys.executable, '-c', INNER], {})"),
    "fork": (False, "import os\nif os.fork() == 0:\n    exec(INNER)\n    os._exit(0)\nos.wait()"),
    "forkpty": (
        False,
        "import os\npid, fd = os.forkpty()\nif pid == 0:\n    exec(INNER)\n    os._exit(0)\n"
        "os.waitpid(pid, 0)\ntry:\n    print(os.read(fd, 1000).decode())\nexcept OSError:\n    pass",
    ),
    "fork_exec": (
        False,
        "import _posixsubprocess, os, sys\n"
        "pid = _posixsubprocess.fork_exec([sys.executable, '-c', INNER], [os.fsencode(sys.executable)], "
        "True, (), None, None, -1, -1, -1, -1, -1, -1, *os.pipe(), False, False, -1, None, None, None, "
        "-1, None, False)\nos.waitpid(pid, 0)",
    ),
    "pty_spawn": (False, "import pty, sys, os\npty.spawn([sys.executable, '-c', INNER])"),
    "multiprocessing": (
        False,
        "import multiprocessing as mp\n"
        "def f():\n    exec(INNER)\n"
        "if __name__ == '__main__':\n    p = mp.get_context('fork').Process(target=f); p.start(); p.join()",
    ),
    "ctypes_system": (
        True,
        "import ctypes, sys; ctypes.CDLL(None).system(f'{sys.executable} -c \"{INNER}\"'.encode())",
    ),
    "ctypes_fork": (
        False,
        "import ctypes, os\nif ctypes.CDLL(None).fork() == 0:\n    exec(INNER)\n    os._exit(0)\nos.wait()",
    ),
    "ctypes_execve": (
        False,
        "import ctypes, sys\nargv = (ctypes.c_char_p * 4)(sys.executable.encode(), b'-c', INNER.encode(), None)\n"
        "ctypes.CDLL(None).execve(sys.executable.encode(), argv, (ctypes.c_char_p * 1)(None))",
    ),
}


@pytest.mark.parametrize("route", sorted(SPAWN))
def test_a_started_process_cannot_write_outside(route, run_dir, tmp_path):
    d, _ = run_dir
    target = d / f"escaped-{route}"
    repo_target = ROOT / f"escaped-{route}-{uuid.uuid4().hex[:8]}"
    inner = (
        f"print('spawned', flush=True); open({str(target)!r}, 'w').write('x'); "
        f"open({str(repo_target)!r}, 'w').write('x'); "
        "print('wrote outside')"
    )
    needs_shell, route_code = SPAWN[route]
    code = f"INNER = {inner!r}\n{route_code}"
    before = snapshot(d)
    r = run(code)
    assert "wrote outside" not in r.output and not target.exists() and not repo_target.exists(), r.output
    assert snapshot(d) == before
    if not needs_shell or shell_inside():
        assert "spawned" in r.output, r.output  # the route did start a process: it ran, and was still held
    c = control(code, tmp_path / "control")
    try:
        assert target.exists() and "spawned" in c.stdout, (c.stdout, c.stderr)  # unsandboxed, the write happens
    finally:
        repo_target.unlink(missing_ok=True)


# Writing, creating, linking and special files outside its directory: the checkpoint dir and the repository.
WRITE = {
    "open_w": "open(T, 'w').write('x')",
    "os_open_creat": "import os; os.write(os.open(T, os.O_WRONLY | os.O_CREAT), b'x')",
    "overwrite_ckpt": "open(CKPT, 'w').write('tampered')",
    "append_ckpt": "open(CKPT, 'a').write('tampered')",
    "truncate_ckpt": "import os; os.truncate(CKPT, 0)",
    "remove_ckpt": "import os; os.remove(CKPT)",
    "rename_ckpt": "import os; os.rename(CKPT, T)",
    "chmod_ckpt": "import os; os.chmod(CKPT, 0o600)",
    "utime_ckpt": "import os; os.utime(CKPT, (0, 0))",
    "mkdir": "import os; os.mkdir(T)",
    "symlink": "import os; os.symlink('/etc/passwd', T)",
    "hardlink": "import os; os.link(CKPT, T)",
    "mkfifo": "import os; os.mkfifo(T)",
    "mknod_fifo": "import os, stat; os.mknod(T, stat.S_IFIFO | 0o600)",
    "mknod_device": "import os, stat; os.mknod(T, stat.S_IFCHR | 0o600, os.makedev(1, 3))",
    "chdir_then_write": "import os; os.chdir(os.path.dirname(T)); open(os.path.basename(T), 'w').write('x')",
    "path_traversal": "open('../' * 20 + T, 'w').write('x')",
    "proc_root_of_pid1": "open('/proc/1/root' + T, 'w').write('x')",
}


@pytest.mark.parametrize("attempt", sorted(WRITE))
def test_no_write_create_link_or_special_file_outside(attempt, run_dir, tmp_path):
    d, _ = run_dir
    target = d / f"new-{attempt}"
    code = f"T = {str(target)!r}\nCKPT = {str(d / 'ckpt.pt')!r}\n{WRITE[attempt]}\nprint('done')"
    before = snapshot(d)
    r = run(code)
    assert snapshot(d) == before and not target.exists(), r.output
    assert "done" not in r.output
    # the same write inside its own directory works: the sandbox refuses the place, not the operation
    if attempt not in ("mknod_device", "proc_root_of_pid1", "path_traversal"):
        inside = run(
            "import os\nT = os.path.join(os.getcwd(), 'own')\nCKPT = 'ckpt'\n"
            f"open(CKPT, 'w').write('x')\n{WRITE[attempt]}\n"
            "print('done', os.listdir('.'))"
        )
        assert "done" in inside.output, inside.output
    if attempt != "proc_root_of_pid1" and (attempt != "mknod_device" or os.geteuid() == 0):
        control(code, tmp_path / "control")
        assert snapshot(d) != before  # unsandboxed, the same program does change the run directory


# Every directory the program can see is tried for a new file: only its own directory (and /dev/shm) takes one. Below a
# directory refused as a read-only file system, the rest of its mount (same mnt_id) is read-only too: it is not walked
# further unless another mount lies beneath. TOP: where the walk starts.
WRITABLE_DIRS = """
import errno, os
def mount_id(path):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with open(f'/proc/self/fdinfo/{fd}') as f:
            return next(line.split()[1] for line in f if line.startswith('mnt_id:'))
    finally:
        os.close(fd)
with open('/proc/self/mountinfo') as f:
    mount_points = [line.split()[4] for line in f]
writable, read_only_mounts = [], set()
for d, dirs, _ in os.walk(TOP):
    dirs[:] = [x for x in dirs if os.path.join(d, x) not in ('/proc', '/sys')]
    try:
        mnt = mount_id(d)
    except OSError:
        continue
    if mnt not in read_only_mounts:
        try:
            fd = os.open(os.path.join(d, '.probe'), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.close(fd)
            os.unlink(os.path.join(d, '.probe'))
            writable.append(d)
            continue
        except OSError as e:
            if e.errno != errno.EROFS:
                continue
            read_only_mounts.add(mnt)
    if not any(m.startswith(d.rstrip('/') + '/') for m in mount_points):
        dirs[:] = []
print('writable', writable)
"""


def test_its_own_directory_is_the_only_writable_place(tmp_path):
    r = run(
        "TOP = '/'\n" + WRITABLE_DIRS + "import multiprocessing as mp\nwith mp.Pool(2) as p:\n"
        "    print('pool', p.map(abs, [-1, -2]))\n"
    )
    assert sorted(eval(r.output.split("writable ")[1].splitlines()[0])) == ["/dev/shm", "/sandbox"], r.output
    assert "pool [1, 2]" in r.output, r.output  # the one use of /dev/shm: multiprocessing's semaphores
    (tmp_path / "run").mkdir()  # control: the same walk on the host, from a directory standing for the run's
    c = control(f"TOP = {str(tmp_path)!r}\n" + WRITABLE_DIRS, tmp_path / "control")
    assert sorted(eval(c.stdout.split("writable ")[1])) == [
        str(tmp_path),
        str(tmp_path / "control"),
        str(tmp_path / "run"),
    ], c


def test_repository_and_home_are_invisible_and_unwritable():
    own = Path(__file__).read_text().splitlines()[0]
    home = Path.home()
    home_files = [str(p) for p in home.iterdir() if p.is_file()][:10] if home.is_dir() else []
    marker = f"escaped-{uuid.uuid4().hex[:8]}"
    code = (
        f"import os\nfor p in {[str(ROOT / 'tests/test_sandbox.py'), str(ROOT / 'README.md'), *home_files]!r}:\n"
        "    try:\n        print(open(p).read())\n    except OSError as e:\n        print('no', type(e).__name__)\n"
        f"print('visible', [p for p in {[str(ROOT), '/home', '/work', '/etc/passwd', '/etc/shadow']!r} "
        "if os.path.exists(p)])\n"
        f"for d in {[str(ROOT), str(ROOT / 'rlspmd'), str(home)]!r}:\n"
        f"    try:\n        open(os.path.join(d, {marker!r}), 'w')\n    except OSError:\n        pass\n"
    )
    r = run(code)
    assert own not in r.output and "visible []" in r.output, r.output
    assert not (ROOT / marker).exists() and not (ROOT / "rlspmd" / marker).exists() and not (home / marker).exists()
    for f in home_files:
        assert Path(f).exists()  # they exist on the host, and the sandbox saw none of them


def test_the_run_data_next_to_it_cannot_be_read(run_dir, monkeypatch):
    d, canary = run_dir
    monkeypatch.setenv("RLSPMD_TEST_CANARY", canary)  # the trainer's environment is not the sandbox's
    code = (
        f"import os, glob\nfor p in [{str(d / 'ckpt.pt')!r}, *glob.glob({str(d) + '/*'!r})]:\n"
        "    try:\n        print(open(p).read())\n    except OSError as e:\n        print(type(e).__name__)\n"
        "print(dict(os.environ))"
    )
    r = run(code)
    assert canary not in r.output and "FileNotFoundError" in r.output, r.output
    assert canary in control(code, d.parent / "control").stdout  # unsandboxed, it reads the answer key


def test_other_processes_proc_entries_are_out_of_reach(tmp_path):
    canary = f"CANARY-{uuid.uuid4().hex}"
    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", canary], env={**os.environ, "RLSPMD_TEST_CANARY": canary}
    )
    try:
        code = (
            "import os\nfor pid in [" + f"{sleeper.pid}, {os.getpid()}, 1, 'self'" + "] + os.listdir('/proc'):\n"
            "    for what in ('cmdline', 'environ', 'status', 'maps'):\n"
            "        try:\n            print(pid, what, open(f'/proc/{pid}/{what}', 'rb').read()[:4000])\n"
            "        except (OSError, ValueError) as e:\n            print(pid, what, type(e).__name__)\n"
            "print('pids', sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))"
        )
        r = run(code, max_output_chars=200_000)
        assert canary not in r.output and "pytest" not in r.output, r.output[-2000:]
        pids = eval(r.output.rsplit("pids ", 1)[1].splitlines()[0])
        assert pids == [1, 2]  # its own PID namespace: bwrap's init and the program itself
        assert canary in control(code, tmp_path / "control").stdout
    finally:
        sleeper.kill()
        sleeper.wait()


def test_signals_cannot_reach_other_processes(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # the sleeper, this test's process, the sleeper's group, then everything it may signal, then its own group
        r = run(
            f"import os, signal\ntry:\n    os.killpg({os.getpgid(sleeper.pid)}, signal.SIGKILL)\n"
            "except OSError as e:\n    print(e)\n"
            f"for pid in ({sleeper.pid}, {os.getpid()}, -1, 0):\n"
            "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError as e:\n        print(pid, e)\n"
        )
        time.sleep(0.2)
        assert sleeper.poll() is None, r.output  # still alive (and so is this test's process)
        control(f"import os, signal; os.kill({sleeper.pid}, signal.SIGKILL)", tmp_path / "control")
        assert sleeper.wait(timeout=10) == -signal.SIGKILL  # unsandboxed, the same signal does reach it
    finally:
        sleeper.kill()
        sleeper.wait()


def _listen_tcp():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    return server


def _accepts(server: socket.socket, seconds: float) -> bool:
    server.settimeout(seconds)
    try:
        server.accept()[0].close()
        return True
    except OSError:
        return False


def test_sockets_do_not_connect(tmp_path):
    tcp = _listen_tcp()
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    unix_path = str(tmp_path / "s.sock")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(unix_path)
    unix.listen(4)
    abstract = socket.socket(socket.AF_UNIX)
    abstract_name = f"\0rlspmd-test-{uuid.uuid4().hex}"
    abstract.bind(abstract_name)
    abstract.listen(4)
    try:
        code = (
            "import socket\n"
            f"for fam, addr in [(socket.AF_INET, ('127.0.0.1', {tcp.getsockname()[1]})), "
            f"(socket.AF_UNIX, {unix_path!r}), (socket.AF_UNIX, {abstract_name!r})]:\n"
            "    try:\n        s = socket.socket(fam); s.settimeout(2); s.connect(addr); print('CONNECTED', addr)\n"
            "    except OSError as e:\n        print('FAILED', addr, e)\n"
            "u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            f"u.sendto(b'leak', ('127.0.0.1', {udp.getsockname()[1]}))\n"
            "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=2); print('CONNECTED internet')\n"
            "except OSError as e:\n    print('FAILED internet', e)"
        )
        r = run(code)
        assert "CONNECTED" not in r.output and r.output.count("FAILED") == 4, r.output
        assert not _accepts(tcp, 0.2) and not _accepts(unix, 0.1) and not _accepts(abstract, 0.1)
        udp.settimeout(0.2)
        with pytest.raises(TimeoutError):
            udp.recvfrom(100)
        control(code, tmp_path / "control")
        assert _accepts(tcp, 5) and _accepts(unix, 5) and _accepts(abstract, 5)  # unsandboxed, all three connect
    finally:
        for s in (tcp, udp, unix, abstract):
            s.close()


def test_fork_bomb_is_bounded_and_the_call_returns():
    t0 = time.monotonic()
    r = run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", timeout_s=3.0)
    assert r.timed_out and r.seconds < 8 and time.monotonic() - t0 < 8
    # and the number of processes is the limit: count how many children one program gets
    r = run(
        "import os, time\nn = 0\ntry:\n    for _ in range(1000):\n        if os.fork() == 0:\n"
        "            time.sleep(5); os._exit(0)\n        n += 1\nexcept OSError as e:\n    print('refused', e.errno)\n"
        "print('children', n, 'visible', len([p for p in os.listdir('/proc') if p.isdigit()]))"
    )
    n = int(r.output.split("children ")[1].split()[0])
    assert "refused 11" in r.output and 1 <= n <= 16 - 1, r.output  # max_processes=16 tasks: the runner, children
    assert subprocess.run(["true"], timeout=10).returncode == 0  # the machine still forks


def test_thread_bomb_is_bounded():
    r = run(
        "import threading, time\nn = 0\ntry:\n    for _ in range(10000):\n"
        "        threading.Thread(target=time.sleep, args=(5,), daemon=True).start(); n += 1\n"
        "except RuntimeError as e:\n    print('refused', e)\nprint('threads', n, flush=True)\nimport os; os._exit(0)"
    )
    n = int(r.output.split("threads ")[1].split()[0])
    assert "refused" in r.output and n <= 16, r.output


def test_memory_exhaustion_fails_in_the_program_and_its_children():
    r = run("x = bytearray(1024 ** 3)\nprint('allocated')")
    assert r.exit_code != 0 and "MemoryError" in r.output and "allocated" not in r.output
    r = run(
        "import os\nif os.fork() == 0:\n    try:\n        x = bytearray(1024 ** 3); print('child allocated')\n"
        "    except MemoryError:\n        print('child refused', flush=True)\n    os._exit(0)\nos.wait()"
    )
    assert "child refused" in r.output and "child allocated" not in r.output, r.output
    # the workdir is a tmpfs of workdir_mb: filling it stops there (and never touches the host's disks)
    r = run(
        "import os\nn = 0\ntry:\n    for i in range(1000):\n"
        "        open(f'f{i}', 'wb').write(b'0' * (1 << 20)); n += 1\n"
        "except OSError as e:\n    print('stopped', e.errno)\nprint('mb', n)",
        workdir_mb=8,
    )
    assert "stopped 28" in r.output and int(r.output.split("mb ")[1]) <= 8, r.output  # ENOSPC


def test_cpu_exhaustion_is_stopped_even_when_sigxcpu_is_ignored():
    # (the plain busy loop, stopped by SIGXCPU: tests/test_agent_tools.py::test_code_runner_cpu_limit, both modes)
    r = run("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass", timeout_s=30.0, cpu_s=1)
    assert not r.timed_out and r.exit_code == 128 + signal.SIGKILL and r.seconds < 20  # the hard limit, 1 s later


def test_huge_output_is_truncated_and_bounded():
    r = run("import sys\nfor _ in range(100):\n    sys.stdout.write('y' * 1_000_000)\nprint('end')", max_file_mb=4)
    assert r.truncated and len(r.output) == LIMITS["max_output_chars"] and " [...] " in r.output
    assert r.exit_code != 0 and "end" not in r.output  # RLIMIT_FSIZE stopped it at 4 MiB (SIGXFSZ)
    r = run("open('big', 'wb').write(b'0' * (64 << 20))")  # a file past max_file_mb (16 MiB)
    assert r.exit_code != 0


def test_nothing_outlives_the_call_daemons_setsid_and_sigterm_ignorers():
    """A double-forked, setsid daemon that ignores SIGTERM, left behind by a program that exits at once, and the same
    inside a program killed at the wall-time limit: neither survives the call (checked by its marker on the host)."""
    for exit_at_once in (True, False):
        marker = f"rlspmd-daemon-{uuid.uuid4().hex}"
        code = (
            "import os, signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            "        os.execv(sys.executable, [sys.executable, '-c', "
            "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)', "
            f"{marker!r}])\n"
            "    os._exit(0)\ntime.sleep(0.5)\nprint('parent done', flush=True)\n"
            + ("" if exit_at_once else "time.sleep(60)\n")
        )
        r = run(code, timeout_s=2.0)
        assert r.timed_out is (not exit_at_once) and "parent done" in r.output, r.output
        assert processes_with(marker) == [], [describe(pid) for pid in processes_with(marker)]
    # control: the same daemon started unsandboxed does outlive its parent
    marker = f"rlspmd-daemon-{uuid.uuid4().hex}"
    daemon = (
        f"import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
        "    os._exit(0)\ntime.sleep(0.5)"
    )
    subprocess.run([PYTHON, "-c", daemon], timeout=30)
    left = processes_with(marker)
    assert left, "the control daemon should have outlived its parent"
    for pid in left:
        os.kill(pid, signal.SIGKILL)


# sandbox.py alone (standard library only), from the path in argv[1]: quick to start, and any Python can load it
LOAD_SANDBOX = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("sandbox", sys.argv[1])
sandbox = importlib.util.module_from_spec(spec)
sys.modules["sandbox"] = sandbox
spec.loader.exec_module(sandbox)
"""


def test_the_sandbox_dies_with_its_parent(tmp_path):
    """The trainer killed with SIGKILL mid-call: the sandboxed program (and what it started) goes too."""
    marker = f"rlspmd-orphan-{uuid.uuid4().hex}"
    # the marker is spelled backwards in the code: the parent's own command line holds the code
    code = (
        f"import os, sys\nM = {marker[::-1]!r}[::-1]\nif os.fork() == 0:\n    os.setsid()\n"
        "    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', M])\n"
        "os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', M])"
    )
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            LOAD_SANDBOX + "sandbox.run_python(sys.argv[2], timeout_s=60, "
            "memory_mb=256, cpu_s=60, max_output_chars=100)",
            str(ROOT / "rlspmd/agent/sandbox.py"),
            code,
        ]
    )
    try:
        deadline = time.monotonic() + 30
        while len(processes_with(marker)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(processes_with(marker)) == 2
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(marker) == []


def test_root_on_the_host_is_not_root_inside(tmp_path):
    """Nothing host-writable is bound, whoever runs the trainer; the sandbox has no capability, cannot make itself a
    user namespace to gain some (seccomp as root, --disable-userns otherwise), so cannot remount the read-only binds
    and write through them."""
    stdlib = os.path.dirname(os.__file__)
    marker = f"escaped-{uuid.uuid4().hex[:8]}"
    code = (
        "import ctypes, os\n"
        "print('uid', os.getuid(), [l for l in open('/proc/self/status') if l.startswith('CapEff')])\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print('unshare', libc.unshare(0x10000000 | 0x00020000), ctypes.get_errno())  # CLONE_NEWUSER | CLONE_NEWNS\n"
        f"print('remount', libc.mount(None, {stdlib!r}.encode(), None, 32 | 4096 | 16384, None), ctypes.get_errno())\n"
        f"for p in [{os.path.join(stdlib, marker)!r}, '/usr/lib/' + {marker!r}, '/' + {marker!r}]:\n"
        "    try:\n        open(p, 'w').write('x'); print('wrote', p)\n    except OSError as e:\n        print(p, e)"
    )
    r = run(code)
    assert "wrote" not in r.output and "CapEff:\\t0000000000000000" in r.output, r.output
    assert "uid 0" not in r.output and "unshare -1 " in r.output
    assert not os.path.exists(os.path.join(stdlib, marker)) and not os.path.exists("/usr/lib/" + marker)
    if os.geteuid() == 0:  # control: unsandboxed, the same call makes a user namespace
        assert "unshare 0 " in control(code.split("print('remount'")[0], tmp_path / "control").stdout


def test_output_from_the_sandbox_cannot_reach_the_trainer_through_inherited_files():
    """Only stdin (the code) and one output file are shared; /proc/self/fd shows nothing else of the host's."""
    r = run(
        "import os\nprint(sorted(os.listdir('/proc/self/fd')))\n"
        "print(os.readlink('/proc/self/fd/1'))\nprint(os.getcwd())"
    )
    fds = eval(r.output.splitlines()[0])
    assert fds == ["0", "1", "2", "3"], r.output  # stdin, stdout, stderr and the listing's own directory fd
    assert r.output.splitlines()[2] == WORKDIR


def test_missing_bubblewrap_refuses_to_start_naming_it(monkeypatch, tmp_path):
    """Fail closed: the python tool is not built, and the config check (before anything loads) says what is missing
    and names the opt-in; the opt-in builds it, with a warning."""
    from rlspmd.agent import load_tools
    from rlspmd.config import AgentConfig, CodeRunnerConfig, Config, RolloutConfig
    from rlspmd.validate import config_problems

    def problems(sandbox: str) -> list[str]:
        cfg = Config(rollout=RolloutConfig(agent=AgentConfig(tools=["python"], code=CodeRunnerConfig(sandbox=sandbox))))
        return config_problems(cfg, world_size=2, check_files=False)

    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on PATH
    with pytest.raises(
        ValueError,
        match=r"rollout.agent.code.sandbox='bwrap'.*bubblewrap is not installed.*"
        r"audit-hook-unsafe",
    ):
        check_sandbox("bwrap")
    with pytest.raises(ValueError, match=r"rollout.agent.tools\[0\]='python'.*bubblewrap is not installed"):
        load_tools(AgentConfig(tools=["python"]))
    [line] = problems("bwrap")
    assert "rollout.agent.code.sandbox='bwrap': model-written code cannot be isolated" in line, line
    with pytest.warns(UserWarning, match="audit-hook-unsafe.*can read every file"):
        assert problems("audit-hook-unsafe") == []  # opted in
    assert "rollout.agent.code.sandbox='docker': must be one of ['bwrap', 'audit-hook-unsafe']" in problems("docker")


def test_refused_user_namespaces_refuse_to_start_naming_them(tmp_path):
    """A non-root user on a machine where user namespaces are off (here: inside a sandbox with them disabled)."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import importlib.util as u\n"
        "s = u.spec_from_file_location('sb', sys.argv[1] + '/rlspmd/agent/sandbox.py'); m = u.module_from_spec(s)\n"
        "sys.modules['sb'] = m; s.loader.exec_module(m)\n"
        "try:\n    m.check_sandbox('bwrap')\nexcept ValueError as e:\n    print(e)"
    )
    interp = interpreter()
    cmd = [
        "bwrap",
        "--unshare-user",
        "--disable-userns",
        "--uid",
        "1000",
        "--gid",
        "1000",
        "--unshare-pid",
        "--die-with-parent",
        "--ro-bind",
        "/",
        "/",
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--tmpfs",
        "/tmp",
        "--ro-bind",
        str(ROOT),
        str(ROOT),
        "--",
        interp.executable,
        "-I",
        "-S",
        "-c",
        code,
        str(ROOT),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert "model-written code cannot be isolated on this machine" in out.stdout, (out.stdout, out.stderr)
    assert "namespace" in out.stdout, out.stdout  # bwrap's own words on what it could not create


SYSTEM_PYTHON = "/usr/bin/python3"
AS_NOBODY = (
    LOAD_SANDBOX
    + """
r = sandbox.run_python(sys.argv[2], timeout_s=20.0, memory_mb=256, cpu_s=5, max_output_chars=4000)
print(json.dumps({"output": r.output, "exit_code": r.exit_code}))
"""
)


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
    reason="runs the unprivileged path as uid 65534: needs root here and a system Python at /usr/bin",
)
def test_the_unprivileged_path_holds_too(tmp_path):
    """An ordinary user's trainer (here uid 65534, the system Python): a user namespace instead of root's uid drop.
    The run directory is world-readable and world-writable, so the user could read and write it unsandboxed."""
    shared = Path(tempfile.mkdtemp(prefix="rlspmd-test-shared-"))
    try:
        os.chmod(shared, 0o777)
        canary = f"CANARY-{uuid.uuid4().hex}"
        (shared / "ckpt.pt").write_text(canary)
        os.chmod(shared / "ckpt.pt", 0o644)
        target = shared / "escaped"
        attack = (
            "import ctypes, os, sys\nprint('uid', os.getuid())\n"
            f"try:\n    print(open({str(shared / 'ckpt.pt')!r}).read())\nexcept OSError as e:\n    print(e)\n"
            f"try:\n    open({str(target)!r}, 'w').write('x')\nexcept OSError as e:\n    print(e)\n"
            "libc = ctypes.CDLL(None, use_errno=True)\nprint('unshare', libc.unshare(0x10000000))\n"
            # bwrap's init, outside the limits, with the code's uid here: not to be taken over
            "print('ptrace', libc.ptrace(16, 1, 0, 0), 'init', os.listdir('/proc/1') if os.getpid() == 2 else '')\n"
        )
        bomb = (
            "n = 0\ntry:\n    for _ in range(100):\n"
            "        if os.fork() == 0:\n            import time; time.sleep(3); os._exit(0)\n"
            "        n += 1\nexcept OSError:\n    pass\nprint('children', n)"
        )
        code = "TOP = '/'\n" + WRITABLE_DIRS + attack + bomb
        sandbox_py = str(ROOT / "rlspmd/agent/sandbox.py")
        nobody = dict(user=65534, group=65534, extra_groups=[], capture_output=True, text=True, timeout=120, cwd="/")
        r = subprocess.run([SYSTEM_PYTHON, "-I", "-c", AS_NOBODY, sandbox_py, code], **nobody)
        out = json.loads(r.stdout.splitlines()[-1])["output"] if r.returncode == 0 else r.stderr
        assert "uid 65534" in out and canary not in out and "unshare -1" in out and not target.exists(), out
        assert sorted(eval(out.split("writable ")[1].splitlines()[0])) == ["/dev/shm", "/sandbox"], out
        assert "ptrace -1 init []" in out, out
        assert 1 <= int(out.split("children ")[1]) <= 16 - 2, out  # its user namespace's count: init, runner
        c = subprocess.run([SYSTEM_PYTHON, "-I", "-S", "-c", attack], **nobody)  # control: unsandboxed, same user
        assert canary in c.stdout and target.exists(), (c.stdout, c.stderr)
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_the_cost_benchmark_runs_and_prints_json():
    """``scripts/bench/sandbox_calls.py`` (docs/agents.md: its figures); a smoke run, the figures are not asserted."""
    out = subprocess.run(
        [sys.executable, "scripts/bench/sandbox_calls.py", "--calls", "10", "--threads", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for mode in ("bare", "audit-hook-unsafe", "bwrap"):
        assert result[mode]["calls"] == 10 and result[mode]["calls_per_s_2_threads"] > 0
