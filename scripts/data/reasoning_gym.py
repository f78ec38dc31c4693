"""Write procedurally generated problems from the `reasoning-gym` package in rlspmd's (verl's) schema.

reasoning-gym ships GSM8K-derived templates (``gsm_symbolic``) and easy arithmetic tasks with their own
answer checkers, so it gives unlimited, verifiable RL prompts offline. Each row keeps the whole item
(question, answer, metadata) as JSON in ``extra_info["entry"]``; ``rlspmd.rewards.reasoning_gym.score``
hands it back to the package's checker.

reasoning-gym derives item ``i`` of a dataset with seed ``s`` from ``Random(s + i)``, so two seeds that
differ by less than the dataset size share items. The test split therefore starts at seed
``seed + num_train`` and also drops any question already in train.

    pip install reasoning-gym==0.1.25
    python scripts/data/reasoning_gym.py --tasks gsm_symbolic,basic_arithmetic,chain_sum --out-dir data/reasoning_gym
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from types import ModuleType
from typing import Any

INSTRUCTION = ' Output the final answer after "####".'
PIP_HINT = "pip install reasoning-gym==0.1.25"


def import_reasoning_gym() -> ModuleType:
    """Import the package, not this file: run as a script, this file's folder is on sys.path and shares its name."""
    here = Path(__file__).resolve().parent
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    try:
        return importlib.import_module("reasoning_gym")
    except ImportError as e:
        raise ImportError(f"reasoning-gym is not installed ({e}); install it with: {PIP_HINT}") from e
    finally:
        sys.path[:] = saved


def _json_default(obj: Any) -> Any:
    """Encode the few non-JSON types items carry in metadata (gsm_symbolic keeps Fractions among its
    template variables). Checkers read the answer and simple metadata, never these values."""
    if isinstance(obj, (Fraction, Decimal)):
        return str(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    raise TypeError(f"cannot store a {type(obj).__name__} from a reasoning-gym item as JSON")


def make_row(item: dict[str, Any], *, task: str, split: str, index: int) -> dict[str, Any]:
    """A verl-schema row for one reasoning-gym item."""
    entry = json.dumps(item, sort_keys=True, default=_json_default)
    return {
        "data_source": f"reasoning_gym/{task}",
        "prompt": [{"role": "user", "content": item["question"] + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(item["answer"])},
        # JSON text rather than a nested struct: metadata differs per task and parquet needs one schema.
        "extra_info": {"split": split, "index": index, "task": task, "entry": entry},
    }


def generate(tasks: list[str], *, num_train: int, num_test: int, seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    """Rows per split (``train``/``test``), ``num_train``/``num_test`` per task, tasks concatenated in order."""
    rg = import_reasoning_gym()
    splits: dict[str, list[dict[str, Any]]] = {"train": [], "test": []}
    for task in tasks:
        try:
            train_items = list(rg.create_dataset(task, size=num_train, seed=seed)) if num_train else []
        except ValueError as e:
            raise ValueError(f"--tasks: reasoning-gym task {task!r}: {e}") from e
        seen = {item["question"] for item in train_items}
        # Oversample so that dropping repeats of train questions still leaves num_test items.
        pool = rg.create_dataset(task, size=2 * num_test + 100, seed=seed + num_train) if num_test else []
        test_items = []
        for item in pool:
            if len(test_items) == num_test:
                break
            if item["question"] not in seen:
                seen.add(item["question"])
                test_items.append(item)
        if len(test_items) < num_test:
            raise ValueError(
                f"task {task!r}: only {len(test_items)} test questions unseen in train (--num-test {num_test})"
            )
        for split, items in (("train", train_items), ("test", test_items)):
            offset = len(splits[split])
            splits[split] += [make_row(it, task=task, split=split, index=offset + i) for i, it in enumerate(items)]
    return splits


def write_rows(rows: list[dict[str, Any]], path: Path, fmt: str) -> None:
    """Write through `datasets` so readers see exactly the schema the trainer loads."""
    import datasets

    ds = datasets.Dataset.from_list(rows)
    if fmt == "parquet":
        ds.to_parquet(str(path))
    elif fmt == "jsonl":
        ds.to_json(str(path), lines=True)
    else:
        raise ValueError(f"--format must be parquet or jsonl, got {fmt!r}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="gsm_symbolic,basic_arithmetic,chain_sum", help="comma-separated task names")
    p.add_argument("--num-train", type=int, default=2000, help="train items per task")
    p.add_argument("--num-test", type=int, default=200, help="test items per task")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=Path("data/reasoning_gym"))
    p.add_argument("--format", choices=["parquet", "jsonl"], default="parquet")
    args = p.parse_args(argv)

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError("--tasks is empty")
    splits = generate(tasks, num_train=args.num_train, num_test=args.num_test, seed=args.seed)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        path = args.out_dir / f"{split}.{'parquet' if args.format == 'parquet' else 'jsonl'}"
        write_rows(rows, path, args.format)
        print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
