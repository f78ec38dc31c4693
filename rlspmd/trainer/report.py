"""What a step and a run report: the step's metrics reduced over the trainer's DP ranks, validation accuracy, and the
run summary printed at the end.

``StepReport`` lives on the actor's ranks; in split placement the rollout-only ranks hold ``NoReport`` (their batches
are empty, their rollout metrics reach the step through ``rollout.sync_weights``).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh

from rlspmd.agent.loop import STOP_REASONS
from rlspmd.distributed.dispatch import all_gather_objects, gather_batch
from rlspmd.distributed.runtime import machine_info
from rlspmd.metrics import MetricBuffer
from rlspmd.protocol import Batch
from rlspmd.roles.rollout import truncated
from rlspmd.trainer.timing import StageProbe


class AgentMetrics:
    """Multi-turn rollouts (``rollout.agent``): per step, from the batch's per-sample agent fields (``agent/loop.py``),
    turns per sample, tool calls per sample (all, by tool, and the share of samples with one), tool errors and
    timeouts per sample, why conversations ended, the share of response tokens masked out of the loss, and the tools'
    own metrics (summed per sample, averaged over samples); in validation the tool-call rate, turns and user turns."""

    validation_fields = ("agent_tool_calls_BK", "agent_turns_B", "agent_user_turns_B")

    def __init__(self, *, tool_names: list[str], mesh: DeviceMesh):
        self.tool_names, self.mesh = tool_names, mesh

    def step(self, batch: Batch, m: MetricBuffer) -> None:
        n = len(batch)
        calls = batch["agent_tool_calls_BK"]
        m.mean("agent/turns", batch["agent_turns_B"].sum(), n)
        m.mean("agent/user_turns", batch["agent_user_turns_B"].sum(), n)
        m.mean("agent/tool_calls", calls.sum(), n)
        m.mean("agent/tool_call_rate", (calls.sum(-1) > 0).float().sum(), n)
        for k, name in enumerate(self.tool_names):
            m.mean(f"agent/tool_calls/{name}", calls[:, k].sum(), n)
        m.mean("agent/tool_errors", batch["agent_tool_errors_B"].sum(), n)
        m.mean("agent/tool_timeouts", batch["agent_tool_timeouts_B"].sum(), n)
        for reason in STOP_REASONS:
            m.mean(f"agent/stop/{reason}", sum(s == reason for s in batch["agent_stop"]), n)
        response = batch["response_mask_BR"].float()
        m.mean("agent/masked_token_share", (response - batch["loss_mask_BR"].float()).sum(), response.sum())
        # the tools' own metrics: every DP rank must record the same names, so agree on their union first
        mine = sorted({k for d in batch["agent_tool_metrics"] for k in d})
        for name in sorted({k for names in all_gather_objects(mine, mesh=self.mesh) for k in names}):
            m.mean(f"agent/tool_metrics/{name}", sum(d.get(name, 0.0) for d in batch["agent_tool_metrics"]), n)

    def validation(self, allv: Batch) -> dict[str, float]:
        calls = allv["agent_tool_calls_BK"]
        return {
            "val/agent/tool_call_rate": float((calls.sum(-1) > 0).float().mean()),
            "val/agent/tool_calls": float(calls.sum(-1).mean()),
            "val/agent/turns": float(allv["agent_turns_B"].mean()),
            "val/agent/user_turns": float(allv["agent_user_turns_B"].mean()),
        }


class NoAgentMetrics:
    """Single-turn rollouts: nothing to add."""

    validation_fields: tuple[str, ...] = ()

    def step(self, batch: Batch, m: MetricBuffer) -> None:
        pass

    def validation(self, allv: Batch) -> dict[str, float]:
        return {}


class StepReport:
    def __init__(
        self,
        *,
        mesh: DeviceMesh,
        eos_ids: list[int],
        max_response_length: int,
        components: tuple[tuple[str, str], ...],
        agent: AgentMetrics | NoAgentMetrics | None = None,
    ):
        """``components``: (batch field, metric name) of the reward's parts and shaping, reported as ``reward/<name>``.
        ``agent``: the multi-turn metrics (the builder decides; default none)."""
        self.mesh, self.eos_ids, self.max_response_length = mesh, eos_ids, max_response_length
        self.components = components
        self.agent = agent or NoAgentMetrics()
        self._val: list[Batch] = []

    def step(self, batch: Batch, m: MetricBuffer, probe: StageProbe) -> dict[str, float]:
        """The step's metrics: the stages' buffer ``m`` plus what the final batch shows, reduced over the DP ranks, and
        the stages' seconds and peak memory (max over ranks)."""
        scores, mask = batch["scores_B"], batch["response_mask_BR"].float()
        # the tokens the update trains on: the model's own, less what a rollout correction rejected
        loss_mask = batch["loss_mask_BR"].float()
        n = len(batch)
        m.mean("reward/mean", scores.sum(), n)
        m.mean("reward/sq", scores.pow(2).sum(), n)
        m.mean("acc/mean", (batch["task_scores_B"] >= 1.0).float().sum(), n)
        for key, name in self.components:
            m.mean(f"reward/{name}", batch[key].sum(), n)
        lengths = mask.sum(-1)
        m.mean("response_length/mean", lengths.sum(), n)
        m.max("response_length/max", lengths.max())
        clipped = truncated(
            batch["responses_BR"], lengths, eos_ids=self.eos_ids, max_response_length=self.max_response_length
        )
        m.mean("response_length/clip_ratio", clipped.float().sum(), n)
        adv, valid = batch["advantages_BR"], loss_mask > 0
        m.mean("adv/mean", (adv * loss_mask).sum(), loss_mask.sum())
        m.max("adv/max", torch.where(valid, adv, -torch.inf).max())
        m.min("adv/min", torch.where(valid, adv, torch.inf).min())
        m.sum("tokens/response", mask.sum())
        self.agent.step(batch, m)
        m.sum("tokens/total", batch["attention_mask_BL"].sum())
        for k, v in probe.metrics().items():
            m.max(k, v)
        out = m.reduce(mesh=self.mesh)
        out["reward/std"] = max(0.0, out.pop("reward/sq") - out["reward/mean"] ** 2) ** 0.5
        out["throughput/tokens_per_s"] = out["tokens/total"] / out["timing/step"]
        # generation throughput counts the model's tokens only (not tool results spliced into a multi-turn response),
        # over the engine's time when the trainer did not wait for it (asynchronous RL: the batch was generated during
        # the previous step and ``gen`` is only its hand-over)
        out["throughput/gen_tokens_per_s"] = out["tokens/generated"] / max(
            out["timing/gen"], out["timing/rollout/gen"], 1e-9
        )
        return out

    def sampled(self, batch: Batch, m: MetricBuffer) -> None:
        """A generation round's samples as they come from the rollout, before anything drops tokens or samples (the
        rollout correction's rejection edits ``loss_mask_BR``, dynamic sampling drops groups): ``tokens/generated``
        counts the tokens the model sampled (``loss_mask_BR`` as generated: every response position in single turn,
        not the tool results and template glue of an agent's response), so the generation throughput counts what
        generation did."""
        m.sum("tokens/generated", batch["loss_mask_BR"].sum())

    def add_validation(self, scored: Batch, n_pad: int) -> None:
        """One validation round's scored samples (``n_pad`` padding rows at the global end), gathered to rank 0."""
        slim = Batch(
            {
                "scores_B": scored["scores_B"].cpu(),
                "task_scores_B": scored["task_scores_B"].cpu(),
                **{k: scored[k].cpu() for k in self.agent.validation_fields},
            },
            {"data_source": scored["data_source"]},
        )
        gathered = gather_batch(slim, mesh=self.mesh)
        if gathered is not None:
            self._val.append(gathered.slice(0, len(gathered) - n_pad))

    def validation(self) -> dict[str, float]:
        """Accuracy overall and per data_source on rank 0 (empty elsewhere); starts the next validation."""
        results, self._val = self._val, []
        if not results:
            return {}
        allv = Batch.concat(results)
        scores, task = allv["scores_B"], allv["task_scores_B"]
        metrics = {
            "val/acc": float((task >= 1.0).float().mean()),
            "val/reward": float(scores.mean()),
            **self.agent.validation(allv),
        }
        sources = allv["data_source"]
        for src in sorted(set(sources)):
            sel = torch.tensor([s == src for s in sources])
            metrics[f"val/acc/{src}"] = float((task[sel] >= 1.0).float().mean())
        return metrics


class NoReport:
    """Rollout-only ranks of a split placement: nothing of their own to report."""

    def step(self, batch: Batch, m: MetricBuffer, probe: StageProbe) -> dict[str, float]:
        return {}

    def sampled(self, batch: Batch, m: MetricBuffer) -> None:
        pass

    def add_validation(self, scored: Batch, n_pad: int) -> None:
        pass

    def validation(self) -> dict[str, float]:
        return {}


class RunSummary:
    """What a run did, for the end of the log and ``summary.json``: validation first -> last, step-time breakdown."""

    def __init__(self):
        self.t0 = time.time()
        self.val: list[tuple[int, float]] = []
        self.tool_calls: list[tuple[int, float]] = []  # greedy validation tool-call rate (rollout.agent runs)
        self.timings: list[dict[str, float]] = []
        self.tokens: list[tuple[float, float]] = []  # (generated tokens, all tokens) per step
        self.last: dict[str, float] = {}

    def add(self, step: int, metrics: dict[str, float]) -> None:
        if "val/acc" in metrics:
            self.val.append((step, metrics["val/acc"]))
        if "val/agent/tool_call_rate" in metrics:
            self.tool_calls.append((step, metrics["val/agent/tool_call_rate"]))
        t = {k.removeprefix("timing/"): v for k, v in metrics.items() if k.startswith("timing/")}
        if t:
            self.timings.append(t)
            self.tokens.append((metrics.get("tokens/generated", 0.0), metrics.get("tokens/total", 0.0)))
        self.last = metrics

    def as_dict(self) -> dict:
        steady = self.timings[1:] or self.timings  # the first step pays one-off warm-up costs
        mean = {k: sum(t.get(k, 0.0) for t in steady) / len(steady) for k in (steady[0] if steady else {})}
        out = {"wall_s": time.time() - self.t0, "steps": len(self.timings), "val_acc": self.val, "mean_step_s": mean}
        if self.tool_calls:
            out["val_tool_call_rate"] = self.tool_calls
        if steady:
            first = 1 if len(self.timings) > 1 else 0
            tokens = self.tokens[first:]
            gen_s = sum(max(t.get("gen", 0.0), t.get("rollout/gen", 0.0)) for t in steady)  # as the step's throughput
            step_s = sum(t.get("step", 0.0) for t in steady)
            out["sec_per_step"] = statistics.median(t.get("step", 0.0) for t in steady)  # median after the first step
            out["gen_tokens_per_sec"] = sum(r for r, _ in tokens) / gen_s if gen_s > 0 else 0.0
            out["tokens_per_sec"] = sum(a for _, a in tokens) / step_s if step_s > 0 else 0.0
        return out

    def text(self) -> str:
        d = self.as_dict()
        lines = [f"done: {d['steps']} steps in {d['wall_s']:.0f} s"]
        if len(self.val) >= 2:
            (s0, a0), (s1, a1) = self.val[0], self.val[-1]
            lines.append(
                f"validation accuracy: {a0:.3f} (step {s0}) -> {a1:.3f} (step {s1}), {100 * (a1 - a0):+.1f} points"
            )
        if len(self.tool_calls) >= 2:
            (s0, r0), (s1, r1) = self.tool_calls[0], self.tool_calls[-1]
            lines.append(
                f"greedy tool-call rate: {r0:.3f} (step {s0}) -> {r1:.3f} (step {s1}), {100 * (r1 - r0):+.1f} points"
            )
        if d["mean_step_s"]:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in d["mean_step_s"].items() if k != "step" and v >= 0.005)
            lines.append(f"seconds per step (mean after the first): {d['mean_step_s'].get('step', 0):.2f} = {parts}")
        return "\n".join(lines)

    def write(self, output_dir: str) -> None:
        (Path(output_dir) / "summary.json").write_text(json.dumps(self.as_dict(), indent=2))

    def json_line(self) -> str:
        return json.dumps({"summary": self.as_dict(), "machine": machine_info()})
