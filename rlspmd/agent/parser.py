"""Tool-call parsers: the model's text of one turn -> the calls it makes.

``HermesParser`` reads the Hermes / Qwen format, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any
number of times in one turn. A parser never raises on model output: a call it cannot read (bad JSON, no name, arguments
that are not an object, an unclosed tag) is a ``ParseError`` in the list, in order, which the loop turns into an error
message to the model and counts.

Pluggable: ``rollout.agent.parser`` is a registered name (``hermes``) or ``path/to/file.py:Class`` /
``module:Class``, a class with ``parse(text) -> list[ToolCall | ParseError]``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol

from rlspmd.components import Registry


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Any
    """Decoded JSON; checked against the tool's schema later (``tools.check_arguments``)."""


@dataclass(frozen=True)
class ParseError:
    message: str
    """What the model reads back."""


class ToolCallParser(Protocol):
    def parse(self, text: str) -> list[ToolCall | ParseError]: ...


PARSERS = Registry("tool-call parser")
"""Every tool-call parser by its name (``rollout.agent.parser``: a name here, or ``path/to/file.py:Class``)."""


@PARSERS.register("hermes")
class HermesParser:
    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def __init__(self):
        self.pattern = re.compile(re.escape(self.open_tag) + r"(.*?)" + re.escape(self.close_tag), re.DOTALL)

    def parse(self, text: str) -> list[ToolCall | ParseError]:
        calls: list[ToolCall | ParseError] = [self._one(body) for body in self.pattern.findall(text)]
        # An opening tag left without its closing one (the turn ended inside a call).
        if text.count(self.open_tag) > len(calls):
            calls.append(ParseError(f"a {self.open_tag} without its {self.close_tag}"))
        return calls

    @staticmethod
    def _one(body: str) -> ToolCall | ParseError:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return ParseError(f"the tool call is not valid JSON ({e.msg} at character {e.pos})")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ParseError('a tool call must be a JSON object {"name": ..., "arguments": {...}}')
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models encode the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return ParseError(f"the arguments of {obj['name']!r} are a string that is not JSON")
        return ToolCall(obj["name"], args)
