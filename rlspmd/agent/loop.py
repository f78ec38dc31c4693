"""The agent loop: each sample is a conversation, generated request by request.

    generate a turn -> parse its tool calls -> run them (threads, per-call timeout) -> append the results as a
    ``tool`` message (token delta, ``agent/chat.py``) -> generate the next turn ... until the model answers without
    a call (then an optional interaction may reply and the conversation goes on), ``max_turns`` assistant turns, or
    ``max_response_length`` tokens in all.

``AgentLoop.run`` hands the engine a ``Session`` (the ``RequestSource`` of ``rollout/continuous.py``): the engine
pulls ready requests between decode steps and reports each finished turn; the turn's tool calls start on a thread at
once and the engine goes on decoding the other conversations. A conversation whose tools returned is ready again and
joins the running batch at the next step. Tool calls of one turn run in order (they share the conversation's tool
state); different conversations' calls run concurrently, at most ``max_parallel_tools`` at a time.

Nothing the model writes raises: a malformed call (bad JSON, unknown tool, arguments that do not fit the schema) is an
error message to the model; a tool that raises, returns garbage or runs past ``tool_timeout_s`` is the same (a timed-out
call's thread is abandoned: Python cannot kill it, the sandboxed code runner kills its own process). All are counted.

Layout of a conversation in the batch (``rlspmd/protocol.py``): ``responses_BR`` is every token after the prompt, the
model's and the appended ones; ``loss_mask_BR`` is 1 exactly on the model's tokens; ``rollout_logprobs_BR`` holds the
engine's log-probs there (0 elsewhere). Per sample: ``agent_turns_B``, ``agent_user_turns_B``,
``agent_tool_calls_BK`` (column k: calls dispatched to tool k), ``agent_tool_errors_B``, ``agent_tool_timeouts_B``,
``agent_rewards_B`` (tool reward deltas + the tools' final-state scores + interaction rewards); ``agent_stop`` (why the
conversation ended: ``STOP_REASONS``) and ``agent_tool_metrics`` (the tools' metrics, summed) as objects.

Per row, as in verl: ``agent_name`` (a column; ``rollout.agent.default_agent_loop`` without one) is ``tool_agent``
(the conversation above) or ``single_turn_agent`` (one response: no call is run, no interaction replies, no tool
state is created); ``extra_info.interaction_kwargs.name`` picks the row's interaction among the run's;
``extra_info.tools_kwargs[tool].create_kwargs`` reach the tool's ``create``. ``check_rows`` checks these columns
against the run at start-up, naming the file and the row.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from rlspmd.agent.chat import ChatRenderer
from rlspmd.agent.interaction import InteractionSample
from rlspmd.agent.parser import ParseError, ToolCall
from rlspmd.agent.tools import ToolSample, check_arguments
from rlspmd.agent.config import AgentConfig
from rlspmd.metrics import MetricBuffer
from rlspmd.models.vision import ImageInputs
from rlspmd.protocol import Batch
from rlspmd.rollout.base import RolloutEngine, assemble_rollout
from rlspmd.rollout.continuous import Request
from rlspmd.rollout.sampling import SamplingParams

STOP_REASONS = ("answer", "max_turns", "length", "interaction_error")
AGENT_LOOPS = ("tool_agent", "single_turn_agent")
"""verl's agent names a row's ``agent_name`` may carry."""


@dataclass
class _Call:
    call: ToolCall | ParseError
    tool: Any = None
    status: str | None = None
    """None while pending; ``ok``, ``error`` or ``timeout``."""
    text: str = ""
    reward: float = 0.0
    metrics: dict = field(default_factory=dict)


@dataclass
class _Turn:
    calls: list[_Call]
    current: int = -1
    started: float | None = None
    """When the running call started (None while none runs)."""
    expired: bool = False


@dataclass
class _Conversation:
    index: int
    prompt_ids: list[int]
    seed: int
    messages: list[dict]
    tool_states: dict
    interaction: Any
    """The row's interaction (None: none)."""
    interaction_state: Any
    single_turn: bool = False
    """``agent_name=single_turn_agent``: one response, no tools run, no interaction."""
    response: list[int] = field(default_factory=list)
    loss: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    generated: int = 0
    turns: int = 0
    user_turns: int = 0
    calls_by_tool: list[int] = field(default_factory=list)
    errors: int = 0
    timeouts: int = 0
    reward: float = 0.0
    tool_metrics: dict = field(default_factory=dict)
    stop: str | None = None
    stop_text: str | None = None
    images: ImageInputs | None = None
    """The prompt's images (a vision-language model): every turn's request carries them."""

    def append(self, ids: list[int], *, model: bool, logprobs: list[float] | None = None) -> None:
        self.response += ids
        self.loss += [int(model)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


class AgentLoop:
    def __init__(
        self,
        cfg: AgentConfig,
        *,
        tools: list,
        parser,
        interactions: dict,
        renderer: ChatRenderer,
        tokenizer,
        eos_ids: list[int],
        pad_id: int,
        max_response_length: int,
    ):
        """``tools``, ``parser``, ``interactions`` (by name): built and checked by ``build_agent_loop``."""
        self.cfg, self.tools, self.parser, self.interactions = cfg, tools, parser, interactions
        self.by_name = {t.name: k for k, t in enumerate(tools)}
        self.renderer, self.tokenizer = renderer, tokenizer
        self.tool_schemas = renderer.tools
        """What the chat template's ``tools`` argument receives when prompts are rendered."""
        self.tool_names = [t.name for t in tools]
        self.eos_ids, self.pad_id, self.max_response_length = list(eos_ids), pad_id, max_response_length

    def run(
        self,
        engine: RolloutEngine,
        prompts: Batch,
        params: SamplingParams,
        generator: torch.Generator | None,
        metrics: MetricBuffer,
    ) -> Batch:
        """``params.n`` conversations per prompt on ``engine.serve``. ``metrics`` gets the step statistics
        (``declare``): tool-call seconds and calls run (summed over ranks), and the seconds the engine sat idle waiting
        for tools (``timing/rollout/tool_wait``, max over ranks)."""
        batch = prompts.repeat(params.n) if params.n > 1 else prompts
        seeds = (
            torch.randint(0, 2**62, (len(batch),), generator=generator, device=generator.device).tolist()
            if generator is not None
            else [0] * len(batch)
        )
        convs = [self._start(batch, i, seeds[i]) for i in range(len(batch))]
        session = Session(self, convs)
        engine.serve(
            session, params, max_len=batch["prompts_BP"].shape[1] + self.max_response_length, max_requests=len(convs)
        )
        assert all(c.stop is not None for c in convs), "the engine returned before every conversation ended"
        metrics.sum("agent/tool_call_seconds", session.call_seconds)
        metrics.sum("agent/tool_calls_run", session.calls_run)
        metrics.max("timing/rollout/tool_wait", session.wait_seconds)
        return self._assemble(batch, convs)

    def declare(self, metrics: MetricBuffer) -> None:
        metrics.sum("agent/tool_call_seconds", 0.0)
        metrics.sum("agent/tool_calls_run", 0.0)
        metrics.max("timing/rollout/tool_wait", 0.0)

    def agent_name(self, batch: Batch, i: int) -> str:
        name = batch["agent_name"][i] if "agent_name" in batch else None
        return name or self.cfg.default_agent_loop

    def interaction_for(self, kwargs: dict) -> str | None:
        """The name of the interaction a row's ``interaction_kwargs`` choose (None: the run has none); ``ValueError``
        for a row that names none of the run's, or none where the run has several (``check_rows`` says which row)."""
        if not self.interactions:
            return None
        name = kwargs.get("name")
        if name is None and len(self.interactions) == 1:
            return next(iter(self.interactions))
        if name not in self.interactions:
            why = "has no name and the run has several" if name is None else f"name={name!r} is not one of the run's"
            raise ValueError(
                f"extra_info.interaction_kwargs {why}: {sorted(self.interactions)} (rollout.agent.interaction"
                "/interaction_config_path)"
            )
        return name

    def _start(self, batch: Batch, i: int, seed: int) -> _Conversation:
        mask = batch["prompt_mask_BP"][i].bool()
        info = batch["extra_info"][i] or {}
        conv = _Conversation(
            index=i,
            prompt_ids=batch["prompts_BP"][i][mask].tolist(),
            seed=seed,
            messages=list(batch["prompt_messages"][i]),
            tool_states={},
            interaction=None,
            interaction_state=None,
            calls_by_tool=[0] * len(self.tools),
            images=batch["images"][i] if "images" in batch else None,
        )
        if self.agent_name(batch, i) == "single_turn_agent":
            conv.single_turn = True
            return conv
        tools_kwargs = info.get("tools_kwargs") or {}
        states = conv.tool_states
        for tool in self.tools:
            create_kwargs = (tools_kwargs.get(tool.name) or {}).get("create_kwargs") or {}
            sample = ToolSample(
                ground_truth=batch["ground_truth"][i],
                data_source=batch["data_source"][i],
                extra_info=info,
                create_kwargs=dict(create_kwargs),
            )
            try:
                states[tool.name] = tool.create(sample)
            except Exception as e:  # noqa: BLE001 - a row the tool cannot start from is a data problem: name it
                raise ValueError(
                    f"rollout.agent.tools: {tool.name}.create failed on the sample with extra_info.index="
                    f"{info.get('index')} (data_source={batch['data_source'][i]!r}): {type(e).__name__}: {e}"
                ) from e
        kwargs = dict(info.get("interaction_kwargs") or {})
        name = self.interaction_for(kwargs)
        if name is not None:
            sample = InteractionSample(
                ground_truth=batch["ground_truth"][i],
                data_source=batch["data_source"][i],
                extra_info=info,
                kwargs=kwargs,
            )
            conv.interaction = self.interactions[name]
            conv.interaction_state = conv.interaction.start(sample)
        return conv

    def request(self, conv: _Conversation) -> Request:
        return Request(
            key=conv.index,
            ids=conv.prompt_ids + conv.response,
            max_new_tokens=self.max_response_length - len(conv.response),
            seed=conv.seed,
            counter=conv.generated,
            images=conv.images,
            prompt_len=len(conv.prompt_ids),
        )

    def _assemble(self, batch: Batch, convs: list[_Conversation]) -> Batch:
        B, K = len(convs), len(self.tools)
        R = max([len(c.response) for c in convs] + [1])
        dev = batch["prompts_BP"].device
        tokens = torch.full((B, R), self.pad_id, dtype=torch.long)
        loss = torch.zeros(B, R, dtype=torch.long)
        logprobs = torch.zeros(B, R, dtype=torch.float32)
        for c in convs:
            n = len(c.response)
            tokens[c.index, :n] = torch.tensor(c.response, dtype=torch.long)
            loss[c.index, :n] = torch.tensor(c.loss, dtype=torch.long)
            logprobs[c.index, :n] = torch.tensor(c.logprobs, dtype=torch.float32)
        for c in convs:  # the conversation is over: final-state scores, then the tools and the interaction let go
            for tool in self.tools if not c.single_turn else ():
                state = c.tool_states[tool.name]
                try:
                    score = float(tool.score(state))
                    c.reward += score if math.isfinite(score) else 0.0
                    c.errors += not math.isfinite(score)
                    tool.release(state)
                except Exception:  # noqa: BLE001 - a tool failing here is counted like any tool error
                    c.errors += 1
            if c.interaction is not None:
                try:
                    c.interaction.finish(c.interaction_state)
                except Exception:  # noqa: BLE001
                    c.errors += 1
        lengths = torch.tensor([len(c.response) for c in convs], dtype=torch.long)
        out = assemble_rollout(
            batch, tokens.to(dev), lengths.to(dev), logprobs.to(dev), pad_id=self.pad_id, loss_mask_BR=loss.to(dev)
        )

        def col(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=dev)

        return out.set(
            agent_turns_B=col([c.turns for c in convs]),
            agent_user_turns_B=col([c.user_turns for c in convs]),
            agent_tool_calls_BK=col([c.calls_by_tool for c in convs]).reshape(B, K),
            agent_tool_errors_B=col([c.errors for c in convs]),
            agent_tool_timeouts_B=col([c.timeouts for c in convs]),
            agent_rewards_B=col([c.reward for c in convs]),
            agent_stop=[c.stop for c in convs],
            agent_tool_metrics=[c.tool_metrics for c in convs],
        )


class Session:
    """One ``AgentLoop.run``: the engine's ``RequestSource``. ``take`` and ``finish`` run on the engine's thread; tool
    calls on worker threads, which only hand their results back (under ``lock``) and signal ``settled``."""

    def __init__(self, loop: AgentLoop, convs: list[_Conversation]):
        self.loop, self.convs, self.cfg = loop, convs, loop.cfg
        self.ready: deque[Request] = deque(loop.request(c) for c in convs)
        self.waiting: dict[int, _Turn] = {}
        self.settled: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.slots = threading.Semaphore(max(1, self.cfg.max_parallel_tools))
        self.eos = set(loop.eos_ids)
        self.call_seconds = self.wait_seconds = 0.0
        self.calls_run = 0

    # -- the engine's side -------------------------------------------------------------------------------------------

    def take(self, *, block: bool) -> list[Request]:
        t0 = time.perf_counter()
        while True:
            self._expire()
            try:
                while True:
                    self._resume(self.settled.get_nowait())
            except queue.Empty:
                pass
            if self.ready or not block or not self.waiting:
                break
            try:  # idle engine: wait for a turn to settle, or for the next timeout to pass
                self._resume(self.settled.get(timeout=self._next_deadline()))
            except queue.Empty:
                pass
        if block:
            self.wait_seconds += time.perf_counter() - t0
        out = list(self.ready)
        self.ready.clear()
        return out

    def finish(self, key: int, tokens: list[int], logprobs: list[float]) -> None:
        loop, conv = self.loop, self.convs[key]
        conv.turns += 1
        conv.generated += len(tokens)
        conv.append(tokens, model=True, logprobs=logprobs)
        stopped = bool(tokens) and tokens[-1] in self.eos
        conv.stop_text = loop.tokenizer.decode(tokens[-1:]) if stopped else None
        text = loop.tokenizer.decode(tokens, skip_special_tokens=True)
        conv.messages.append({"role": "assistant", "content": text})
        if not stopped or len(conv.response) >= loop.max_response_length:
            return self._end(conv, "length")
        if conv.single_turn:
            return self._end(conv, "answer")
        calls = loop.parser.parse(text) if loop.tools else []
        if calls:
            if conv.turns >= self.cfg.max_turns:
                return self._end(conv, "max_turns")
            return self._dispatch(conv, calls)
        if conv.interaction is None or conv.user_turns >= self.cfg.max_user_turns or conv.turns >= self.cfg.max_turns:
            return self._end(conv, "answer")
        try:
            done, reply, reward = conv.interaction.respond(conv.interaction_state, conv.messages)
            reward = float(reward)
        except Exception:  # noqa: BLE001 - counted, never raised
            conv.errors += 1
            return self._end(conv, "interaction_error")
        conv.reward += reward if math.isfinite(reward) else 0.0
        if done:
            return self._end(conv, "answer")
        conv.user_turns += 1
        self._append(conv, [{"role": "user", "content": str(reply)}])

    # -- conversations -----------------------------------------------------------------------------------------------

    def _end(self, conv: _Conversation, reason: str) -> None:
        conv.stop = reason

    def _append(self, conv: _Conversation, messages: list[dict]) -> None:
        """Append messages as the token delta and queue the next turn, if the budget leaves room for one."""
        delta = self.loop.renderer.delta_ids(messages, stop_text=conv.stop_text)
        conv.messages += messages
        if len(conv.response) + len(delta) >= self.loop.max_response_length:
            return self._end(conv, "length")
        conv.append(delta, model=False)
        self.ready.append(self.loop.request(conv))

    def _dispatch(self, conv: _Conversation, parsed: list[ToolCall | ParseError]) -> None:
        calls = []
        for p in parsed:
            c = _Call(p)
            if isinstance(p, ParseError):
                c.status, c.text = "error", f"Error: {p.message}"
            elif p.name not in self.loop.by_name:
                c.status, c.text = "error", f"Error: unknown tool {p.name!r}; available: {sorted(self.loop.by_name)}"
            else:
                c.tool = self.loop.tools[self.loop.by_name[p.name]]
                problem = check_arguments(c.tool.schema, p.arguments)
                if problem is not None:
                    c.status, c.text = "error", f"Error: {p.name}: {problem}"
                else:
                    conv.calls_by_tool[self.loop.by_name[p.name]] += 1
            calls.append(c)
        turn = _Turn(calls)
        self.waiting[conv.index] = turn
        if all(c.status is not None for c in calls):
            self.settled.put(conv.index)
        else:
            threading.Thread(target=self._run_turn, args=(conv, turn), daemon=True).start()

    def _resume(self, index: int) -> None:
        conv = self.convs[index]
        turn = self.waiting.pop(index)
        limit = self.cfg.max_tool_response_chars
        for c in turn.calls:
            conv.errors += c.status == "error"
            conv.timeouts += c.status == "timeout"
            conv.reward += c.reward
            for k, v in c.metrics.items():
                conv.tool_metrics[k] = conv.tool_metrics.get(k, 0.0) + v
        messages = [
            {"role": "tool", "content": c.text if len(c.text) <= limit else c.text[:limit] + " [truncated]"}
            for c in turn.calls
        ]
        self._append(conv, messages)

    # -- tool threads ------------------------------------------------------------------------------------------------

    def _run_turn(self, conv: _Conversation, turn: _Turn) -> None:
        """A conversation's calls of one turn, in order, on a worker thread."""
        for j, c in enumerate(turn.calls):
            if c.status is not None:
                continue
            with self.slots:
                with self.lock:
                    if turn.expired:
                        return
                    turn.current, turn.started = j, time.perf_counter()
                result = self._call(c, conv.tool_states[c.tool.name])
                with self.lock:
                    if turn.expired:
                        return
                    c.status, c.text, c.reward, c.metrics = result
                    self.call_seconds += time.perf_counter() - turn.started
                    self.calls_run += 1
                    turn.started = None
        self.settled.put(conv.index)

    @staticmethod
    def _call(c: _Call, state) -> tuple[str, str, float, dict]:
        try:
            text, reward, metrics = c.tool.call(state, c.call.arguments)
            reward = float(reward)
            metrics = {str(k): float(v) for k, v in (metrics or {}).items()}
            if not math.isfinite(reward):
                raise ValueError(f"reward_delta {reward} is not finite")
        except Exception as e:  # noqa: BLE001 - a failing tool is an error message to the model
            return "error", f"Error: {c.tool.name} failed: {type(e).__name__}: {e}", 0.0, {}
        return "ok", str(text), reward, metrics

    def _expire(self) -> None:
        """Calls running past the timeout: the call times out, the turn's later calls are not run, the turn settles."""
        now, timeout = time.perf_counter(), self.cfg.tool_timeout_s
        with self.lock:
            for index, turn in self.waiting.items():
                if turn.expired or turn.started is None or now - turn.started < timeout:
                    continue
                turn.expired = True
                for j, c in enumerate(turn.calls):
                    if c.status is None:
                        late = j == turn.current
                        c.status = "timeout" if late else "error"
                        c.text = (
                            f"Error: {c.tool.name} timed out after {timeout:g} s"
                            if late
                            else "Error: not run (an earlier call of this turn timed out)"
                        )
                self.call_seconds += now - turn.started
                self.calls_run += 1
                self.settled.put(index)

    def _next_deadline(self) -> float:
        now = time.perf_counter()
        with self.lock:
            starts = [t.started for t in self.waiting.values() if t.started is not None and not t.expired]
        if not starts:
            return 0.05  # calls still queued for a worker slot
        return max(0.001, min(starts) + self.cfg.tool_timeout_s - now)


def check_rows(rows: list[dict], *, loop: AgentLoop | None, field_name: str) -> None:
    """The data's agent columns against the run (``loop``: None for single-turn runs), at start-up: ``ValueError``
    naming the file and the row for what the run cannot honour. ``rows``: ``PromptDataset.rows`` (``where``: file and
    row; ``agent_name``; ``extra_info``)."""
    tools = {t.name for t in loop.tools} if loop is not None else set()
    for row in rows:
        path, i = row["where"]
        where = f"{field_name}: {path} row {i}"
        info = row["extra_info"] or {}
        name = row.get("agent_name")
        if name is not None and name not in AGENT_LOOPS:
            raise ValueError(f"{where}: agent_name={name!r}; rlspmd runs {list(AGENT_LOOPS)}")
        if loop is None:
            if name == "tool_agent" or info.get("need_tools_kwargs"):
                what = "agent_name='tool_agent'" if name == "tool_agent" else "extra_info.need_tools_kwargs=True"
                raise ValueError(
                    f"{where}: {what} but the run has no rollout.agent (set rollout.agent.tools or "
                    "tool_config_path, or drop the column)"
                )
            continue
        if (name or loop.cfg.default_agent_loop) == "single_turn_agent":
            continue
        tools_kwargs = {k: v for k, v in (info.get("tools_kwargs") or {}).items() if v is not None}  # parquet: None
        if info.get("need_tools_kwargs") and not tools_kwargs:
            raise ValueError(f"{where}: extra_info.need_tools_kwargs=True but extra_info.tools_kwargs is empty")
        for tool, kw in tools_kwargs.items():
            if tool not in tools:
                raise ValueError(
                    f"{where}: extra_info.tools_kwargs names the tool {tool!r}, which the run does not have "
                    f"(its tools: {sorted(tools)})"
                )
            unread = sorted(k for k, v in (kw or {}).items() if k != "create_kwargs" and v)
            if unread:
                raise ValueError(
                    f"{where}: extra_info.tools_kwargs[{tool!r}] sets {unread}; rlspmd passes only "
                    "create_kwargs (to the tool's create)"
                )
        try:
            loop.interaction_for(dict(info.get("interaction_kwargs") or {}))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
