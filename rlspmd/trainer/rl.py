"""The RL loop. ``RLTrainer.step`` is the data flow of one step, one line per stage:

    prompts (rank 0 samples them, scatter to the DP ranks)
      -> rollout.generate      n samples per prompt
      -> reward.score          rule functions / user function / reward model, same rank
      -> shaping               DAPO overlong penalty (no-op when off)
      -> baseline              ReMax's greedy response, scored (no-op for other estimators)
         (dynamic sampling repeats the lines above until enough groups carry signal)
      -> ref.log_prob          frozen reference (no-op without a KL term)
      -> teacher.log_prob      frozen teacher of on-policy distillation (no-op without one)
      -> actor.old_log_prob    old log-probs of the behaviour policy (or from the update's own forward)
      -> critic.values         PPO only (no-op otherwise)
      -> token rewards         score on the last token, minus the KL penalty when it is in the reward
      -> advantages            pure functions in rlspmd.algorithms
      -> distill               the teacher's reverse KL on the advantage (no-op otherwise; GKD is a loss term)
      -> rollout correction    importance weights / rejection for pi_rollout != pi_train (roles/rollout_correction.py)
      -> balance               move samples between DP ranks to even out tokens (within each mini-batch)
      -> critic.update, actor.update   (the actor waits for critic.warmup_steps)
      -> rollout.sync_weights  actor -> rollout
      -> metrics               reduced over ranks, logged by rank 0 (and a few samples: trainer/samples.py)

Every stage takes the step's batch and metric buffer and returns the batch (``roles/base.py``). A prompt's samples
are generated, scored and trained on one DP rank, so group statistics are local and only scalars cross ranks. Rank 0
decides (which prompts, when dynamic sampling has enough, when to stop) and broadcasts.

Every rank runs this loop. The builder (``trainer/build.py``) decides what each rank's stages are: in split
placement the rollout-only ranks hold a ``RolloutServer`` and stages that do nothing, so they follow the step and
serve every generation and weight sync with collectives, and their batches stay empty.

``fit`` adds what a long run needs around the step: resume from a checkpoint, the NaN policy, periodic and
final checkpoints, and a clean stop (checkpoint, then exit) when any rank got SIGTERM/SIGUSR1.
"""

from __future__ import annotations

import math

import torch

from rlspmd.config import TrainerConfig
from rlspmd.distributed.dispatch import broadcast_object
from rlspmd.distributed.progress import progress
from rlspmd.distributed.runtime import Runtime, StopRequest
from rlspmd.metrics import MetricBuffer, MetricLogger
from rlspmd.protocol import Batch
from rlspmd.trainer.checkpoint import Counters, StopAndSave
from rlspmd.trainer.report import RunSummary
from rlspmd.trainer.roles import Roles
from rlspmd.trainer.timing import StageProbe


class RLTrainer:
    def __init__(
        self,
        cfg: TrainerConfig,
        *,
        roles: Roles,
        rt: Runtime,
        stop_request: StopRequest,
        val_batch_size: int,
        messages: list[str] = (),
    ):
        """``messages``: what the builder wants in the run's log (the attention kernel, ignored settings)."""
        self.cfg, self.roles, self.rt = cfg, roles, rt
        self.stop_request = stop_request
        self.val_batch_size = val_batch_size
        self.messages = list(messages)
        self.counters = Counters()
        self.logger: MetricLogger | None = None  # opened in fit(), once the resume step is known
        self.stop_and_save: StopAndSave | None = None  # built in fit(), with the logger

    def rollout_round(self, step: int, round: int, m: MetricBuffer, t: StageProbe) -> Batch:
        """One generation round on this rank: fresh prompts -> n samples each -> scored (+ ReMax's baseline)."""
        r = self.roles
        prompts = r.prompts.next()
        with t("gen"):
            batch = r.rollout.generate(prompts, step=step, round=round)
        r.report.sampled(batch, m)  # tokens/generated: what the model sampled, before any rejection or filter
        with t("reward"):
            batch = r.reward.score(batch, m)
            batch = r.shaping(batch, m)
        with t("baseline"):
            return r.baseline(prompts, batch, m)

    def step(self, step: int) -> dict[str, float]:
        r, m, t = self.roles, MetricBuffer(), StageProbe(self.rt.device, step=step)
        with t("step"):
            batch = r.sampling.collect(lambda round: self.rollout_round(step, round, m, t), m)
            batch = r.stages("scored", batch, m)  # the user's own stages (trainer.stages): none by default
            with t("ref"):
                batch = r.ref.log_prob(batch, m)
            with t("teacher"):
                batch = r.teacher.log_prob(batch, m)
            with t("old_log_prob"):
                batch = r.actor.old_log_prob(batch, m)
            with t("values"):
                batch = r.critic.values(batch, m)
            with t("adv"):
                batch = r.token_rewards(batch, m)
                batch = r.advantage(batch, m)
                batch = r.distill(batch, m)
                batch = r.stages("advantaged", batch, m)
                # Rollout correction with recomputed old log-probs: weights and rejected tokens for the updates (after
                # the advantages, whose group statistics see every sample). Otherwise the loss computes it.
                batch = r.correction(batch, m)
            with t("balance"):
                batch = r.balance(batch, m)
            with t("update_critic"):
                batch = r.critic.update(batch, m)
            with t("update_actor"):
                # Critic warm-up: the first critic.warmup_steps steps fit the critic to the initial policy only.
                if step > r.critic.warmup_steps:
                    batch = r.actor.update(batch, m)
            with t("weight_sync"):
                r.rollout.sync_weights(m)
            r.samples.train(batch, step=step)  # a few trained samples to <output_dir>/samples/train.jsonl (rank 0)
        return r.report.step(batch, m, t)

    @torch.no_grad()
    def validate(self, step: int) -> dict[str, float]:
        """Greedy generation on the validation set; accuracy overall and per data_source (on rank 0)."""
        r, n_val = self.roles, self.roles.data_stats["val_prompts"]
        for start in range(0, n_val, self.val_batch_size):
            prompts, n_pad = r.prompts.validation(start, min(start + self.val_batch_size, n_val))
            with progress.stage("gen"):  # the stages every rank passes, for the hang monitor
                samples = r.rollout.generate_validation(prompts, step=step)
            with progress.stage("reward"):
                scored = r.reward.score(samples, MetricBuffer())  # unshaped
            r.report.add_validation(scored, n_pad)
            r.samples.validation(scored, step=step, start=start)  # the first prompts' generations to samples/val.jsonl
        return r.report.validation()

    def fit(self) -> dict[str, float]:
        cfg, r = self.cfg, self.roles
        if r.resume_from is not None:
            self.counters = r.checkpointing.restore(r.resume_from)
        # Rank 0's logger starts the experiment trackers' runs (seconds) while the other ranks wait in the broadcast,
        # not in the first step's collectives, where the wait would count as step time.
        self.logger = MetricLogger(
            cfg.loggers,
            cfg.output_dir,
            total_steps=cfg.total_steps,
            initial_step=self.counters.step,
            enabled=self.rt.is_main,
            trackers=r.trackers,
        )
        # Every rank continues at the same step (the rollout-only ranks of a split placement restore nothing).
        self.counters.step = broadcast_object(self.counters.step)
        self.stop_and_save = StopAndSave(
            r.checkpointing,
            self.stop_request,
            device=self.rt.device,
            logger=self.logger,
            total_steps=cfg.total_steps,
            stop_at_step=cfg.stop_at_step,
            stop_field="trainer.stop_at_step",
            last=r.resume_from,
        )
        r.samples.open(self.logger, initial_step=self.counters.step)
        stats = r.data_stats
        self.logger.write(
            f"train prompts: {stats['train_prompts']} (dropped {stats['train_dropped']} over data.max_prompt_length, "
            f"{stats['train_empty_dropped']} empty)"
        )
        for message in self.messages:
            self.logger.write(message)
        if r.resume_from is not None:
            self.logger.write(f"resumed from {r.resume_from} at step {self.counters.step}")
        summary = RunSummary()
        if cfg.val_before_train and self.counters.step == 0:
            with progress.stage("validate", step=0):
                val = self.validate(0)
            summary.add(0, val)
            self.logger.log(0, val, advance=False)
        for step in range(self.counters.step + 1, cfg.total_steps + 1):
            metrics = self.step(step)
            self.counters.step = step
            self.apply_nan_policy(step, metrics)
            if cfg.val_every and (step % cfg.val_every == 0 or step == cfg.total_steps):
                with progress.stage("validate", step=step):
                    metrics.update(self.validate(step))
            summary.add(step, metrics)
            self.logger.log(step, metrics)
            if self.stop_and_save(self.counters):
                break
        if self.rt.is_main:
            self.logger.write(summary.text())
            summary.write(cfg.output_dir)
            if cfg.print_summary_json:
                print(summary.json_line(), flush=True)
        r.reward.close()
        self.logger.close()
        return summary.last

    def apply_nan_policy(self, step: int, metrics: dict[str, float]) -> None:
        """A non-finite loss or gradient norm: the engine has already skipped that update (every rank agrees,
        the norm is global); ``skip`` counts it, ``stop`` ends the run naming the step."""
        skipped = {k: v for k, v in metrics.items() if k.endswith("skipped_updates") and v > 0}
        if skipped and self.cfg.nan_policy == "stop":
            bad = {k: v for k, v in metrics.items() if ("loss" in k or "grad_norm" in k) and not math.isfinite(v)}
            raise FloatingPointError(
                f"step {step}: non-finite loss or gradient norm ({bad or skipped}) and trainer.nan_policy=stop; "
                f"the update was not applied. Last checkpoint: {self.stop_and_save.last or 'none'}"
            )
        if skipped:
            self.counters.skipped_updates_total += sum(skipped.values())
            counts = ", ".join(f"{k}={v:g}" for k, v in skipped.items())
            self.logger.write(
                f"step {step}: skipped updates with a non-finite loss or gradient norm "
                f"({counts}; trainer.nan_policy=skip)"
            )
        metrics["trainer/skipped_updates_total"] = self.counters.skipped_updates_total
