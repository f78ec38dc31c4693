"""Process-group start-up, per-rank seeding and whole-job failure.

Every rank runs the same program. Under ``torchrun`` the rank/world come from the environment; a plain
``python -m rlspmd.train`` starts a world of one so the same code path can be stepped through in pdb.

Failure model: an exception on any rank is printed once (by the first rank that fails on this node) and
the process exits with status 1 without unwinding through collectives. torchrun's agent sees the
non-zero exit and terminates the other ranks within about a second. Launchers without an agent
(plain srun) rely on the collective timeout instead: a rank blocked on a dead peer fails after
``dist.timeout_s``.

A rank never outlives its launcher: under torchrun, ``init_distributed`` arms ``parent.watch_parent`` (a
parent-death signal and a watchdog thread), so a SIGKILLed agent takes its ranks with it within a second. Hangs are
named: ``start_hang_monitor`` starts the per-rank ``progress.HangMonitor`` (``dist.hang_warn_s``,
``dist.hang_timeout_s``).

Stop requests (preemption): SIGUSR1 and SIGTERM only set a flag (``StopRequest``); the trainer checks it
at step boundaries, agreed over all ranks (any rank saw it -> every rank saves and exits). A signal
handler never saves: a rank may be inside a collective when the signal arrives. One exception: torchrun's
agent also sends SIGTERM to the survivors when a rank has failed; a survivor that finds the failure
marker of a peer on its node then dies at once (as without a handler), since a save would wait on the
dead peer.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import logging
import os
import random
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from functools import wraps
from typing import Literal, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from rlspmd.distributed.parent import watch_parent
from rlspmd.distributed.progress import HangMonitor, job_prefix, where


@dataclass
class DistConfig:
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend; auto picks NCCL when CUDA is available, Gloo otherwise."""
    timeout_s: float = 600.0
    """Collective timeout: a rank that waits longer than this for a dead peer fails instead of hanging."""
    hang_warn_s: float = 300.0
    """Rank 0 warns (naming the rank, its stage, step and seconds) when a rank has been in one stage of a step (``gen``,
    ``reward``, ``update_actor``, ...) longer than this, and repeats every ``hang_warn_s`` while it lasts. Below
    ``timeout_s``, so the late rank is named before a collective times out. 0 disables the warning."""
    hang_timeout_s: float = 7200.0
    """End the job (non-zero exit on every rank, the message naming the rank and stage) when a rank has been in one
    stage longer than this. Far above any one stage of a healthy run (generating a long batch can take many minutes);
    raise it for longer ones. 0 disables it."""


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(cfg: DistConfig) -> Runtime:
    """Initialise ``torch.distributed`` (NCCL on CUDA, Gloo on CPU) and pick this rank's device."""
    if "RANK" not in os.environ:  # plain `python -m ...`: a world of one
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun's agent: leave when it dies
        watch_parent(who=f"rank {rank}")
        if local_rank == 0:
            sweep_failure_markers()
    cuda = torch.cuda.is_available()
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        raise ValueError("dist.backend=nccl needs CUDA; use gloo or auto on this machine")
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        # A dead peer must surface as an error, not a hang (NCCL watchdog aborts on timeout).
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    else:
        device = torch.device("cpu")
        keep_freed_memory()
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(seconds=cfg.timeout_s),
            device_id=device if backend == "nccl" else None,
        )
    return Runtime(rank=rank, world_size=world, local_rank=local_rank, device=device, backend=backend)


MALLOC_ENV = "RLSPMD_KEEP_FREED_MEMORY"
"""Set to ``0`` to leave glibc's allocator in its defaults on CPU (``keep_freed_memory``)."""


def keep_freed_memory() -> bool:
    """On CPU, keep freed tensor memory in the process for the next tensor instead of returning it to the OS: glibc's
    ``mallopt`` with the largest mmap threshold (32 MiB: smaller blocks come from the heap) and a 1 GiB trim threshold.

    In glibc's defaults a tensor of a few MiB is often ``mmap``-ed and unmapped again when freed, so every step
    touches fresh pages: a SmolLM2-135M actor update on a 2-core Xeon page-faulted 340k times per step (0.6 s of
    system time); with these settings, about none after the first step, and the update took 6-10 % less (the
    CPU counterpart of CUDA's caching allocator). Costs: the process keeps up to its peak heap. Returns whether the
    settings were applied (glibc only; ``RLSPMD_KEEP_FREED_MEMORY=0`` opts out)."""
    if os.environ.get(MALLOC_ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 32 << 20)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):  # not glibc
        return False


def quiet_libraries() -> None:
    """Silence per-file progress bars of datasets/transformers; rlspmd logs its own progress."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import datasets
        import transformers

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
    except ImportError:  # pragma: no cover - both are core dependencies
        pass


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch identically on every rank (model init and data order must agree).

    Randomness that must differ between ranks (sampling) uses its own generators seeded from
    ``(seed, rank)``; see ``rollout_generator``.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_deterministic(enabled: bool) -> None:
    """Bit-reproducible kernels. On CPU with a fixed thread count runs are reproducible anyway; this makes
    the choice explicit and fails loudly on an op without a deterministic implementation."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=False)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def rng_state() -> dict:
    """Every global RNG of this process: python, numpy, torch CPU and (when present) CUDA."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class StopRequest:
    """Records SIGTERM/SIGUSR1 so the trainer can checkpoint and exit at the next step boundary.

    The Python-level handler only runs when the main thread is back in the interpreter, which may be never
    if it is blocked in a collective with a dead peer. So the signal is also seen by a watcher thread
    through ``signal.set_wakeup_fd`` (written by the C-level handler at once): it sets the flag, or ends
    the process immediately when a peer on this node has already failed (torchrun's agent is ending the
    job; there is nothing consistent to save).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.signal_name: str | None = None

    def install(self) -> "StopRequest":
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("StopRequest.install must run on the main thread")
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._sockets = (reader, writer)  # keep both ends alive
        for sig in self.SIGNALS:
            signal.signal(sig, lambda signum, frame: self._record(signum))
        threading.Thread(target=self._watch, args=(reader,), daemon=True, name="rlspmd-signals").start()
        return self

    def _watch(self, reader: socket.socket) -> None:
        while True:
            data = reader.recv(64)
            if not data:
                return
            for signum in data:
                if signum in self.SIGNALS:
                    self._record(signum)

    def _record(self, signum: int) -> None:
        if signum == signal.SIGTERM and _peer_failed():
            # Either thread may get here first, and the watcher thread may be the only one that does: the kernel can
            # deliver the signal to it, leaving the main thread asleep in C code. os._exit works from any thread
            # (signal.signal, to re-raise with the default action, only from the main one).
            sys.stderr.flush()
            os._exit(128 + signal.SIGTERM)
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            sys.stderr.write(
                f"[rlspmd] rank {os.environ.get('RANK', '0')}: {self.signal_name} received; "
                "saving a checkpoint and stopping after the current step\n"
            )
            sys.stderr.flush()

    def agreed(self, device: torch.device, *, mesh=None) -> bool:
        """True on every rank of ``mesh`` (None: the whole world) if any of them has seen a stop signal."""
        flag = torch.tensor([1.0 if self.signal_name else 0.0], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=None if mesh is None else mesh.get_group())
        return bool(flag.item())


_STARTED = time.time()

MARKER_PREFIX = "rlspmd-failed-"
"""Names of the failure markers in the temporary directory (``_failure_marker``)."""


def _failure_marker() -> str:
    """This node's failure marker for this job: named by the run id and this rank's parent (torchrun's agent on this
    node), its pid and its start time, so that a marker an earlier job left behind (torchrun's default run id is
    ``none``, and pids are reused) is never this job's."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT", "local")
    ppid = os.getppid()
    return os.path.join(tempfile.gettempdir(), f"{MARKER_PREFIX}{run_id}-{ppid}-{_start_time(ppid) or '0'}")


def _start_time(pid: int) -> str | None:
    """A process's start time, in clock ticks since boot (field 22 of ``/proc/<pid>/stat``; Linux); None if it is
    gone (or not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def sweep_failure_markers() -> int:
    """Remove the failure markers of jobs that have ended: a marker names its node's torchrun agent by pid and start
    time (``_failure_marker``), and one whose agent no longer runs serves nobody (a failed job leaves its marker, so
    they would otherwise pile up in the temporary directory). Others' files that this user may not remove are left.
    Returns how many were removed."""
    if _start_time(os.getpid()) is None:  # no /proc: a marker's agent cannot be checked
        return 0
    removed, tmp = 0, tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(tmp) if n.startswith(MARKER_PREFIX)]
    except OSError:
        return 0
    for name in names:
        parts = name[len(MARKER_PREFIX) :].rsplit("-", 2)
        if len(parts) < 2 or not all(p.isdigit() for p in parts[-2:]):
            continue  # not a marker this code wrote
        pid, started = int(parts[-2]), parts[-1]
        if started == "0" or _start_time(pid) == started:
            continue  # its agent still runs: the job may be alive
        try:
            os.remove(os.path.join(tmp, name))
            removed += 1
        except OSError:
            pass
    return removed


def _peer_failed() -> bool:
    """A rank of this job on this node has failed (its marker is newer than this process: not a stale one)."""
    try:
        return os.path.getmtime(_failure_marker()) >= _STARTED - 1.0
    except OSError:
        return False


class UserError(ValueError):
    """A mistake in what the user gave (configuration, files), reported by its message alone, without a traceback."""


def _mark_failed() -> bool:
    """Create this node's failure marker; True for the first rank to do so (it prints the full report)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return True
    path = _failure_marker()
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        if _peer_failed():
            return False
        # Older than this process: not this job's (its report would otherwise be lost on every rank). Take it over.
        try:
            os.utime(path)
        except OSError:
            pass
    except OSError:
        pass
    return True


def report_failure(exc: BaseException) -> None:
    """Print the traceback once per node: the first failing rank prints it, later ones print one line. Rank 0 adds
    where every rank was when its hang monitor last looked (a collective timeout then names the late rank)."""
    rank = os.environ.get("RANK", "0")
    if _ENDING.is_set():  # the hang monitor is ending the job and has said why; this is a consequence
        return
    first = _mark_failed()
    if first:
        text = f"{exc}\n" if isinstance(exc, UserError) else "".join(traceback.format_exception(exc))
        sys.stderr.write(f"[rlspmd] rank {rank} failed:\n{text}")
        if _MONITOR is not None and _MONITOR.last_views:
            sys.stderr.write(
                "[rlspmd] where the ranks were at the hang monitor's last look: "
                f"{where(_MONITOR.last_views, interval=_MONITOR.interval)}\n"
            )
        sys.stderr.write("[rlspmd] ending the job on every rank.\n")
    else:
        sys.stderr.write(
            f"[rlspmd] rank {rank} also failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}\n"
        )
    sys.stderr.flush()


_MONITOR: HangMonitor | None = None
_ENDING = threading.Event()


def start_hang_monitor(cfg: DistConfig, rt: Runtime) -> HangMonitor | None:
    """Publish this rank's progress to the job's store and, on rank 0, watch every rank's (``progress.py``).
    Call once, after ``init_distributed``. None when both ``dist.hang_warn_s`` and ``dist.hang_timeout_s`` are 0."""
    global _MONITOR
    if cfg.hang_warn_s <= 0 and cfg.hang_timeout_s <= 0:
        return None
    # The store torchrun's agent hosts (or rank 0's, without torchrun): the one every rank already reached at init.
    store = dist.distributed_c10d._get_default_store()

    def end_job(message: str) -> None:
        _ENDING.set()
        _mark_failed()  # torchrun's SIGTERM to this node's other ranks then ends them at once (see StopRequest)
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        if rt.rank == 0:  # let every rank find the message in the store before this rank (maybe its host) is gone
            time.sleep(2 * _MONITOR.interval)
        os._exit(1)

    _MONITOR = HangMonitor(
        store,
        rank=rt.rank,
        world_size=rt.world_size,
        warn_s=cfg.hang_warn_s,
        timeout_s=cfg.hang_timeout_s,
        prefix=job_prefix(),
        end_job=end_job,
    ).start()
    return _MONITOR


def spmd_main(fn):
    """Wrap an entry point so that an exception on this rank ends the job (exit 1) instead of a hang."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SystemExit as e:  # argparse/tyro --help and usage errors
            if e.code not in (0, None) and dist.is_initialized() and dist.get_world_size() > 1:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(int(e.code) if isinstance(e.code, int) else 1)
            raise
        except BaseException as e:  # noqa: BLE001 - any failure must end the whole job
            report_failure(e)
            sys.stdout.flush()
            # os._exit: skip atexit/destructors that could block in a collective with dead peers.
            os._exit(1)

    return wrapper


def shutdown() -> None:
    """End of a clean run on every rank: wait for the peers, drop the Python objects that still hold
    communicators (reference cycles), then destroy every process group while the interpreter is fully alive."""
    if dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        gc.collect()
        dist.destroy_process_group()
    marker = _failure_marker()
    if os.path.exists(marker):
        try:
            os.remove(marker)
        except OSError:
            pass


def exit_process(code: int = 0) -> NoReturn:
    """The last call of a program's ``__main__`` after :func:`shutdown`: flush and leave without interpreter
    finalisation. Gloo and c10d keep native threads whose objects can outlive ``destroy_process_group``; freeing
    them while the interpreter tears down aborts the process now and then (``terminate called without an active
    exception``) after a run that has finished and saved everything, and torchrun then reports the job failed."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def machine_info() -> dict:
    """What a timing was measured on: platform, versions, cores and threads, GPU, CPU model, load average. Printed
    with the run summary (``trainer.print_summary_json``) and by every benchmark script."""
    import platform

    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info
