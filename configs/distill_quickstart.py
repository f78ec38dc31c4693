"""On-policy distillation on the quickstart's task: the GRPO quickstart's trained policy teaches a fresh student from
the same SFT warm start, 2 CPU ranks, a few minutes.

    bash scripts/distill_quickstart.sh   # the GRPO quickstart first (its step-40 policy is the teacher), then this

The GRPO quickstart's run (``configs/quickstart.py``: the same warm start, 32 prompts x 8 samples per step, the same
greedy validation) with the learning signal changed. Pure distillation: no reward (``algorithm.adv-estimator:none``;
the task's reward is still computed, for the logs only), and GKD's loss (``teacher.signal:gkd``): at every token the
student wrote, the generalized Jensen-Shannon divergence between its next-token distribution and the teacher's over the
whole vocabulary. The learning rate is the one ``configs/gdpo.py:cpu`` uses for demos of 10-20 steps (1e-4 instead of
the quickstart's 3e-5): the divergence to a fixed teacher keeps the student's arithmetic in place at a step size where
GRPO's accuracy decays (README, "On-policy distillation"). ``teacher.signal:reverse-kl`` is slime's form instead (the
advantage minus the per-token reverse KL).
"""

from pathlib import Path

from rlspmd.config import GKD, NoAdvantage, OptimConfig, TeacherConfig, load_config_file

TEACHER = "outputs/quickstart/checkpoints/step_00000040/hf"  # the GRPO quickstart's last policy (checkpoint.save_hf)

config = load_config_file(Path(__file__).with_name("quickstart.py"))  # the GRPO quickstart, whose signal changes
config.algorithm.adv_estimator = NoAdvantage()
config.teacher = TeacherConfig(model_path=TEACHER, signal=GKD(beta=0.5), logprob_micro_batch_size=128)
config.actor.optim = OptimConfig(lr=1e-4, warmup_steps=5)
config.trainer.total_steps = 20
config.trainer.val_every = 2
config.trainer.output_dir = "outputs/distill_quickstart"
