"""A reward worker process: scores samples sent by its rank (``pool.RewardPool``) until its input closes.

    python -m rlspmd.rewards.worker IN_FD OUT_FD PARENT_PID [SPEC]

Reads lists of ``(slot, response, ground_truth, extra_info, data_source)`` from ``IN_FD`` and answers each call as
soon as it returns, on ``OUT_FD``: ``("ok", slot, value)`` or ``("error", slot, type name, message)``; first of all
``("ready",)`` once the user's function (``SPEC``) is imported, or ``("failed", message)``. One message per call
lets the rank tell which call is running, and kill this process when that call overruns its limit.

Dies with its rank: a parent-death SIGKILL (Linux) and end-of-file on ``IN_FD``; ignores the stop signals meant
for the rank (it runs in a session of its own, too). Imports no torch.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection

from rlspmd.distributed.parent import set_parent_death_signal
from rlspmd.rewards.functions import call_reward, load_function, resolve


def serve(conn_in: Connection, conn_out: Connection, spec: str | None) -> None:
    try:
        custom = load_function(spec) if spec else None
    except BaseException as e:  # noqa: BLE001 - reported to the rank, which names the field
        conn_out.send(("failed", "".join(traceback.format_exception_only(e)).strip()))
        return
    conn_out.send(("ready",))
    while True:
        try:
            work = conn_in.recv()
        except EOFError:  # the rank closed the pool, or died
            return
        for slot, response, ground_truth, extra_info, data_source in work:
            try:
                value = call_reward(resolve(custom, data_source), response, ground_truth, extra_info, data_source)
                conn_out.send(("ok", slot, value))
            except Exception as e:  # noqa: BLE001 - the rank raises it naming the sample (a send failure lands here too)
                conn_out.send(("error", slot, type(e).__name__, str(e)))


def main(argv: list[str]) -> None:
    fd_in, fd_out, parent = int(argv[0]), int(argv[1]), int(argv[2])
    spec = argv[3] if len(argv) > 3 and argv[3] else None
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # the rank died before the signal was armed
        return
    # Stop signals are the rank's business (SLURM signals every process of the job step): a worker killed by one would
    # fail the step the rank is about to checkpoint. It ends with its rank instead.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    serve(Connection(fd_in, writable=False), Connection(fd_out, readable=False), spec)


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown: the user's module may hold threads
