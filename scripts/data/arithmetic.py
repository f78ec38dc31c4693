"""Synthetic arithmetic task: the quickstart's offline dataset.

Problems are short integer expressions such as ``37 + 45 - 12``. A tiny model can learn them in
minutes, and the reward is exact, so the whole RL pipeline can be exercised without downloads.

Writes three files in verl's schema:
  train.parquet  RL prompts (ground truth only)
  test.parquet   held-out prompts; no expression in it appears in train or sft
  sft.parquet    the same schema plus a ``response`` column (the step-by-step solution) for the
                 SFT warm-up; drawn from its own seed stream so it is not a copy of train

Solutions are worked left to right, one step per operator, ending in the GSM8K marker:
``37 + 45 = 82, 82 - 12 = 70 #### 70``. Multiplication, when enabled with ``--ops``, binds tighter,
so its steps come first; the answer always equals Python's ``eval`` of the expression.

    python scripts/data/arithmetic.py --out-dir data/arithmetic
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

SUPPORTED_OPS = "+-*"
DATA_SOURCE = "arithmetic"


def make_problem(
    rng: random.Random, *, min_terms: int = 2, max_terms: int = 3, max_value: int = 99, ops: str = "+-"
) -> str:
    """One expression like ``"37 + 45 - 12"``: operands in [0, max_value], spaces around operators."""
    num_terms = rng.randint(min_terms, max_terms)
    parts = [str(rng.randint(0, max_value))]
    for _ in range(num_terms - 1):
        parts += [rng.choice(ops), str(rng.randint(0, max_value))]
    return " ".join(parts)


def _step(tokens: list[str], i: int, steps: list[str]) -> None:
    """Apply the operator at ``tokens[i]`` in place and record the step text."""
    a, op, b = int(tokens[i - 1]), tokens[i], int(tokens[i + 1])
    value = a + b if op == "+" else a - b if op == "-" else a * b
    steps.append(f"{a} {op} {b} = {value}")
    tokens[i - 1 : i + 2] = [str(value)]


def solve(expression: str) -> tuple[str, int]:
    """Step-by-step solution text and the integer answer of a space-separated expression.

    ``"37 + 45 - 12"`` -> ``("37 + 45 = 82, 82 - 12 = 70 #### 70", 70)``.
    """
    tokens = expression.split()
    if len(tokens) % 2 == 0 or any(t not in SUPPORTED_OPS for t in tokens[1::2]):
        raise ValueError(f"expression {expression!r} is not 'int op int op ...' with ops in {SUPPORTED_OPS!r}")
    steps: list[str] = []
    # Products first (operator precedence), then sums and differences left to right.
    while "*" in tokens:
        _step(tokens, tokens.index("*"), steps)
    while len(tokens) > 1:
        _step(tokens, 1, steps)
    answer = int(tokens[0])
    if not steps:  # a single-term expression still gets a well-formed target
        steps.append(str(answer))
    return f"{', '.join(steps)} #### {answer}", answer


def make_row(expression: str, *, split: str, index: int) -> dict[str, Any]:
    """A verl-schema row for one expression."""
    solution, answer = solve(expression)
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"Calculate {expression}."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"split": split, "index": index, "expression": expression, "solution": solution},
    }


def generate(
    *,
    num_train: int = 20000,
    num_test: int = 500,
    num_sft: int = 20000,
    min_terms: int = 2,
    max_terms: int = 3,
    max_value: int = 99,
    ops: str = "+-",
    seed: int = 0,
    sft_other_style: float = 0.0,
) -> dict[str, list[dict[str, Any]]]:
    """Rows of the three splits, keyed ``train``/``test``/``sft``; same arguments give the same rows."""
    if not 1 <= min_terms <= max_terms:
        raise ValueError(f"--min-terms/--max-terms: need 1 <= min <= max, got {min_terms}, {max_terms}")
    if max_value < 0:
        raise ValueError(f"--max-value must be >= 0, got {max_value}")
    if not 0.0 <= sft_other_style <= 1.0:
        raise ValueError(f"--sft-other-style must be in [0, 1], got {sft_other_style}")
    if not ops or any(op not in SUPPORTED_OPS for op in ops):
        raise ValueError(f"--ops must be a non-empty string of {SUPPORTED_OPS!r}, got {ops!r}")
    shape = dict(min_terms=min_terms, max_terms=max_terms, max_value=max_value, ops=ops)

    # String seeds are hashed with SHA-512 by `random`, so each split gets an independent,
    # reproducible stream (not affected by PYTHONHASHSEED).
    def stream(split: str) -> random.Random:
        return random.Random(f"arithmetic/{split}/{seed}")

    train_rng, sft_rng = stream("train"), stream("sft")
    train = [make_row(make_problem(train_rng, **shape), split="train", index=i) for i in range(num_train)]
    sft = [make_row(make_problem(sft_rng, **shape), split="sft", index=i) for i in range(num_sft)]
    # A fraction of the demonstrations end in another answer style ("... The answer is 70.") that the
    # task's checker, like GSM8K's, does not accept. A warm start trained on this mix follows the
    # majority style under greedy decoding; RL on the verifiable reward has to move it to the accepted
    # style while keeping the arithmetic right. This is the quickstart's deliberately imperfect warm start.
    style_rng = stream("sft-style")
    for row in sft:
        solution = row["extra_info"]["solution"]
        if style_rng.random() < sft_other_style:
            steps, answer = solution.rsplit(" #### ", 1)
            solution = f"{steps}. The answer is {answer}."
        row["response"] = solution

    # Held-out: reject anything seen in training (and repeats), so test accuracy measures generalisation.
    seen = {r["extra_info"]["expression"] for r in train + sft}
    test_rng, test = stream("test"), []
    budget = 100 * num_test + 10_000
    while len(test) < num_test and budget > 0:
        budget -= 1
        expression = make_problem(test_rng, **shape)
        if expression not in seen:
            seen.add(expression)
            test.append(make_row(expression, split="test", index=len(test)))
    if len(test) < num_test:
        raise ValueError(
            f"only {len(test)} of --num-test {num_test} unseen expressions found; the problem space is too small "
            "for these sizes (raise --max-value/--max-terms or lower --num-train/--num-sft)"
        )
    return {"train": train, "test": test, "sft": sft}


def write_rows(rows: list[dict[str, Any]], path: Path, fmt: str) -> None:
    """Write through `datasets` so readers see exactly the schema the trainer loads."""
    import datasets  # deferred: importing it takes a few seconds and tests call generate() directly

    ds = datasets.Dataset.from_list(rows)
    if fmt == "parquet":
        ds.to_parquet(str(path))
    elif fmt == "jsonl":
        ds.to_json(str(path), lines=True)
    else:
        raise ValueError(f"--format must be parquet or jsonl, got {fmt!r}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=Path("data/arithmetic"))
    p.add_argument("--num-train", type=int, default=20000)
    p.add_argument("--num-test", type=int, default=500)
    p.add_argument("--num-sft", type=int, default=20000)
    p.add_argument("--min-terms", type=int, default=2)
    p.add_argument("--max-terms", type=int, default=3)
    p.add_argument("--max-value", type=int, default=99, help="operands are drawn from [0, max-value]")
    p.add_argument("--ops", default="+-", help=f"operators to draw from, a subset of {SUPPORTED_OPS!r}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", choices=["parquet", "jsonl"], default="parquet")
    p.add_argument(
        "--sft-other-style",
        type=float,
        default=0.0,
        help="fraction of SFT responses ending 'The answer is N.' instead of '#### N' (not accepted by the reward)",
    )
    args = p.parse_args(argv)

    splits = generate(
        num_train=args.num_train,
        num_test=args.num_test,
        num_sft=args.num_sft,
        min_terms=args.min_terms,
        max_terms=args.max_terms,
        max_value=args.max_value,
        ops=args.ops,
        seed=args.seed,
        sft_other_style=args.sft_other_style,
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    ext = "parquet" if args.format == "parquet" else "jsonl"
    for split, rows in splits.items():
        path = args.out_dir / f"{split}.{ext}"
        write_rows(rows, path, args.format)
        print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
