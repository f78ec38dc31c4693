"""Generation throughput: the native engine vs Hugging Face ``generate`` on the same model, prompts and sampling.

    python scripts/bench/gen_vs_hf.py                        # bench-256 model, 64 prompts x 128 new tokens (CPU)
    python scripts/bench/gen_vs_hf.py --model models/bench-512 --batch 16 --new-tokens 64
    python scripts/bench/gen_vs_hf.py --model models/bench-q05 --dtype bfloat16 --sizes 256x256,64x256   # GPU
    python scripts/bench/gen_vs_hf.py --tiny                 # smoke run (seconds)

Both sample with temperature 1.0 (no top-k/top-p: HF's default top_k=50 is switched off) from the same left-padded
batch of chat prompts, with EOS never stopping a row (``min_new_tokens = max_new_tokens`` for HF, no stop ids for the
native engine), so both produce exactly ``batch x new_tokens`` tokens. The native engine runs exactly as the rollout
runs it: ``NativeEngine.generate`` on the HF model's parameters (read in place), in each of ``--modes``: ``eager``
(the eager decoder) and, on CUDA, ``graphs`` (``rollout.engine.cuda_graphs``: static KV cache and CUDA-graph replay; the
capture is paid inside every generation, as in training, and reported as ``capture_s``). One JSON line per
``--sizes`` entry (``BATCHxNEW_TOKENS``); its ``ratio`` is the fastest native mode's tokens/s over HF's (medians over
``--repeats`` interleaved runs, after one short warm-up run of each).
"""

from __future__ import annotations

import argparse
import statistics

from common import emit, ensure_model, machine, measure

TOPICS = ["apples", "trains", "rivers", "numbers", "gardens", "markets", "birds", "clocks"]


def make_prompts(tok, n: int):
    """Deterministic chat prompts (varying lengths, so the batch is left-padded like a real rollout)."""
    texts = [
        f"Calculate {i * 7 % 97} + {i * 13 % 89} - {i % 10}, then tell me about {TOPICS[i % 8]}." * (1 + i % 2)
        for i in range(n)
    ]
    chats = [
        tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
        for t in texts
    ]
    enc = tok(chats, padding=True, return_tensors="pt", add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model dir (default: build models/bench-256)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument(
        "--sizes",
        default=None,
        help="comma-separated BATCHxNEW_TOKENS, one JSON line each (overrides --batch/--new-tokens)",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument(
        "--modes", default=None, help="native engine modes: eager, graphs (default: eager,graphs on CUDA, eager on CPU)"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    p.add_argument("--tiny", action="store_true", help="smoke run: tiny model, batch 4, 8 tokens")
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    if a.tiny:
        a.batch, a.new_tokens, a.repeats = 4, 8, 1

    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    from rlspmd.models.loader import load_causal_lm, load_tokenizer
    from rlspmd.protocol import Batch
    from rlspmd.rollout.native import NativeEngine, OwnWeights
    from rlspmd.rollout.sampling import SamplingParams

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    modes = (a.modes or ("eager,graphs" if dev.type == "cuda" else "eager")).split(",")
    sizes = [tuple(int(x) for x in s.split("x")) for s in a.sizes.split(",")] if a.sizes else [(a.batch, a.new_tokens)]
    path = ensure_model(a.model, preset="bench-tiny" if a.tiny else "bench-256")
    tok = load_tokenizer(path, field_name="--model")
    model = load_causal_lm(path, dtype=a.dtype, attn_implementation="sdpa", field_name="--model").eval().to(dev)
    engines = {
        m: NativeEngine(
            OwnWeights(model),
            eos_ids=[],
            pad_id=tok.pad_token_id,
            max_batch_size=max(b for b, _ in sizes),
            device=dev,
            cuda_graphs=m == "graphs",
        )
        for m in modes
    }

    for batch, new_tokens in sizes:
        ids, mask = (x.to(dev) for x in make_prompts(tok, batch))
        prompts = Batch({"prompts_BP": ids, "prompt_mask_BP": mask, "uid_B": torch.arange(batch, device=dev)})

        def native(engine, n_new):
            params = SamplingParams(temperature=1.0, max_new_tokens=n_new)
            out = engine.generate(prompts, params, generator=torch.Generator(dev).manual_seed(0))
            assert int(out["response_mask_BR"].sum()) == batch * n_new

        @torch.inference_mode()
        def hf(n_new):
            torch.manual_seed(0)
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=n_new,
                min_new_tokens=n_new,
                pad_token_id=tok.pad_token_id,
            )
            assert out.shape == (batch, ids.shape[1] + n_new)

        fns = {**{f"native_{m}": (lambda n, e=e: native(e, n)) for m, e in engines.items()}, "hf": hf}
        for fn in fns.values():  # warm-up: cuBLAS handles, allocator, kernels; short
            fn(min(8, new_tokens))
        runs = {name: [] for name in fns}
        captures = []
        for _ in range(a.repeats):  # interleaved, so a load change on a shared machine hits all alike
            for name, fn in fns.items():
                runs[name].append(measure(lambda: fn(new_tokens), repeats=1, warmup=0))
                if name == "native_graphs":
                    captures.append(engines["graphs"].take_times()["capture_s"])
        n_tokens = batch * new_tokens
        res = {}
        for name, samples in runs.items():
            wall = statistics.median(s["wall_s"][0] for s in samples)
            cpu = statistics.median(s["cpu_s"][0] for s in samples)
            res[name] = {
                "wall_s_median": wall,
                "cpu_s_median": cpu,
                "tokens_per_s": n_tokens / wall,
                "wall_s": [s["wall_s"][0] for s in samples],
            }
        if captures:
            res["native_graphs"]["capture_s"] = captures
        best = max((k for k in res if k.startswith("native_")), key=lambda k: res[k]["tokens_per_s"])
        emit(
            {
                "benchmark": "gen_vs_hf",
                "workload": {
                    "model": path,
                    "batch": batch,
                    "prompt_len_padded": ids.shape[1],
                    "new_tokens": new_tokens,
                    "sampling": "temperature 1.0, no top-k/top-p, EOS never stops",
                    "dtype": a.dtype,
                    "device": str(dev),
                    "repeats": a.repeats,
                },
                **res,
                "native": res[best],  # the fastest mode, under the key the CPU figures have always used
                "native_mode": best.removeprefix("native_"),
                "ratio": res[best]["tokens_per_s"] / res["hf"]["tokens_per_s"],
                "ratio_cpu": res["hf"]["cpu_s_median"] / res[best]["cpu_s_median"],
                "machine": machine(),
            },
            a.out,
        )


if __name__ == "__main__":
    main()
