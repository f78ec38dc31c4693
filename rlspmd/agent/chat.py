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
"""

from __future__ import annotations

PROBE = "rlspmd-probe-3f9c"


class ChatRenderer:
    def __init__(self, tokenizer, *, tools: list[dict] | None, field_name: str):
        """``tools``: the schemas rendered into every prompt (None: no tools). Checks at start-up that the template
        renders assistant text verbatim, renders ``tool`` messages, and shows every tool's name in the prompt;
        ``field_name`` names the model in the errors."""
        self.tokenizer, self.tools = tokenizer, tools
        self.probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": PROBE}]
        if PROBE not in self.render(self.probe, add_generation_prompt=False):
            raise ValueError(f"{field_name}: the chat template does not render an assistant message's content verbatim; "
                             "multi-turn rollouts cannot append turns to it")
        if PROBE + "2" not in self.delta_text([{"role": "tool", "content": PROBE + "2"}], stop_text=None):
            raise ValueError(f"{field_name}: the chat template does not render messages with role 'tool'; use a template "
                             "with tool support for rollout.agent")
        prompt = self.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
        missing = [t["function"]["name"] for t in tools or [] if t["function"]["name"] not in prompt]
        if missing:
            raise ValueError(f"{field_name}: the chat template ignores its `tools` argument (tools {missing} do not appear "
                             "in the prompt), so the model would never see the tool schemas; use a template with tool support")

    def render(self, messages: list[dict], *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def delta_text(self, messages: list[dict], *, stop_text: str | None) -> str:
        """What the template appends after an assistant turn that ended with ``stop_text`` (its stop token's text;
        None: the turn ended without one)."""
        full = self.render(self.probe + messages, add_generation_prompt=True)
        after = full[full.index(PROBE) + len(PROBE):]  # the probe assistant turn (tool results come after it)
        if stop_text and after.startswith(stop_text):
            after = after[len(stop_text):]
        return after

    def delta_ids(self, messages: list[dict], *, stop_text: str | None) -> list[int]:
        return self.tokenizer(self.delta_text(messages, stop_text=stop_text), add_special_tokens=False)["input_ids"]
