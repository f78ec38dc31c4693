"""Rule rewards, chosen by a sample's ``data_source``, and the registry of named reward functions.

Each function has the signature ``fn(response, ground_truth, extra_info) -> float``. Answers follow the
GSM8K convention: the final answer follows the last ``####`` in the response.

``REWARD_FUNCTIONS`` holds them by name: a sample's ``data_source`` picks its rule there, and ``reward.function`` /
``reward.components`` accept a registered name as well as an import path (``path/to/file.py:fn``,
``package.module:fn``), the spelling every component uses (``rlspmd/components.py``).
"""

from __future__ import annotations

import re

from rlspmd.components import Registry

REWARD_FUNCTIONS = Registry("reward function", load_as="callable")
"""Reward functions by name; the name of a rule is the ``data_source`` it scores."""

_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def extract_final_answer(response: str) -> str | None:
    """The number after the last ``####`` (commas removed), or None."""
    matches = _FINAL.findall(response)
    return matches[-1].replace(",", "") if matches else None


def _same_number(a: str, b: str) -> bool:
    try:
        return abs(float(a) - float(b.replace(",", ""))) < 1e-6
    except ValueError:
        return a.strip() == b.strip()


@REWARD_FUNCTIONS.register("openai/gsm8k", "gsm8k")
def gsm8k(response: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 when the number after the last ``####`` equals the ground truth, else 0.0."""
    answer = extract_final_answer(response)
    return float(answer is not None and _same_number(answer, ground_truth))


@REWARD_FUNCTIONS.register("arithmetic")
def arithmetic(response: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """The synthetic arithmetic task (``scripts/data/arithmetic.py``): exact integer after ``####``."""
    return gsm8k(response, ground_truth, extra_info)


_FINAL_LINE = re.compile(r"####\s*-?[\d,]*\.?\d+\s*\Z")


@REWARD_FUNCTIONS.register("answer_format")
def answer_format(response: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 when the response ends with GSM8K's answer line ``#### <number>``, right or wrong, else 0.0 (a format
    reward: a component for GDPO, ``reward.components=["rlspmd.rewards.rules:answer_format"]``)."""
    return float(_FINAL_LINE.search(response.strip()) is not None)


_FINAL_WORD = re.compile(r"####\s*([A-Za-z]+)")


@REWARD_FUNCTIONS.register("shapes")
def shapes(response: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """The synthetic visual task (``scripts/data/shapes.py``): the word after the last ``####`` is the colour of the
    largest shape (case-insensitive)."""
    matches = _FINAL_WORD.findall(response)
    return float(bool(matches) and matches[-1].lower() == ground_truth.strip().lower())


def _reasoning_gym(response: str, ground_truth: str, extra_info: dict | None = None) -> float:
    from rlspmd.rewards.reasoning_gym import score

    return score(response, ground_truth, extra_info or {})


_IN_PROCESS = frozenset(REWARD_FUNCTIONS)  # the rules above: a bounded regular expression each
PREFIX_RULES = {"reasoning_gym/": _reasoning_gym}


def runs_in_process(data_source: str) -> bool:
    """The built-in rules above are a bounded regular expression each: cheap enough to call in the rank's own process
    even under ``reward.timeout_s``. Third-party checkers (``PREFIX_RULES``) go to the worker pool."""
    return data_source in _IN_PROCESS


def rule_for(data_source: str):
    if data_source in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[data_source]
    for prefix, fn in PREFIX_RULES.items():
        if data_source.startswith(prefix):
            return fn
    known = REWARD_FUNCTIONS.names() + [p + "*" for p in PREFIX_RULES]
    raise ValueError(
        f"no rule reward for data_source {data_source!r} (known: {known}); set reward.function to a custom function"
    )
