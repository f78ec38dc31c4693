"""What ``reward.timeout_s`` costs: scoring one rank's share of a step in this process vs in the worker pool.

    python scripts/bench/reward_pool.py                    # 128 samples (the quickstart's 32 x 8 over 2 ranks)
    python scripts/bench/reward_pool.py --samples 512 --workers 1 2 4

Scores ``--samples`` GSM8K-style responses with ``RewardManager.score`` exactly as the trainer does (decode, call,
check), three ways: the built-in ``arithmetic`` rule (always in this process: the quickstart's path), a user
function in this process (``reward.timeout_s=None``) and the same function in a pool of N workers
(``reward.timeout_s`` set). The function is as cheap as the rules (a regex), so the difference is the pool's own
cost: pickling each sample to a worker and each score back. Prints one JSON line: medians per call of ``score``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import emit, measure

USER_FN = """import re

_FINAL = re.compile(r"####\\s*(-?[\\d,]*\\.?\\d+)")


def score(response, ground_truth):
    found = _FINAL.findall(response)
    return float(bool(found) and found[-1].replace(",", "") == ground_truth)
"""


class WordTokenizer:
    """Stands in for the model's tokenizer: ``batch_decode`` returns the prepared texts (decoding is not measured)."""

    def __init__(self, texts: list[str]):
        self.texts = texts

    def batch_decode(self, ids, skip_special_tokens=True):
        return self.texts[: len(ids)]


def main(argv=None):
    import torch

    from rlspmd.config import RewardConfig
    from rlspmd.protocol import Batch
    from rlspmd.rewards import RewardManager

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)

    n = args.samples
    texts = [
        f"{i} + {i % 7} = {i + i % 7}. Then we add 3 to get {i + i % 7 + 3}. #### {i + i % 7 + 3}" for i in range(n)
    ]
    batch = Batch(
        {"responses_BR": torch.ones(n, 4, dtype=torch.long), "response_mask_BR": torch.ones(n, 4, dtype=torch.long)},
        {
            "ground_truth": [str(i + i % 7 + 3) for i in range(n)],
            "data_source": ["arithmetic"] * n,
            "extra_info": [{"index": i} for i in range(n)],
        },
    )
    tok = WordTokenizer(texts)
    fn_file = Path(tempfile.mkdtemp()) / "user_reward.py"
    fn_file.write_text(USER_FN)
    spec = f"{fn_file}:score"

    def timed(manager) -> dict:
        assert manager.score(batch)["task_scores_B"].sum().item() == n  # every answer is right: the work is real
        result = measure(lambda: manager.score(batch), repeats=args.repeats, warmup=2)
        manager.close()
        return {
            "wall_ms_per_step": round(1000 * result["wall_s_median"], 3),
            "us_per_sample": round(1e6 * result["wall_s_median"] / n, 1),
            "cpu_ms_per_step": round(1000 * result["cpu_s_median"], 3),
        }

    out = {
        "samples_per_step": n,
        "builtin_rule_in_process": timed(RewardManager(RewardConfig(), tok)),
        "user_fn_in_process": timed(RewardManager(RewardConfig(function=spec, timeout_s=None), tok)),
    }
    for w in args.workers:
        out[f"user_fn_pool_{w}_workers"] = timed(
            RewardManager(RewardConfig(function=spec, timeout_s=60.0, num_workers=w), tok)
        )
    emit({"benchmark": "reward_pool", **out})


if __name__ == "__main__":
    main()
