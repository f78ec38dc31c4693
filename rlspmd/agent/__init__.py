"""Agentic rollouts: tools, tool-call parsing, chat deltas, interactions and the multi-turn loop.

``load_tools`` / ``load_parser`` / ``load_interaction`` turn the ``rollout.agent`` section into checked objects at
start-up; ``build_agent_loop`` assembles the loop the rollout role runs (``roles/rollout.py``).
"""

from __future__ import annotations

from rlspmd.agent.builtin import Calculator, Gsm8kAnswer, PythonRunner
from rlspmd.agent.chat import ChatRenderer, system_tool_template, use_system_tool_prompt
from rlspmd.agent.interaction import INTERACTIONS, InteractionSample
from rlspmd.agent.interaction import MEMBERS as INTERACTION_MEMBERS
from rlspmd.agent.loop import STOP_REASONS, AgentLoop
from rlspmd.agent.parser import PARSERS, HermesParser, ParseError, ToolCall
from rlspmd.agent.tools import Tool, ToolSample, check_arguments, check_schema, check_tool, function_schema
from rlspmd.config import AgentConfig, CodeRunnerConfig
from rlspmd.utils.imports import load_object

__all__ = [
    "AgentLoop", "Calculator", "ChatRenderer", "system_tool_template", "use_system_tool_prompt", "Gsm8kAnswer", "HermesParser", "InteractionSample", "ParseError",
    "PythonRunner", "STOP_REASONS", "Tool", "ToolCall", "ToolSample", "build_agent_loop", "check_arguments",
    "check_schema", "function_schema", "load_interaction", "load_parser", "load_tools", "tool_schemas",
]


def _builtin_tools(code: CodeRunnerConfig) -> dict:
    python = lambda: PythonRunner(timeout_s=code.timeout_s, memory_mb=code.memory_mb, cpu_s=code.cpu_s,  # noqa: E731
                                  max_output_chars=code.max_output_chars, sandbox=code.sandbox)
    return {"calculator": Calculator, "calc_gsm8k_reward": Gsm8kAnswer, "gsm8k_answer": Gsm8kAnswer, "python": python}


def _instantiate(obj, *, where: str):
    try:
        return obj()
    except Exception as e:  # noqa: BLE001 - a tool that cannot be built stops the run naming it
        raise ValueError(f"{where}: constructing it failed: {type(e).__name__}: {e}") from None


def load_tools(cfg: AgentConfig, *, field_name: str = "rollout.agent.tools") -> list:
    """The configured tools, built and checked (members, schema, unique names)."""
    builtin = _builtin_tools(cfg.code)
    tools, names = [], {}
    for i, spec in enumerate(cfg.tools):
        where = f"{field_name}[{i}]={spec!r}"
        factory = builtin.get(spec) or load_object(spec, field_name=f"{field_name}[{i}]", kind="class",
                                                   registered=list(builtin))
        tool = _instantiate(factory, where=where)
        check_tool(tool, where=where)
        if tool.name in names:
            raise ValueError(f"{where}: tool name {tool.name!r} is already used by {field_name}[{names[tool.name]}]")
        names[tool.name] = i
        tools.append(tool)
    return tools


def tool_schemas(tools: list) -> list[dict] | None:
    """What the chat template's ``tools`` argument receives (None without tools: prompts render as before)."""
    return [t.schema for t in tools] or None


def load_parser(cfg: AgentConfig, *, field_name: str = "rollout.agent.parser"):
    cls = PARSERS.get(cfg.parser) or load_object(cfg.parser, field_name=field_name, kind="class", registered=list(PARSERS))
    parser = _instantiate(cls, where=f"{field_name}={cfg.parser!r}")
    if not callable(getattr(parser, "parse", None)):
        raise ValueError(f"{field_name}={cfg.parser!r}: a parser needs parse(text) -> list[ToolCall | ParseError]")
    return parser


def load_interaction(cfg: AgentConfig, *, field_name: str = "rollout.agent.interaction"):
    if cfg.interaction is None:
        return None
    where = f"{field_name}={cfg.interaction!r}"
    cls = INTERACTIONS.get(cfg.interaction) or load_object(cfg.interaction, field_name=field_name, kind="class",
                                                            registered=list(INTERACTIONS))
    obj = _instantiate(cls, where=where)
    missing = [m for m in INTERACTION_MEMBERS if not callable(getattr(obj, m, None))]
    if missing:
        raise ValueError(f"{where}: an interaction needs {list(INTERACTION_MEMBERS)}; {type(obj).__name__} lacks {missing}")
    return obj


def build_agent_loop(cfg: AgentConfig, *, tokenizer, eos_ids: list[int], pad_id: int, max_response_length: int,
                     model_field: str) -> AgentLoop:
    """The loop with its tools, parser, interaction and renderer (``rlspmd/validate.py`` checked the section before
    anything loaded)."""
    tools = load_tools(cfg)
    if cfg.tool_prompt not in ("template", "system"):
        raise ValueError(f"rollout.agent.tool_prompt={cfg.tool_prompt!r}: expected 'template' or 'system'")
    if cfg.tool_prompt == "system" and tools:
        use_system_tool_prompt(tokenizer)  # the run's one tokenizer: the prompt dataset renders with it too
    renderer = ChatRenderer(tokenizer, tools=tool_schemas(tools), field_name=model_field)
    return AgentLoop(cfg, tools=tools, parser=load_parser(cfg), interaction=load_interaction(cfg), renderer=renderer,
                     tokenizer=tokenizer, eos_ids=eos_ids, pad_id=pad_id, max_response_length=max_response_length)
