"""The agent quickstart's task: arithmetic on numbers too large for the tiny model to add reliably in its head, with a
calculator tool (``rollout.agent.tools=["calculator"]``).

Writes, in verl's multi-turn schema (so verl's tooling reads them too):
  train.parquet  RL prompts: ``prompt`` messages, ``reward_model.ground_truth``, and ``extra_info.tools_kwargs``
                 (``{"calculator": {"create_kwargs": {...}}}``) with ``need_tools_kwargs``, as verl writes them
  test.parquet   held-out prompts (no expression in it appears in train or sft)
  sft.parquet    demonstrations as whole conversations in a ``messages`` column (user, assistant, tool, assistant):
                 a share ``--sft-tool-share`` calls the calculator and copies its result,
                 ``<tool_call>{"name": "calculator", "arguments": {"expression": "482 + 397"}}</tool_call>``,
                 tool ``879``, assistant ``#### 879``; the others answer in their head, ``482 + 397 = 879 #### 879``

Operands have three digits (``--max-value 999``): the tiny model learns to copy them into a call and to copy the
tool's result back in a 400-step warm start, but not to add or subtract them in its head. (With four digits, 400 steps
left it unable to copy either: no path earned any reward and GRPO had nothing to learn from.) A warm start on this mix
answers in its head under greedy decoding (the majority) and gets the sums mostly wrong; the calls it samples now and
then are mostly right. GRPO has to find that out from reward alone.

    python scripts/data/agent_arithmetic.py --out-dir data/agent_arithmetic
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
from pathlib import Path
from typing import Any

DATA_SOURCE = "arithmetic"
TOOL = "calculator"


def _arithmetic():
    path = Path(__file__).resolve().parent / "arithmetic.py"
    spec = importlib.util.spec_from_file_location("rlspmd_scripts_data_arithmetic", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tool_call(expression: str) -> str:
    """The Hermes-format call the demonstrations make (and the parser reads)."""
    return "<tool_call>" + json.dumps({"name": TOOL, "arguments": {"expression": expression}}) + "</tool_call>"


def make_row(expression: str, *, split: str, index: int) -> dict[str, Any]:
    answer = _arithmetic().solve(expression)[1]
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"Calculate {expression}."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {
            "split": split,
            "index": index,
            "expression": expression,
            "need_tools_kwargs": True,
            # verl's layout; the calculator needs nothing per sample (parquet cannot store an empty struct)
            "tools_kwargs": {TOOL: {"create_kwargs": {"expression": expression}}},
        },
    }


def demonstration(expression: str, *, use_tool: bool) -> list[dict[str, str]]:
    answer = _arithmetic().solve(expression)[1]
    user = {"role": "user", "content": f"Calculate {expression}."}
    if use_tool:
        return [
            user,
            {"role": "assistant", "content": tool_call(expression)},
            {"role": "tool", "content": str(answer)},
            {"role": "assistant", "content": f"#### {answer}"},
        ]
    return [user, {"role": "assistant", "content": f"{expression} = {answer} #### {answer}"}]


def generate(
    *,
    num_train: int = 5000,
    num_test: int = 200,
    num_sft: int = 8000,
    min_terms: int = 2,
    max_terms: int = 2,
    max_value: int = 999,
    ops: str = "+-",
    sft_tool_share: float = 0.3,
    seed: int = 0,
) -> dict[str, list[dict]]:
    if not 0.0 <= sft_tool_share <= 1.0:
        raise ValueError(f"--sft-tool-share must be in [0, 1], got {sft_tool_share}")
    arithmetic = _arithmetic()
    shape = dict(min_terms=min_terms, max_terms=max_terms, max_value=max_value, ops=ops)

    def stream(split: str) -> random.Random:
        return random.Random(f"agent-arithmetic/{split}/{seed}")

    train_rng, sft_rng, style_rng = stream("train"), stream("sft"), stream("sft-style")
    train = [make_row(arithmetic.make_problem(train_rng, **shape), split="train", index=i) for i in range(num_train)]
    sft_expr = [arithmetic.make_problem(sft_rng, **shape) for _ in range(num_sft)]
    sft = [
        {
            **make_row(e, split="sft", index=i),
            "messages": demonstration(e, use_tool=style_rng.random() < sft_tool_share),
        }
        for i, e in enumerate(sft_expr)
    ]
    seen = {r["extra_info"]["expression"] for r in train} | set(sft_expr)
    test_rng, test = stream("test"), []
    for _ in range(100 * num_test + 10_000):
        if len(test) == num_test:
            break
        e = arithmetic.make_problem(test_rng, **shape)
        if e not in seen:
            seen.add(e)
            test.append(make_row(e, split="test", index=len(test)))
    if len(test) < num_test:
        raise ValueError(f"only {len(test)} of --num-test {num_test} unseen expressions; raise --max-value")
    return {"train": train, "test": test, "sft": sft}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=Path("data/agent_arithmetic"))
    p.add_argument("--num-train", type=int, default=5000)
    p.add_argument("--num-test", type=int, default=200)
    p.add_argument("--num-sft", type=int, default=8000)
    p.add_argument("--min-terms", type=int, default=2)
    p.add_argument("--max-terms", type=int, default=2)
    p.add_argument("--max-value", type=int, default=999, help="operands are drawn from [0, max-value]")
    p.add_argument("--ops", default="+-")
    p.add_argument("--sft-tool-share", type=float, default=0.3, help="share of demonstrations that call the calculator")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    splits = generate(
        num_train=args.num_train,
        num_test=args.num_test,
        num_sft=args.num_sft,
        min_terms=args.min_terms,
        max_terms=args.max_terms,
        max_value=args.max_value,
        ops=args.ops,
        sft_tool_share=args.sft_tool_share,
        seed=args.seed,
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_rows = _arithmetic().write_rows
    for split, rows in splits.items():
        path = args.out_dir / f"{split}.parquet"
        write_rows(rows, path, "parquet")
        print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
