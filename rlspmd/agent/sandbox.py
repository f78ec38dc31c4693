"""Run model-written Python in OS-level isolation: model output is untrusted input, and an RL run optimises against its
tools, so whatever the sandbox lets through a policy will eventually find.

Two modes (``rollout.agent.code.sandbox``):

``bwrap`` (the default): the code runs under bubblewrap (``bwrap``, a Debian/Ubuntu/Fedora package) in new mount, PID,
network, IPC, UTS and cgroup namespaces. What is enforced, for every run (``run_python``):

* **It sees only its own directory and what the interpreter needs.** The root is an empty, read-only tmpfs; into it are
  bound, read-only and ``nosuid``, the interpreter (the trainer's *base* interpreter, ``sys._base_executable``, not a
  venv's), its standard library (the install prefix's ``lib``), the system library directories (``/usr/lib*``,
  ``/lib*``) and ``/etc/ld.so.cache``; a minimal, read-only ``/dev`` (null, zero, full, random, urandom, tty); ``/proc``
  of its own PID namespace. The run's data, checkpoints, configs, rlspmd's code, ``/home``, ``/root``'s files, ``/tmp``
  and the other processes do not exist there. Its directory, ``/sandbox`` (cwd, ``HOME``, ``TMPDIR``; ``/tmp`` points
  there), is a tmpfs of ``workdir_mb`` that lives and dies with the call, the only place it can write but a 4 MiB
  ``/dev/shm`` (multiprocessing's semaphores): nothing it writes reaches the host's disks. Its code arrives on stdin as
  a sealed in-memory file; its stdout and stderr go to one host file the trainer opened, capped by ``RLIMIT_FSIZE``.
* **It runs as an identity that can write nowhere else.** Without root, under a user namespace of its own as uid/gid
  65534 (mapped to the caller's uid), in which it cannot create another (the seccomp filter below; elsewhere
  ``--disable-userns``, bubblewrap 0.8+). As root (CI, containers), bwrap sets the namespaces up without a user
  namespace and the runner, before it reads the code, drops to a fresh, otherwise unused uid/gid per call
  (``SANDBOX_UID_BASE`` + 24 random bits; root cannot be a sandbox's uid: the kernel exempts uid 0 from
  ``RLIMIT_NPROC``) and checks that no capability is left. ``no_new_privs`` is set; every bound filesystem is
  ``nosuid``. On x86_64 a seccomp filter (``seccomp_filter``) refuses new user namespaces (the way back to
  capabilities), ``clone3``, ``bpf``, ``perf_event_open``, ``userfaultfd``, io_uring, the keyring, 32-bit/x32 system
  calls and ``ptrace`` & co.; ``/proc/1`` (bwrap's init, outside the code's rlimits) is masked.
* **No network**: a network namespace with only its own loopback (the host's ``127.0.0.1``, its abstract and path unix
  sockets are out of reach).
* **Limits** (per process, inherited by everything it starts): address space ``memory_mb`` (``RLIMIT_AS``), CPU time
  ``cpu_s``, file size ``max_file_mb``, no core dumps, and at most ``max_processes`` tasks, threads included
  (``RLIMIT_NPROC``, counted in its own user namespace or for its own uid). Worst case for the whole call:
  ``max_processes * memory_mb`` of memory plus the ``workdir_mb`` tmpfs, ``max_processes`` cores until ``timeout_s``.
* **Nothing outlives the call**: at the wall-time limit, the sandbox's PID 1 is killed and ``run_python`` waits until
  the kernel has killed every process of the namespace (daemons, double forks and ``setsid`` included); a normal exit
  ends the namespace the same way. ``--die-with-parent``: if the trainer dies, so does the sandbox. ``--new-session``:
  no terminal to inject input into.
* **Output truncated** to ``max_output_chars`` (stdout and stderr together, in order): its head and its tail, where a
  traceback ends.

The code runs with ``python -I -S``: no ``site``, so the standard library only (no packages of the trainer's venv).
Inside the sandbox it may start processes, use ``ctypes``, write files: the limits above hold for all of them. Not
enforced: the CPU and memory use of the machine as a whole beyond ``max_processes`` times the per-process limits (run
fewer tools at once with ``rollout.agent.max_parallel_tools``), and the rest of the kernel's attack surface (a kernel
bug reachable from an unprivileged process through an allowed system call is out of scope; run hostile workloads on a
separate machine).

Where bwrap is missing or cannot create its namespaces, ``check_sandbox`` (called when the ``python`` tool is built,
i.e. at config validation) raises an error naming what is missing: the tool does not start.

``audit-hook-unsafe``: the previous, weaker runner, for machines where bubblewrap cannot run, chosen explicitly. A
``python -I`` subprocess in a private host directory, in a network namespace where ``unshare`` allows one, with the same
rlimits; a PEP 578 audit hook refuses sockets, process creation, ``ctypes`` and writes outside its directory. An audit
hook is not a security boundary: the code runs as the trainer's user, can **read every file the trainer can** (data,
ground truth, checkpoints), and a primitive that raises no audit event escapes the hook entirely and writes anywhere the
trainer can."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import random
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import lru_cache

SANDBOX_MODES = ("bwrap", "audit-hook-unsafe")
FIELD = "rollout.agent.code.sandbox"
SANDBOX_UID_BASE = 0x5A000000
"""As root, each call runs as ``SANDBOX_UID_BASE + random 24 bits`` (1509949440 ..): a uid range no account uses."""
WORKDIR = "/sandbox"
SHM_MB = 4  # /dev/shm: a tmpfs of its own, for multiprocessing's semaphores

# The bwrap runner: trusted code that drops its identity (as root), limits itself, then runs the model's code from
# stdin. Nothing of the model's runs before the limits are in place.
BWRAP_RUNNER = r"""
import os, resource, sys
uid, mem, cpu, fsize, nproc = map(int, sys.argv[1:6])
if uid >= 0:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
with open("/proc/self/status") as f:
    caps = {k: int(v, 16) for k, v in (line.split(":") for line in f) if k in ("CapPrm", "CapEff", "CapAmb")}
if os.getuid() == 0 or os.geteuid() == 0 or any(caps.values()):
    sys.exit(f"sandbox: refusing to run: uid {os.getuid()}, capabilities {caps}")
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
code = sys.stdin.read()
sys.argv = ["<code>"]
del uid, mem, cpu, fsize, nproc, caps, f, resource
exec(compile(code, "<code>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""

# The audit-hook runner (``audit-hook-unsafe``): limits itself, installs the audit hook, then executes the code.
AUDIT_HOOK_RUNNER = r"""
import os, resource, sys
workdir, mem, cpu, fsize = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
code = sys.stdin.read()
root = os.path.realpath(workdir) + os.sep
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
PATH_EVENTS = {"os.remove": 1, "os.rename": 2, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1, "os.chown": 1,
               "os.link": 2, "os.symlink": 2, "os.truncate": 1, "os.utime": 1, "shutil.rmtree": 1, "shutil.move": 2,
               "shutil.copyfile": 2}
REFUSED = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
           "ctypes.", "os.kill", "os.killpg", "_posixsubprocess")

def inside(path):
    if isinstance(path, int):
        return True
    try:
        p = os.path.realpath(os.fsdecode(path))
    except Exception:
        return False
    return (p + os.sep).startswith(root)

def hook(event, args):
    if event.startswith("socket."):
        raise PermissionError("network access is disabled in this sandbox")
    if event.startswith(REFUSED):
        raise PermissionError(f"{event} is disabled in this sandbox")
    if event == "open":
        path, mode, flags = args
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags or 0) & WRITE_FLAGS
        if writing and not inside(path):
            raise PermissionError(f"writing outside the sandbox directory is not allowed: {path}")
    n = PATH_EVENTS.get(event)
    if n:
        for path in args[:n]:
            if isinstance(path, (str, bytes, os.PathLike)) and not inside(path):
                raise PermissionError(f"{event} outside the sandbox directory is not allowed: {path}")

sys.addaudithook(hook)
exec(compile(code, "<code>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


@dataclass(frozen=True)
class RunResult:
    output: str
    """stdout and stderr, interleaved; past ``max_output_chars`` its head and tail around ``[...]``."""
    exit_code: int | None
    """None when the run was killed at the wall-time limit. A program killed by a signal: ``128 + signal`` under
    ``bwrap`` (as a shell reports it), ``-signal`` under ``audit-hook-unsafe``."""
    timed_out: bool
    seconds: float
    truncated: bool


def run_python(
    code: str,
    *,
    timeout_s: float,
    memory_mb: int,
    cpu_s: int,
    max_output_chars: int,
    max_file_mb: int = 16,
    max_processes: int = 16,
    workdir_mb: int = 64,
    sandbox: str = "bwrap",
) -> RunResult:
    """Run ``code`` under the limits above; never raises for anything the code does (``ValueError`` where the
    ``sandbox`` mode cannot run here, see ``check_sandbox``)."""
    check_sandbox(sandbox)
    t0 = time.perf_counter()
    with tempfile.TemporaryFile(prefix="rlspmd-sandbox-out-") as out:
        if sandbox == "bwrap":
            exit_code, timed_out = _run_bwrap(
                code,
                out=out,
                timeout_s=timeout_s,
                memory_mb=memory_mb,
                cpu_s=cpu_s,
                max_file_mb=max_file_mb,
                max_processes=max_processes,
                workdir_mb=workdir_mb,
            )
        else:
            exit_code, timed_out = _run_audit_hook(
                code, out=out, timeout_s=timeout_s, memory_mb=memory_mb, cpu_s=cpu_s, max_file_mb=max_file_mb
            )
        text, truncated = _read_output(out, max_output_chars)
    return RunResult(
        output=text, exit_code=exit_code, timed_out=timed_out, seconds=time.perf_counter() - t0, truncated=truncated
    )


def check_sandbox(mode: str, *, field_name: str = FIELD) -> None:
    """Raise ``ValueError`` naming ``field_name`` and what is missing where ``mode`` cannot isolate code here (fail
    closed: the ``python`` tool does not start). ``bwrap`` is probed once per process with a real run."""
    if mode not in SANDBOX_MODES:
        raise ValueError(f"{field_name}={mode!r}: must be one of {list(SANDBOX_MODES)}")
    if mode != "bwrap":
        return
    bwrap = shutil.which("bwrap")
    problem = "bubblewrap is not installed (no `bwrap` on PATH)" if bwrap is None else _probe_bwrap(bwrap)
    if problem:
        raise ValueError(
            f"{field_name}='bwrap': model-written code cannot be isolated on this machine: {problem}. Install "
            "bubblewrap (`apt-get install bubblewrap`, `dnf install bubblewrap`; scripts/install.sh does as root) and "
            "allow user namespaces (sysctl user.max_user_namespaces > 0; Ubuntu 24.04: "
            "kernel.apparmor_restrict_unprivileged_userns=0 or an AppArmor profile for bwrap), or accept the weaker "
            f"Python-level sandbox with {field_name}='audit-hook-unsafe' (docs/agents.md: The python tool's sandbox)"
        )


_PROBED: set[str] = set()
_PROBE_LOCK = threading.Lock()


def _probe_bwrap(bwrap: str) -> str | None:
    """None where a trivial program runs in the full sandbox (once per process and bwrap path), else what failed."""
    with _PROBE_LOCK:
        if bwrap in _PROBED:
            return None
        with tempfile.TemporaryFile() as out:
            try:
                exit_code, _ = _run_bwrap(
                    "print('sandbox-ok')",
                    out=out,
                    timeout_s=30,
                    memory_mb=256,
                    cpu_s=10,
                    max_file_mb=1,
                    max_processes=4,
                    workdir_mb=1,
                )
            except OSError as e:
                return f"{bwrap} failed to start: {e}"
            text, _ = _read_output(out, 2000)
        if exit_code != 0 or text.strip() != "sandbox-ok":
            return f"a trial run under {bwrap} failed (exit code {exit_code}): {text.strip()!r}"
        _PROBED.add(bwrap)
        return None


@dataclass(frozen=True)
class Interpreter:
    executable: str
    """The base interpreter, symlinks resolved; bound at the same path inside."""
    binds: tuple[str, ...]
    """Host paths bound read-only at the same path (none inside another)."""
    symlinks: tuple[tuple[str, str], ...]
    """``(target, path)``: ``/lib`` -> ``usr/lib`` on merged-/usr systems, recreated inside."""


@lru_cache(maxsize=1)
def interpreter() -> Interpreter:
    """What the sandbox binds: the interpreter, its standard library and shared library, the system libraries."""
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    # the base installation's library paths (a venv's own lib/, its site-packages, stays outside)
    base = {
        "base": sys.base_prefix,
        "platbase": sys.base_exec_prefix,
        "installed_base": sys.base_prefix,
        "installed_platbase": sys.base_exec_prefix,
    }
    lib = sysconfig.get_paths(vars=base)
    paths = {exe, lib["stdlib"], lib["platstdlib"], "/etc/ld.so.cache"}
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and sysconfig.get_config_var("LIBDIR"):
        paths.add(sysconfig.get_config_var("LIBDIR"))  # libpython3.x.so
    symlinks = []
    for d in ("/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32", "/lib", "/lib64", "/lib32", "/libx32"):
        if os.path.islink(d):
            symlinks.append((os.readlink(d), d))
        elif os.path.isdir(d):
            paths.add(d)
    real = sorted({os.path.realpath(p) for p in paths if os.path.exists(p)})
    binds = [p for p in real if not any(p.startswith(q.rstrip("/") + "/") for q in real if q != p)]
    return Interpreter(executable=exe, binds=tuple(binds), symlinks=tuple(symlinks))


def bwrap_arguments(
    interp: Interpreter, *, as_root: bool, workdir_mb: int, info_fd: int, disable_userns: bool = True
) -> list[str]:
    """The namespaces and the filesystem of one sandbox (the command follows ``--``). ``disable_userns`` (bubblewrap
    0.8+) is redundant where the seccomp filter already refuses new user namespaces."""
    args = [
        "--die-with-parent",
        "--new-session",
        "--unshare-ipc",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--hostname",
        "sandbox",
        "--info-fd",
        str(info_fd),
    ]
    if as_root:  # namespaces without a user namespace; the runner drops to its own uid with these two, then has none
        args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-user", "--uid", "65534", "--gid", "65534"]
        args += ["--disable-userns"] if disable_userns else []
    # the directories leading to the binds, world-readable: bwrap would create them 0700 for root, and the code (its
    # own uid) could then not import a module that was not loaded before the runner dropped root
    parents = {os.path.dirname(p) for p in interp.binds} | {os.path.dirname(p) for _, p in interp.symlinks}
    for d in sorted({a for p in parents for a in _ancestors(p)}):
        args += ["--perms", "0755", "--dir", d]
    for path in interp.binds:
        args += ["--ro-bind", path, path]
    for target, path in interp.symlinks:
        args += ["--symlink", target, path]
    # /proc/1 (bwrap's init, which holds none of the code's limits) masked by an empty directory: as an ordinary user
    # init has the code's uid, and its /proc entries (mem, fds) would be a way around the limits. /dev read-only (its
    # device nodes stay usable): as an ordinary user its tmpfs is the code's, with no size limit; /dev/shm a small
    # tmpfs of its own, for multiprocessing's semaphores.
    args += [
        "--proc",
        "/proc",
        "--perms",
        "0555",
        "--tmpfs",
        "/proc/1",
        "--remount-ro",
        "/proc/1",
        "--dev",
        "/dev",
        "--perms",
        "1777",
        "--size",
        str(SHM_MB << 20),
        "--tmpfs",
        "/dev/shm",
        "--remount-ro",
        "/dev",
        "--perms",
        "1777",
        "--size",
        str(workdir_mb << 20),
        "--tmpfs",
        WORKDIR,
        "--symlink",
        WORKDIR,
        "/tmp",
        "--remount-ro",
        "/",
        "--chdir",
        WORKDIR,
        "--clearenv",
        "--setenv",
        "HOME",
        WORKDIR,
        "--setenv",
        "TMPDIR",
        WORKDIR,
        "--setenv",
        "PATH",
        "/usr/bin:/bin",
    ]
    return args


def _ancestors(path: str) -> list[str]:
    """``/a/b/c`` -> ``["/a", "/a/b", "/a/b/c"]``."""
    parts = [p for p in path.split("/") if p]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _run_bwrap(
    code: str,
    *,
    out,
    timeout_s: float,
    memory_mb: int,
    cpu_s: int,
    max_file_mb: int,
    max_processes: int,
    workdir_mb: int,
) -> tuple[int | None, bool]:
    deadline = time.monotonic() + timeout_s
    interp = interpreter()
    as_root = os.geteuid() == 0
    uid = SANDBOX_UID_BASE + random.getrandbits(24) if as_root else -1
    info_r, info_w = os.pipe()
    child_fds = [info_w]  # bwrap's ends, closed here once it started
    bpf = seccomp_filter()
    args = bwrap_arguments(interp, as_root=as_root, workdir_mb=workdir_mb, info_fd=info_w, disable_userns=bpf is None)
    if bpf is not None:
        child_fds.append(_sealed_memfd("rlspmd-seccomp", bpf))  # close-on-exec: only bwrap gets it (pass_fds)
        args += ["--seccomp", str(child_fds[-1])]
    cmd = [
        shutil.which("bwrap") or "bwrap",
        *args,
        "--",
        interp.executable,
        "-I",
        "-S",
        "-c",
        BWRAP_RUNNER,
        str(uid),
        str(memory_mb << 20),
        str(max(1, int(cpu_s))),
        str(max_file_mb << 20),
        str(max_processes),
    ]
    code_fd = _sealed_memfd("rlspmd-code", code.encode())  # stdin: a file, so no writer can block on a full pipe
    pidfd = None
    try:
        proc = subprocess.Popen(
            cmd, stdin=code_fd, stdout=out, stderr=subprocess.STDOUT, env={}, start_new_session=True, pass_fds=child_fds
        )
        while child_fds:
            os.close(child_fds.pop())
        # bwrap's own exit, waited on with a pidfd (Popen.wait(timeout) polls with sleeps of up to 50 ms)
        bwrap_fd = os.pidfd_open(proc.pid)
        try:
            pidfd = _sandbox_init(info_r, deadline)
            timed_out = not select.select([bwrap_fd], [], [], max(0.0, deadline - time.monotonic()))[0]
        finally:
            os.close(bwrap_fd)
        _end_sandbox(proc, pidfd)
        return (None if timed_out else proc.returncode), timed_out
    finally:
        for fd in [info_r, code_fd, *child_fds] + ([pidfd] if pidfd is not None else []):
            os.close(fd)


def _sealed_memfd(name: str, data: bytes) -> int:
    """An in-memory file holding ``data``, sealed against any change (the code could otherwise write to its stdin),
    positioned at its start."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


# A seccomp filter (classic BPF over struct seccomp_data) for x86_64, the architecture it was tested on; elsewhere
# none is installed. It refuses what a standard-library program never needs and what most kernel exploits start
# from: new user namespaces (clone/unshare with CLONE_NEWUSER; as root the sandbox has no user namespace whose
# --disable-userns would do it), clone3 (its flags are out of a filter's reach: ENOSYS, and glibc falls back to
# clone), bpf, perf_event_open, userfaultfd, io_uring, the kernel keyring, 32-bit / x32 system calls, and access to
# another process's memory or files (ptrace & co.: as an ordinary user bwrap's init has the code's uid, not its limits).
_AUDIT_ARCH_X86_64 = 0xC000003E
_X86_64 = {
    "clone": 56,
    "unshare": 272,
    "clone3": 435,
    # bpf, perf_event_open, userfaultfd, io_uring_*, keyring; ptrace, process_vm_*, kcmp, pidfd_getfd, process_madvise
    "refused": (321, 298, 323, 425, 426, 427, 248, 249, 250, 101, 310, 311, 312, 438, 440),
}
_CLONE_NEWUSER = 0x10000000


@lru_cache(maxsize=1)
def seccomp_filter() -> bytes | None:
    """The filter as bwrap's ``--seccomp`` reads it (``struct sock_filter`` array), or None off x86_64."""
    if platform.machine() != "x86_64" or sys.byteorder != "little":
        return None
    import struct

    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    nr = _X86_64
    # (code, jump-if-true label, jump-if-false label, k); labels resolve to relative offsets below
    prog = [
        (ld, None, None, 4),
        (jeq, None, "enosys", _AUDIT_ARCH_X86_64),
        (ld, None, None, 0),
        (jge, "enosys", None, 0x40000000),
        (jeq, "enosys", None, nr["clone3"]),
    ]
    prog += [(jeq, "eperm", None, n) for n in nr["refused"]]
    prog += [(jeq, "flags", None, nr["unshare"]), (jeq, "flags", None, nr["clone"]), (ret, None, None, allow)]
    labels = {"flags": len(prog)}
    prog += [(ld, None, None, 16), (jset, "eperm", None, _CLONE_NEWUSER), (ret, None, None, allow)]  # args[0], low
    labels["eperm"] = len(prog)
    prog.append((ret, None, None, eperm))
    labels["enosys"] = len(prog)
    prog.append((ret, None, None, enosys))
    rel = lambda i, label: 0 if label is None else labels[label] - i - 1  # noqa: E731
    return b"".join(struct.pack("=HBBI", code, rel(i, jt), rel(i, jf), k) for i, (code, jt, jf, k) in enumerate(prog))


def _sandbox_init(info_r: int, deadline: float) -> int | None:
    """A pidfd of the sandbox's PID 1, from the JSON bwrap writes to ``--info-fd`` once the sandbox exists; opened
    while bwrap, its parent, has not reaped it, so the pid cannot have been reused. None where bwrap stopped before
    (its message is in the output) or the deadline passed first (killing bwrap then ends what it set up)."""
    data = b""
    while True:
        wait = deadline - time.monotonic()
        if wait <= 0 or not select.select([info_r], [], [], wait)[0]:
            return None
        chunk = os.read(info_r, 1 << 16)
        if not chunk:
            return None
        data += chunk
        try:
            pid = json.loads(data)["child-pid"]
        except ValueError:
            continue  # not all of it yet
        try:
            return os.pidfd_open(pid)
        except ProcessLookupError:
            return None


def _end_sandbox(proc: subprocess.Popen, pidfd: int | None) -> None:
    """Kill the sandbox's PID 1 and wait until it is gone: the kernel kills every other process of the PID namespace
    before PID 1's exit completes, so when this returns nothing the code started survives. (bwrap itself returns as
    soon as the program exits, and leaves the namespace's end to --die-with-parent, asynchronously.)"""
    if pidfd is not None:
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _kill_group(proc)  # bwrap (its own process group): --die-with-parent ends a sandbox still being set up
    proc.wait()
    if pidfd is not None:
        select.select([pidfd], [], [], 30.0)  # readable once PID 1, and so its whole namespace, has exited


def _run_audit_hook(
    code: str, *, out, timeout_s: float, memory_mb: int, cpu_s: int, max_file_mb: int
) -> tuple[int | None, bool]:
    workdir = tempfile.mkdtemp(prefix="rlspmd-sandbox-")
    try:
        cmd = [
            *network_namespace_prefix(),
            sys.executable,
            "-I",
            "-c",
            AUDIT_HOOK_RUNNER,
            workdir,
            str(memory_mb << 20),
            str(max(1, int(cpu_s))),
            str(max_file_mb << 20),
        ]
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "PYTHONDONTWRITEBYTECODE": "1"}
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env=env,
            start_new_session=True,
        )
        try:
            proc.communicate(code.encode(), timeout=timeout_s)
            return proc.returncode, False
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.communicate()
            return None, True
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _read_output(out, max_output_chars: int) -> tuple[str, bool]:
    """The head and the tail: an error's last lines are what the model needs."""
    size = out.seek(0, os.SEEK_END)
    out.seek(0)
    head = out.read(2 * max_output_chars).decode("utf-8", errors="replace")
    out.seek(max(0, size - 2 * max_output_chars))
    tail = out.read().decode("utf-8", errors="replace")
    truncated = size > 2 * max_output_chars or len(head) > max_output_chars
    text = head if not truncated else head[: max_output_chars // 2] + " [...] " + tail[-(max_output_chars // 2 - 7) :]
    return text, truncated


@lru_cache(maxsize=1)
def network_namespace_prefix() -> tuple[str, ...]:
    """``unshare`` arguments that give the child its own (empty) network namespace, or () where that is not allowed
    (``audit-hook-unsafe`` mode)."""
    exe = shutil.which("unshare")
    if exe is None:
        return ()
    cmd = (exe, "--user", "--map-root-user", "--net", "--")
    try:
        ok = subprocess.run([*cmd, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return cmd if ok else ()


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
