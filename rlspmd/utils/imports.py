"""User code named in a config: ``path/to/file.py:Name`` or ``package.module:Name`` -> the object.

One loader for every field that names user code (``reward.function``, ``rollout.agent.tools``, ``.parser``,
``.interaction``), so they accept the same specs and fail the same way: every error names the config field, the spec
and, where one is involved, the file: the spec has no ``:``, the file does not exist, the module fails to import (the
exception is quoted), it has no such name (the names it does define are listed), or the object is not what the field
needs (a class, or a callable).

A file is imported once per process, as a module named after its resolved path and registered in ``sys.modules``:
classes defined in it pickle by reference (split placement pickles tool states between ranks, and every rank loaded the
same file under the same name), and a second field naming the same file sees the same module. Imports nothing heavy.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Literal

Kind = Literal["class", "callable", "object"]


def split_spec(spec: str, *, field_name: str, example: str = "Name") -> tuple[str, str]:
    """``"a/b.py:Name"`` -> ``("a/b.py", "Name")``; a spec without a target or name is a ``ValueError``."""
    target, sep, name = str(spec).rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise ValueError(f"{field_name}={spec!r}: expected 'path/to/file.py:{example}' or 'package.module:{example}'")
    return target, name


def module_name_for(path: Path) -> str:
    """The ``sys.modules`` name of a user file: its stem plus a hash of its resolved path (two ``tools.py`` in
    different directories do not collide; the same file is the same module on every rank)."""
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
    stem = "".join(c if c.isalnum() else "_" for c in path.stem)
    return f"_rlspmd_user_{stem}_{digest}"


def import_target(target: str, *, spec: str, field_name: str):
    """The module a spec's target names: a ``.py`` file (imported by path) or a dotted module on ``sys.path``."""
    if target.endswith(".py"):
        path = Path(target).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{field_name}={spec!r}: file {path} does not exist")
        name = module_name_for(path)
        if name in sys.modules:
            return sys.modules[name]
        mod_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[name] = module  # before running it: dataclasses and pickling look the module up by name
        try:
            mod_spec.loader.exec_module(module)
        except BaseException as e:  # noqa: BLE001 - a user file that fails to run stops the run naming it
            del sys.modules[name]
            if not isinstance(e, Exception):
                raise
            raise ValueError(f"{field_name}={spec!r}: {path} failed to import: {type(e).__name__}: {e}") from e
        return module
    try:
        return importlib.import_module(target)
    except Exception as e:  # noqa: BLE001 - a missing package or a module that raises: name both
        raise ValueError(f"{field_name}={spec!r}: module {target!r} failed to import: {type(e).__name__}: {e}") from e


_NOUN = {"class": "class", "callable": "function", "object": "attribute"}


def load_object(spec: str, *, field_name: str, kind: Kind = "object", registered: list[str] | None = None) -> Any:
    """The object a spec names, checked to be a class (``kind="class"``) or callable (``"callable"``).

    ``registered``: the names the field also accepts, quoted in the error for a spec that is neither one of them nor
    a ``file:Name`` spec (the caller looks registered names up first)."""
    if registered is not None and ":" not in str(spec):
        raise ValueError(
            f"{field_name}={spec!r}: neither a registered name ({', '.join(sorted(registered))}) nor "
            f"'path/to/file.py:{_example(kind)}' / 'package.module:{_example(kind)}'"
        )
    target, name = split_spec(spec, field_name=field_name, example=_example(kind))
    module = import_target(target, spec=spec, field_name=field_name)
    where = module.__file__ if target.endswith(".py") else target
    if not hasattr(module, name):
        public = sorted(
            k
            for k, v in vars(module).items()
            if not k.startswith("_") and _fits(v, kind) and getattr(v, "__module__", module.__name__) == module.__name__
        )
        raise ValueError(
            f"{field_name}={spec!r}: {where} has no {_NOUN[kind]} {name!r}"
            + (f" (it defines {public})" if public else "")
        )
    obj = getattr(module, name)
    if not _fits(obj, kind):
        want = "a class" if kind == "class" else "a function or other callable"
        raise ValueError(f"{field_name}={spec!r}: {where}: {name} is {_describe(obj)}, expected {want}")
    return obj


def _example(kind: Kind) -> str:
    return {"class": "Class", "callable": "function", "object": "Name"}[kind]


def _fits(obj: Any, kind: Kind) -> bool:
    if kind == "class":
        return inspect.isclass(obj)
    if kind == "callable":
        return callable(obj) and not inspect.ismodule(obj)
    return True


def _describe(obj: Any) -> str:
    if inspect.isclass(obj):
        return f"the class {obj.__name__}"
    if inspect.ismodule(obj):
        return f"the module {obj.__name__}"
    return f"an object of type {type(obj).__name__} ({obj!r:.40})"


def lazy_exports(package: str, where: dict[str, str]):
    """A package's module ``__getattr__`` (PEP 562) that imports ``<package>.<where[name]>`` when ``name`` is first
    read: a package re-exports its heavy parts (an engine, DCP checkpointing) without importing them with the package,
    so that parsing and checking a config, which import the package's config module, stay fast."""

    def __getattr__(name: str):
        if name in where:
            return getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
