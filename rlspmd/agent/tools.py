"""Tools as plain Python: the interface, the start-up checks, and the argument check a call goes through.

A tool is a class (subclass ``Tool``, or any class with the same members) with

* ``name`` and ``schema``: an OpenAI-style function schema, ``{"type": "function", "function": {"name", "description",
  "parameters": {"type": "object", "properties": {...}, "required": [...]}}}``; the schemas are rendered into the
  prompt through the chat template's ``tools`` argument;
* ``create(sample) -> state``: one state per conversation. ``sample`` is a ``ToolSample``: the row's ground truth,
  data source and extra info, and this tool's ``create_kwargs`` from verl's ``extra_info.tools_kwargs``
  (``{tool_name: {"create_kwargs": {...}}}``), so verl multi-turn parquet files load unchanged;
* ``call(state, arguments) -> (text, reward_delta, metrics)``: one call with arguments already checked against the
  schema; ``text`` goes back to the model as a ``tool`` message, ``reward_delta`` adds to the sample's score;
* ``score(state) -> float``: the tool's contribution to the final score from its final state (e.g. whether the last
  submitted answer is right; ``Tool``'s default: 0);
* ``release(state)``: the conversation is over (free what ``create`` took).

Tools are configured as ``rollout.agent.tools``: names registered in ``TOOLS`` (``calculator``, ``gsm8k_answer``,
``python``) or ``path/to/file.py:Class`` / ``package.module:Class`` (``rlspmd/components.py``). ``load_tools`` builds
and checks them at start-up: a class that does not import, lacks a member or has an invalid schema stops the run naming
the tool and the field. At run time nothing a model writes raises: bad arguments come back as an error message
(``check_arguments``).

A tool's methods run on worker threads, several at once (one thread per call): a tool keeps its per-conversation data
in the state ``create`` returns, not in ``self``. States travel with the batch (split placement pickles them), so they
should be plain data.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlspmd.components import Registry

if TYPE_CHECKING:
    from rlspmd.agent.config import AgentConfig

JSON_TYPES = {"string", "integer", "number", "boolean", "array", "object", "null"}
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MEMBERS = ("name", "schema", "create", "call", "score", "release")


@dataclass(frozen=True)
class ToolSample:
    """What ``Tool.create`` sees of the conversation's row."""

    ground_truth: Any
    data_source: str
    extra_info: dict
    create_kwargs: dict = field(default_factory=dict)
    """This tool's ``extra_info.tools_kwargs[name].create_kwargs`` (empty when the row names none)."""


TOOLS = Registry("tool")
"""Every built-in tool by its registered name (``@TOOLS.register("name")`` on the class)."""


class Tool:
    """Base class with the defaults; a subclass sets ``name`` and ``schema`` and implements ``call``."""

    name: str = ""
    schema: dict = {}

    @classmethod
    def from_config(cls, agent: AgentConfig) -> Tool:
        """The tool as the ``rollout.agent`` section configures it: a tool with options reads them here (the ``python``
        tool its limits, ``rollout.agent.code``); the default takes none."""
        return cls()

    def create(self, sample: ToolSample) -> Any:
        return None

    def call(self, state: Any, arguments: dict) -> tuple[str, float, dict]:
        raise NotImplementedError

    def score(self, state: Any) -> float:
        return 0.0

    def release(self, state: Any) -> None:
        pass


def function_schema(name: str, description: str, properties: dict, required: list[str]) -> dict:
    """An OpenAI-style function schema."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def check_schema(schema: Any, *, where: str) -> str:
    """Validate an OpenAI-style function schema; returns the function's name. ``where`` names the tool in errors."""

    def bad(msg: str) -> ValueError:
        return ValueError(f"{where}: invalid tool schema: {msg}")

    if not isinstance(schema, dict) or schema.get("type") != "function" or not isinstance(schema.get("function"), dict):
        raise bad('expected {"type": "function", "function": {...}}')
    fn = schema["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise bad(f"function.name={name!r} must be 1-64 characters of letters, digits, '_' or '-'")
    if not isinstance(fn.get("description", ""), str):
        raise bad("function.description must be a string")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type") != "object":
        raise bad('function.parameters must be {"type": "object", "properties": {...}}')
    props = params.get("properties", {})
    if not isinstance(props, dict):
        raise bad("function.parameters.properties must be an object")
    for key, spec in props.items():
        if not isinstance(spec, dict) or spec.get("type") not in JSON_TYPES:
            raise bad(f"property {key!r} needs a 'type' among {sorted(JSON_TYPES)}")
        if "enum" in spec and not isinstance(spec["enum"], list):
            raise bad(f"property {key!r}: 'enum' must be a list")
    required = params.get("required", [])
    if not isinstance(required, list) or any(r not in props for r in required):
        raise bad(f"function.parameters.required={required!r} must list properties that exist ({sorted(props)})")
    return name


def _type_ok(value: Any, kind: str) -> bool:
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "array":
        return isinstance(value, list)
    if kind == "object":
        return isinstance(value, dict)
    return value is None


def check_arguments(schema: dict, arguments: Any) -> str | None:
    """None when ``arguments`` fit the schema, else the error message the model reads (never raises)."""
    params = schema["function"].get("parameters", {})
    props, required = params.get("properties", {}), params.get("required", [])
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    missing = [r for r in required if r not in arguments]
    if missing:
        return f"missing required argument(s) {missing}"
    unknown = sorted(set(arguments) - set(props))
    if unknown:
        return f"unknown argument(s) {unknown}; expected {sorted(props)}"
    for key, value in arguments.items():
        spec = props[key]
        if not _type_ok(value, spec["type"]):
            return f"argument {key!r} must be of type {spec['type']}, got {type(value).__name__}"
        if "enum" in spec and value not in spec["enum"]:
            return f"argument {key!r} must be one of {spec['enum']}"
    return None


def check_tool(tool: Any, *, where: str) -> None:
    """The members every tool needs, and a valid schema whose name is the tool's ``name``."""
    missing = [m for m in MEMBERS if not hasattr(tool, m)]
    if missing:
        raise ValueError(
            f"{where}: a tool needs {list(MEMBERS)}; {type(tool).__name__} lacks {missing} "
            "(subclass rlspmd.agent.Tool for the defaults)"
        )
    for m in ("create", "call", "score", "release"):
        if not callable(getattr(tool, m)):
            raise ValueError(f"{where}: {type(tool).__name__}.{m} must be a method")
    name = check_schema(tool.schema, where=where)
    if name != tool.name:
        raise ValueError(f"{where}: the tool's name {tool.name!r} differs from its schema's function.name {name!r}")
