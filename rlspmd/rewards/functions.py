"""Finding and calling reward functions: ``reward.function`` specs and the rule chosen by ``data_source``.

Imports nothing heavy (no torch): reward worker processes (``worker.py``) use it too.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from rlspmd.rewards.rules import REWARD_FUNCTIONS, rule_for


def load_function(spec: str, *, field_name: str = "reward.function") -> Callable:
    """A registered name (``gsm8k``, ...) or ``path/to/file.py:fn`` / ``package.module:fn`` -> the function (imports,
    and so runs, its module; errors name the field, the spec and the file: ``rlspmd/utils/imports.py``)."""
    return REWARD_FUNCTIONS.resolve(spec, field_name=field_name)


def function_name(fn: Callable) -> str:
    return fn.__name__ if hasattr(fn, "__name__") else repr(fn)


def spec_name(spec: str) -> str:
    """The function's name in a ``reward.function`` spec (``file.py:score`` -> ``score``)."""
    return spec.rsplit(":", 1)[-1]


@functools.lru_cache(maxsize=64)
def _arity(fn: Callable) -> int:
    """How many of the four arguments ``fn`` takes (``inspect.signature`` costs tens of microseconds: once per fn)."""
    return max(2, min(len(inspect.signature(fn).parameters), 4))


def call_reward(fn: Callable, response: str, ground_truth, extra_info: dict, data_source: str):
    """User functions may take (response, ground_truth, extra_info, data_source) or the first 3 / 2 of them."""
    return fn(*(response, ground_truth, extra_info, data_source)[: _arity(fn)])


def resolve(custom: Callable | None, data_source: str) -> Callable:
    """The function that scores a sample: the user's, or the rule for its ``data_source``."""
    return custom if custom is not None else rule_for(data_source)
