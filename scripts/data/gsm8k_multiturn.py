"""GSM8K for tool-using rollouts, in verl's multi-turn schema (``configs/gsm8k_tool_smollm2.py`` trains on it).

Each row is a conversation start: ``prompt`` is chat messages, a system prompt telling the model to submit its answer
with the ``calc_gsm8k_reward`` tool (``rlspmd/agent/builtin.py``: the model hears "correct" / "incorrect"; the last
submitted answer is the tool's score) and the question as the user turn. ``extra_info`` carries what verl writes:

  * ``tools_kwargs = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}`` and ``need_tools_kwargs``:
    the tool's ``create`` reads the answer from there, so the rows also load in verl unchanged;
  * ``interaction_kwargs = {"name": "gsm8k", "query": ..., "ground_truth": ...}`` for
    ``rollout.agent.interaction=gsm8k``.

``reward_model.ground_truth`` is the number; the rule reward for the row's ``data_source`` checks the final text's
``#### N`` as for single-turn GSM8K.

``--interaction`` writes the interaction-only rows instead (verl's ``gsm8k_multiturn_w_interaction.py``): a system
prompt that asks for ``#### N`` and to reconsider when told the answer is wrong, ``interaction_kwargs`` only (no tools:
``need_tools_kwargs`` would make a run without tools refuse the rows), for ``rollout.agent.interaction=gsm8k`` with
no tools.

Two sources, both offline:
  * ``--input``: a local GSM8K copy, any layout ``scripts/data/gsm8k.py`` reads (official jsonl dir, one jsonl file,
    a ``save_to_disk`` dir); ``data_source`` is ``openai/gsm8k``;
  * ``--gsm-symbolic``: reasoning-gym's GSM8K-derived templates (``scripts/data/reasoning_gym.py``; the Hub is not
    needed); ``data_source`` is ``reasoning_gym/gsm_symbolic``, scored by the package's own checker.

    python scripts/data/gsm8k_multiturn.py --gsm-symbolic --num-train 5000 --num-test 200 --out-dir data/gsm8k_tool
    python scripts/data/gsm8k_multiturn.py --input ~/gsm8k --out-dir data/gsm8k_tool
    python scripts/data/gsm8k_multiturn.py --gsm-symbolic --interaction --out-dir data/gsm8k_interaction
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from typing import Any

TOOL = "calc_gsm8k_reward"
SYSTEM_PROMPT = (
    "You are a careful math solver. Work through the problem step by step. When you have an answer, submit it with "
    f"the `{TOOL}` tool; it tells you whether the answer is correct, so revise and submit again if it is not. "
    "Finish with the final answer on its own line as `#### <number>`."
)
INSTRUCTION = ' Let\'s think step by step and output the final answer after "####".'
INTERACTION_SYSTEM_PROMPT = (
    "You are a careful math solver. Work through the problem step by step. If the user tells you that your answer is "
    "wrong, reconsider it carefully. Finish with the final answer on its own line as `#### <number>`."
)


def _sibling(name: str):
    """A script next to this one, imported by path (``reasoning_gym.py`` must not shadow the package)."""
    path = Path(__file__).resolve().parent / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"rlspmd_scripts_data_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def to_multiturn(row: dict[str, Any], *, question: str, interaction: bool = False) -> dict[str, Any]:
    """A single-turn verl row (``scripts/data/gsm8k.py`` / ``reasoning_gym.py``) -> the tool-using multi-turn row
    (``interaction``: the interaction-only row)."""
    truth = row["reward_model"]["ground_truth"]
    if interaction:
        return {
            **row,
            "prompt": [
                {"role": "system", "content": INTERACTION_SYSTEM_PROMPT},
                {"role": "user", "content": question + INSTRUCTION},
            ],
            "extra_info": {
                **row["extra_info"],
                "interaction_kwargs": {"name": "gsm8k", "query": question, "ground_truth": truth},
            },
        }
    return {
        **row,
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question + INSTRUCTION}],
        "extra_info": {
            **row["extra_info"],
            "need_tools_kwargs": True,
            "tools_kwargs": {TOOL: {"create_kwargs": {"ground_truth": truth}}},
            "interaction_kwargs": {"name": "gsm8k", "query": question, "ground_truth": truth},
        },
    }


def from_gsm8k(
    input_path: Path, *, split: str | None = None, interaction: bool = False
) -> dict[str, list[dict[str, Any]]]:
    gsm8k = _sibling("gsm8k")
    return {
        name: [to_multiturn(r, question=r["extra_info"]["question"], interaction=interaction) for r in rows]
        for name, rows in gsm8k.load_splits(input_path, split=split).items()
    }


def from_gsm_symbolic(
    *, num_train: int, num_test: int, seed: int = 0, interaction: bool = False
) -> dict[str, list[dict[str, Any]]]:
    splits = _sibling("reasoning_gym").generate(["gsm_symbolic"], num_train=num_train, num_test=num_test, seed=seed)
    return {
        name: [
            to_multiturn(r, question=json.loads(r["extra_info"]["entry"])["question"], interaction=interaction)
            for r in rows
        ]
        for name, rows in splits.items()
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--input", type=Path, help="a local GSM8K copy (official jsonl dir, jsonl file, save_to_disk dir)"
    )
    source.add_argument("--gsm-symbolic", action="store_true", help="generate GSM8K-style problems with reasoning-gym")
    p.add_argument("--split", default=None, help="--input: split name for a single file or a saved Dataset")
    p.add_argument("--num-train", type=int, default=5000, help="--gsm-symbolic: train problems")
    p.add_argument("--num-test", type=int, default=200, help="--gsm-symbolic: test problems")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--interaction",
        action="store_true",
        help="interaction-only rows (verl's gsm8k_multiturn_w_interaction): no tools, interaction_kwargs",
    )
    p.add_argument("--out-dir", type=Path, default=Path("data/gsm8k_tool"))
    args = p.parse_args(argv)

    splits = (
        from_gsm8k(args.input.expanduser(), split=args.split, interaction=args.interaction)
        if args.input is not None
        else from_gsm_symbolic(
            num_train=args.num_train, num_test=args.num_test, seed=args.seed, interaction=args.interaction
        )
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_rows = _sibling("gsm8k").write_rows
    for name, rows in splits.items():
        path = args.out_dir / f"{name}.parquet"
        write_rows(rows, path, "parquet")
        print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
