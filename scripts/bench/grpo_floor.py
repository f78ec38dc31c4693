"""The fastest a GRPO step of the benchmark workload could be on this machine: its matmuls and its unavoidable
memory traffic, timed alone, and the machine's peaks they run at.

    python scripts/bench/grpo_floor.py --which grpo_small --trl-sec-per-step 6.01 --rlspmd-sec-per-step 4.27
    python scripts/bench/grpo_floor.py --which grpo_smollm2 --dtypes float32 bfloat16

Times, in each of ``--dtypes`` at the workload's exact shapes and with the model's own weights, nothing but the
matmuls every implementation of the step must run:

- ``gen``: the prefill of the 4 distinct prompts, then 64 decode steps of 16 rows through every weight matrix of
  every layer (q, k, v, o, gate, up, down) and the LM head, in layer order (the weights stream from memory at
  every step, as in any decoder); at each row count (prefill, decode) the faster of ``x @ W.T`` and pre-transposed
  weights for the whole chain.
- ``ref``: one forward of the 16 packed sequences (prompt + 64 tokens each) through every matrix, the LM head on the
  1,024 response positions only.
- ``update``: the same forward plus the two backward matmuls of each (input and weight gradients), and AdamW's one
  pass over the float32 master weights, gradients and both moments (read 4, write 3 values of 4 bytes per parameter)
  at the machine's copy bandwidth.

In a 16-bit dtype the master weights stay float32, so ``gen`` also pays one cast of them to the compute dtype per
step (read 4, write 2 bytes per parameter; the same 16-bit weights then serve the reference-free passes of the step).
No attention, normalisation, activation, sampling or communication is timed, so the sum is a floor no implementation
in that dtype goes under on this machine. ``peaks`` gives what the machine does at best: each dtype's matmul rate
(the best of a large square GEMM and the workload's own shapes) and the memory bandwidth (``read``: summing a 1 GiB
buffer; ``copy``: read + written bytes of a 512 MiB copy, what the optimiser and the casts are charged at).

``shared_prefix`` is the same floor for a trainer that runs each prompt once for its group (4 prompts' tokens
instead of 16). With ``--trl-sec-per-step`` (TRL's median from ``grpo_vs_trl.py``) the JSON adds ``max_ratio``: TRL's
time over the floor, the largest speed-up any implementation could show on this machine. The top-level ``full`` and
``shared_prefix`` are the first dtype's; ``by_dtype`` holds every dtype's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, measure  # noqa: E402
from grpo_workload import PRESETS, model_dir, prompt_length  # noqa: E402

PROMPTS, SAMPLES, PROMPT_TOKENS, NEW_TOKENS = 4, 4, 27, 64
ADAMW_BYTES = 28
"""Bytes AdamW moves per float32 parameter in one fused pass: reads weight, gradient and both moments, writes three."""
CAST_BYTES = 6
"""Bytes per parameter of casting the float32 master weights to a 16-bit compute dtype: read 4, write 2."""


def weight_matrices(model) -> list:
    """Every projection matrix of every decoder layer, in execution order, as ``(out, in)`` tensors."""
    mats = []
    for layer in model.get_decoder().layers:
        a, m = layer.self_attn, layer.mlp
        mats += [
            a.q_proj.weight,
            a.k_proj.weight,
            a.v_proj.weight,
            a.o_proj.weight,
            m.gate_proj.weight,
            m.up_proj.weight,
            m.down_proj.weight,
        ]
    return [w.detach() for w in mats]


def machine_peaks(dtypes, *, repeats: int, tiny: bool) -> dict:
    """Each dtype's square-GEMM rate (GFLOP/s) and the memory bandwidth (GB/s), measured here."""
    import torch

    n = 256 if tiny else 2048
    out = {"gemm_gflops": {}, "gemm_size": n}
    for dtype in dtypes:
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        s = measure(lambda: torch.mm(a, b), repeats=max(3, repeats))["wall_s_min"]
        out["gemm_gflops"][str(dtype).removeprefix("torch.")] = round(2 * n**3 / s / 1e9, 1)
    mib = 16 if tiny else 512
    x = torch.ones(2 * mib << 18)  # float32: 2 * mib MiB
    s = measure(lambda: x.sum(), repeats=max(3, repeats))["wall_s_min"]
    out["read_gb_s"] = round(x.numel() * 4 / s / 1e9, 2)
    src = torch.ones(mib << 18)
    dst = torch.empty_like(src)
    s = measure(lambda: dst.copy_(src), repeats=max(3, repeats))["wall_s_min"]
    out["copy_gb_s"] = round(2 * src.numel() * 4 / s / 1e9, 2)  # bytes read + bytes written
    return out


def dtype_floor(model, dtype, *, prompt_tokens: int, decode_steps: int, repeats: int, copy_gb_s: float) -> dict:
    """``full`` and ``shared_prefix`` floors (seconds, GFLOP, GFLOP/s per stage) of the workload in ``dtype``, and the
    closures ``body_fwd_bwd`` of the full batch (for the HF comparison)."""
    import torch
    import torch.nn.functional as F

    mats = [w.to(dtype) for w in weight_matrices(model)]
    head = model.get_output_embeddings().weight.detach().to(dtype)
    hidden = head.shape[1]
    mat_params = sum(w.numel() for w in mats)
    n_params = sum(p.numel() for p in model.parameters())  # tied embeddings once
    mats_t = [w.t().contiguous() for w in mats]
    head_t = head.t().contiguous()
    g = torch.Generator().manual_seed(0)
    rows = PROMPTS * SAMPLES

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    def best_forward(n_rows: int):
        """The chain of matmuls over ``n_rows`` rows in its faster layout, and whether that is the pre-transposed
        one."""
        xs = {k: randn(n_rows, k) for k in {w.shape[1] for w in mats}}

        def plain():
            for w in mats:
                F.linear(xs[w.shape[1]], w)

        def transposed():
            for w in mats_t:
                torch.mm(xs[w.shape[0]], w)

        t_plain = measure(plain, repeats=3)["wall_s_median"]
        t_trans = measure(transposed, repeats=3)["wall_s_median"]
        return (plain, False) if t_plain <= t_trans else (transposed, True)

    # Generation: prefill of the distinct prompts, then decode steps of all rows (the LM head in the chain's layout).
    prefill, _ = best_forward(PROMPTS * prompt_tokens)
    step_chain, step_transposed = best_forward(rows)
    x_rows = randn(rows, hidden)

    def gen():
        prefill()
        for _ in range(decode_steps):
            step_chain()
            torch.mm(x_rows, head_t) if step_transposed else F.linear(x_rows, head)

    def train_passes(n_prompt_tokens: int):
        """Closures over ``n_prompt_tokens + rows * 64`` packed tokens: the forward, the forward + backward, and the
        decoder stack's forward + backward without the LM head; and the token count."""
        n_tok = n_prompt_tokens + rows * NEW_TOKENS
        n_resp = rows * NEW_TOKENS
        xs = {k: randn(n_tok, k) for k in {w.shape[1] for w in mats}}
        gs = {n: randn(n_tok, n) for n in {w.shape[0] for w in mats}}
        h_resp = randn(n_resp, hidden)
        g_logits = randn(n_resp, head.shape[0])

        def body_fwd():
            for w in mats:
                F.linear(xs[w.shape[1]], w)

        def fwd():
            body_fwd()
            F.linear(h_resp, head)

        def body_fwd_bwd():
            body_fwd()
            for w in reversed(mats):
                torch.mm(gs[w.shape[0]], w)  # d input
                torch.mm(gs[w.shape[0]].t(), xs[w.shape[1]])  # d weight

        def fwd_bwd():
            F.linear(h_resp, head)
            torch.mm(g_logits, head)  # d hidden
            torch.mm(g_logits.t(), h_resp)  # d W_head
            body_fwd_bwd()

        return fwd, fwd_bwd, body_fwd_bwd, n_tok

    def flops_fwd(n_tok: int) -> float:
        return 2.0 * n_tok * mat_params + 2.0 * rows * NEW_TOKENS * head.numel()

    optim_s = ADAMW_BYTES * n_params / (copy_gb_s * 1e9)
    cast_s = 0.0 if dtype == torch.float32 else CAST_BYTES * n_params / (copy_gb_s * 1e9)
    out = {"n_params": n_params, "optim_s": round(optim_s, 6), "cast_s": round(cast_s, 6)}
    body = None
    with torch.no_grad():
        gen_s = measure(gen, repeats=repeats)["wall_s_median"]
        gen_flop = (
            2.0 * (PROMPTS * prompt_tokens + rows * decode_steps) * mat_params
            + 2.0 * rows * decode_steps * head.numel()
        )
        for name, n_prompt in (("full", rows * prompt_tokens), ("shared_prefix", PROMPTS * prompt_tokens)):
            fwd, fwd_bwd, body_fwd_bwd, n_tok = train_passes(n_prompt)
            ref_s = measure(fwd, repeats=repeats)["wall_s_median"]
            upd_s = measure(fwd_bwd, repeats=repeats)["wall_s_median"]
            floor = {"gen": gen_s + cast_s, "ref": ref_s, "update": upd_s + optim_s}
            floor["total"] = sum(floor.values())
            out[name] = {
                "tokens": n_tok,
                "floor_s": {k: round(v, 6) for k, v in floor.items()},
                "matmul_s": {"gen": round(gen_s, 6), "ref": round(ref_s, 6), "update": round(upd_s, 6)},
                "gflop": {
                    "gen": round(gen_flop / 1e9, 3),
                    "ref": round(flops_fwd(n_tok) / 1e9, 3),
                    "update": round(3 * flops_fwd(n_tok) / 1e9, 3),
                },
                "gflops_per_s": {
                    "gen": round(gen_flop / gen_s / 1e9, 1),
                    "ref": round(flops_fwd(n_tok) / ref_s / 1e9, 1),
                    "update": round(3 * flops_fwd(n_tok) / upd_s / 1e9, 1),
                },
            }
            if name == "full":
                body = measure(body_fwd_bwd, repeats=repeats)["wall_s_median"]
    return out, body


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--which", choices=sorted(PRESETS), default="grpo_small")
    p.add_argument("--model", default=None, help="HF model dir (default: the preset's, built if missing)")
    p.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-steps", type=int, default=NEW_TOKENS, help="decode steps timed (the workload has 64)")
    p.add_argument("--trl-sec-per-step", type=float, default=None, help="TRL's measured sec/step, for max_ratio")
    p.add_argument(
        "--rlspmd-sec-per-step", type=float, default=None, help="rlspmd's measured sec/step, for its share of the floor"
    )
    p.add_argument("--tiny", action="store_true", help="smoke run: the tiny bench model, 2 decode steps, 1 repeat")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    preset = PRESETS[a.which]
    prompt_tokens = prompt_length(a.which, PROMPT_TOKENS)
    if a.tiny:
        preset, a.decode_steps, a.repeats, prompt_tokens = "bench-tiny", 2, 1, PROMPT_TOKENS

    import torch

    from rlspmd.models.loader import load_causal_lm

    path = a.model or model_dir(preset)
    model = load_causal_lm(path, dtype="float32", attn_implementation="sdpa", field_name="--model").eval()
    dtypes = [getattr(torch, d) for d in a.dtypes]
    peaks = machine_peaks(dtypes, repeats=a.repeats, tiny=a.tiny)
    by_dtype, body_s = {}, None
    for name, dtype in zip(a.dtypes, dtypes):
        floors, body = dtype_floor(
            model,
            dtype,
            prompt_tokens=prompt_tokens,
            decode_steps=a.decode_steps,
            repeats=a.repeats,
            copy_gb_s=peaks["copy_gb_s"],
        )
        body_s = body if body_s is None else body_s
        for key in ("full", "shared_prefix"):
            total = floors[key]["floor_s"]["total"]
            if a.trl_sec_per_step:
                floors[key]["max_ratio"] = round(a.trl_sec_per_step / total, 3)
            if a.rlspmd_sec_per_step:
                floors[key]["rlspmd_over_floor"] = round(a.rlspmd_sec_per_step / total, 3)
        by_dtype[name] = floors
    # For scale: the Hugging Face decoder stack's own forward + backward of the same 16 sequences in float32 (every
    # sequence has the same length, so nothing is padded), matmuls and everything else: what a trainer's update pays
    # at least, against the first dtype's matmuls of the same.
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (PROMPTS * SAMPLES, prompt_tokens + NEW_TOKENS))
    autocast = torch.autocast("cpu", dtype=dtypes[0], enabled=dtypes[0] != torch.float32)

    def hf_stack():
        with autocast:
            model.get_decoder()(input_ids=ids).last_hidden_state.float().sum().backward()
        model.zero_grad(set_to_none=True)

    hf_s = measure(hf_stack, repeats=a.repeats)["wall_s_median"]
    first = by_dtype[a.dtypes[0]]
    emit(
        {
            "benchmark": "grpo_floor",
            "workload": {
                "which": a.which,
                "model": path,
                "rows": PROMPTS * SAMPLES,
                "prompt_tokens": prompt_tokens,
                "new_tokens": NEW_TOKENS,
                "decode_steps_timed": a.decode_steps,
                "dtype": a.dtypes[0],
                "trl_sec_per_step": a.trl_sec_per_step,
                "rlspmd_sec_per_step": a.rlspmd_sec_per_step,
            },
            "peaks": peaks,
            "full": first["full"],
            "shared_prefix": first["shared_prefix"],
            "by_dtype": by_dtype,
            "hf_decoder": {
                "fwd_bwd_s": round(hf_s, 6),
                "matmuls_s": round(body_s, 6),
                "outside_matmuls_s": round(hf_s - body_s, 6),
            },
        },
        a.out,
    )


if __name__ == "__main__":
    main()
