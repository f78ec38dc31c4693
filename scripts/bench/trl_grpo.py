"""The GRPO benchmark workload through TRL's ``GRPOTrainer`` (Hugging Face ``generate`` backend), for comparison.

    pip install trl==1.16.0                      # on the CPU torch; not a dependency of rlspmd
    python scripts/bench/grpo_workload.py        # the models and prompts
    python scripts/bench/trl_grpo.py --model models/bench-256    # last line: JSON with sec_per_step

Same workload as ``configs/bench/grpo_tiny.py`` (and ``grpo_small.py`` with ``--model models/bench-512``): the same
model directory and prompt file; 4 prompts x 4 generations = 16 completions per step (``per_device_train_batch_size``
counts completions in TRL); exactly 64 new tokens (``min_new_tokens = max_completion_length`` keeps EOS from being
sampled); temperature 1.0, no top-k/top-p; KL (TRL's k3 estimator) to a frozen reference with beta 0.04; one
optimiser step per generation (``steps_per_generation = num_iterations = 1``); AdamW at lr 1e-6, grad-norm clip 1.0;
fp32 on CPU, one process, torch's default threads. The reward is 0 for every completion (the random model earns
none in rlspmd either), so advantages are 0 in both frameworks.

On a GPU (``configs/bench/grpo_q05.py``'s workload, what ``scripts/bench/gpu_suite.py`` runs)::

    python scripts/bench/trl_grpo.py --model models/bench-q05 --prompts 32 --generations 8 --new-tokens 256 \
        --per-device-batch 32 --grad-accum 8 --bf16

generates the 32 x 8 completions at once (``steps_per_generation`` = ``gradient_accumulation_steps`` = 8) and makes one
optimiser step over 8 micro-batches of 32, with bf16 autocast and fused AdamW (``optim=adamw_torch_fused``).

``sec_per_step`` is the median wall time between TRL's ``on_step_begin`` and ``on_step_end`` callbacks over the steps
after the first; a step there covers generation, the reference forward, the policy forward/backward and the
optimiser step, like rlspmd's ``timing/step``. ``stages_s`` splits each step (medians over the same steps): ``gen``
(``GRPOTrainer._generate``), ``ref`` (the reference model's log-prob forward), ``update_fwd`` (the policy's forward
with gradients), ``update_bwd`` (``accelerator.backward``), ``optim`` (between the ``on_pre_optimizer_step`` and
``on_optimizer_step`` callbacks) and ``other`` (the rest: rewards, advantages, gradient clipping, bookkeeping): the
stage methods of the built trainer are wrapped with timers, nothing else changes. Without TRL installed the JSON says
so (``skipped``) and the exit status is 0.

``--bf16`` on a CPU: TRL's ``bf16=True`` (accelerate's bf16 autocast around the forwards, float32 weights and
optimiser); with ``--threads`` the process uses that many torch threads (default: torch's own choice).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, emit  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "models" / "bench-256"))
    p.add_argument("--data", default=str(ROOT / "data" / "bench" / "prompts.jsonl"))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--generations", type=int, default=4, help="completions per prompt (num_generations)")
    p.add_argument("--new-tokens", type=int, default=64, help="min_new_tokens = max_completion_length")
    p.add_argument("--per-device-batch", type=int, default=16, help="completions per micro-batch")
    p.add_argument(
        "--grad-accum", type=int, default=1, help="micro-batches per optimiser step (= steps_per_generation)"
    )
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (TRL's bf16=True)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--optim",
        default="adamw_torch_fused",
        help="transformers' optim name (adamw_torch_fused: torch's one-pass AdamW, on CUDA and, since torch 2.4, CPU)",
    )
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    if a.per_device_batch * a.grad_accum != a.prompts * a.generations:
        raise SystemExit(
            f"--per-device-batch x --grad-accum must be --prompts x --generations ({a.prompts * a.generations})"
        )
    workload = {
        "model": a.model,
        "prompts": a.prompts,
        "generations": a.generations,
        "new_tokens": a.new_tokens,
        "per_device_batch": a.per_device_batch,
        "grad_accum": a.grad_accum,
        "bf16": a.bf16,
        "optim": a.optim,
        "beta": 0.04,
        "steps": a.steps,
    }
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        emit(
            {"bench": "trl_grpo", "skipped": "trl is not installed (pip install trl==1.16.0)", "workload": workload},
            a.out,
        )
        return

    import torch
    import trl

    if a.threads:
        torch.set_num_threads(a.threads)
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = torch.cuda.is_available()
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, attn_implementation="sdpa")
    dataset = load_dataset("json", data_files=a.data, split="train").select_columns(["prompt"])

    def zero_reward(completions, **kwargs):
        return [0.0] * len(completions)

    class StepTimer(TrainerCallback):
        """Step wall times, and each step's stage seconds (``stage``-wrapped methods and the optimiser callbacks)."""

        def __init__(self):
            self.times: list[float] = []
            self.stages: list[dict[str, float]] = []
            self.current: dict[str, float] = {}

        def add(self, name: str, seconds: float) -> None:
            self.current[name] = self.current.get(name, 0.0) + seconds

        def wrap(self, name, fn):
            """``fn`` timed as stage ``name`` (a string, or a function of the call's arguments that names it)."""

            def timed(*args, **kwargs):
                stage = name(*args, **kwargs) if callable(name) else name
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.add(stage, time.perf_counter() - t0)

            return timed

        def on_step_begin(self, args, state, control, **kwargs):
            self.current = {}
            self.t0 = time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.t_opt = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kwargs):
            self.add("optim", time.perf_counter() - self.t_opt)

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.t0)
            self.current["other"] = self.times[-1] - sum(self.current.values())
            self.stages.append(self.current)

    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out_dir:
        args = GRPOConfig(
            output_dir=out_dir,
            per_device_train_batch_size=a.per_device_batch,
            num_generations=a.generations,
            steps_per_generation=a.grad_accum,
            num_iterations=1,
            gradient_accumulation_steps=a.grad_accum,
            max_completion_length=a.new_tokens,
            generation_kwargs={"min_new_tokens": a.new_tokens},
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            beta=0.04,
            learning_rate=1e-6,
            lr_scheduler_type="constant",
            max_grad_norm=1.0,
            max_steps=a.steps,
            shuffle_dataset=False,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=not cuda,
            bf16=a.bf16,
            optim=a.optim,
            seed=0,
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=zero_reward,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[timer],
        )

        def logps_stage(model, *args, **kwargs):
            if model is trainer.ref_model:
                return "ref"
            return "update_fwd" if torch.is_grad_enabled() else "old_logprob"

        trainer._generate = timer.wrap("gen", trainer._generate)
        trainer._get_per_token_logps_and_entropies = timer.wrap(logps_stage, trainer._get_per_token_logps_and_entropies)
        trainer.accelerator.backward = timer.wrap("update_bwd", trainer.accelerator.backward)
        trainer.train()
        lengths = [
            m.get("completions/mean_length") for m in trainer.state.log_history if "completions/mean_length" in m
        ]

    steady = timer.times[1:] or timer.times
    sec = statistics.median(steady)
    stages = timer.stages[1:] or timer.stages
    names = sorted({k for st in stages for k in st})
    emit(
        {
            "bench": "trl_grpo",
            "trl": trl.__version__,
            "workload": workload,
            "sec_per_step": sec,
            "step_s": [round(x, 3) for x in timer.times],
            "stages_s": {k: statistics.median(st.get(k, 0.0) for st in stages) for k in names},
            "stages_s_all": [{k: round(v, 4) for k, v in st.items()} for st in timer.stages],
            "completion_mean_length": lengths,
            "gen_tokens_per_step": a.prompts * a.generations * a.new_tokens,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        },
        a.out,
    )


if __name__ == "__main__":
    main()
