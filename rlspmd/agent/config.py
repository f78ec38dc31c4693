"""The ``rollout.agent`` section: multi-turn rollouts with tools and interactions (``rlspmd/agent/``), and the limits of
the ``python`` tool. Tools, parsers and interactions are named here by their registered names or import paths; the
registries that resolve them are beside their code (``tools.py``, ``parser.py``, ``interaction.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class CodeRunnerConfig:
    timeout_s: float = 5.0
    """Wall-time limit of one run of the ``python`` tool; the process group is killed when it passes."""
    memory_mb: int = 512
    """Address-space limit of the run (``RLIMIT_AS``): larger allocations fail with ``MemoryError``."""
    cpu_s: int = 5
    """CPU-time limit of the run (``RLIMIT_CPU``)."""
    max_output_chars: int = 2000
    """Output (stdout and stderr) the model reads back; the rest is cut and marked ``[output truncated]``."""
    sandbox: Literal["bwrap", "audit-hook-unsafe"] = "bwrap"
    """Isolation of the model's code (``rlspmd/agent/sandbox.py``; docs/agents.md, "The python tool's sandbox"):
    ``bwrap``, bubblewrap namespaces (sees only its own directory and the standard library, no network, own PID
    namespace, unprivileged identity); the tool refuses to start, naming what is missing, where they cannot be created.
    ``audit-hook-unsafe``, an explicit opt-in for such machines: a Python audit hook, which the code can step around,
    and it can read every file the trainer can (data, ground truth, checkpoints)."""


@dataclass
class AgentConfig:
    tools: list[str] = field(default_factory=list)
    """Tools the model may call: registered names (``calculator``, ``calc_gsm8k_reward`` alias ``gsm8k_answer``,
    ``python``) or ``path/to/file.py:Class`` / ``module:Class`` (``rlspmd.agent.Tool``'s interface). Non-empty (or an
    ``interaction``) turns every rollout into a multi-turn conversation; the schemas are rendered into every prompt
    through the chat template's ``tools`` argument. Checked at start-up (import, members, schema)."""
    tool_prompt: Literal["template", "system"] = "template"
    """How the tool schemas reach the prompt: ``template``, the chat template's ``tools`` argument (start-up error if
    the template ignores it); ``system``, rlspmd writes them into the system message itself (a ``<tools>`` block and
    the ``<tool_call>`` syntax the ``hermes`` parser reads) for templates without tool support, e.g. SmolLM2's. The
    run's tokenizer then renders that way everywhere: prompts, appended turns, the ``checkpoint.save_hf`` export."""
    parser: str = "hermes"
    """Tool-call format: ``hermes`` (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, Qwen's) or
    ``path/to/file.py:Class`` with ``parse(text) -> list[ToolCall | ParseError]``."""
    max_turns: int = 4
    """Assistant turns per conversation; a turn that calls tools past the last one ends the conversation."""
    tool_timeout_s: float = 10.0
    """Seconds one tool call may run; a call past it is an error message to the model (counted as a timeout)."""
    max_parallel_tools: int = 16
    """Tool calls running at once on a rank (threads; a conversation's calls of one turn run in order)."""
    max_tool_response_chars: int = 1000
    """A tool result (or error) longer than this is cut before it is appended."""
    interaction: str | None = None
    """User simulator after each answer without a tool call: ``gsm8k`` or ``path/to/file.py:Class``; None: none.
    Named as verl names an interaction (``gsm8k``; a class ``FooInteraction`` is ``foo``): a row whose
    ``extra_info.interaction_kwargs.name`` names another is a start-up error; a row without a name gets it."""
    tool_config_path: str | None = None
    """verl's ``tool_config`` YAML, as verl's examples write it (``tools:`` a list of ``{class_name, config,
    tool_schema}``; verl's ``actor_rollout_ref.rollout.multi_turn.tool_config_path``): its tools join
    ``rollout.agent.tools``. verl's ``verl.tools.gsm8k_tool.Gsm8kTool`` is the built-in ``calc_gsm8k_reward``; user
    classes by ``pkg.mod.Class``, ``pkg.mod:Class`` or ``path/to/file.py:Class``, built as ``Class(**config)``;
    ``tool_schema`` is what the model sees. What rlspmd cannot honour (MCP tools, other verl classes, unknown keys) is a
    start-up error naming the file and the entry (``rlspmd/agent/verl_config.py``)."""
    interaction_config_path: str | None = None
    """verl's ``interaction_config`` YAML (``interaction:`` a list of ``{name, class_name, config}``; verl's
    ``...multi_turn.interaction_config_path``): several named interactions per run, each row choosing one by
    ``extra_info.interaction_kwargs.name`` (a row without a name needs the run to have exactly one).
    ``verl.interactions.gsm8k_interaction.Gsm8kInteraction`` is the built-in ``gsm8k``."""
    default_agent_loop: Literal["tool_agent", "single_turn_agent"] = "tool_agent"
    """The agent of a row without an ``agent_name`` column (verl's ``rollout.agent.default_agent_loop``):
    ``tool_agent``, the multi-turn conversation; ``single_turn_agent``, one response (the tools' schemas still in the
    prompt, no call run, no interaction). verl's default is ``single_turn_agent``; rlspmd's is ``tool_agent``, since a
    run that configures tools means to use them. A row's ``agent_name`` outside these two is a start-up error."""
    max_user_turns: int = 1
    """Interaction replies per conversation."""
    code: CodeRunnerConfig = field(default_factory=CodeRunnerConfig)
    """Limits of the ``python`` tool."""

    @property
    def enabled(self) -> bool:
        return (
            bool(self.tools)
            or self.interaction is not None
            or self.tool_config_path is not None
            or self.interaction_config_path is not None
        )
