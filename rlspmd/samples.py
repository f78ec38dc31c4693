"""Read a run's sample log (``<output_dir>/samples/{train,val}.jsonl``, written by ``rlspmd/trainer/samples.py``).

    python -m rlspmd.samples outputs/quickstart                      # the last step's first training sample
    python -m rlspmd.samples outputs/quickstart --step 3 --index 1   # step 3's second logged sample
    python -m rlspmd.samples outputs/quickstart --split val --all    # every sample of the last validation
    python -m rlspmd.samples outputs/quickstart --list               # one line per logged sample

The response is printed as trained: text between ``⟦ ⟧`` (dimmed instead, with ``--color`` or on a terminal) was in the
context but not trained on (tool results, interaction turns, template glue, rollout-correction rejections); the rest
is the model's own tokens, which the loss saw.

Reading and formatting live in ``rlspmd/utils/sample_text.py``, without torch or the trainer (whose sample log,
``rlspmd/trainer/samples.py``, formats with them), so the command answers in a fraction of a second.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlspmd.utils.sample_text import format_sample, read_samples


def _file(run: Path, split: str) -> Path:
    if run.is_file():
        return run
    path = run / "samples" / f"{split}.jsonl"
    if not path.is_file():
        raise SystemExit(
            f"no sample log at {path} (trainer.samples.enable, trainer.samples.num_{split}; "
            "give a run's trainer.output_dir or a samples/*.jsonl file)"
        )
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rlspmd.samples", description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path, help="the run's trainer.output_dir, or a samples/*.jsonl file")
    ap.add_argument(
        "--split", choices=("train", "val"), default="train", help="training samples or validation generations"
    )
    ap.add_argument("--step", type=int, default=None, help="the step (default: the last one logged)")
    ap.add_argument("--index", type=int, default=0, help="which of the step's logged samples, in log order (default 0)")
    ap.add_argument("--all", action="store_true", help="every logged sample of the step")
    ap.add_argument(
        "--list", action="store_true", help="one line per logged sample (step, index, reward, stop, length)"
    )
    ap.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="dim the untrained text instead of bracketing it (auto: when stdout is a terminal)",
    )
    args = ap.parse_args(argv)
    path = _file(args.run, args.split)
    records = read_samples(path)
    if not records:
        raise SystemExit(f"{path} holds no samples yet")
    if args.list:
        counts: dict[int, int] = {}
        for r in records:
            k = counts[r["step"]] = counts.get(r["step"], -1) + 1
            print(
                f"step {r['step']:>5} --index {k:<3} reward {r['reward']:+8.4f}  stop {r['stop']:<17} "
                f"{r['response_tokens']:>5} tokens ({r['trained_tokens']} trained)  prompt index {r['index']}"
            )
        return
    steps = sorted({r["step"] for r in records})
    step = steps[-1] if args.step is None else args.step
    of_step = [r for r in records if r["step"] == step]
    if not of_step:
        raise SystemExit(f"{path}: no samples of step {step}; logged steps: {_ranges(steps)}")
    if not args.all and not 0 <= args.index < len(of_step):
        raise SystemExit(f"{path}: step {step} has {len(of_step)} samples; --index must be in [0, {len(of_step) - 1}]")
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    chosen = of_step if args.all else [of_step[args.index]]
    print("\n\n".join(format_sample(r, color=color) for r in chosen))


def _ranges(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 12 else f"{steps[0]}..{steps[-1]} ({len(steps)} steps)"


if __name__ == "__main__":
    main()
