"""2+ ranks: broadcast, scatter/gather round trips, metric reduction, and disjoint role meshes."""

import torch
import torch.distributed as dist

from rlspmd.config import DistConfig, MeshConfig
from rlspmd.distributed.dispatch import (
    all_gather_objects,
    all_to_all_objects,
    broadcast_object,
    even_split,
    gather_batch,
    redistribute_batch,
    scatter_batch,
)
from rlspmd.distributed.mesh import DP, ParallelDims, RoleMeshes
from rlspmd.distributed.runtime import exit_process, init_distributed, shutdown, spmd_main
from rlspmd.metrics import MetricBuffer
from rlspmd.protocol import Batch


def full_batch(n_per_rank: int, world: int) -> Batch:
    n = n_per_rank * world
    return Batch(
        {"x_BP": torch.arange(n * 3).view(n, 3), "uid_B": torch.arange(n)},
        {"text": [f"row{i}" for i in range(n)], "info": [{"index": i} for i in range(n)]},
    )


@spmd_main
def main():
    rt = init_distributed(DistConfig())
    r, w = rt.rank, rt.world_size
    meshes = RoleMeshes(ParallelDims.from_config(MeshConfig(), w), "cpu", r)
    dp = meshes.get("actor", DP)

    assert broadcast_object({"plan": [1, 2, 3]} if r == 0 else None, mesh=dp) == {"plan": [1, 2, 3]}

    ref = full_batch(3, w)
    local = scatter_batch(ref if r == 0 else None, mesh=dp)
    # consecutive rows: rank r holds rows 3r..3r+2 (a prompt's samples stay together)
    assert local["uid_B"].tolist() == list(range(3 * r, 3 * r + 3)), local["uid_B"]
    assert local["text"] == [f"row{i}" for i in range(3 * r, 3 * r + 3)]
    assert torch.equal(local["x_BP"], ref["x_BP"][3 * r : 3 * r + 3])
    back = gather_batch(local, mesh=dp)
    if r == 0:
        assert torch.equal(back["x_BP"], ref["x_BP"]) and back["info"] == ref["info"] and back["text"] == ref["text"]
    else:
        assert back is None

    m = MetricBuffer()
    m.mean("loss", total=torch.tensor(float(r + 1) * 10), count=r + 1)  # rank r contributes (r+1)*10 over r+1 items
    m.max("max", r)
    m.min("min", r)
    m.sum("sum", 2.0)
    out = m.reduce(mesh=dp)
    assert out["loss"] == 10.0, out
    assert out["max"] == w - 1 and out["min"] == 0 and out["sum"] == 2.0 * w, out

    if w == 4:  # split placement: actor on 0-1, critic+ref on 2-3
        dims = ParallelDims(world_size=w, role_ranks={"actor": [0, 1], "rollout": [0, 1], "ref": [2, 3], "critic": [2, 3],
                                                      "reward": [2, 3]})
        split = RoleMeshes(dims, "cpu", r)
        assert split.hosts("actor") == (r < 2) and split.hosts("critic") == (r >= 2)
        mine = split.get("actor", DP) if r < 2 else split.get("critic", DP)
        assert (split.get("critic") is None) == (r < 2)
        t = torch.tensor([float(r)])
        dist.all_reduce(t, group=mine.get_group())
        assert t.item() == (1.0 if r < 2 else 5.0), t
        assert mine.size() == 2 and split.dp_rank("actor" if r < 2 else "critic") == r % 2
        assert split.get("ref") is split.get("critic")  # same ranks share one mesh

        # actor 0-1 <-> rollout 2-3: uneven rows out to the rollout ranks and back, order kept, no relay
        split = RoleMeshes(ParallelDims.from_config(MeshConfig(actor_ranks="0-1", rollout_ranks="2-3"), w), "cpu", r)
        link = split.link("actor", "rollout")
        assert link.size() == 4 and (split.link("actor", "rollout", first_only=True) is None) == (r == 1)
        assert all_to_all_objects([(r, j) for j in range(4)], mesh=link) == [(j, r) for j in range(4)]
        ref = full_batch(5, 1)  # 5 rows: actor rank 0 holds 3, actor rank 1 holds 2
        mine = {0: ref.slice(0, 3), 1: ref.slice(3, 5)}.get(r)
        counts = [n for _, n in all_gather_objects((None, len(mine) if mine else 0), mesh=link)]
        assert counts == [3, 2, 0, 0]
        out_sizes = [0, 0, *even_split(5, 2)]
        got = redistribute_batch(mine, mesh=link, sizes_in=counts, sizes_out=out_sizes)
        if r >= 2:  # consecutive rows, evenly: rank 2 gets 3, rank 3 gets 2
            assert got["uid_B"].tolist() == ([0, 1, 2] if r == 2 else [3, 4])
        else:
            assert len(got) == 0
        back = redistribute_batch(got if r >= 2 else None, mesh=link, sizes_in=out_sizes, sizes_out=counts)
        if r < 2:
            assert torch.equal(back["x_BP"], mine["x_BP"]) and back["text"] == mine["text"] and back["info"] == mine["info"]
    dist.barrier()
    if r == 0:
        print("DISPATCH OK", flush=True)
    shutdown()


if __name__ == "__main__":
    main()
    exit_process()  # after a clean shutdown(): no interpreter teardown (see its docstring)
