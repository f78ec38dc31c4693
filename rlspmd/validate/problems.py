"""What the collector gathers (``Problems``: one line per problem, naming the field and its value), the error it
raises, and the type check every field goes through first (a Python config can set anything)."""

from __future__ import annotations

import dataclasses
import types
import typing

from rlspmd.components import Component
from rlspmd.distributed.runtime import UserError


class ConfigError(UserError):
    """The configuration cannot run; the message lists every problem found, one per line."""


class Problems:
    def __init__(self):
        self.lines: list[str] = []

    def add(self, field: str, value, why: str) -> None:
        self.lines.append(f"{field}={value!r}: {why}")

    def at_least(self, field: str, value, low) -> None:
        if value < low:
            self.add(field, value, f"must be >= {low}")

    def optional_at_least(self, field: str, value, low) -> None:
        if value is not None and value < low:
            self.add(field, value, f"must be >= {low}, or None (off)")

    def one_of(self, field: str, value, known) -> None:
        if value not in known:
            self.add(field, value, f"must be one of {sorted(known)}")

    def file_check(self, check, *args, **kwargs) -> None:
        """Run a loader's file check; its error message already names the field and the path."""
        try:
            check(*args, **kwargs)
        except (OSError, ValueError) as e:
            self.lines.append(str(e))


def check_types(p: Problems, cfg, prefix: str) -> None:
    """Every field holds a value of its annotated type (``Literal[...]`` fields one of their values). tyro checks the
    command line; a Python config can set anything, and a string where a number belongs would otherwise run."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        name, value, hint = f"{prefix}{f.name}", getattr(cfg, f.name), hints[f.name]
        if _matches(value, hint):
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                check_types(p, value, f"{name}.")  # a section, or the component a union field holds
        elif typing.get_origin(hint) is typing.Literal:
            p.add(name, value, f"must be one of {list(typing.get_args(hint))}")
        else:
            p.add(name, value, f"must be {_type_name(hint)}, not {type(value).__name__}")


def _matches(value, hint) -> bool:
    """``value`` is an instance of the annotation ``hint`` (ints pass for floats, bools pass only for bools, a
    tuple passes for a list)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return True
    if hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if origin is typing.Literal:
        return any(type(value) is type(a) and value == a for a in args)
    if origin in (list, tuple, set, frozenset):
        if not isinstance(value, (list, tuple) if origin is list else origin):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(_matches(v, a) for v, a in zip(value, args))
        return not args or all(_matches(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and (
            not args or all(_matches(k, args[0]) and _matches(v, args[1]) for k, v in value.items())
        )
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, origin or hint) if isinstance(origin or hint, type) else True


def _type_name(hint) -> str:
    """The annotation ``hint`` as an error message names it: ``float``, ``int or None``, ``list[str]``,
    ``one of ['a', 'b'] or None``, ``a policy loss (PPOClip, CISPO, ...)`` for a component's kind."""
    if isinstance(hint, type) and issubclass(hint, Component) and "registry" in vars(hint):
        reg = hint.registry
        article = "an" if reg.kind[0] in "aeiou" else "a"
        return f"{article} {reg.kind} ({', '.join(reg[n].__name__ for n in reg)})"
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "None"
    if typing.get_origin(hint) is typing.Literal:
        return f"one of {list(typing.get_args(hint))}"
    if typing.get_args(hint):  # a parametrised type (list[str], tuple[float, float]): as Python writes it
        return str(hint)
    return getattr(hint, "__name__", str(hint))
