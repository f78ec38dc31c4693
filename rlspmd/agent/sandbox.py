"""Run model-written Python in a separate, limited process: model output is untrusted input and never runs in the
trainer's process.

What is enforced, for every run (``run_python``):

* **A separate process** (``python -I``: no user site, no ``PYTHON*`` variables), started with an empty environment
  (``PATH``, ``HOME`` and ``TMPDIR`` only), in its own session so a timeout kills it and anything it left behind.
* **Wall-time limit** (``timeout_s``): the process group is killed when it passes. **CPU limit** (``RLIMIT_CPU``),
  **address-space limit** (``RLIMIT_AS``: allocations past ``memory_mb`` fail with ``MemoryError``), **file-size
  limit** (``RLIMIT_FSIZE``: no file, the output included, grows past ``max_file_mb``), no core dumps.
* **A private temporary directory** as working directory and ``HOME``, removed afterwards.
* **No network**: where unprivileged user namespaces work (``unshare --user --map-root-user --net``, checked once), the
  process runs in a network namespace of its own, with no interface but a loopback that is down. In every case an
  audit hook (PEP 578), installed before the code runs, refuses socket creation, so the Python level refuses too.
* **No writes outside its directory** (audit hook): opening a file for writing, and removing, renaming, creating or
  changing files and directories, are refused for paths outside the temporary directory; so are starting processes
  (``subprocess``, ``os.system``, ``exec*``, ``fork``) and ``ctypes`` (either could step around the hook).
* **Output truncated** to ``max_output_chars`` (stdout and stderr together, in order): its head and its tail, where a
  traceback ends.

Not enforced: reading files outside the directory (the host's file permissions apply), and CPU or memory use of the
machine as a whole beyond the per-process limits (run fewer tools at once with ``rollout.agent.max_parallel_tools``).
An audit hook is not a security boundary against native code; the namespace, the limits and the refused ``ctypes``
are what keep a Python program inside. For hostile workloads run the tools on a separate machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache

# The runner: trusted code that limits itself, installs the audit hook, then executes the model's code from stdin.
RUNNER = r"""
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
    """None when the run was killed at the wall-time limit."""
    timed_out: bool
    seconds: float
    truncated: bool


@lru_cache(maxsize=1)
def network_namespace_prefix() -> tuple[str, ...]:
    """``unshare`` arguments that give the child its own (empty) network namespace, or () where that is not allowed."""
    exe = shutil.which("unshare")
    if exe is None:
        return ()
    cmd = (exe, "--user", "--map-root-user", "--net", "--")
    try:
        ok = subprocess.run([*cmd, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return cmd if ok else ()


def run_python(code: str, *, timeout_s: float, memory_mb: int, cpu_s: int, max_output_chars: int,
               max_file_mb: int = 16) -> RunResult:
    """Run ``code`` under the limits above; never raises for anything the code does."""
    workdir = tempfile.mkdtemp(prefix="rlspmd-sandbox-")
    out_path = os.path.join(workdir, ".output")
    t0 = time.perf_counter()
    try:
        with open(out_path, "wb") as out:
            cmd = [*network_namespace_prefix(), sys.executable, "-I", "-c", RUNNER, workdir, str(memory_mb << 20),
                   str(max(1, int(cpu_s))), str(max_file_mb << 20)]
            env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "PYTHONDONTWRITEBYTECODE": "1"}
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, cwd=workdir, env=env,
                                    start_new_session=True)
            timed_out = False
            try:
                proc.communicate(code.encode(), timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
                proc.communicate()
        size = os.path.getsize(out_path)
        with open(out_path, "rb") as f:  # the head and the tail: an error's last lines are what the model needs
            head = f.read(2 * max_output_chars).decode("utf-8", errors="replace")
            f.seek(max(0, size - 2 * max_output_chars))
            tail = f.read().decode("utf-8", errors="replace")
        truncated = size > 2 * max_output_chars or len(head) > max_output_chars
        text = head if not truncated else head[: max_output_chars // 2] + " [...] " + tail[-(max_output_chars // 2 - 7):]
        return RunResult(output=text, exit_code=None if timed_out else proc.returncode,
                         timed_out=timed_out, seconds=time.perf_counter() - t0, truncated=truncated)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
