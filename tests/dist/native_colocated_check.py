"""Colocated native engine on 2 ranks: generating from the FSDP2 actor's in-place gathered weights gives the
same tokens as an unsharded copy (greedy and seeded sampling), and training still works afterwards."""

import sys

import torch

from rlspmd.config import ActorConfig, DistConfig, MeshConfig, ModelConfig
from rlspmd.distributed.mesh import DP, ParallelDims, RoleMeshes
from rlspmd.distributed.runtime import exit_process, init_distributed, shutdown, spmd_main
from rlspmd.models.loader import eos_token_ids, load_causal_lm, load_tokenizer
from rlspmd.protocol import Batch
from rlspmd.metrics import MetricBuffer
from rlspmd.rollout.native import NativeEngine, OwnWeights
from rlspmd.rollout.weights import InPlaceWeights
from rlspmd.rollout.sampling import SamplingParams
from rlspmd.trainer.build_models import actor_plan, build_policy


@spmd_main
def main():
    model_dir = sys.argv[1]
    rt = init_distributed(DistConfig())
    dp = RoleMeshes(ParallelDims.from_config(MeshConfig(), rt.world_size), "cpu", rt.rank).get("actor", DP)
    tok = load_tokenizer(model_dir, field_name="model")
    cfg = ActorConfig(model=ModelConfig(path=model_dir), mini_batch_size=1, micro_batch_size=4)
    plan = actor_plan(cfg, samples_per_prompt=2, train_batch_size=1, dp=dp.size(), max_response_length=12, total_steps=1)
    policy = build_policy(cfg, mesh=dp, device=rt.device, plan=plan, temperature=1.0)
    plain = load_causal_lm(model_dir, dtype="float32", attn_implementation="sdpa", field_name="model")
    texts = [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
             for c in ["Calculate 1 + 2.", "Calculate 37 + 45 - 12.", "Calculate 90 - 9."]]
    enc = tok(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    prompts = Batch({"prompts_BP": enc["input_ids"], "prompt_mask_BP": enc["attention_mask"], "uid_B": torch.arange(3)})
    kw = dict(eos_ids=eos_token_ids(model_dir, tok), pad_id=tok.pad_token_id, max_batch_size=64, device=rt.device)
    colocated = NativeEngine(InPlaceWeights(policy.engine), **kw)
    own = NativeEngine(OwnWeights(plain), **kw)
    for params in (SamplingParams(temperature=0.0, max_new_tokens=12), SamplingParams(temperature=1.0, top_k=20, max_new_tokens=12, n=2)):
        a = colocated.generate(prompts, params, generator=torch.Generator().manual_seed(7))
        b = own.generate(prompts, params, generator=torch.Generator().manual_seed(7))
        assert torch.equal(a["responses_BR"], b["responses_BR"]), (a["responses_BR"], b["responses_BR"])
        assert torch.allclose(a["rollout_logprobs_BR"], b["rollout_logprobs_BR"], atol=1e-5)
    # parameters are sharded again afterwards, and a training step runs
    from torch.distributed.tensor import DTensor

    assert all(isinstance(p, DTensor) for p in policy.engine.module.parameters())
    batch = a.set(old_logprobs_BR=a["rollout_logprobs_BR"], ref_logprobs_BR=a["rollout_logprobs_BR"],
                  advantages_BR=torch.ones_like(a["rollout_logprobs_BR"]) * a["response_mask_BR"])
    policy.update(batch.slice(rt.rank * 3, rt.rank * 3 + 3) if rt.world_size == 2 else batch, MetricBuffer())
    if rt.rank == 0:
        print("COLOCATED OK", flush=True)
    shutdown()


if __name__ == "__main__":
    main()
    exit_process()  # after a clean shutdown(): no interpreter teardown (see its docstring)
