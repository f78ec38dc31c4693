"""Synthetic visual task: the vision quickstart's offline dataset ("what colour is the largest shape?").

Each image (``--size`` pixels square, drawn with PIL) holds two or three filled shapes (rectangles and ellipses) in
different colours on a light background; one of them is clearly the largest (its area at least twice any other's),
and it is drawn first, so the smaller ones may overlap it but never hide most of it. The answer is that shape's
colour, one of ``COLOURS``: the image alone decides it (the question is always the same).

Writes three files in verl's multimodal schema (``prompt`` with an ``<image>`` placeholder, ``images`` a list of
``{"bytes": PNG}``):
  train.parquet  RL prompts (ground truth only)
  test.parquet   held-out prompts (their own seed stream)
  sft.parquet    the same schema plus a ``response`` column for the SFT warm start

Responses end in the GSM8K-style answer line ``#### red`` that the task's reward (``rlspmd.rewards.rules.shapes``)
accepts. ``--sft-other-style`` makes that fraction of the demonstrations end ``The answer is red.`` instead (not
accepted), as the text quickstart does: a warm start that reads the colours but answers mostly in the wrong style.

    python scripts/data/shapes.py --out-dir data/shapes
"""

from __future__ import annotations

import argparse
import io
import random
from pathlib import Path
from typing import Any

DATA_SOURCE = "shapes"
QUESTION = "<image>What colour is the largest shape?"
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 200, 30)}


def draw(rng: random.Random, size: int) -> tuple[bytes, str]:
    """One picture as PNG bytes, and the colour of its largest shape."""
    from PIL import Image, ImageDraw

    colours = rng.sample(sorted(COLOURS), rng.randint(2, 3))
    image = Image.new("RGB", (size, size), (235, 235, 235))
    pen = ImageDraw.Draw(image)
    for k, colour in enumerate(colours):  # the first is the largest: sides 45-70% of the image, the others 15-30%
        lo, hi = (0.45, 0.7) if k == 0 else (0.15, 0.3)
        w, h = (int(size * rng.uniform(lo, hi)) for _ in range(2))
        x, y = rng.randint(0, size - w), rng.randint(0, size - h)
        shape = pen.rectangle if rng.random() < 0.5 else pen.ellipse
        shape([x, y, x + w, y + h], fill=COLOURS[colour])
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue(), colours[0]


def make_row(rng: random.Random, *, split: str, index: int, size: int) -> dict[str, Any]:
    png, colour = draw(rng, size)
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": QUESTION}],
        "images": [{"bytes": png}],
        "ability": "vision",
        "reward_model": {"style": "rule", "ground_truth": colour},
        "extra_info": {"split": split, "index": index},
    }


def generate(
    *,
    num_train: int = 2000,
    num_test: int = 200,
    num_sft: int = 2000,
    size: int = 112,
    seed: int = 0,
    sft_other_style: float = 0.0,
) -> dict[str, list[dict[str, Any]]]:
    """Rows of the three splits, keyed ``train``/``test``/``sft``; same arguments give the same rows."""
    if not 0.0 <= sft_other_style <= 1.0:
        raise ValueError(f"--sft-other-style must be in [0, 1], got {sft_other_style}")
    if size < 28:
        raise ValueError(f"--size must be >= 28 (one merged patch of the model's image processor), got {size}")

    def stream(split: str) -> random.Random:
        return random.Random(f"shapes/{split}/{seed}")

    out = {}
    for split, n in (("train", num_train), ("test", num_test), ("sft", num_sft)):
        rng = stream(split)
        out[split] = [make_row(rng, split=split, index=i, size=size) for i in range(n)]
    style = stream("sft-style")
    for row in out["sft"]:
        colour = row["reward_model"]["ground_truth"]
        row["response"] = f"The answer is {colour}." if style.random() < sft_other_style else f"#### {colour}"
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=Path("data/shapes"))
    p.add_argument("--num-train", type=int, default=2000)
    p.add_argument("--num-test", type=int, default=200)
    p.add_argument("--num-sft", type=int, default=2000)
    p.add_argument("--size", type=int, default=112, help="image side in pixels")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sft-other-style",
        type=float,
        default=0.0,
        help="fraction of SFT responses 'The answer is red.' instead of '#### red' (not accepted)",
    )
    args = p.parse_args(argv)
    import datasets

    splits = generate(
        num_train=args.num_train,
        num_test=args.num_test,
        num_sft=args.num_sft,
        size=args.size,
        seed=args.seed,
        sft_other_style=args.sft_other_style,
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        path = args.out_dir / f"{split}.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(path))
        print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
