"""The rollout engine's memory lifecycle as an explicit state machine.

A colocated engine time-shares the GPU with training: between generations it releases its weights and KV cache
(vLLM sleep mode). The order of the phases matters and getting it wrong fails silently or crashes later:

    ASLEEP --wake_weights--> WEIGHTS_AWAKE --load--> WEIGHTS_LOADED --reset_prefix--> WEIGHTS_READY
        --wake_kv--> READY --generate--> READY --sleep--> ASLEEP

* A forward pass between the weights wake and the KV-cache wake touches unmapped memory (vLLM #44395).
* After a level-2 sleep the weights are garbage until a full load (vLLM #29341): waking the KV cache straight
  from ``WEIGHTS_AWAKE`` is refused.
* A weight load leaves prefix-cache entries computed with the old weights (vLLM #17103): nothing may run until
  the prefix cache is reset, so ``wake_kv``/``generate`` are refused from ``WEIGHTS_LOADED``/``STALE``.

An engine that never sleeps (split placement: the rollout ranks are its own) loads weights while ``READY``,
which moves it to ``STALE`` until the prefix cache is reset. A level-1 sleep keeps a CPU copy of the weights, so
waking them leads straight to ``WEIGHTS_READY``.

``Lifecycle.apply(event)`` performs a transition or raises ``LifecycleError`` naming the state, the event and
what should have come first. Engines call it before touching the real engine, so an illegal call never
reaches vLLM.
"""

from __future__ import annotations

import enum


class State(enum.Enum):
    ASLEEP = "asleep"
    WEIGHTS_AWAKE = "weights awake, not loaded"
    WEIGHTS_LOADED = "weights loaded, prefix cache not reset"
    WEIGHTS_READY = "weights ready, KV cache asleep"
    READY = "ready"
    STALE = "weights reloaded while awake, prefix cache not reset"


class LifecycleError(RuntimeError):
    """An engine call out of order (a bug in the caller, never a user error)."""


_HINTS = {
    ("generate", State.ASLEEP): "the engine is asleep: load weights and wake the KV cache first",
    ("generate", State.WEIGHTS_AWAKE): "generate between the weights wake and the KV-cache wake",
    (
        "generate",
        State.WEIGHTS_LOADED,
    ): "the prefix cache was not reset after the weight load, and the KV cache is asleep",
    ("generate", State.WEIGHTS_READY): "generate between the weights wake and the KV-cache wake",
    ("generate", State.STALE): "the prefix cache was not reset after the weight load",
    ("wake_kv", State.WEIGHTS_AWAKE): "the weights were woken but not loaded (a level-2 sleep leaves garbage)",
    ("wake_kv", State.WEIGHTS_LOADED): "the prefix cache was not reset after the weight load",
    ("wake_kv", State.ASLEEP): "wake and load the weights first",
    ("load", State.ASLEEP): "wake the weights first",
    ("wake_weights", State.READY): "the engine is awake already",
}

_LEVEL1_WAKE = "wake_weights_retained"


class Lifecycle:
    """Current state plus the legal transitions."""

    TRANSITIONS: dict[tuple[str, State], State] = {
        ("wake_weights", State.ASLEEP): State.WEIGHTS_AWAKE,
        (_LEVEL1_WAKE, State.ASLEEP): State.WEIGHTS_READY,
        ("load", State.WEIGHTS_AWAKE): State.WEIGHTS_LOADED,
        ("load", State.WEIGHTS_LOADED): State.WEIGHTS_LOADED,
        ("load", State.WEIGHTS_READY): State.WEIGHTS_LOADED,
        ("load", State.READY): State.STALE,
        ("load", State.STALE): State.STALE,
        ("reset_prefix", State.WEIGHTS_LOADED): State.WEIGHTS_READY,
        ("reset_prefix", State.WEIGHTS_READY): State.WEIGHTS_READY,
        ("reset_prefix", State.STALE): State.READY,
        ("reset_prefix", State.READY): State.READY,
        ("wake_kv", State.WEIGHTS_READY): State.READY,
        ("generate", State.READY): State.READY,
        **{("sleep", s): State.ASLEEP for s in State if s is not State.ASLEEP},
    }

    def __init__(self, state: State = State.ASLEEP):
        self.state = state
        self.weights_retained = False  # after a level-1 sleep the weights survive (CPU copy)

    def apply(self, event: str) -> State:
        if event == "wake_weights" and self.state is State.ASLEEP and self.weights_retained:
            event = _LEVEL1_WAKE
        nxt = self.TRANSITIONS.get((event, self.state))
        if nxt is None:
            hint = _HINTS.get((event, self.state), "not a legal transition")
            raise LifecycleError(f"rollout engine: {event!r} in state {self.state.name} ({self.state.value}): {hint}")
        self.state = nxt
        return nxt

    def sleep(self, level: int) -> None:
        self.apply("sleep")
        self.weights_retained = level == 1

    @property
    def holds_weights(self) -> bool:
        """Whether the engine's weights are valid (possibly asleep with a CPU copy)."""
        if self.state is State.ASLEEP:
            return self.weights_retained
        return self.state is not State.WEIGHTS_AWAKE
