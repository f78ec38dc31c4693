"""Interactions: a user-simulator turn after the model answers (verl's ``interaction_kwargs``).

An interaction is a class with ``start(sample) -> state`` (``sample.kwargs`` is the row's
``extra_info.interaction_kwargs``), ``respond(state, messages) -> (done, text, reward)`` called when the model answered
without a tool call (``messages``: the conversation so far, the answer last; ``done=False`` appends ``text`` as a user
message and the model continues; ``reward`` adds to the sample's score either way) and ``finish(state)``.

Configured as ``rollout.agent.interaction`` (a registered name or ``path/to/file.py:Class``); at most
``rollout.agent.max_user_turns`` replies per conversation. ``respond`` runs on the generation loop's thread between
decode steps: keep it quick (a rule, not a model call). An exception in it ends the conversation and is counted as an
interaction error, never raised.

Built in: ``gsm8k`` (verl's GSM8K interaction): right answers (``#### N``) end the conversation with reward 1, wrong
ones hear "Your answer is wrong. Try again." with reward 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlspmd.components import Registry
from rlspmd.rewards.rules import extract_final_answer


@dataclass(frozen=True)
class InteractionSample:
    ground_truth: Any
    data_source: str
    extra_info: dict
    kwargs: dict
    """The row's ``extra_info.interaction_kwargs`` (empty when it has none)."""


INTERACTIONS = Registry("interaction")
"""Every interaction by its name (``rollout.agent.interaction``: a name here, or ``path/to/file.py:Class``)."""


@INTERACTIONS.register("gsm8k")
class Gsm8kInteraction:
    retry = "Your answer is wrong. Try again."

    def start(self, sample: InteractionSample) -> dict:
        return {"ground_truth": str(sample.kwargs.get("ground_truth", sample.ground_truth))}

    def respond(self, state: dict, messages: list[dict]) -> tuple[bool, str, float]:
        answer = extract_final_answer(messages[-1]["content"])
        try:
            right = answer is not None and abs(float(answer) - float(state["ground_truth"].replace(",", ""))) < 1e-6
        except ValueError:
            right = False
        return (True, "Correct.", 1.0) if right else (False, self.retry, 0.0)

    def finish(self, state: dict) -> None:
        pass


MEMBERS = ("start", "respond", "finish")
