"""A LoRA policy on 2 ranks (FSDP2, Gloo): what it trains, what the reference and the rollout see.

usage: lora_check.py MODEL_DIR OUT.pt

Rank 0 saves, after two updates (lr 1e-2, so the adapters move away from B = 0):
  before / after        every parameter's full tensor before and after the updates (only adapters may change)
  after_ac              the same after the same updates with activation checkpointing and CPU offload on
  trainable             the names the optimiser holds
  lora_lp, merged_lp    log-probs of a fixed batch from the LoRA engine and from a plain HF model holding the merged
                        weights (``hf_state_dict``); ref_lp / base_lp the reference (adapters off) and the base model
  stream, merged        the LoRA engine's weight stream (float32) and ``hf_state_dict``
  in_place, own         seeded sampled generations (tokens, log-probs) from the in-place gathered weights and from an
                        own copy of the merged model; base_gen from the base model
  state_keys            the model / optimiser keys of the checkpoint state
  base_unchanged        the sharded base weights are bit-identical after the in-place generation (merge discarded)
"""

import dataclasses
import sys

import torch
from torch.distributed.tensor import DTensor

from rlspmd.config import ActorConfig, DistConfig, FSDPConfig, LoraConfig, MeshConfig, ModelConfig, OptimConfig, RefConfig
from rlspmd.distributed.mesh import DP, ParallelDims, RoleMeshes
from rlspmd.distributed.runtime import exit_process, init_distributed, shutdown, spmd_main
from rlspmd.metrics import MetricBuffer
from rlspmd.models.loader import eos_token_ids, load_causal_lm, load_tokenizer
from rlspmd.models.policy import CausalLMPolicy
from rlspmd.protocol import Batch
from rlspmd.rollout.native import NativeEngine, OwnWeights
from rlspmd.rollout.sampling import SamplingParams
from rlspmd.rollout.weights import InPlaceWeights
from rlspmd.trainer.build_models import actor_plan, build_policy, build_reference

B, P, R = 8, 6, 10


def batch(vocab: int) -> Batch:
    g = torch.Generator().manual_seed(5)
    pm = torch.ones(B, P, dtype=torch.long)
    pm[::3, :2] = 0
    rm = (torch.arange(R)[None] < torch.tensor([10, 4, 7, 2, 9, 10, 3, 6])[:, None]).long()
    prompts, responses = torch.randint(3, vocab, (B, P), generator=g) * pm, torch.randint(3, vocab, (B, R), generator=g) * rm
    attn = torch.cat([pm, rm], 1)
    return Batch({"input_ids_BL": torch.cat([prompts, responses], 1), "attention_mask_BL": attn,
                  "position_ids_BL": (attn.cumsum(-1) - 1).clamp(min=0), "responses_BR": responses,
                  "response_mask_BR": rm, "loss_mask_BR": rm,
                  "old_logprobs_BR": -torch.rand(B, R, generator=g) - 2, "ref_logprobs_BR": -torch.rand(B, R, generator=g) - 2,
                  "advantages_BR": torch.randn(B, R, generator=g) * rm})


def full(engine) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in engine.module.named_parameters()}


@spmd_main
def main():
    model_dir, out = sys.argv[1], sys.argv[2]
    rt = init_distributed(DistConfig())
    dp = RoleMeshes(ParallelDims.from_config(MeshConfig(), rt.world_size), "cpu", rt.rank).get("actor", DP)
    cfg = ActorConfig(model=ModelConfig(path=model_dir), optim=OptimConfig(lr=1e-2, grad_clip=0.0), mini_batch_size=2,
                      micro_batch_size=2, lora=LoraConfig(rank=4, alpha=8.0), kl_loss_coef=0.1)
    plan = actor_plan(cfg, samples_per_prompt=4, train_batch_size=2, dp=dp.size(), max_response_length=R, total_steps=2)
    policy = build_policy(cfg, mesh=dp, device=rt.device, plan=plan, temperature=1.0, seed=11)
    ref = build_reference(RefConfig(), actor=cfg, mesh=dp, device=rt.device, temperature=1.0, policy=policy)
    base = build_policy(ActorConfig(model=ModelConfig(path=model_dir)), mesh=dp, device=rt.device, plan=plan, temperature=1.0)
    data = batch(policy.engine.hf_model.config.vocab_size)
    res = {"before": full(policy.engine)}
    res["trainable"] = sorted(n for g in policy.engine.optimizer.param_groups for p in g["params"]
                              for n, q in policy.engine.module.named_parameters() if q is p)
    n = B // rt.world_size
    for _ in range(2):
        policy.update(data.slice(rt.rank * n, (rt.rank + 1) * n), MetricBuffer())
    res["after"] = full(policy.engine)
    # the same run with activation checkpointing (non-reentrant, through the frozen base layers) and FSDP2's CPU
    # offload (sharded base, adapters, gradients and AdamW state in host memory): the same adapters
    ac_cfg = dataclasses.replace(cfg, model=ModelConfig(path=model_dir, gradient_checkpointing=True), engine=FSDPConfig(cpu_offload=True))
    ac_policy = build_policy(ac_cfg, mesh=dp, device=rt.device, plan=plan, temperature=1.0, seed=11)
    for _ in range(2):
        ac_policy.update(data.slice(rt.rank * n, (rt.rank + 1) * n), MetricBuffer())
    res["after_ac"] = full(ac_policy.engine)
    del ac_policy
    res["lora_lp"] = policy.log_prob(data)
    res["ref_lp"] = ref.log_prob(data, MetricBuffer())["ref_logprobs_BR"]
    res["base_lp"] = base.log_prob(data)
    merged = policy.engine.hf_state_dict()
    stream = dict((k, v.clone()) for k, v in policy.engine.weight_stream(torch.float32))
    state = policy.engine.state_dict()
    res["state_keys"] = (sorted(state["model"]), sorted(state["optim"]["state"]))

    tok = load_tokenizer(model_dir, field_name="model")
    texts = [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
             for c in ["Calculate 1 + 2.", "Calculate 37 + 45 - 12."]]
    enc = tok(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    prompts = Batch({"prompts_BP": enc["input_ids"], "prompt_mask_BP": enc["attention_mask"], "uid_B": torch.arange(2)})
    kw = dict(eos_ids=eos_token_ids(model_dir, tok), pad_id=tok.pad_token_id, max_batch_size=64, device=rt.device)
    plain = load_causal_lm(model_dir, dtype="float32", attn_implementation="sdpa", field_name="model")
    merged_all = [merged]
    torch.distributed.broadcast_object_list(merged_all, src=0)
    plain.load_state_dict(merged_all[0])  # strict: the merged state has exactly the plain model's names
    sampled = SamplingParams(temperature=1.0, max_new_tokens=12, n=2)
    for key, engine in (("in_place", NativeEngine(InPlaceWeights(policy.engine), **kw)), ("own", NativeEngine(OwnWeights(plain), **kw)),
                        ("base_gen", NativeEngine(InPlaceWeights(base.engine), **kw))):
        out_b = engine.generate(prompts, sampled, generator=torch.Generator().manual_seed(3))
        res[key] = (out_b["responses_BR"], out_b["rollout_logprobs_BR"])
    after_gen = full(policy.engine)
    res["base_unchanged"] = all(torch.equal(after_gen[k], res["after"][k]) for k in after_gen)
    if rt.rank == 0:
        res["merged"], res["stream"] = merged, stream
        with torch.no_grad():
            res["merged_lp"] = CausalLMPolicy(plain.eval())(data["input_ids_BL"], data["attention_mask_BL"],
                                                            data["position_ids_BL"], response_len=R)[0]
        torch.save(res, out)
    shutdown()


if __name__ == "__main__":
    main()
    exit_process()
