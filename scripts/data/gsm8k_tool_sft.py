"""Multi-turn SFT demonstrations for the GSM8K tool recipe, from verl-schema rows: the warm start that teaches a model
to call ``calc_gsm8k_reward`` before GRPO (``configs/sft_gsm8k_tool_smollm2.py``, then
``configs/gsm8k_tool_smollm2.py``).

Reads GSM8K tool rows in verl's multi-turn schema (``scripts/data/gsm8k_multiturn.py``'s output, or verl's own
``gsm8k_multiturn_w_tool.py`` parquet files) and writes one conversation per row in a ``messages`` column, as the SFT
trainer reads it (``sft.data.messages_key=messages``)::

    system, user       the row's ``prompt``, unchanged (the RL run renders the same messages)
    assistant          the worked solution, then
                       <tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}</tool_call>
    tool               correct                     (what the tool answers a right submission)
    assistant          #### 72

The worked solution is the row's own: GSM8K's answer text (``extra_info.answer``, verl's and ``scripts/data/gsm8k.py``'s
rows; its ``<<48/2=24>>`` calculator annotations removed) or reasoning-gym's ``answer_cot`` (``extra_info.entry``,
``--gsm-symbolic`` rows); its final ``#### N`` line is cut (the answer is submitted to the tool instead, then repeated
after the verdict). A row with neither is an error naming the file and the row. The SFT trainer puts the loss on the
two assistant turns only; the tool turn is appended as the chat template's token delta, exactly as rollouts build it.

    python scripts/data/gsm8k_tool_sft.py --input data/gsm8k_tool/train.parquet --out data/gsm8k_tool/sft.parquet
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

TOOL = "calc_gsm8k_reward"
VERDICT = "correct"
"""``Gsm8kAnswer.call``'s text for a right answer (``rlspmd/agent/builtin.py``)."""
_ANNOTATION = re.compile(r"<<[^<>]*>>")


def tool_call(answer: str) -> str:
    """The Hermes-format call (what the ``hermes`` parser reads and the system tool prompt shows)."""
    return "<tool_call>" + json.dumps({"name": TOOL, "arguments": {"answer": answer}}) + "</tool_call>"


def solution(row: dict[str, Any], *, where: str) -> str:
    """The row's worked solution without its final ``#### N`` line."""
    info = row.get("extra_info") or {}
    text = info.get("answer")
    if not text and info.get("entry"):
        entry = json.loads(info["entry"]) if isinstance(info["entry"], str) else info["entry"]
        text = (entry.get("metadata") or {}).get("answer_cot")
    if not isinstance(text, str) or not text.strip():
        raise ValueError(
            f"{where}: no worked solution (extra_info.answer, GSM8K's; or extra_info.entry's "
            "metadata.answer_cot, reasoning-gym's) to demonstrate"
        )
    text = _ANNOTATION.sub("", text.rsplit("####", 1)[0]).strip()
    if not text:
        raise ValueError(f"{where}: the worked solution is empty once its '#### N' line is cut")
    return text


def demonstration(row: dict[str, Any], *, where: str) -> dict[str, Any]:
    truth = str(row["reward_model"]["ground_truth"])
    messages = [{"role": m["role"], "content": m["content"]} for m in row["prompt"]]
    if not messages or messages[-1]["role"] != "user":
        raise ValueError(
            f"{where}: the prompt must end with the user's question, got roles {[m['role'] for m in messages]}"
        )
    messages += [
        {"role": "assistant", "content": solution(row, where=where) + "\n" + tool_call(truth)},
        {"role": "tool", "content": VERDICT},
        {"role": "assistant", "content": f"#### {truth}"},
    ]
    return {
        "data_source": row["data_source"],
        "reward_model": row["reward_model"],
        "messages": messages,
        "extra_info": {"index": (row.get("extra_info") or {}).get("index")},
    }


def read(path: Path) -> list[dict[str, Any]]:
    import datasets

    kind = "parquet" if path.suffix == ".parquet" else "json"
    return datasets.load_dataset(kind, data_files=str(path), split="train").to_list()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", type=Path, nargs="+", required=True, help="verl-schema GSM8K tool rows (parquet/jsonl)")
    p.add_argument("--out", type=Path, default=Path("data/gsm8k_tool/sft.parquet"), help="the demonstrations (parquet)")
    p.add_argument("--limit", type=int, default=None, help="at most this many demonstrations")
    args = p.parse_args(argv)

    rows = []
    for path in args.input:
        for i, row in enumerate(read(path.expanduser())):
            rows.append(demonstration(row, where=f"{path} row {i}"))
    rows = rows[: args.limit]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    _write_rows(rows, args.out)
    print(f"wrote {len(rows)} demonstrations to {args.out}")


def _write_rows(rows: list[dict[str, Any]], path: Path) -> None:
    spec = importlib.util.spec_from_file_location(
        "rlspmd_scripts_data_gsm8k", Path(__file__).resolve().parent / "gsm8k.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write_rows(rows, path, "parquet")


if __name__ == "__main__":
    main()
