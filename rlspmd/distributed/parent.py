"""Leave when the launcher dies: a rank (or a reward worker) must not outlive the process that started it.

torchrun starts every rank in a session of its own, so when its agent is killed outright (SIGKILL from the OOM
killer, a lost login shell, ``scancel`` of the launcher step) the kernel takes no rank down with it: the ranks train
on, writing metrics and checkpoints into the directory that a restarted job then uses. Two guards, either suffices:

* Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``, via ctypes): the kernel signals this process the moment
  its parent exits; the handler checks that the parent really changed (the signal also fires when the parent
  *thread* that forked us exits) and leaves.
* A watchdog thread that polls ``os.getppid()`` twice a second: portable, and it acts even while the main thread is
  blocked in C code (a collective waiting for a peer), where a Python signal handler would only run afterwards.

Simplification: both need the interpreter's lock now and then; a main thread that holds it forever in C code is
ended by nothing here (torchrun is gone, so nobody else will either). No module here imports torch: reward
worker processes use it too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
# A real-time signal nobody else uses: SIGTERM/SIGUSR1 already mean "checkpoint and stop", which is exactly what must
# not happen here (the job's launcher is gone; nothing may be written after it).
PARENT_DIED = signal.SIGRTMIN + 2 if hasattr(signal, "SIGRTMIN") else None
POLL_S = 0.5

_exiting = threading.Lock()


def set_parent_death_signal(signum: int) -> bool:
    """Ask the kernel to send ``signum`` to this process when its parent exits (Linux); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def leave(message: str, code: int = 1) -> None:
    """Print ``message`` on stderr once and end the process at once (no unwinding: it may be inside a collective)."""
    if _exiting.acquire(blocking=False):
        try:
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
        finally:
            os._exit(code)
    while True:  # another thread is already leaving
        time.sleep(1)


def watch_parent(*, who: str, parent: int | None = None) -> None:
    """End this process with a message on stderr when ``parent`` (default: the current parent) exits.

    Installs the parent-death signal (Linux; needs the main thread for its handler) and starts the polling thread.
    ``who`` names this process in the message (e.g. ``rank 1``).
    """
    parent = os.getppid() if parent is None else parent

    def check() -> None:
        if os.getppid() != parent:
            leave(
                f"[rlspmd] {who}: the process that launched it (pid {parent}, e.g. torchrun's agent) has died; "
                "leaving now, without writing anything more"
            )

    if PARENT_DIED is not None and threading.current_thread() is threading.main_thread():
        signal.signal(PARENT_DIED, lambda signum, frame: check())
        set_parent_death_signal(PARENT_DIED)
    check()  # the parent may have died before the signal was armed

    def poll() -> None:
        while True:
            time.sleep(POLL_S)
            check()

    threading.Thread(target=poll, daemon=True, name="rlspmd-parent-watch").start()
