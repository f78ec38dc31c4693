"""Settings that differ from their defaults but do nothing under the switches that gate them: the run warns once
(``rlspmd.trainer.build.build_trainer``'s log) instead of failing."""

from __future__ import annotations


from rlspmd.algorithms.distill import TeacherConfig
from rlspmd.config import (
    ActorConfig,
    AgentConfig,
    AlgorithmConfig,
    Config,
    CriticConfig,
    FilterGroupsConfig,
    FixedKL,
    MeshConfig,
    OverlongBufferConfig,
    RewardConfig,
    RewardModelConfig,
    RolloutCorrectionConfig,
)


def ignored_settings(cfg: Config) -> list[str]:
    """Settings that differ from their defaults but do nothing under the switches that gate them (warned once)."""
    alg, out = cfg.algorithm, []
    if not alg.adv_estimator.uses_critic and cfg.critic != CriticConfig():
        out.append(f"critic.* is set but algorithm.adv_estimator={alg.adv_estimator.name!r} uses no critic")
    if not alg.use_kl_in_reward and (alg.kl_ctrl != FixedKL() or alg.kl_penalty != AlgorithmConfig.kl_penalty):
        out.append("algorithm.kl_ctrl / kl_penalty are set but algorithm.use_kl_in_reward=False")
    if not alg.filter_groups.enable and alg.filter_groups != FilterGroupsConfig():
        out.append("algorithm.filter_groups.* is set but algorithm.filter_groups.enable=False")
    if not cfg.reward.overlong_buffer.enable and cfg.reward.overlong_buffer != OverlongBufferConfig():
        out.append("reward.overlong_buffer.* is set but reward.overlong_buffer.enable=False")
    if cfg.reward.model.path is None and cfg.reward.model != RewardModelConfig():
        out.append("reward.model.* is set but reward.model.path is None")
    if not cfg.actor.use_kl_loss and (cfg.actor.kl_loss_coef, cfg.actor.kl_loss_type) != (
        ActorConfig.kl_loss_coef,
        ActorConfig.kl_loss_type,
    ):
        out.append("actor.kl_loss_coef / kl_loss_type are set but actor.use_kl_loss=False")
    out += _ignored_policy_loss_settings(cfg.actor)
    if cfg.mesh.actor_sp == 1 and cfg.mesh.actor_sp_mode != MeshConfig.actor_sp_mode:
        out.append("mesh.actor_sp_mode is set but mesh.actor_sp=1 (no sequence parallelism)")
    est = alg.adv_estimator.name
    if alg.adv_estimator.uses_reward_components and alg.use_kl_in_reward:
        out.append(
            f"algorithm.use_kl_in_reward does not reach {est}, which reads reward_components_BK, not the token "
            "rewards (use actor.use_kl_loss)"
        )
    if alg.adv_estimator.uses_reward_components and cfg.reward.overlong_buffer.enable:
        out.append(
            f"reward.overlong_buffer does not reach {est}, which reads reward_components_BK, not the shaped score"
        )
    rc = alg.rollout_correction
    if rc.mode in ("off", "mis") and rc.tis_threshold != RolloutCorrectionConfig.tis_threshold:
        out.append(f"algorithm.rollout_correction.tis_threshold is set but mode={rc.mode!r} does not truncate")
    if rc.mode in ("off", "tis") and (rc.mis_lower, rc.mis_upper) != (None, None):
        out.append(f"algorithm.rollout_correction.mis_lower / mis_upper are set but mode={rc.mode!r} rejects nothing")
    ag = cfg.rollout.agent
    if not ag.enabled and ag != AgentConfig():
        out.append(
            "rollout.agent.* is set but rollout.agent has no tools, tool_config_path, interaction or "
            "interaction_config_path"
        )
    if not ag.enabled and cfg.reward.agent_weight != RewardConfig.agent_weight:
        out.append("reward.agent_weight is set but rollout.agent is off")
    if not cfg.teacher.enabled and cfg.teacher != TeacherConfig():
        out.append("teacher.* is set but teacher.model_path is None")
    return out


def _ignored_policy_loss_settings(actor: ActorConfig) -> list[str]:
    loss = actor.policy_loss
    if loss.per_sequence and actor.loss_agg_mode != "seq-mean-token-mean":
        return [
            f"actor.loss_agg_mode={actor.loss_agg_mode!r} does not apply to the {loss.name} policy loss, which "
            f"aggregates seq-mean-token-mean as verl does (it still applies to the KL and entropy terms)"
        ]
    return []
