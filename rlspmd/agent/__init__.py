"""Agentic rollouts: tools, tool-call parsing, chat deltas, interactions and the multi-turn loop.

``load_tools`` / ``load_parser`` / ``load_interactions`` turn the ``rollout.agent`` section (and verl's tool and
interaction YAML files it may name, ``agent/verl_config.py``) into checked objects at start-up; ``build_agent_loop``
assembles the loop the rollout role runs (``roles/rollout.py``); ``check_rows`` checks the data's agent columns
against it.
"""

from __future__ import annotations

from rlspmd.agent.builtin import Calculator, Gsm8kAnswer, PythonRunner
from rlspmd.agent.chat import ChatRenderer, system_tool_template, use_system_tool_prompt
from rlspmd.agent.interaction import INTERACTIONS, InteractionSample
from rlspmd.agent.interaction import MEMBERS as INTERACTION_MEMBERS
from rlspmd.agent.loop import AGENT_LOOPS, STOP_REASONS, AgentLoop, check_rows
from rlspmd.agent.parser import PARSERS, HermesParser, ParseError, ToolCall
from rlspmd.agent.tools import TOOLS, Tool, ToolSample, check_arguments, check_schema, check_tool, function_schema
from rlspmd.agent.verl_config import (
    VERL_INTERACTIONS,
    VERL_TOOLS,
    Entry,
    default_interaction_name,
    read_interaction_config,
    read_tool_config,
    user_spec,
    verl_class_error,
)
from rlspmd.agent.config import AgentConfig
from rlspmd.utils.imports import load_object

__all__ = [
    "AGENT_LOOPS",
    "AgentLoop",
    "check_rows",
    "load_interactions",
    "read_interaction_config",
    "read_tool_config",
    "Calculator",
    "ChatRenderer",
    "system_tool_template",
    "use_system_tool_prompt",
    "Gsm8kAnswer",
    "HermesParser",
    "InteractionSample",
    "ParseError",
    "PythonRunner",
    "STOP_REASONS",
    "TOOLS",
    "Tool",
    "ToolCall",
    "ToolSample",
    "build_agent_loop",
    "check_arguments",
    "check_schema",
    "function_schema",
    "load_interaction",
    "load_parser",
    "load_tools",
    "tool_schemas",
]


def _tool_factory(cls, cfg: AgentConfig):
    """How a tool class is built: a ``Tool`` subclass as the section configures it (``Tool.from_config``), any other
    class with the tool's members by calling it."""
    return (lambda: cls.from_config(cfg)) if isinstance(cls, type) and issubclass(cls, Tool) else cls


def _instantiate(obj, *, where: str):
    try:
        return obj()
    except Exception as e:  # noqa: BLE001 - a tool that cannot be built stops the run naming it
        raise ValueError(f"{where}: constructing it failed: {type(e).__name__}: {e}") from None


def load_tools(cfg: AgentConfig, *, field_name: str = "rollout.agent.tools") -> list:
    """The configured tools, built and checked (members, schema, unique names): ``rollout.agent.tools``, then the
    entries of ``rollout.agent.tool_config_path`` (verl's YAML)."""
    tools, names = [], {}

    def add(tool, where: str) -> None:
        check_tool(tool, where=where)
        if tool.name in names:
            raise ValueError(f"{where}: tool name {tool.name!r} is already used by {names[tool.name]}")
        names[tool.name] = where
        tools.append(tool)

    for i, spec in enumerate(cfg.tools):
        where = f"{field_name}[{i}]={spec!r}"
        cls = TOOLS.resolve(spec, field_name=f"{field_name}[{i}]")
        add(_instantiate(_tool_factory(cls, cfg), where=where), where)
    if cfg.tool_config_path is not None:
        for entry in read_tool_config(cfg.tool_config_path):
            add(_yaml_tool(entry, cfg), entry.where)
    return tools


def _yaml_tool(entry: Entry, cfg: AgentConfig):
    """One verl ``tools:`` entry: an rlspmd built-in (verl's class name mapped, or a registered name) or a user class
    built with ``config`` as keyword arguments; ``tool_schema`` replaces the class's schema and names the tool."""
    registered, cls = _entry_class(entry, mapped=VERL_TOOLS, registry=TOOLS)
    factory = _tool_factory(cls, cfg) if registered is not None else (lambda: cls(**entry.config))
    tool = _instantiate(factory, where=f"{entry.where} ({entry.class_name})")
    if entry.schema is not None:
        where = f"{entry.where}.tool_schema"
        name = check_schema(entry.schema, where=where)
        if registered is not None:
            _same_parameters(tool.schema, entry.schema, where=where, builtin=registered)
        tool.schema, tool.name = entry.schema, name  # what the model sees; verl names the tool by its schema
    return tool


def _entry_class(entry: Entry, *, mapped: dict[str, str], registry):
    """``(registered name, class)`` of a YAML entry: a built-in (verl's class name ``mapped`` to it, or its registered
    name; it takes no ``config`` options), or a user class (``(None, Class)``, built as ``Class(**config)``)."""
    registered = mapped.get(entry.class_name, entry.class_name if entry.class_name in registry else None)
    if registered is not None:
        if entry.config:
            raise ValueError(
                f"{entry.where}.config: the built-in {registered!r} ({entry.class_name}) takes no options, "
                f"got {sorted(entry.config)}"
            )
        return registered, registry[registered]
    error = verl_class_error(entry, mapped=mapped)
    if error is not None:
        raise error
    return None, load_object(user_spec(entry.class_name), field_name=f"{entry.where}.class_name", kind="class")


def _same_parameters(own: dict, given: dict, *, where: str, builtin: str) -> None:
    """A built-in reads its own arguments: a schema for it may word them differently, not rename or retype them."""

    def shape(schema: dict) -> tuple[dict, list]:
        params = schema["function"].get("parameters", {})
        return ({k: v.get("type") for k, v in params.get("properties", {}).items()}, sorted(params.get("required", [])))

    if shape(own) != shape(given):
        raise ValueError(
            f"{where}: the built-in {builtin!r} reads the arguments {shape(own)[0]} (required "
            f"{shape(own)[1]}); this schema declares {shape(given)[0]} (required {shape(given)[1]})"
        )


def tool_schemas(tools: list) -> list[dict] | None:
    """What the chat template's ``tools`` argument receives (None without tools: prompts render as before)."""
    return [t.schema for t in tools] or None


def load_parser(cfg: AgentConfig, *, field_name: str = "rollout.agent.parser"):
    cls = PARSERS.resolve(cfg.parser, field_name=field_name)
    parser = _instantiate(cls, where=f"{field_name}={cfg.parser!r}")
    if not callable(getattr(parser, "parse", None)):
        raise ValueError(f"{field_name}={cfg.parser!r}: a parser needs parse(text) -> list[ToolCall | ParseError]")
    return parser


def load_interaction(cfg: AgentConfig, *, field_name: str = "rollout.agent.interaction"):
    """The interaction of ``rollout.agent.interaction`` (None without one), built and checked."""
    if cfg.interaction is None:
        return None
    where = f"{field_name}={cfg.interaction!r}"
    cls = INTERACTIONS.resolve(cfg.interaction, field_name=field_name)
    return _check_interaction(_instantiate(cls, where=where), where=where)


def _check_interaction(obj, *, where: str):
    missing = [m for m in INTERACTION_MEMBERS if not callable(getattr(obj, m, None))]
    if missing:
        raise ValueError(
            f"{where}: an interaction needs {list(INTERACTION_MEMBERS)}; {type(obj).__name__} lacks {missing}"
        )
    return obj


def load_interactions(cfg: AgentConfig) -> dict:
    """Every interaction of the run by name: ``rollout.agent.interaction`` (named as verl would name it: ``gsm8k``, or
    the class name less ``Interaction``, lower-cased) and the entries of ``rollout.agent.interaction_config_path``.
    A row picks one by ``extra_info.interaction_kwargs.name``."""
    out: dict = {}
    wheres: dict[str, str] = {}
    one = load_interaction(cfg)
    if one is not None:
        name = cfg.interaction if cfg.interaction in INTERACTIONS else default_interaction_name(cfg.interaction)
        out[name], wheres[name] = one, f"rollout.agent.interaction={cfg.interaction!r}"
    if cfg.interaction_config_path is not None:
        for entry in read_interaction_config(cfg.interaction_config_path):
            if entry.name in out:
                raise ValueError(f"{entry.where}.name={entry.name!r}: already used by {wheres[entry.name]}")
            out[entry.name], wheres[entry.name] = _yaml_interaction(entry), entry.where
    return out


def _yaml_interaction(entry: Entry):
    """One verl ``interaction:`` entry: an rlspmd built-in or a user class built with
    ``config`` as keyword arguments."""
    registered, cls = _entry_class(entry, mapped=VERL_INTERACTIONS, registry=INTERACTIONS)
    factory = cls if registered is not None else (lambda: cls(**entry.config))
    return _check_interaction(_instantiate(factory, where=f"{entry.where} ({entry.class_name})"), where=entry.where)


def build_agent_loop(
    cfg: AgentConfig, *, tokenizer, eos_ids: list[int], pad_id: int, max_response_length: int, model_field: str
) -> AgentLoop:
    """The loop with its tools, parser, interactions and renderer (``rlspmd/validate/`` checked the section before
    anything loaded)."""
    tools = load_tools(cfg)
    if cfg.tool_prompt not in ("template", "system"):
        raise ValueError(f"rollout.agent.tool_prompt={cfg.tool_prompt!r}: expected 'template' or 'system'")
    if cfg.tool_prompt == "system" and tools:
        use_system_tool_prompt(tokenizer)  # the run's one tokenizer: the prompt dataset renders with it too
    renderer = ChatRenderer(tokenizer, tools=tool_schemas(tools), field_name=model_field)
    return AgentLoop(
        cfg,
        tools=tools,
        parser=load_parser(cfg),
        interactions=load_interactions(cfg),
        renderer=renderer,
        tokenizer=tokenizer,
        eos_ids=eos_ids,
        pad_id=pad_id,
        max_response_length=max_response_length,
    )
