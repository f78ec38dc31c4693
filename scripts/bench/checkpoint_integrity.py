"""What the checkpoint file digests cost: DCP save and load of a q05-shaped actor's state (Qwen2.5-0.5B's body, 365 M
fp32 parameters, AdamW's two moments: 4.4 GB) on CPU, in one process, with and without digests. Prints JSON.

    python scripts/bench/checkpoint_integrity.py                  # q05 shape, 3 rounds
    python scripts/bench/checkpoint_integrity.py --layers 4 --repeats 2 --dir /tmp/x   # smaller, elsewhere

Save: ``dcp.save`` with DCP's ``FileSystemWriter`` against rlspmd's ``DigestingFileSystemWriter`` (the same files; each
byte is hashed on its way to the file). Load: ``dcp_load`` alone against ``check_files`` (re-hash every file against the
record, what ``Checkpointer._verify`` does on each rank for its share) followed by ``dcp_load``. The variants alternate
within each round (ABBA order across rounds), into a fresh directory each time, so drift on a shared machine hits both.
The loads read what the save just wrote (from the page cache, where it still holds it). Wall-clock seconds of a save are
mostly the disk (DCP fsyncs every file) and swing by more than the digests add on a shared machine; this process's CPU
seconds (``time.process_time``) show the digests' own cost. Only figures taken in the same run compare.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, emit  # noqa: E402

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from rlspmd.trainer.checkpoint import DIGEST, DigestingFileSystemWriter, FileDigests, check_files, dcp_load  # noqa: E402

Q05 = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=8192,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
)
"""``configs/bench/grpo_q05.py``'s model (``scripts/bench/common.py: ensure_model`` preset ``bench-q05``)."""


def actor_state(layers: int) -> tuple[dict, int]:
    """The actor's checkpoint state as the trainer saves it at world size 1: weights and AdamW state after one step."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**{**Q05, "num_hidden_layers": layers}))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-6)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optim.step()
    model.zero_grad(set_to_none=True)
    state = {"actor": {"model": model.state_dict(), "optim": optim.state_dict()}}
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    return state, nbytes


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def hash_rate(nbytes: int = 256 << 20) -> dict:
    """In-memory throughput of the digest (and of BLAKE2b and CRC-32 for comparison), GB/s."""
    import zlib

    data = memoryview(os.urandom(nbytes))
    out = {}
    for name in (DIGEST, "blake2b", "crc32"):
        t = time.perf_counter()
        if name == "crc32":
            zlib.crc32(data)
        else:
            hashlib.new(name, data)
        out[name] = round(nbytes / (time.perf_counter() - t) / 1e9, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=24, help="decoder layers (24: the q05 shape)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds; each saves and loads once per variant")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory under /tmp)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()

    torch.set_num_threads(1)
    state, nbytes = actor_state(args.layers)
    target = {
        "actor": {
            "model": {k: torch.empty_like(v) for k, v in state["actor"]["model"].items()},
            "optim": state["actor"]["optim"],
        }
    }  # loaded in place (the optimiser's tensors included)
    work = Path(tempfile.mkdtemp(prefix="ckpt_integrity_", dir=args.dir))
    wall: dict[str, list[float]] = {k: [] for k in ("save", "save_digest", "load", "load_verify")}
    cpu: dict[str, list[float]] = {k: [] for k in wall}

    def timed(name: str, fn, *args, **kwargs) -> None:
        w, c = time.perf_counter(), time.process_time()
        fn(*args, **kwargs)
        wall[name].append(time.perf_counter() - w)
        cpu[name].append(time.process_time() - c)

    def load_verified(ckpt: Path, written: FileDigests) -> None:
        problems = check_files(ckpt, written.files)
        assert not problems, problems
        dcp_load(target, ckpt, no_dist=True)

    try:
        for r in range(args.repeats):
            for digests in (False, True) if r % 2 == 0 else (True, False):
                ckpt = work / f"r{r}_{int(digests)}"
                written = FileDigests(ckpt)
                writer = DigestingFileSystemWriter(ckpt, written) if digests else dcp.FileSystemWriter(ckpt)
                timed("save_digest" if digests else "save", dcp.save, state, storage_writer=writer, no_dist=True)
                if digests:
                    timed("load_verify", load_verified, ckpt, written)
                else:
                    timed("load", dcp_load, target, ckpt, no_dist=True)
                shutil.rmtree(ckpt)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for k, v in state["actor"]["model"].items():
        assert torch.equal(target["actor"]["model"][k], v), k

    med = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    emit(
        {
            "bench": "checkpoint_integrity",
            "note": (
                "indicative: CPU, one process, a machine shared with other jobs; loads read what the save just wrote"
            ),
            "model": {**Q05, "num_hidden_layers": args.layers},
            "digest": DIGEST,
            "checkpoint_bytes": nbytes,
            "repeats": args.repeats,
            "wall_s_median": {k: round(v, 3) for k, v in med.items()},
            "cpu_s_median": {k: round(v, 3) for k, v in med_cpu.items()},
            "wall_s": {k: [round(x, 3) for x in v] for k, v in wall.items()},
            "cpu_s": {k: [round(x, 3) for x in v] for k, v in cpu.items()},
            "save_added_s": round(med["save_digest"] - med["save"], 3),
            "load_added_s": round(med["load_verify"] - med["load"], 3),
            "save_added_cpu_s": round(med_cpu["save_digest"] - med_cpu["save"], 3),
            "load_added_cpu_s": round(med_cpu["load_verify"] - med_cpu["load"], 3),
            "hash_gb_per_s": hash_rate(),
            "where": str(args.dir or tempfile.gettempdir()),
            "root": str(ROOT),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
