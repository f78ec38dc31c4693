"""Components: the one way to extend rlspmd, for every kind of thing a run picks by name.

A *kind* is a family of interchangeable parts: policy losses, advantage estimators, KL controllers, distillation
signals, training engines, rollout engines (config components, below), and tools, interactions, tool-call parsers,
reward functions (named objects). Each kind has one ``Registry``, defined beside the code of the kind, that its members
fill themselves. A run names a member either by its registered name (``gspo``, ``calculator``) or by an import path, the
spelling every field uses: ``package.module:Name`` or ``path/to/file.py:Name`` (``rlspmd/utils/imports.py``). A user's
own part is therefore picked exactly like a built-in one, from their own file, without editing the package.

**Config components** are dataclasses that subclass their kind's base (``PolicyLoss``, ``AdvantageEstimator``, ...,
each a ``Component`` holding its ``registry``): their fields are the options (a docstring under each, shown by
``--help``), ``problems()`` lists what is wrong with them (collected by ``rlspmd.validate`` before anything loads,
each prefixed with where the component sits) and ``build(...)`` returns the bound object the trainer calls. Defining
such a subclass registers it under its ``name`` (a class variable; the command line's subcommand). A config field
that holds one is annotated ``REGISTRY.choice()``: tyro then offers every registered member as a subcommand
(``actor.policy-loss:gspo --actor.policy-loss.clip-ratio-low 3e-4``), including members registered after the config
module was imported (a user's class defined in their config file, or named on the command line by its import path:
``actor.policy-loss:my_losses.py:MyLoss``, which ``rlspmd.startup`` imports before tyro parses the line).

Imports nothing heavy: reading this module needs neither torch nor a model.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import typing
from collections.abc import Iterator
from typing import Annotated, Any, ClassVar, Union

import tyro

from rlspmd.utils.imports import Kind, load_object

Problem = tuple[str, object, str]
"""``(field, value, why)``: one thing wrong with a component's options; the collector (``rlspmd.validate``) prefixes
the field with where the component sits."""


class Registry:
    """The members of one kind by name. ``base``: the class every member must subclass (config components), or None
    for named objects (tools are classes with the tool interface, reward functions are callables)."""

    def __init__(self, kind: str, *, base: type | None = None, load_as: Kind = "class"):
        self.kind, self.base, self.load_as = kind, base, load_as
        self._members: dict[str, Any] = {}

    def add(self, name: str, member: Any) -> Any:
        """Register ``member`` under ``name``. The same member again (a module imported twice) replaces itself; another
        member under a taken name is an error naming both."""
        old = self._members.get(name)
        if old is not None and import_path(old) != import_path(member):
            raise ValueError(
                f"two {self.kind}s named {name!r}: {import_path(old)} and {import_path(member)}; give one another name"
            )
        self._members[name] = member
        return member

    def register(self, *names: str):
        """Decorator for named objects: ``@TOOLS.register("calculator")`` (several names are aliases)."""

        def add(member):
            for name in names:
                self.add(name, member)
            return member

        return add

    def __getitem__(self, name: str) -> Any:
        return self._members[name]

    def __contains__(self, name: object) -> bool:
        return name in self._members

    def __iter__(self) -> Iterator[str]:
        return iter(self._members)

    def __len__(self) -> int:
        return len(self._members)

    def items(self):
        return self._members.items()

    def names(self) -> list[str]:
        return sorted(self._members)

    def shipped(self) -> set[str]:
        """The names of the members that ship with rlspmd (a user's registered members left out)."""
        return {n for n, m in self._members.items() if getattr(m, "__module__", "").startswith("rlspmd.")}

    def resolve(self, spec: str, *, field_name: str) -> Any:
        """The member a config value names: a registered name, or an import path (``pkg.mod:Name``,
        ``path/to/file.py:Name``) whose class registers itself on import (a config component) or is checked to fit
        the kind. Errors name the field, the spec and the file."""
        if spec in self._members:
            return self._members[spec]
        member = load_object(spec, field_name=field_name, kind=self.load_as, registered=self.names())
        if self.base is not None and not issubclass(member, self.base):
            raise ValueError(
                f"{field_name}={spec!r}: {member.__qualname__} is not a {self.kind} (subclass {import_path(self.base)})"
            )
        return member

    def union(self):
        """Every member as a tyro subcommand: the type tyro parses a ``choice()`` field as (built when parsing, so
        members registered after import are offered too)."""
        members = tuple(Annotated[c, tyro.conf.subcommand(n)] for n, c in self._members.items())
        return Union[members] if len(members) > 1 else members[0]  # noqa: UP007 - a runtime-built union

    def choice(self):
        """The annotation of a config field holding one member, picked by name on the command line."""
        return Annotated[self.base, tyro.conf.arg(constructor_factory=self.union), self]


class Component:
    """Base of the config components of every kind (a kind's base sets ``registry``; its members set ``name``).

    A member is a dataclass whose fields are its options; ``problems()`` returns what is wrong with them (empty:
    fine); ``build(...)`` (its signature is the kind's) returns what the trainer runs. A class declared with
    ``abstract=True`` shares code between members without being one."""

    name: ClassVar[str]
    registry: ClassVar[Registry]

    def __init_subclass__(cls, abstract: bool = False, **kwargs):
        super().__init_subclass__(**kwargs)
        if "registry" in vars(cls):  # the kind's base: what every member of its registry subclasses
            cls.registry.base = cls
            return
        if abstract:
            return
        if "name" not in vars(cls):
            cls.name = snake_case(cls.__name__)
        cls.registry.add(cls.name, cls)

    def problems(self) -> list[Problem]:
        return []


def snake_case(name: str) -> str:
    """``MyLoss`` -> ``my_loss``: the name of a member that does not give one."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def import_path(obj: Any) -> str:
    """How to import ``obj`` again: ``package.module:Name``, or ``path/to/file.py:Name`` for a class or function
    defined in a user's file or config file (their modules are named after the file, not importable by name)."""
    module = sys.modules.get(getattr(obj, "__module__", ""), None)
    qualname = getattr(obj, "__qualname__", repr(obj))
    name = getattr(module, "__name__", "?")
    if name.startswith(("_rlspmd_user_", "_rlspmd_config_")) and getattr(module, "__file__", None):
        return f"{module.__file__}:{qualname}"
    return f"{name}:{qualname}"


def registry_of(hint) -> Registry | None:
    """The registry of a field annotated ``REGISTRY.choice()`` (type hints read with ``include_extras=True``)."""
    if typing.get_origin(hint) is Annotated:
        return next((m for m in hint.__metadata__ if isinstance(m, Registry)), None)
    return None


def picked_fields(cls: type) -> dict[str, Registry]:
    """The fields of config dataclass ``cls`` that hold a component picked by name, with their kind's registry."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: reg for f in dataclasses.fields(cls) if (reg := registry_of(hints[f.name])) is not None}


def picked_paths(cls: type, prefix: str = "") -> dict[str, Registry]:
    """``{"actor.policy_loss": POLICY_LOSSES, ...}``: every component field of a config tree, by dotted path."""
    out: dict[str, Registry] = {}
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        reg = registry_of(hints[f.name])
        if reg is not None:
            out[f"{prefix}{f.name}"] = reg
            continue
        hint = hints[f.name]
        if typing.get_origin(hint) is Annotated:
            hint = typing.get_args(hint)[0]
        if dataclasses.is_dataclass(hint):
            out.update(picked_paths(hint, f"{prefix}{f.name}."))
    return out


def describe(component: Component) -> dict:
    """The head of a component's record in ``config.json`` and the checkpoint meta: its name, and for a component
    that does not ship with rlspmd its import path (a resumed run or a reader finds the class again)."""
    cls = type(component)
    out = {"name": cls.name}
    if not cls.__module__.startswith("rlspmd."):
        out["import"] = import_path(cls)
    return out
