"""verl's agent configuration files, read as verl's examples write them.

* ``rollout.agent.tool_config_path``: verl's ``tool_config`` YAML (``actor_rollout_ref.rollout.multi_turn.
  tool_config_path``)::

      tools:
        - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
          config: {type: native}
          tool_schema: {type: function, function: {name: calc_gsm8k_reward, description: ..., parameters: {...}}}

* ``rollout.agent.interaction_config_path``: verl's ``interaction_config`` YAML (``...multi_turn.
  interaction_config_path``)::

      interaction:
        - name: "gsm8k"
          class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"
          config: {}

``class_name`` is one of verl's built-in classes that rlspmd has an equivalent of (``VERL_TOOLS``,
``VERL_INTERACTIONS``: rlspmd never imports verl), one of rlspmd's registered names, or a user class:
``package.module.Class`` (verl's spelling), ``package.module:Class`` or ``path/to/file.py:Class``. A user class
implements rlspmd's interface (``rlspmd.agent.Tool``; an interaction's ``start/respond/finish``), not verl's async
one, and is built as ``Class(**config)`` (``config`` without verl's ``type`` key), so an option it does not take is
a start-up error. A built-in takes no ``config`` options. ``tool_schema``, when given, is what the model sees (verl
builds the tool from it): it replaces the class's own schema and names the tool; for a built-in its parameters must
be the ones the built-in reads.

Anything else verl's files can say and rlspmd cannot honour is a start-up error naming the file and the entry:
MCP tools (``config.type: mcp``), keys rlspmd does not know, verl classes without an rlspmd equivalent.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

VERL_TOOLS = {"verl.tools.gsm8k_tool.Gsm8kTool": "calc_gsm8k_reward"}
"""verl's built-in tool classes -> the rlspmd built-in that does the same."""
VERL_INTERACTIONS = {"verl.interactions.gsm8k_interaction.Gsm8kInteraction": "gsm8k"}
"""verl's built-in interaction classes -> the rlspmd built-in that does the same."""
VERL_HINTS = {
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": "rlspmd's local code runner is the built-in `python` tool "
    "(rollout.agent.tools=['python'], limits in rollout.agent.code)",
}
"""verl classes with no equivalent but a near one, named in the error."""

TOOL_KEYS = ("class_name", "config", "tool_schema")
INTERACTION_KEYS = ("name", "class_name", "config")


@dataclass(frozen=True)
class Entry:
    """One ``tools`` / ``interaction`` item of a verl YAML file, checked for shape."""

    where: str
    """``<field>=<file>: tools[i]``: how errors name it."""
    class_name: str
    config: dict
    """``config`` without verl's ``type: native``."""
    schema: dict | None = None
    """A tool's ``tool_schema`` (None: the class's own)."""
    name: str = ""
    """An interaction's name (``interaction_kwargs.name`` chooses it)."""


def _read(path: str, *, field_name: str, top: str) -> tuple[str, list]:
    import yaml

    file = Path(path).expanduser()
    head = f"{field_name}={path!r}"
    if not file.is_file():
        raise FileNotFoundError(f"{head}: file {file} does not exist")
    try:
        doc = yaml.safe_load(file.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{head}: not valid YAML: {e}") from None
    if not isinstance(doc, dict) or top not in doc:
        raise ValueError(f"{head}: must be a mapping with a `{top}:` list (verl's format)")
    unknown = sorted(set(doc) - {top})
    if unknown:
        raise ValueError(f"{head}: top-level key(s) {unknown} are not part of verl's format (only `{top}:`)")
    items = doc[top]
    if not isinstance(items, list) or not items:
        raise ValueError(f"{head}: `{top}:` must be a non-empty list")
    return head, items


def _entry_config(item: dict, where: str) -> dict:
    config = item.get("config")
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ValueError(f"{where}.config={config!r}: must be a mapping")
    return dict(config)


def _class_name(item: dict, where: str) -> str:
    name = item.get("class_name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.class_name={name!r}: must name a class")
    return name


def _keys(item: Any, where: str, known: tuple[str, ...]) -> None:
    if not isinstance(item, dict):
        raise ValueError(f"{where}: expected a mapping with {list(known)}, got {item!r}")
    unknown = sorted(set(item) - set(known))
    if unknown:
        hint = " (MCP tools are not supported)" if "mcp" in unknown else ""
        raise ValueError(f"{where}: key(s) {unknown} are not supported; an entry has {list(known)}{hint}")


def read_tool_config(path: str, *, field_name: str = "rollout.agent.tool_config_path") -> list[Entry]:
    """The ``tools:`` entries of a verl ``tool_config`` file."""
    head, items = _read(path, field_name=field_name, top="tools")
    out = []
    for i, item in enumerate(items):
        where = f"{head}: tools[{i}]"
        _keys(item, where, TOOL_KEYS)
        config = _entry_config(item, where)
        kind = config.pop("type", "native")
        if kind != "native":
            raise ValueError(
                f"{where}.config.type={kind!r}: rlspmd runs native (in-process) tools only; MCP tools are not supported"
            )
        schema = item.get("tool_schema")
        if schema is not None and not isinstance(schema, dict):
            raise ValueError(f"{where}.tool_schema={schema!r}: must be a mapping (an OpenAI function schema)")
        out.append(Entry(where=where, class_name=_class_name(item, where), config=config, schema=schema))
    return out


def read_interaction_config(path: str, *, field_name: str = "rollout.agent.interaction_config_path") -> list[Entry]:
    """The ``interaction:`` entries of a verl ``interaction_config`` file; a nameless entry is named as verl names it
    (the class name without its ``Interaction`` suffix, lower-cased)."""
    head, items = _read(path, field_name=field_name, top="interaction")
    out = []
    for i, item in enumerate(items):
        where = f"{head}: interaction[{i}]"
        _keys(item, where, INTERACTION_KEYS)
        class_name = _class_name(item, where)
        name = item.get("name")
        if name is None:
            name = default_interaction_name(class_name)
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.name={name!r}: must be a non-empty string")
        out.append(Entry(where=where, class_name=class_name, config=_entry_config(item, where), name=name))
    return out


def default_interaction_name(class_name: str) -> str:
    """verl's name for an interaction without one: ``pkg.mod.Gsm8kInteraction`` -> ``gsm8k``."""
    simple = class_name.replace(":", ".").rsplit(".", 1)[-1]
    return simple.removesuffix("Interaction").lower()


def user_spec(class_name: str) -> str:
    """A user class as ``load_object`` reads it: verl's ``pkg.mod.Class`` becomes ``pkg.mod:Class``; ``file.py:Class``
    and ``pkg.mod:Class`` stay."""
    if ":" in class_name:
        return class_name
    module, _, name = class_name.rpartition(".")
    return f"{module}:{name}" if module else class_name


def verl_class_error(entry: Entry, *, mapped: dict[str, str]) -> ValueError | None:
    """The error for a ``verl.*`` class rlspmd has no equivalent of (None for any other class)."""
    if not entry.class_name.startswith("verl."):
        return None
    hint = VERL_HINTS.get(entry.class_name)
    return ValueError(
        f"{entry.where}.class_name={entry.class_name!r}: rlspmd does not import verl; the verl classes "
        f"it has equivalents of are {sorted(mapped)}" + (f"; {hint}" if hint else "")
    )
