"""Sequence parallel (``mesh.actor_sp``) on CPU ranks: each rank's peak memory and the step time of one actor update
on one long response per rank, with SP 1, 2 and 4, and the longest response that fits a memory budget. Prints JSON.

    python scripts/bench/sequence_parallel.py        # short: the tiny model, 1k/2k-token responses, SP 1 and 2, 2 ranks
    python scripts/bench/sequence_parallel.py --models tiny smollm2 --lengths 4096 8192 16384 --sp 1 2 4
    python scripts/bench/sequence_parallel.py --lengths 8192 --sp 1 2 --max-rss-gb 1.5   # + the longest that fits

Every configuration (model, response length, SP degree) runs under its own ``torchrun`` on ``--nproc`` ranks (default:
the largest SP degree asked for, so every degree runs on the same ranks with the same FSDP shards; one thread each).
Each rank holds one response of ``--lengths`` tokens after a ``--prompt``-token prompt, as the trainer would hand it
its own rows; SP 1 is plain FSDP2 over the ranks. The actor engine is built as the trainer builds it (meta device,
sharded load, float32, activation checkpointing unless ``--no-ac``); after a short warm-up update the rank resets its
resident-set high-water mark (``/proc/self/clear_refs``), runs one optimiser step of the policy's log-prob loss on its
response and records:

* ``peak_rss``: the process's peak resident set during the step (what a memory budget limits);
* ``activation``: that peak minus the resident set just before the step (the step's activations and temporaries;
  model, gradients and optimiser state are allocated by then); on CUDA the same from the device allocator's counters
  (``cuda_peak`` is then its peak);
* ``step_s``: the step's wall-clock seconds (the slowest rank).

Per configuration the JSON gives the largest of each over the ranks, and per (model, length) the ratio of each SP
degree's activation peak to SP 1's. With ``--max-rss-gb`` it then searches, per model and SP degree, the longest
response (a multiple of ``--search-step`` tokens) whose every rank stays under the budget: doubling from
``--search-start``, then bisecting. A watchdog thread on every rank ends the run as soon as its resident set passes
the budget (the machine never goes over it); such a run counts as "does not fit".

On CUDA (one GPU per rank; the GPU suite's ``sequence_parallel`` phase, which reports itself skipped with fewer GPUs
than ranks) the memory budget search still reads the host's resident set. On a 2-core machine ranks beyond 2 share
cores: step times then measure oversubscribed ranks (compare SP degrees run
on the same ``--nproc``). ``smollm2`` is SmolLM2-135M-Instruct (9 heads, 3 KV heads: Ulysses cannot split them, so
SP runs the ``allgather`` mode; ``scripts/models/smollm2.py`` builds it from the installed GGUF wheel); its 16k-token
steps take tens of minutes per configuration on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

GiB = 1 << 30
EXCEEDED = 3  # a worker's exit status when the watchdog stopped it


def status_bytes(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def watchdog(budget: int) -> None:
    """End the process (status ``EXCEEDED``) as soon as its resident set passes ``budget`` bytes."""

    def watch():
        while True:
            if status_bytes("VmRSS") > budget:
                sys.stderr.write(f"[sequence_parallel bench] resident set over {budget / GiB:.2f} GiB: stopping\n")
                os._exit(EXCEEDED)
            time.sleep(0.005)

    threading.Thread(target=watch, daemon=True).start()


def worker(model: str, out: str, sp: int, mode: str, response: int, prompt: int, ac: bool, budget: int) -> None:
    import torch

    from load_memory import write_records
    from rlspmd.config import DistConfig, FSDPConfig, MeshConfig, ModelConfig, OptimConfig
    from rlspmd.distributed.mesh import DP, ParallelDims, RoleMeshes
    from rlspmd.distributed.runtime import init_distributed, shutdown

    if budget:
        watchdog(budget)
    rt = init_distributed(DistConfig())
    meshes = RoleMeshes(
        ParallelDims.from_config(MeshConfig(actor_sp=sp, actor_sp_mode=mode), rt.world_size), rt.device.type, rt.rank
    )
    mesh = meshes.get("actor", DP)
    engine = FSDPConfig().build(
        "policy",
        model,
        model=ModelConfig(path=model, gradient_checkpointing=ac),
        mesh=mesh,
        device=rt.device,
        optim=OptimConfig(lr=1e-6),
        gradient_checkpointing=ac,
        field_name="model",
        section="actor",
        sequence_mesh=meshes.sequence_mesh("actor"),
        sequence_mode=mode,
    )
    vocab = engine.hf_model.config.vocab_size
    g = torch.Generator().manual_seed(rt.rank)

    def row(R: int):
        ids = torch.randint(3, vocab, (1, prompt + R), generator=g).to(rt.device)
        pos = torch.arange(prompt + R, device=rt.device)[None]
        return ids, torch.ones_like(ids), pos, R

    def loss_fn(module, mb):
        ids, mask, pos, R = mb
        logp, _ = module(ids, mask, pos, response_len=R, with_entropy=False)
        return -logp.sum() / (R * mesh.size())

    cuda = rt.device.type == "cuda"
    engine.optimizer_step([row(128)], loss_fn)  # warm-up: lazy initialisation, optimiser state
    mb = row(response)
    open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM: the peak below is the step's
    before = status_bytes("VmRSS")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    cuda_before = torch.cuda.memory_allocated() if cuda else 0
    t0 = time.perf_counter()
    engine.optimizer_step([mb], loss_fn)
    if cuda:
        torch.cuda.synchronize()
    step_s = time.perf_counter() - t0
    rec = {"before": before, "peak": status_bytes("VmHWM"), "step_s": step_s}
    if cuda:
        rec.update(cuda_before=cuda_before, cuda_peak=torch.cuda.max_memory_allocated())
    rec["mode"] = None if engine.seq is None else engine.seq.mode
    write_records(rec, out)
    shutdown()


def run_config(model: str, *, nproc: int, sp: int, mode: str, response: int, prompt: int, ac: bool, budget: int):
    """One configuration under torchrun: the ranks' records, or None when the watchdog stopped it (over budget)."""
    import subprocess
    import tempfile

    from common import free_port

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "records.json"
        args = [model, str(out), str(sp), mode, str(response), str(prompt), str(int(ac)), str(budget)]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
               "127.0.0.1", "--master-port", str(free_port()), __file__, "--worker", *args]  # fmt: skip
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            if budget and "resident set over" in proc.stderr:
                return None
            raise SystemExit(
                f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
            )
        recs = json.loads(out.read_text())
    if budget and max(r["peak"] for r in recs) > budget:  # passed it between two looks of the watchdog
        return None
    return recs


def summary(recs: list[dict]) -> dict:
    """The largest figures over the ranks, and each rank's. On CUDA the activation figure is the device's (the
    allocator's peak during the step minus what was allocated before it)."""
    gib = lambda x: round(x / GiB, 3)  # noqa: E731
    cuda = "cuda_peak" in recs[0]
    act = [r["cuda_peak"] - r["cuda_before"] if cuda else r["peak"] - r["before"] for r in recs]
    out = {
        "mode": recs[0]["mode"],
        "peak_rss_gib": gib(max(r["peak"] for r in recs)),
        "activation_gib": gib(max(act)),
        "step_s": round(max(r["step_s"] for r in recs), 2),
        "per_rank": [{"peak_rss_gib": gib(r["peak"]), "activation_gib": gib(a)} for r, a in zip(recs, act)],
    }
    if cuda:
        out["cuda_peak_gib"] = gib(max(r["cuda_peak"] for r in recs))
    return out


def longest_fit(fits, *, start: int, step: int, limit: int) -> dict:
    """The longest length (a multiple of ``step``, up to ``limit``) with ``fits(length)``: doubling, then bisection."""
    lo, hi = 0, None  # lo fits (0: nothing tried yet), hi does not
    n = start
    while n <= limit:
        if fits(n):
            lo, n = n, n * 2
        else:
            hi = n
            break
    if hi is None:
        return {"longest_fit": lo, "first_miss": None, "limited_by": f"--search-max {limit}"}
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return {"longest_fit": lo, "first_miss": hi}


def model_dir(name: str) -> str:
    if name == "tiny":
        sys.path.insert(0, str(ROOT / "scripts" / "models"))
        import build_tiny

        out = ROOT / "models" / "tiny-32k"
        if (out / "config.json").is_file():  # built by an earlier run
            return str(out)
        # room for long responses (the trainer checks max_position_embeddings; a forward computes RoPE for any)
        return str(build_tiny.build(out, max_position=65536 + 1024))
    if name == "smollm2":
        sys.path.insert(0, str(ROOT / "scripts" / "models"))
        import smollm2

        return str(smollm2.convert())
    return name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["tiny"], help="tiny, smollm2, or model directories")
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048], help="response tokens per rank")
    p.add_argument("--sp", nargs="+", type=int, default=[1, 2], help="sequence-parallel degrees")
    p.add_argument("--mode", default="auto", choices=["auto", "ulysses", "allgather"], help="mesh.actor_sp_mode")
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: the largest --sp)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens before each response")
    p.add_argument("--no-ac", dest="ac", action="store_false", help="no activation checkpointing")
    p.add_argument("--max-rss-gb", type=float, default=None, help="search the longest response under this budget")
    p.add_argument("--search-start", type=int, default=2048)
    p.add_argument("--search-step", type=int, default=1024)
    p.add_argument("--search-max", type=int, default=65536)
    p.add_argument("--worker", nargs=8, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        model, out, sp, mode, response, prompt, ac, budget = args.worker
        return worker(model, out, int(sp), mode, int(response), int(prompt), bool(int(ac)), int(budget))
    from common import emit

    nproc = args.nproc or max(args.sp)
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() < nproc:  # the GPU suite's phase on a 1-GPU machine
        return emit(
            {"benchmark": "sequence_parallel", "skipped": f"needs {nproc} GPUs, found {torch.cuda.device_count()}"}
        )
    result: dict = {
        "benchmark": "sequence_parallel",
        "nproc": nproc,
        "prompt": args.prompt,
        "activation_checkpointing": args.ac,
        "load_avg_start": [round(x, 2) for x in os.getloadavg()],
        "runs": [],
        "activation_vs_sp1": {},
        "fits": {},
    }
    kw = dict(nproc=nproc, mode=args.mode, prompt=args.prompt, ac=args.ac)
    for name in args.models:
        path = model_dir(name)
        for length in args.lengths:
            for sp in args.sp:
                recs = run_config(path, sp=sp, response=length, budget=0, **kw)
                result["runs"].append({"model": name, "response_len": length, "sp": sp, **summary(recs)})
                print(json.dumps(result["runs"][-1]), file=sys.stderr, flush=True)
            same = [r for r in result["runs"] if r["model"] == name and r["response_len"] == length]
            base = next((r for r in same if r["sp"] == 1), None)
            if base is not None:
                result["activation_vs_sp1"].setdefault(name, {})[str(length)] = {
                    str(r["sp"]): round(r["activation_gib"] / base["activation_gib"], 3) for r in same
                }
        if args.max_rss_gb:
            budget = int(args.max_rss_gb * GiB)
            for sp in args.sp:

                def fits(n: int, sp=sp) -> bool:
                    ok = run_config(path, sp=sp, response=n, budget=budget, **kw) is not None
                    print(
                        json.dumps({"model": name, "sp": sp, "response_len": n, "fits": ok}),
                        file=sys.stderr,
                        flush=True,
                    )
                    return ok

                found = longest_fit(fits, start=args.search_start, step=args.search_step, limit=args.search_max)
                result["fits"].setdefault(name, {})[str(sp)] = {"max_rss_gb": args.max_rss_gb, **found}
    emit(result)


if __name__ == "__main__":
    main()
