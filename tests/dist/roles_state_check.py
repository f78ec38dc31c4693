"""The checkpoint state is explicit and complete: build the roles for a run that has every kind of state (PPO with a
critic, an adaptive KL controller in the reward, the data sampler) and check that every stateful object the builder
made is in the checkpoint's dict, under its documented name, and that the trainer's components round-trip.

    torchrun --nproc-per-node 1 roles_state_check.py MODEL_DIR DATA_DIR OUT_DIR
"""

import dataclasses
import sys

from rlspmd.distributed.runtime import exit_process, shutdown, spmd_main
from rlspmd.engines.base import TrainingEngine
from rlspmd.startup import parse_args, start
from rlspmd.trainer.build import build_roles
from rlspmd.trainer.checkpoint import TrainerState


def stateful(obj) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


@spmd_main
def main():
    model, data, out = sys.argv[1:4]
    cfg, _ = parse_args([
        "--config", "configs/ppo.py:cpu", "--actor.model.path", model, "--trainer.output-dir", out,
        "--data.train-files", f"{data}/train.parquet", "--data.val-files", f"{data}/test.parquet",
        "--algorithm.use-kl-in-reward", "algorithm.kl-ctrl:adaptive",
        "--data.train-batch-size", "4", "--actor.mini-batch-size", "2", "--critic.mini-batch-size", "2", "--rollout.n", "2",
    ])
    rt, meshes = start(cfg, dist=cfg.dist, mesh=cfg.mesh, seed=0)
    roles = build_roles(cfg, rt, meshes)
    saved = roles.checkpointing.state(TrainerState({}))
    # Every stateful object the builder made (a role's engine, a stage, the sampler) is saved under a name.
    found = {}
    for field in dataclasses.fields(roles):
        obj = getattr(roles, field.name)
        for name, candidate in [(field.name, obj), (f"{field.name}.engine", getattr(obj, "engine", None)),
                                (f"{field.name}.sampler", getattr(obj, "sampler", None))]:
            if isinstance(candidate, TrainingEngine) and candidate.optimizer is None:
                continue  # frozen (reference, reward model): rebuilt from its model directory
            if candidate is not None and stateful(candidate) and not isinstance(candidate, type(roles.checkpointing)):
                found[name] = candidate
    listed = {id(v) for v in saved.values()} | {id(v) for v in roles.checkpointing.components.values()}
    missing = sorted(name for name, obj in found.items() if id(obj) not in listed)
    assert not missing, f"stateful objects missing from the checkpoint state: {missing}"
    assert set(saved) == {"actor", "critic", "trainer", "rng"}, sorted(saved)
    # the experiment trackers' run ids (rlspmd/trackers.py) are saved by rank 0
    want = {"sampler", "token_rewards"} | ({"trackers"} if rt.is_main else set())
    assert set(roles.checkpointing.components) == want, roles.checkpointing.components
    assert {"actor.engine", "critic.engine", "prompts.sampler", "token_rewards"} <= set(found), sorted(found)

    # The components round-trip: a restored sampler continues where the saved one was.
    batch = roles.prompts.next()
    states = {k: c.state_dict() for k, c in roles.checkpointing.components.items()}
    position = roles.prompts.sampler.position
    roles.prompts.next()
    for k, c in roles.checkpointing.components.items():
        c.load_state_dict(states[k])
    assert roles.prompts.sampler.position == position > 0 and len(batch) == 4
    print("ROLES STATE OK", flush=True)
    shutdown()


if __name__ == "__main__":
    main()
    exit_process()
