"""The colocated native rollout of a LoRA policy: adapters merged into the weights once per generation, against
adapters applied on the fly at every decoded token. Prints JSON (one process, CPU or the current CUDA device).

    python scripts/bench/lora_generate.py                      # hidden 512, 8 layers, r=16, 64 prompts x 128 tokens
    python scripts/bench/lora_generate.py --hidden 256 --layers 4 --rank 8 --batch 32 --new-tokens 64

Both paths run ``NativeEngine.generate`` on the same random Qwen2 model with the same adapters (B non-zero, so the
adapters matter) and the same seed; ``merged`` includes the merge itself (``merge_in_place``: one ``W + s B A`` per
adapted layer, what ``LoraEngine.gathered_hf_model`` does on the gathered weights) and checks that both paths
sample the same tokens. On the fly costs two extra small matmuls per adapted layer per decoded token (plus peft's
per-layer dispatch); merging costs one matmul per layer per generation.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rlspmd.config import LoraConfig  # noqa: E402
from rlspmd.models.lora import ADAPTER, adapters_disabled, apply_lora, lora_layers, merge_in_place  # noqa: E402
from rlspmd.protocol import Batch  # noqa: E402
from rlspmd.rollout.native import NativeEngine, OwnWeights  # noqa: E402
from rlspmd.rollout.sampling import SamplingParams  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args(argv)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=a.hidden // 64,
        num_key_value_heads=max(1, a.hidden // 256),
        intermediate_size=a.hidden * 11 // 4,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(cfg).to(device)
    apply_lora(model, LoraConfig(rank=a.rank, alpha=2.0 * a.rank))
    with torch.no_grad():
        for _, m in lora_layers(model):
            torch.nn.init.normal_(m.lora_B[ADAPTER].weight, std=0.02)  # a trained adapter: B != 0
    engine = NativeEngine(OwnWeights(model), eos_ids=[-1], pad_id=0, max_batch_size=a.batch, device=device)
    g = torch.Generator().manual_seed(1)
    prompts = Batch(
        {
            "prompts_BP": torch.randint(3, a.vocab, (a.batch, a.prompt_tokens), generator=g),
            "prompt_mask_BP": torch.ones(a.batch, a.prompt_tokens, dtype=torch.long),
            "uid_B": torch.arange(a.batch),
        }
    )
    params = SamplingParams(temperature=1.0, max_new_tokens=a.new_tokens, n=1)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def on_the_fly():
        return engine.generate(prompts, params, generator=torch.Generator().manual_seed(3))

    def merged():
        with adapters_disabled(model):
            merge_in_place(model)
            out = engine.generate(prompts, params, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():  # undo the merge: the next repeat starts from the same base weights
            for n, p in model.named_parameters():
                if n in base:
                    p.copy_(base[n])
        return out

    seconds, outs = {}, {}
    for name, fn in (("on_the_fly", on_the_fly), ("merged", merged)):
        fn()  # warm-up
        best = float("inf")
        for _ in range(a.repeats):
            sync()
            t0 = time.perf_counter()
            outs[name] = fn()
            sync()
            best = min(best, time.perf_counter() - t0)
        seconds[name] = best
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        merge_in_place(model)
    sync()
    merge_s = time.perf_counter() - t0
    same = torch.equal(outs["merged"]["responses_BR"], outs["on_the_fly"]["responses_BR"])
    print(
        json.dumps(
            {
                "bench": "lora_generate",
                "device": str(device),
                "hidden": a.hidden,
                "layers": a.layers,
                "rank": a.rank,
                "batch": a.batch,
                "new_tokens": a.new_tokens,
                "on_the_fly_s": seconds["on_the_fly"],
                "merged_s": seconds["merged"],
                "merge_only_s": merge_s,
                "speedup_merged": seconds["on_the_fly"] / seconds["merged"],
                "same_tokens": same,
            }
        )
    )


if __name__ == "__main__":
    main()
