"""The RL loop. ``RLTrainer.step`` is the data flow of one step, one line per stage:

    prompts (rank 0 samples them, scatter to the DP ranks)
      -> rollout.generate      n samples per prompt, on this rank
      -> reward.score          rule functions / user function / reward model, same rank
      -> shaping               DAPO overlong penalty (no-op when off)
      -> baseline              ReMax's greedy response, scored (no-op for other estimators)
         (dynamic sampling repeats the lines above until enough groups carry signal)
      -> ref.log_prob          frozen reference (no-op without a KL term)
      -> actor.log_prob        old log-probs of the behaviour policy
      -> critic.values         PPO only (no-op otherwise)
      -> token rewards         score on the last token, minus the KL penalty when it is in the reward
      -> advantages            pure functions in rlspmd.algorithms
      -> balance               move samples between DP ranks to even out tokens (within each mini-batch)
      -> critic.update, actor.update   (the actor waits for critic.warmup_steps)
      -> rollout.sync_weights  actor -> rollout
      -> metrics               reduced over ranks, logged by rank 0

A prompt's samples are generated, scored and trained on one DP rank, so group statistics are local and
only scalars cross ranks. Rank 0 decides (which prompts, when to validate, when dynamic sampling has enough)
and broadcasts.

``fit`` adds what a long run needs around the step: resume from a checkpoint, the NaN policy, periodic and
final checkpoints, and a clean stop (checkpoint, then exit) when any rank got SIGTERM/SIGUSR1.

Placement (``build_program``): colocated, every rank runs this trainer. Split (the rollout on ranks of its own),
the actor's ranks run this trainer, whose collectives use the actor's meshes, never the whole world, and the
rollout-only ranks run ``RolloutWorker.fit``, which serves the trainer's rollout calls (``roles/rollout.py``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

from rlspmd.config import Config, ignored_settings
from rlspmd.data.prompts import EpochSampler, PromptDataset
from rlspmd.distributed.dispatch import MetricBuffer, balance_batch, broadcast_object, gather_batch, on_main, scatter_batch
from rlspmd.distributed.mesh import DP, FOLLOWERS, ParallelDims, RoleMeshes
from rlspmd.distributed.runtime import Runtime, StopRequest, machine_info
from rlspmd.engines.fsdp import compute_dtype
from rlspmd.models.loader import eos_token_ids, load_tokenizer
from rlspmd.protocol import Batch
from rlspmd.rewards import RewardManager
from rlspmd.rewards.shaping import NoShaping, OverlongShaping
from rlspmd.roles.critic import Critic, NoCritic
from rlspmd.roles.policy import NoReference, Policy, Reference
from rlspmd.roles.reward_model import NoRewardModel, RewardModel
from rlspmd.roles.rollout import build_rollout
from rlspmd.trainer.advantage import NEEDS_CRITIC, NEEDS_GREEDY_BASELINE, AdvantageStage, build_token_rewards
from rlspmd.trainer.checkpoint import Checkpointer, RNGState, TrainerState, copy_model_files, hf_state_dict, write_hf_dir
from rlspmd.trainer.logger import MetricLogger
from rlspmd.trainer.sampling import DynamicSampling, GreedyBaseline, NoBaseline, SingleRound


class StageTimer:
    """Seconds spent per stage of one step. Entering a stage also publishes it (with ``step``, when given) to this
    rank's ``Progress``, so that the hang monitor can name the rank and stage that holds the job up."""

    def __init__(self, step: int | None = None):
        from rlspmd.distributed.progress import progress

        self.seconds: dict[str, float] = {}
        self.step, self.progress = step, progress

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        with self.progress.stage(name, step=self.step):
            yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


def check_placement(dims: ParallelDims, *, engine: str) -> None:
    """The placements the RL trainer runs: reference, critic and reward model on the actor's ranks (which include
    rank 0); the rollout on the same ranks (colocated) or on ranks of its own (split); no idle ranks."""
    actor = dims.role_ranks["actor"]
    for role in FOLLOWERS:
        if dims.role_ranks[role] != actor:
            raise ValueError(f"mesh.{role}_ranks: the RL trainer runs the {role} on the actor's ranks {actor}; set it to 'actor'")
    if 0 not in actor:
        raise ValueError(f"mesh.actor_ranks must include rank 0 (it reads the data and logs); got {actor}")
    rollout = dims.role_ranks["rollout"]
    split = dims.disjoint("actor", "rollout")
    if rollout != actor and not split:
        raise ValueError(
            f"mesh.rollout_ranks={rollout} must equal the actor's ranks {actor} (colocated) or share none with them (split)"
        )
    idle = sorted(set(range(dims.world_size)) - set(actor) - set(rollout))
    if idle:
        raise ValueError(f"ranks {idle} host no role: extend mesh.actor_ranks or mesh.rollout_ranks")
    if split and engine == "vllm":
        raise ValueError(
            "rollout.engine=vllm runs colocated only: vLLM's external_launcher mode builds its process groups over the "
            "whole torch world, so every rank must host an engine. Use rollout.engine=native for split placement"
        )


def build_program(cfg: Config, rt: Runtime, meshes: RoleMeshes):
    """What this rank runs: the trainer (actor ranks), or, in split placement, the rollout worker."""
    check_placement(meshes.dims, engine=cfg.rollout.engine)
    if meshes.hosts("actor"):
        return RLTrainer(cfg, rt, meshes)
    # A stop signal is the actor side's to act on (checkpoint, then close the rollout): here it is only recorded,
    # so this rank keeps serving until the actor side's stop command instead of dying first.
    StopRequest().install()
    model = cfg.actor.model
    tokenizer = load_tokenizer(model.tokenizer_path or model.path, field_name="actor.model.tokenizer_path")
    return build_rollout(
        cfg.rollout, meshes=meshes, policy=None, model_path=model.path, compute_dtype=compute_dtype(cfg.actor.fsdp, rt.device),
        eos_ids=eos_token_ids(model.path, tokenizer), pad_id=tokenizer.pad_token_id, device=rt.device, seed=cfg.trainer.seed,
        max_prompt_length=cfg.data.max_prompt_length,
    )


class RLTrainer:
    def __init__(self, cfg: Config, rt: Runtime, meshes: RoleMeshes):
        self.cfg, self.rt = cfg, rt
        if not 0 <= cfg.trainer.stop_at_step <= cfg.trainer.total_steps:
            raise ValueError(f"trainer.stop_at_step={cfg.trainer.stop_at_step} must be in [0, trainer.total_steps={cfg.trainer.total_steps}]")
        # The trainer's collectives run on the actor's mesh: in split placement the rollout ranks are elsewhere.
        self.dp_mesh = meshes.get("actor", DP)
        # Checkpoint directory and resume target first: a bad one fails in seconds, before models load.
        self.checkpointer = Checkpointer(cfg.checkpoint, output_dir=cfg.trainer.output_dir, rank=rt.rank,
                                         world_size=self.dp_mesh.size(), mesh=self.dp_mesh)
        self.resume_from = self.checkpointer.prepare()
        self.last_checkpoint: Path | None = None
        self.stop_request = StopRequest().install()
        dp = self.dp_mesh.size()
        if cfg.data.train_batch_size % dp:
            raise ValueError(f"data.train_batch_size={cfg.data.train_batch_size} does not split over {dp} DP ranks")
        model_path = cfg.actor.model.path
        self.tokenizer = load_tokenizer(
            cfg.actor.model.tokenizer_path or model_path,
            field_name="actor.model.tokenizer_path" if cfg.actor.model.tokenizer_path else "actor.model.path",
        )
        alg, n = cfg.algorithm, cfg.rollout.n
        self.sampling = (
            DynamicSampling(alg.filter_groups, mesh=self.dp_mesh, train_batch_size=cfg.data.train_batch_size,
                            samples_per_prompt=n, pad_id=self.tokenizer.pad_token_id)
            if alg.filter_groups.enable
            else SingleRound(train_batch_size=cfg.data.train_batch_size)
        )
        self.train_data = self.val_data = self.sampler = None
        if rt.is_main:  # rank 0 reads the data and decides each step's prompts
            d = cfg.data
            kw = dict(prompt_key=d.prompt_key, max_prompt_length=d.max_prompt_length, overlong=d.overlong_prompts)
            self.train_data = PromptDataset(d.train_files, self.tokenizer, field_name="data.train_files", **kw)
            self.val_data = PromptDataset(d.val_files, self.tokenizer, field_name="data.val_files", **kw)
            self.sampler = EpochSampler(len(self.train_data), self.sampling.prompts_per_round, seed=cfg.trainer.seed, shuffle=d.shuffle)
        self.data_stats = broadcast_object(
            {"train_prompts": len(self.train_data), "train_dropped": self.train_data.n_dropped} if rt.is_main else None,
            mesh=self.dp_mesh,
        )

        temperature = cfg.rollout.temperature
        model_kw = dict(dtype=cfg.actor.model.dtype, attn_implementation=cfg.actor.model.attn_implementation, packing=cfg.actor.model.packing)
        with_critic = alg.adv_estimator in NEEDS_CRITIC
        self.critic = (
            Critic(
                cfg.critic, model_path=model_path, **model_kw, mesh=self.dp_mesh, device=rt.device, samples_per_prompt=n,
                train_batch_size=cfg.data.train_batch_size, max_response_length=cfg.rollout.max_response_length,
                total_steps=cfg.trainer.total_steps, seed=cfg.trainer.seed,
            )
            if with_critic
            else NoCritic()
        )
        self.actor = Policy(
            cfg.actor,
            mesh=self.dp_mesh,
            device=rt.device,
            samples_per_prompt=n,
            train_batch_size=cfg.data.train_batch_size,
            temperature=temperature,
            max_response_length=cfg.rollout.max_response_length,
            total_steps=max(1, cfg.trainer.total_steps - self.critic.warmup_steps),
        )
        self.ref = (
            Reference(cfg.ref, model_path=model_path, **model_kw, mesh=self.dp_mesh, device=rt.device, fsdp=cfg.actor.fsdp, temperature=temperature)
            if cfg.actor.use_kl_loss or alg.use_kl_in_reward
            else NoReference()
        )
        self.rollout = build_rollout(
            cfg.rollout, meshes=meshes, policy=self.actor, model_path=model_path, compute_dtype=compute_dtype(cfg.actor.fsdp, rt.device),
            eos_ids=eos_token_ids(model_path, self.tokenizer), pad_id=self.tokenizer.pad_token_id, device=rt.device,
            seed=cfg.trainer.seed, max_prompt_length=cfg.data.max_prompt_length,
        )
        reward_model = (
            RewardModel(cfg.reward.model, actor_tokenizer=self.tokenizer, **model_kw, mesh=self.dp_mesh, device=rt.device, fsdp=cfg.actor.fsdp)
            if cfg.reward.model.path
            else NoRewardModel()
        )
        self.reward = RewardManager(cfg.reward, self.tokenizer, reward_model=reward_model)
        self.shaping = (
            OverlongShaping(cfg.reward.overlong_buffer, max_response_length=cfg.rollout.max_response_length)
            if cfg.reward.overlong_buffer.enable
            else NoShaping()
        )
        self.baseline = (
            GreedyBaseline(rollout=self.rollout, score=lambda b: self.shaping(self.reward.score(b)), samples_per_prompt=n)
            if alg.adv_estimator in NEEDS_GREEDY_BASELINE
            else NoBaseline()
        )
        self.token_rewards = build_token_rewards(alg, mesh=self.dp_mesh)
        self.advantage = AdvantageStage(alg, mesh=self.dp_mesh)
        self.balance = (
            # Within chunks that lie inside one mini-batch of the actor AND of the critic: both see the same samples per step.
            partial(balance_batch, mesh=self.dp_mesh, chunk_rows=math.gcd(self.actor.local_mini_batch, getattr(self.critic, "local_mini_batch", 0)))
            if cfg.trainer.balance_batch else lambda batch: (batch, {})
        )
        # One update per step and no consumer of old log-probs before it: the update's forward provides them.
        self.reuse_update_logprobs = cfg.actor.reuse_update_logprobs and self.actor.single_update and not alg.use_kl_in_reward
        self.step_count = 0
        self.skipped_updates_total = 0.0
        self.logger: MetricLogger | None = None  # opened in fit(), once the resume step is known

    def next_prompts(self) -> Batch:
        batch = self.train_data.batch(self.sampler.next_batch()) if self.rt.is_main else None
        return scatter_batch(batch, mesh=self.dp_mesh, device=self.rt.device)

    def rollout_round(self, step: int, round: int, t: StageTimer) -> Batch:
        """One generation round on this rank: fresh prompts -> n samples each -> scored (+ ReMax's baseline)."""
        prompts = self.next_prompts()
        with t("gen"):
            batch = self.rollout.generate(prompts, step=step, round=round)
        with t("reward"):
            batch = self.shaping(self.reward.score(batch))
        with t("baseline"):
            return self.baseline(prompts, batch)

    def step(self, step: int) -> dict[str, float]:
        t = StageTimer()
        with t("step"):
            batch, sampling_metrics = self.sampling.collect(lambda round: self.rollout_round(step, round, t))
            with t("ref"):
                batch = self.ref.log_prob(batch)
            with t("old_log_prob"):
                if not self.reuse_update_logprobs:
                    batch = self.actor.log_prob(batch)
            with t("values"):
                batch = self.critic.values(batch)
            with t("adv"):
                batch, kl_metrics = self.token_rewards(batch)
                batch = self.advantage(batch)
            with t("balance"):
                batch, balance_metrics = self.balance(batch)
            with t("update_critic"):
                critic_metrics = self.critic.update(batch)
            with t("update_actor"):
                # Critic warm-up: the first critic.warmup_steps steps fit the critic to the initial policy only.
                actor_metrics = self.actor.update(batch) if step > self.critic.warmup_steps else MetricBuffer()
            with t("weight_sync"):
                sync_metrics = self.rollout.sync_weights(self.actor)
        buffers = [sampling_metrics, kl_metrics, critic_metrics, actor_metrics]
        return self.step_metrics(batch, buffers, {**sync_metrics, **balance_metrics}, t)

    def step_metrics(self, batch: Batch, buffers: list[MetricBuffer], extra: dict[str, float], t: StageTimer) -> dict[str, float]:
        m = MetricBuffer()
        for b in buffers:
            m.merge(b)
        scores, mask = batch["scores_B"], batch["response_mask_BR"].float()
        n = len(batch)
        m.mean("reward/mean", scores.sum(), n)
        m.mean("reward/sq", scores.pow(2).sum(), n)
        m.mean("acc/mean", (batch["task_scores_B"] >= 1.0).float().sum(), n)
        for key, name in (("task_scores_B", "task_score"), ("rm_scores_B", "rm_score"), ("overlong_penalty_B", "overlong_penalty")):
            if key in batch:  # the reward's components, where configured
                m.mean(f"reward/{name}", batch[key].sum(), n)
        lengths = mask.sum(-1)
        m.mean("response_length/mean", lengths.sum(), n)
        m.max("response_length/max", lengths.max())
        m.mean("response_length/clip_ratio", self.rollout.truncated(batch).float().sum(), n)
        if "old_logprobs_BR" in batch:  # else the actor's update measured it (reuse_update_logprobs)
            gap = ((batch["rollout_logprobs_BR"] - batch["old_logprobs_BR"]).abs() * mask).sum()
            m.mean("rollout/logprob_gap", gap, mask.sum())
        adv, valid = batch["advantages_BR"], mask > 0
        m.mean("adv/mean", (adv * mask).sum(), mask.sum())
        m.max("adv/max", torch.where(valid, adv, -torch.inf).max())
        m.min("adv/min", torch.where(valid, adv, torch.inf).min())
        m.sum("tokens/response", mask.sum())
        m.sum("tokens/total", batch["attention_mask_BL"].sum())
        for k, v in t.seconds.items():
            m.max(f"timing/{k}", v)
        out = m.reduce(mesh=self.dp_mesh)
        out["reward/std"] = max(0.0, out.pop("reward/sq") - out["reward/mean"] ** 2) ** 0.5
        out["throughput/tokens_per_s"] = out["tokens/total"] / out["timing/step"]
        out["throughput/gen_tokens_per_s"] = out["tokens/response"] / max(out["timing/gen"], 1e-9)
        out.update(extra)
        return out

    @torch.no_grad()
    def validate(self, step: int) -> dict[str, float]:
        """Greedy generation on the validation set; accuracy overall and per data_source."""
        dp = self.dp_mesh.size()
        cfg = self.cfg.data
        n_val = broadcast_object(len(self.val_data) if self.rt.is_main else None, mesh=self.dp_mesh)
        if cfg.max_val_samples is not None:
            n_val = min(n_val, cfg.max_val_samples)
        results = []
        for start in range(0, n_val, cfg.val_batch_size):
            idx = list(range(start, min(start + cfg.val_batch_size, n_val)))
            batch, n_pad = (self.val_data.batch(idx).pad_to_divisor(dp) if self.rt.is_main else (None, 0))
            local = scatter_batch(batch, mesh=self.dp_mesh, device=self.rt.device)
            out = self.reward.score(self.rollout.generate_validation(local, step=step))
            slim = Batch({"scores_B": out["scores_B"].cpu(), "task_scores_B": out["task_scores_B"].cpu()}, {"data_source": out["data_source"]})
            gathered = gather_batch(slim, mesh=self.dp_mesh)
            if gathered is not None:
                results.append(gathered.slice(0, len(gathered) - n_pad))
        if not self.rt.is_main:
            return {}
        allv = Batch.concat(results)
        scores, task = allv["scores_B"], allv["task_scores_B"]
        metrics = {"val/acc": float((task >= 1.0).float().mean()), "val/reward": float(scores.mean())}
        sources = allv["data_source"]
        for src in sorted(set(sources)):
            sel = torch.tensor([s == src for s in sources])
            metrics[f"val/acc/{src}"] = float((task[sel] >= 1.0).float().mean())
        return metrics

    def fit(self) -> dict[str, float]:
        cfg = self.cfg.trainer
        if self.resume_from is not None:
            self.restore(self.resume_from)
        self.logger = MetricLogger(
            cfg.loggers, cfg.output_dir, total_steps=cfg.total_steps, initial_step=self.step_count, enabled=self.rt.is_main
        )
        stats = self.data_stats
        self.logger.write(
            f"train prompts: {stats['train_prompts']} (dropped {stats['train_dropped']} over data.max_prompt_length)"
        )
        for message in ignored_settings(self.cfg):
            self.logger.write(f"warning: {message}; ignored")
        if self.resume_from is not None:
            self.logger.write(f"resumed from {self.resume_from} at step {self.step_count}")
        summary = RunSummary()
        if cfg.val_before_train and self.step_count == 0:
            val = self.validate(0)
            summary.add(0, val)
            self.logger.log(0, val, advance=False)
        for step in range(self.step_count + 1, cfg.total_steps + 1):
            metrics = self.step(step)
            self.step_count = step
            self.apply_nan_policy(step, metrics)
            if cfg.val_every and (step % cfg.val_every == 0 or step == cfg.total_steps):
                metrics.update(self.validate(step))
            summary.add(step, metrics)
            self.logger.log(step, metrics)
            signalled = self.stop_request.agreed(self.rt.device, mesh=self.dp_mesh)
            stop = signalled or step == cfg.stop_at_step
            if stop or self.checkpointer.due(step, last=step == cfg.total_steps):
                self.save_checkpoint(step)
            if stop:
                why = "a stop signal (SIGTERM/SIGUSR1)" if signalled else f"trainer.stop_at_step={cfg.stop_at_step}"
                self.logger.write(
                    f"stopped after step {step} on {why}; checkpoint {self.last_checkpoint}; continue with --resume auto"
                )
                break
        if self.rt.is_main:
            self.logger.write(summary.text())
            summary.write(self.cfg.trainer.output_dir)
            if cfg.print_summary_json:
                print(summary.json_line(), flush=True)
        self.rollout.close()
        self.logger.close()
        return summary.last

    def apply_nan_policy(self, step: int, metrics: dict[str, float]) -> None:
        """A non-finite loss or gradient norm: the engine has already skipped that update (every rank agrees,
        the norm is global); ``skip`` counts it, ``stop`` ends the run naming the step."""
        skipped = {k: v for k, v in metrics.items() if k.endswith("skipped_updates") and v > 0}
        if skipped and self.cfg.trainer.nan_policy == "stop":
            bad = {k: v for k, v in metrics.items() if ("loss" in k or "grad_norm" in k) and not math.isfinite(v)}
            raise FloatingPointError(
                f"step {step}: non-finite loss or gradient norm ({bad or skipped}) and trainer.nan_policy=stop; "
                f"the update was not applied. Last checkpoint: {self.last_checkpoint or 'none'}"
            )
        if skipped:
            self.skipped_updates_total += sum(skipped.values())
            counts = ", ".join(f"{k}={v:g}" for k, v in skipped.items())
            self.logger.write(f"step {step}: skipped updates with a non-finite loss or gradient norm ({counts}; trainer.nan_policy=skip)")
        metrics["trainer/skipped_updates_total"] = self.skipped_updates_total

    # -- checkpoints ------------------------------------------------------------------------------------

    def trainable_engines(self) -> dict:
        """Role engines with an optimiser (actor; critic when the algorithm has one), checkpointed sharded."""
        roles = {"actor": self.actor, "critic": self.critic}
        return {name: role.engine for name, role in roles.items() if getattr(role, "engine", None) is not None}

    def stateful_components(self) -> dict[str, object]:
        """Trainer attributes whose progress must survive a restart: anything with ``state_dict`` and
        ``load_state_dict`` (the data sampler on rank 0, a KL controller, ...)."""
        return {
            name: obj for name, obj in vars(self).items()
            if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
        }

    def save_checkpoint(self, step: int) -> None:
        snapshot = broadcast_object(  # rank 0 owns the sampler: its view is the record, the same on every rank
            {
                "step": step,
                "skipped_updates_total": self.skipped_updates_total,
                "components": {name: c.state_dict() for name, c in self.stateful_components().items()},
            }
            if self.rt.is_main
            else None,
            mesh=self.dp_mesh,
        )
        engines = self.trainable_engines()
        state = {**engines, "trainer": TrainerState(snapshot), "rng": RNGState(self.rt.rank)}
        meta = {
            "total_steps": self.cfg.trainer.total_steps,
            "roles": sorted(engines),
            "models": {"actor": self.cfg.actor.model.path},
            "trainer_components": sorted(snapshot["components"]),
            "trainer_state": snapshot,
            "config": dataclasses.asdict(self.cfg),
        }
        self.last_checkpoint = self.checkpointer.save(step, state, meta=meta, write_files=self._write_model_files)
        self.logger.write(f"step {step}: saved checkpoint {self.last_checkpoint}")

    def _write_model_files(self, ckpt: Path) -> None:
        """Config and tokenizer for export; the actor as an HF directory with ``checkpoint.save_hf``."""
        model = self.cfg.actor.model
        engine = self.actor.engine
        full = hf_state_dict(engine) if self.cfg.checkpoint.save_hf else None  # collective

        def write():
            copy_model_files(model.path, model.tokenizer_path or model.path, ckpt / "model")
            if full is not None:
                write_hf_dir(engine.hf_model, full, self.tokenizer, model.path, ckpt / "hf")

        on_main(write, mesh=self.dp_mesh)

    def restore(self, path: Path) -> None:
        def put(snapshot: dict) -> None:
            self.step_count = int(snapshot["step"])
            self.skipped_updates_total = float(snapshot["skipped_updates_total"])
            for name, component in self.stateful_components().items():
                component.load_state_dict(snapshot["components"][name])

        engines = self.trainable_engines()
        state = {**engines, "trainer": TrainerState(restore=put), "rng": RNGState(self.rt.rank)}
        meta = self.checkpointer.load(
            path, state, engines={name: e.param_shapes() for name, e in engines.items()},
            components=sorted(self.stateful_components()),
        )
        self.last_checkpoint = path
        if meta["world_size"] != self.dp_mesh.size() and self.rt.is_main:
            print(f"checkpoint {path} was written by {meta['world_size']} ranks; resharded onto {self.dp_mesh.size()}", flush=True)


class RunSummary:
    """What a run did, for the end of the log and ``summary.json``: validation first -> last, step-time breakdown."""

    def __init__(self):
        self.t0 = time.time()
        self.val: list[tuple[int, float]] = []
        self.timings: list[dict[str, float]] = []
        self.tokens: list[tuple[float, float]] = []  # (response tokens, all tokens) per step
        self.last: dict[str, float] = {}

    def add(self, step: int, metrics: dict[str, float]) -> None:
        if "val/acc" in metrics:
            self.val.append((step, metrics["val/acc"]))
        t = {k.removeprefix("timing/"): v for k, v in metrics.items() if k.startswith("timing/")}
        if t:
            self.timings.append(t)
            self.tokens.append((metrics.get("tokens/response", 0.0), metrics.get("tokens/total", 0.0)))
        self.last = metrics

    def as_dict(self) -> dict:
        steady = self.timings[1:] or self.timings  # the first step pays one-off warm-up costs
        mean = {k: sum(t.get(k, 0.0) for t in steady) / len(steady) for k in (steady[0] if steady else {})}
        out = {"wall_s": time.time() - self.t0, "steps": len(self.timings), "val_acc": self.val, "mean_step_s": mean}
        if steady:
            first = 1 if len(self.timings) > 1 else 0
            tokens = self.tokens[first:]
            gen_s = sum(t.get("gen", 0.0) for t in steady)
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
            lines.append(f"validation accuracy: {a0:.3f} (step {s0}) -> {a1:.3f} (step {s1}), {100 * (a1 - a0):+.1f} points")
        if d["mean_step_s"]:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in d["mean_step_s"].items() if k != "step" and v >= 0.005)
            lines.append(f"seconds per step (mean after the first): {d['mean_step_s'].get('step', 0):.2f} = {parts}")
        return "\n".join(lines)

    def write(self, output_dir: str) -> None:
        (Path(output_dir) / "summary.json").write_text(json.dumps(self.as_dict(), indent=2))

    def json_line(self) -> str:
        return json.dumps({"summary": self.as_dict(), "machine": machine_info()})
