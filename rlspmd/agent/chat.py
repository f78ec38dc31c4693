"""Chat rendering for multi-turn rollouts: the prompt with the tool schemas, and each appended turn as a token delta.

Token in, token out: the ids a conversation is trained on are the prompt's ids, then exactly the ids the model
generated, then the ids of what was appended (tool results, a user-simulator turn, the next generation prompt), and
so on. The history is never decoded and re-encoded: a template that is not append-only (one that drops the reasoning
of earlier assistant turns, say) would otherwise shift or rewrite tokens the model already produced.

The delta of appended messages is rendered against a fixed probe conversation, ``[user, assistant(PROBE)]``:
``template(probe + new, add_generation_prompt=True)`` from just after the probe's assistant text. That text is what
the template emits after an assistant turn followed by these messages: the turn's closing (``<|im_end|>\\n`` in
ChatML), the new messages, and the next generation prompt. The model's generation already ended with its stop token,
so when the closing starts with that token's text it is not repeated. Nothing of the real history is re-rendered.

Templates without tool support (SmolLM2's ChatML template ignores its ``tools`` argument): with
``rollout.agent.tool_prompt="system"`` the run's tokenizer gets ``system_tool_template``, a wrapper that writes the
schemas into the system message itself, in the format the ``hermes`` parser reads (a ``<tools>`` block of JSON schemas
and the ``<tool_call>`` call syntax), and then renders with the original template. It is installed on the one tokenizer
object of the run, so the prompt dataset, the appended turns and the Hugging Face export (``checkpoint.save_hf``) all
render the same text; ``tool_prompt="template"`` (the default) keeps the template's own rendering and stops the run at
start-up if the template ignores the tools.
"""

from __future__ import annotations

PROBE = "rlspmd-probe-3f9c"
TOOL_PROMPT_MARKER = "{#- rlspmd: tool schemas in the system message (rollout.agent.tool_prompt=system) -#}"
TOOL_SYSTEM_HEADER = (
    "# Tools\n\nYou can call functions to help answer. Their signatures, one JSON schema per line, are inside "
    "<tools></tools>:\n<tools>"
)
TOOL_SYSTEM_FOOTER = (
    "\n</tools>\n\nTo call a function, write a JSON object with its name and arguments inside "
    '<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}'
    "\n</tool_call>"
)


def tool_system_text(tools: list[dict]) -> str:
    """What ``system_tool_template`` appends to the system message for ``tools`` (the same text, in Python)."""
    import json

    return TOOL_SYSTEM_HEADER + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools) + TOOL_SYSTEM_FOOTER


def system_tool_template(template: str) -> str:
    """``template`` wrapped so that a ``tools`` argument is rendered into the system message (appended to the
    conversation's system message, or as a system message of its own when there is none; the template's default
    system prompt is then not used) and the original template renders the rest, without ``tools``. Idempotent."""
    if template.startswith(TOOL_PROMPT_MARKER):
        return template
    as_jinja = lambda text: "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"  # noqa: E731
    return (
        TOOL_PROMPT_MARKER
        + "{%- if tools %}"
        + "{%- set ns = namespace(text="
        + as_jinja(TOOL_SYSTEM_HEADER)
        + ") %}"
        + "{%- for tool in tools %}{%- set ns.text = ns.text + '\\n' + (tool | tojson) %}{%- endfor %}"
        + "{%- set ns.text = ns.text + "
        + as_jinja(TOOL_SYSTEM_FOOTER)
        + " %}"
        + "{%- if messages and messages[0]['role'] == 'system' %}"
        + "{%- set messages = [{'role': 'system', 'content': messages[0]['content'] + '\\n\\n' + ns.text}]"
        + " + messages[1:] %}"
        + "{%- else %}"
        + "{%- set messages = [{'role': 'system', 'content': ns.text}] + messages %}"
        + "{%- endif %}"
        + "{%- set tools = none %}"
        + "{%- endif %}"
        + template
    )


def use_system_tool_prompt(tokenizer) -> None:
    """Install ``system_tool_template`` on ``tokenizer`` (``rollout.agent.tool_prompt="system"``)."""
    tokenizer.chat_template = system_tool_template(tokenizer.chat_template)


class ChatRenderer:
    def __init__(self, tokenizer, *, tools: list[dict] | None, field_name: str):
        """``tools``: the schemas rendered into every prompt (None: no tools). Checks at start-up that the template
        renders assistant text verbatim, renders ``tool`` messages, and shows every tool's name in the prompt;
        ``field_name`` names the model in the errors."""
        self.tokenizer, self.tools = tokenizer, tools
        self.probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": PROBE}]
        if PROBE not in self.render(self.probe, add_generation_prompt=False):
            raise ValueError(
                f"{field_name}: the chat template does not render an assistant message's content verbatim; "
                "multi-turn rollouts cannot append turns to it"
            )
        if PROBE + "2" not in self.delta_text([{"role": "tool", "content": PROBE + "2"}], stop_text=None):
            raise ValueError(
                f"{field_name}: the chat template does not render messages with role 'tool'; use a template "
                "with tool support for rollout.agent"
            )
        prompt = self.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
        missing = [t["function"]["name"] for t in tools or [] if t["function"]["name"] not in prompt]
        if missing:
            raise ValueError(
                f"{field_name}: the chat template ignores its `tools` argument (tools {missing} do not appear "
                "in the prompt), so the model would never see the tool schemas; use a template with tool "
                "support, or (RL runs) set rollout.agent.tool_prompt=system to have rlspmd write the schemas "
                "into the system message"
            )

    def render(self, messages: list[dict], *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def delta_text(self, messages: list[dict], *, stop_text: str | None) -> str:
        """What the template appends after an assistant turn that ended with ``stop_text`` (its stop token's text;
        None: the turn ended without one)."""
        full = self.render(self.probe + messages, add_generation_prompt=True)
        after = full[full.index(PROBE) + len(PROBE) :]  # the probe assistant turn (tool results come after it)
        if stop_text and after.startswith(stop_text):
            after = after[len(stop_text) :]
        return after

    def delta_ids(self, messages: list[dict], *, stop_text: str | None) -> list[int]:
        return self.tokenizer(self.delta_text(messages, stop_text=stop_text), add_special_tokens=False)["input_ids"]
