"""Two RL steps through ``build_trainer`` (the entry point's path), every rank running the step; rank 0 saves each step's responses, rewards and
metrics. Run colocated and split (actor and rollout on disjoint ranks) with the same seed and rollout DP layout:
the outputs must match.

    torchrun --nproc-per-node N split_rollout_check.py OUT.pt [rlspmd.train overrides...]
"""

import sys

import torch

from rlspmd.distributed.dispatch import gather_batch
from rlspmd.distributed.mesh import DP, ParallelDims, RoleMeshes
from rlspmd.distributed.runtime import exit_process, init_distributed, seed_everything, shutdown, spmd_main
from rlspmd.protocol import Batch
from rlspmd.startup import parse_args
from rlspmd.trainer.build import build_trainer


def digit_reward(response: str, ground_truth: str, extra_info: dict, data_source: str) -> float:
    """Varies between samples of a random model, so advantages (and the update) are not all zero."""
    return sum(c.isdigit() for c in response) / 10.0


@spmd_main
def main():
    out_path, overrides = sys.argv[1], sys.argv[2:]
    cfg, _ = parse_args(["--config", "configs/quickstart.py", "--reward.function", f"{__file__}:digit_reward", *overrides])
    rt = init_distributed(cfg.dist)
    seed_everything(cfg.trainer.seed)
    meshes = RoleMeshes(ParallelDims.from_config(cfg.mesh, rt.world_size), rt.device.type, rt.rank)
    trainer = build_trainer(cfg, rt, meshes)
    seen: list[Batch] = []
    score = trainer.roles.reward.score

    def recording_score(batch, metrics):
        out = score(batch, metrics)
        seen.append(Batch({"responses_BR": out["responses_BR"].cpu(), "scores_B": out["scores_B"].cpu(),
                           "rollout_logprobs_BR": out["rollout_logprobs_BR"].cpu()}))
        return out

    if meshes.hosts("actor"):  # the rollout-only ranks score nothing (their batches are empty)
        trainer.roles.reward.score = recording_score
    steps = [trainer.step(step) for step in (1, 2)]
    if not meshes.hosts("actor"):
        assert not seen and steps == [{}, {}]
        shutdown()
        return
    gathered = [gather_batch(b, mesh=meshes.get("actor", DP)) for b in seen]
    if rt.rank == 0:
        torch.save({"batches": [b.tensors for b in gathered], "metrics": steps}, out_path)
        print("SPLIT CHECK DONE", flush=True)
    shutdown()


if __name__ == "__main__":
    main()
    exit_process()  # after a clean shutdown(): no interpreter teardown (see its docstring)
