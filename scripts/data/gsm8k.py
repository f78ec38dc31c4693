"""Convert a local GSM8K copy into rlspmd's (verl's) dataset schema.

The Hub is often out of reach on clusters, so this reads a copy you already have:
  * a directory holding the official ``train.jsonl`` / ``test.jsonl`` (``{"question", "answer"}``),
  * a single ``.jsonl`` file (its split is ``--split``, default the file's stem), or
  * a directory written by ``datasets``' ``save_to_disk`` (a DatasetDict with train/test, or one Dataset).

Each answer ends in ``#### N``; N (commas stripped) becomes the ground truth, and the full answer is
kept in ``extra_info`` for SFT or inspection. Writes ``<split>.parquet`` (or ``.jsonl``) per split.

    python scripts/data/gsm8k.py --input ~/gsm8k --out-dir data/gsm8k
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Iterable

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = ' Let\'s think step by step and output the final answer after "####".'


def extract_answer(answer: str, *, where: str) -> str:
    """The number after the last ``####`` with thousands separators removed (``"1,200"`` -> ``"1200"``)."""
    if "####" not in answer:
        raise ValueError(f"{where}: answer has no '####' final-answer marker: {answer[-80:]!r}")
    final = answer.rsplit("####", 1)[1].strip().replace(",", "")
    if not final:
        raise ValueError(f"{where}: nothing after '####' in answer: {answer[-80:]!r}")
    return final


def make_row(record: dict[str, Any], *, split: str, index: int, where: str) -> dict[str, Any]:
    """A verl-schema row from one ``{"question", "answer"}`` record; ``where`` names the row in errors."""
    for key in ("question", "answer"):
        if not isinstance(record.get(key), str):
            raise ValueError(f"{where}: missing string field {key!r} (fields present: {sorted(record)})")
    question, answer = record["question"], record["answer"]
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_answer(answer, where=where)},
        "extra_info": {"split": split, "index": index, "question": question, "answer": answer},
    }


def convert_records(records: Iterable[dict[str, Any]], *, split: str, source: str) -> list[dict[str, Any]]:
    """Rows for one split; ``source`` (a file or dir name) prefixes every error message."""
    return [make_row(r, split=split, index=i, where=f"{source}: row {i}") for i, r in enumerate(records)]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: line {lineno} is not valid JSON: {e}") from None
    return records


def _is_saved_dataset(path: Path) -> bool:
    """``save_to_disk`` writes ``dataset_dict.json`` (DatasetDict) or ``state.json`` (Dataset)."""
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def load_splits(input_path: Path, *, split: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """Converted rows per split name for any of the three supported input layouts."""
    if input_path.is_file():
        name = split or input_path.stem
        return {name: convert_records(_read_jsonl(input_path), split=name, source=str(input_path))}
    if not input_path.is_dir():
        raise FileNotFoundError(f"--input {input_path} does not exist")
    if _is_saved_dataset(input_path):
        import datasets  # deferred: only this layout needs it

        loaded = datasets.load_from_disk(str(input_path))
        parts = loaded if isinstance(loaded, datasets.DatasetDict) else {split or "train": loaded}
        return {name: convert_records(ds, split=name, source=f"{input_path} [{name}]") for name, ds in parts.items()}
    files = {name: input_path / f"{name}.jsonl" for name in ("train", "test")}
    found = {name: f for name, f in files.items() if f.is_file()}
    if not found:
        raise FileNotFoundError(
            f"--input {input_path}: expected train.jsonl/test.jsonl or a datasets save_to_disk directory"
        )
    return {name: convert_records(_read_jsonl(f), split=name, source=str(f)) for name, f in found.items()}


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
    p.add_argument("--input", type=Path, required=True, help="official jsonl dir, one jsonl file, or save_to_disk dir")
    p.add_argument("--out-dir", type=Path, default=Path("data/gsm8k"))
    p.add_argument("--split", default=None, help="split name for a single file or a saved Dataset")
    p.add_argument("--format", choices=["parquet", "jsonl"], default="parquet")
    args = p.parse_args(argv)

    splits = load_splits(args.input.expanduser(), split=args.split)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in splits.items():
        path = args.out_dir / f"{name}.{'parquet' if args.format == 'parquet' else 'jsonl'}"
        write_rows(rows, path, args.format)
        print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
