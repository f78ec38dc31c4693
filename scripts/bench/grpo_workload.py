"""The fixed GRPO benchmark workload: a random-init Qwen2 model and prompts of exactly 27 tokens.

    python scripts/bench/grpo_workload.py                   # models/bench-{256,512}, data/bench/prompts.jsonl
    python scripts/bench/grpo_workload.py --which grpo_q05  # the GPU workload's model (models/bench-q05)

Models (random init, seed 0, fp32, tied embeddings, vocab 8192, the tiny model's trained tokenizer and chat template):
  bench-256  hidden 256, 4 layers, 4 heads / 2 KV heads, intermediate 688   (configs/bench/grpo_tiny.py)
  bench-512  hidden 512, 12 layers, 8 heads / 4 KV heads, intermediate 1376 (configs/bench/grpo_small.py)
  bench-q05  Qwen2.5-0.5B's body: hidden 896, 24 layers, 14 heads / 2 KV heads, intermediate 4864, max positions
             1024: 365 M parameters (configs/bench/grpo_q05.py, GPU)
  bench-q15  Qwen2.5-1.5B's body: hidden 1536, 28 layers, 12 heads / 2 KV heads, intermediate 8960, max positions
             1024: 1.32 B parameters (configs/bench/grpo_q15.py, GPU)
  smollm2    the real SmolLM2-135M-Instruct (Llama, hidden 576, 30 layers, 9 / 3 heads, intermediate 1536, vocab
             49152, tied), converted from the PyPI GGUF by ``scripts/models/smollm2.py`` (configs/bench/grpo_smollm2.py)

Prompts: ``--num-prompts`` arithmetic questions in verl's schema (``prompt`` = one user message), each exactly
``--prompt-tokens`` tokens once the chat template is applied with the generation prompt. The bench models share one
tokenizer, so one prompt file serves them all (``data/bench/prompts.jsonl``); SmolLM2 has its own
(``data/bench/prompts_smollm2.jsonl``). Everything is deterministic: the same files on every run and machine.
The same jsonl feeds rlspmd (``data.train_files``) and TRL (``scripts/bench/trl_grpo.py``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ensure_model  # noqa: E402

PRESETS = {
    "grpo_tiny": "bench-256",
    "grpo_small": "bench-512",
    "grpo_q05": "bench-q05",
    "grpo_q15": "bench-q15",
    "smoke": "bench-tiny",
    "grpo_smollm2": "smollm2",
}
PROMPTS_FILE = {"smollm2": "data/bench/prompts_smollm2.jsonl"}
"""Presets whose tokenizer is not the bench models' one, and their prompt file (else ``data/bench/prompts.jsonl``)."""
PROMPT_TOKENS = {"smollm2": 48}
"""Prompt length where 27 tokens do not fit: SmolLM2's chat template adds a 30-token default system message."""


def prompt_length(which: str, default: int = 27) -> int:
    return PROMPT_TOKENS.get(PRESETS[which], default)


def prompts_file(which: str) -> Path:
    """The prompt file of a preset: one per tokenizer."""
    return ROOT / PROMPTS_FILE.get(PRESETS[which], "data/bench/prompts.jsonl")


def model_dir(preset: str) -> str:
    """A model preset's directory, built (deterministically) or converted once and reused."""
    if preset == "smollm2":
        sys.path.insert(0, str(ROOT / "scripts" / "models"))
        from smollm2 import convert

        return str(convert())
    return ensure_model(None, preset=preset)


def prompt_of_length(tokenizer, rng: random.Random, n_tokens: int) -> tuple[str, int]:
    """A question ``Calculate a + b - c ...`` whose chat-templated form is exactly ``n_tokens`` tokens, and its
    answer."""
    for _ in range(10_000):
        terms = [rng.randint(0, 99)]
        ops: list[str] = []
        while True:
            expr = " ".join([str(terms[0])] + [f"{o} {t}" for o, t in zip(ops, terms[1:])])
            text = f"Calculate {expr}."
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True
            )
            if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            if len(ids) == n_tokens:
                return text, eval(expr)  # noqa: S307 - our own digits and +/-
            if len(ids) > n_tokens:
                break  # overshot: start again with other numbers
            ops.append(rng.choice("+-"))
            terms.append(rng.randint(0, 99))
    raise RuntimeError(f"could not build a prompt of exactly {n_tokens} tokens")


def write_prompts(model_dir: str, out: Path, *, num_prompts: int, prompt_tokens: int, seed: int = 0) -> Path:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for i in range(num_prompts):
            text, answer = prompt_of_length(tokenizer, rng, prompt_tokens)
            row = {
                "data_source": "arithmetic",
                "prompt": [{"role": "user", "content": text}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"split": "bench", "index": i},
            }
            f.write(json.dumps(row) + "\n")
    return out


def build(which: list[str], *, data: Path | None = None, num_prompts: int, prompt_tokens: int) -> dict[str, str]:
    """The models (built once, reused) and their prompt files, one per tokenizer (``prompts_file``), of
    ``prompt_tokens`` tokens each (``PROMPT_TOKENS`` where the template needs more); ``data`` replaces the path when
    every preset in ``which`` shares one tokenizer."""
    models = {name: model_dir(PRESETS[name]) for name in which}
    files = {prompts_file(name): models[name] for name in which}
    if data is not None and len(files) > 1:
        raise SystemExit(f"--data: {sorted(which)} use {len(files)} tokenizers (one prompt file each); give one family")
    lengths = {prompts_file(name): prompt_length(name, prompt_tokens) for name in which}
    for path, model in files.items():
        write_prompts(model, data or path, num_prompts=num_prompts, prompt_tokens=lengths[path])
    return models


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--which", nargs="+", choices=sorted(PRESETS), default=["grpo_small", "grpo_tiny"])
    p.add_argument("--data", type=Path, default=None, help="prompt file (default: the preset's, prompts_file)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=27)
    a = p.parse_args(argv)
    models = build(a.which, data=a.data, num_prompts=a.num_prompts, prompt_tokens=a.prompt_tokens)
    for name, path in models.items():
        print(f"{name}: model {path}")
    for name in a.which:
        n_tokens = prompt_length(name, a.prompt_tokens)
        print(f"prompts: {a.data or prompts_file(name)} ({a.num_prompts} x {n_tokens} tokens)")


if __name__ == "__main__":
    main()
