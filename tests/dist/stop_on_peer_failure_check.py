"""Rank 1 raises while rank 0 is busy with long local work (no collective to fail): torchrun's SIGTERM must end
rank 0 at once, even though rlspmd's stop handler (SIGTERM = save and stop at the next step) is installed."""

import time

import torch.distributed as dist

from rlspmd.config import DistConfig
from rlspmd.distributed.runtime import StopRequest, init_distributed, spmd_main


@spmd_main
def main():
    rt = init_distributed(DistConfig())
    StopRequest().install()
    dist.barrier()
    if rt.rank == 1:
        time.sleep(0.5)
        raise ValueError("boom on rank 1")
    time.sleep(45)
    print("UNREACHABLE", flush=True)


if __name__ == "__main__":
    main()
