"""Training forward+backward: packed (padding-free) vs padded, on a batch whose sequence lengths vary 4x.

    python scripts/bench/packed_vs_padded.py                    # bench-256 model, 32 sequences of 64..256 tokens
    python scripts/bench/packed_vs_padded.py --model models/bench-512 --repeats 5
    python scripts/bench/packed_vs_padded.py --tiny             # smoke run (seconds)

The workload is the actor update's micro-batch in the rollout layout: a 27-token prompt (left-padded) and a
response (right-padded) whose total lengths are spaced evenly from ``--min-len`` to ``--max-len``; the padded width is
``--max-len``. Each pass is ``CausalLMPolicy.forward`` (log-probs and entropy through the chunked kernel, temperature
1) and the backward of a token-mean loss, exactly what ``Policy.update`` runs per micro-batch. Both paths are checked to
give the same log-probs first. The JSON's ``ratio`` is padded time / packed time (median CPU seconds; wall-clock
ratio alongside), ``ideal_ratio`` is padded tokens / valid tokens.
"""

from __future__ import annotations

import argparse

from common import emit, ensure_model, machine, measure


def make_batch(B: int, prompt_len: int, min_len: int, max_len: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(0)
    total = torch.linspace(min_len, max_len, B).round().long()
    R = max_len - prompt_len
    rlen = total - prompt_len
    pm = torch.ones(B, prompt_len, dtype=torch.long)
    rm = (torch.arange(R)[None] < rlen[:, None]).long()
    am = torch.cat([pm, rm], 1)
    ids = torch.randint(3, vocab, (B, prompt_len + R), generator=g) * am
    return ids, am, (am.cumsum(-1) - 1).clamp(min=0), rm, R


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model dir (default: build models/bench-256)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=27)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    p.add_argument("--tiny", action="store_true", help="smoke run: tiny model, small batch, 2 repeats")
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    if a.tiny:
        a.batch, a.min_len, a.max_len, a.repeats, a.prompt_len = 4, 16, 64, 2, 8

    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    from rlspmd.models.loader import load_causal_lm
    from rlspmd.models.packing import training_attn_implementation
    from rlspmd.models.policy import CausalLMPolicy

    path = ensure_model(a.model, preset="bench-tiny" if a.tiny else "bench-256")
    padded = CausalLMPolicy(load_causal_lm(path, dtype="float32", attn_implementation="sdpa", field_name="--model"))
    impl = training_attn_implementation("sdpa", packing=True, field_name="--model")
    packed = CausalLMPolicy(
        load_causal_lm(path, dtype="float32", attn_implementation=impl, field_name="--model"), packing=True
    )
    ids, am, pos, rm, R = make_batch(a.batch, a.prompt_len, a.min_len, a.max_len, padded.config.vocab_size)
    n_valid = rm.sum()

    def step(module):
        module.zero_grad(set_to_none=True)
        lp, ent = module(ids, am, pos, response_len=R)
        loss = -((lp + 0.01 * ent) * rm).sum() / n_valid
        loss.backward()
        return lp.detach()

    with torch.no_grad():
        diff = (padded(ids, am, pos, response_len=R)[0] - packed(ids, am, pos, response_len=R)[0]).mul(rm).abs().max()
    assert float(diff) < 1e-3, f"packed and padded log-probs differ by {float(diff)}"
    res = {}
    # Interleave the two so that a load change on the shared machine hits both alike.
    runs = {"padded": [], "packed": []}
    for _ in range(a.repeats):
        for name, module in (("padded", padded), ("packed", packed)):
            runs[name].append(measure(lambda: step(module), repeats=1, warmup=0 if runs[name] else 1))
    import statistics

    for name, samples in runs.items():
        res[name] = {
            "wall_s_median": statistics.median(s["wall_s"][0] for s in samples),
            "cpu_s_median": statistics.median(s["cpu_s"][0] for s in samples),
            "wall_s": [s["wall_s"][0] for s in samples],
        }
    tokens_padded = a.batch * am.shape[1]
    tokens_valid = int(am.sum())
    for name, tok in (("padded", tokens_valid), ("packed", tokens_valid)):
        res[name]["valid_tokens_per_s"] = tok / res[name]["wall_s_median"]
    emit(
        {
            "benchmark": "packed_vs_padded",
            "workload": {
                "model": path,
                "batch": a.batch,
                "prompt_len": a.prompt_len,
                "min_len": a.min_len,
                "max_len": a.max_len,
                "padded_tokens": tokens_padded,
                "valid_tokens": tokens_valid,
                "repeats": a.repeats,
                "pass": "CausalLMPolicy.forward (log-probs + entropy, chunked head) + backward, fp32",
            },
            "max_abs_logprob_diff": float(diff),
            **res,
            "ideal_ratio": tokens_padded / tokens_valid,
            "ratio": res["padded"]["cpu_s_median"] / res["packed"]["cpu_s_median"],
            "ratio_wall": res["padded"]["wall_s_median"] / res["packed"]["wall_s_median"],
            "machine": machine(),
        },
        a.out,
    )


if __name__ == "__main__":
    main()
