"""Rank 1 raises while rank 0 waits in a collective that would never complete."""

import sys
import time

import torch
import torch.distributed as dist

from rlspmd.config import DistConfig
from rlspmd.distributed.runtime import init_distributed, spmd_main


@spmd_main
def main():
    rt = init_distributed(DistConfig(timeout_s=float(sys.argv[1]) if len(sys.argv) > 1 else 600))
    dist.barrier()
    if rt.rank == 1:
        time.sleep(0.5)
        raise ValueError("boom on rank 1: the reward file row 7 is malformed")
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 1 never joins
    print("UNREACHABLE", flush=True)


if __name__ == "__main__":
    main()
