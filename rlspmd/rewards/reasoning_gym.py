"""Reward for rows written by ``scripts/data/reasoning_gym.py``: the package's own answer checker.

Each task in reasoning-gym knows how to grade its answers (numeric tolerance, partial credit), so rather
than re-implement that we extract the final answer and call ``score_answer`` of the task's dataset
class with the original item, which the data script stored as JSON in ``extra_info["entry"]``.

Needs ``pip install reasoning-gym==0.1.25``; it is imported on first use.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Callable

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(response: str) -> str | None:
    """The final answer in a response, or None if it states none.

    Prefers the GSM8K convention: the first line of text after the last ``####`` (later lines are
    chatter that should not change the grade). Falls back to the last ``<answer>...</answer>``.
    """
    if "####" in response:
        tail = response.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0].strip() if tail else None
    tags = _ANSWER_TAG.findall(response)
    if tags and tags[-1].strip():
        return tags[-1].strip()
    return None


@functools.lru_cache(maxsize=None)
def _score_fn(task: str) -> Callable[[str | None, dict[str, Any]], float]:
    """The task's checker; built once per task since it instantiates a dataset."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError(f"reasoning-gym is not installed ({e}); run: pip install reasoning-gym==0.1.25") from e
    return reasoning_gym.get_score_answer_fn(task)


def score(response: str, ground_truth: str, extra_info: dict) -> float:
    """Score in [0, 1] from reasoning-gym's checker for ``extra_info["task"]``.

    ``ground_truth`` is unused: the checker reads the answer (and any metadata it needs) from the
    stored entry. It is in the signature so all rule rewards share one calling convention.
    """
    for key in ("task", "entry"):
        # A parquet that mixes data sources holds None where a row has no such key, hence the type check.
        if not isinstance(extra_info.get(key), str):
            raise ValueError(f"extra_info lacks a string {key!r}; rows must come from scripts/data/reasoning_gym.py")
    entry = json.loads(extra_info["entry"])
    return float(_score_fn(extra_info["task"])(extract_answer(response), entry))
