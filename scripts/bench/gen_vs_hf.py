"""Generation throughput: the native engine vs Hugging Face ``generate`` on the same model, prompts and sampling.

    python scripts/bench/gen_vs_hf.py                        # bench-256 model, 64 prompts x 128 new tokens
    python scripts/bench/gen_vs_hf.py --model models/bench-512 --batch 16 --new-tokens 64
    python scripts/bench/gen_vs_hf.py --tiny                 # smoke run (seconds)

Both sample with temperature 1.0 (no top-k/top-p: HF's default top_k=50 is switched off) from the same left-padded
batch of ``--batch`` chat prompts, with EOS never stopping a row (``min_new_tokens = max_new_tokens`` for HF, no stop
ids for the native engine), so both produce exactly ``batch x new_tokens`` tokens. The native engine runs exactly
as the rollout runs it: ``NativeEngine.generate`` on the HF model's parameters (read in place). The JSON's ``ratio``
is native tokens/s over HF tokens/s (medians over ``--repeats`` interleaved runs).
"""

from __future__ import annotations

import argparse
import statistics

from common import emit, ensure_model, machine, measure

TOPICS = ["apples", "trains", "rivers", "numbers", "gardens", "markets", "birds", "clocks"]


def make_prompts(tok, n: int):
    """Deterministic chat prompts (varying lengths, so the batch is left-padded like a real rollout)."""
    texts = [f"Calculate {i * 7 % 97} + {i * 13 % 89} - {i % 10}, then tell me about {TOPICS[i % 8]}." * (1 + i % 2)
             for i in range(n)]
    chats = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True) for t in texts]
    enc = tok(chats, padding=True, return_tensors="pt", add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model dir (default: build models/bench-256)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
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

    path = ensure_model(a.model, preset="bench-tiny" if a.tiny else "bench-256")
    tok = load_tokenizer(path, field_name="--model")
    model = load_causal_lm(path, dtype="float32", attn_implementation="sdpa", field_name="--model").eval()
    ids, mask = make_prompts(tok, a.batch)
    prompts = Batch({"prompts_BP": ids, "prompt_mask_BP": mask, "uid_B": torch.arange(a.batch)})
    engine = NativeEngine(OwnWeights(model), eos_ids=[], pad_id=tok.pad_token_id, max_batch_size=a.batch, device=torch.device("cpu"))
    params = SamplingParams(temperature=1.0, max_new_tokens=a.new_tokens)

    def native():
        out = engine.generate(prompts, params, generator=torch.Generator().manual_seed(0))
        assert out["response_mask_BR"].sum() == a.batch * a.new_tokens

    @torch.inference_mode()
    def hf():
        torch.manual_seed(0)
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, pad_token_id=tok.pad_token_id)
        assert out.shape == (a.batch, ids.shape[1] + a.new_tokens)

    runs = {"native": [], "hf": []}
    for r in range(a.repeats):  # interleaved, so a load change on a shared machine hits both alike
        for name, fn in (("native", native), ("hf", hf)):
            runs[name].append(measure(fn, repeats=1, warmup=1 if r == 0 else 0))
    n_tokens = a.batch * a.new_tokens
    res = {}
    for name, samples in runs.items():
        wall = statistics.median(s["wall_s"][0] for s in samples)
        cpu = statistics.median(s["cpu_s"][0] for s in samples)
        res[name] = {"wall_s_median": wall, "cpu_s_median": cpu, "tokens_per_s": n_tokens / wall,
                     "wall_s": [s["wall_s"][0] for s in samples]}
    emit(
        {
            "benchmark": "gen_vs_hf",
            "workload": {"model": path, "batch": a.batch, "prompt_len_padded": ids.shape[1], "new_tokens": a.new_tokens,
                         "sampling": "temperature 1.0, no top-k/top-p, EOS never stops", "dtype": "float32",
                         "repeats": a.repeats},
            **res,
            "ratio": res["native"]["tokens_per_s"] / res["hf"]["tokens_per_s"],
            "ratio_cpu": res["hf"]["cpu_s_median"] / res["native"]["cpu_s_median"],
            "machine": machine(),
        },
        a.out,
    )


if __name__ == "__main__":
    main()
