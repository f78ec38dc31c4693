"""The fastest a GRPO step of the benchmark workload could be on this machine: its matrix multiplications alone.

    python scripts/bench/grpo_floor.py --which grpo_small --trl-sec-per-step 6.01 --rlspmd-sec-per-step 4.27

Times, in float32 at the workload's exact shapes and with the model's own weights, nothing but the matmuls every
implementation of the step must run:

- ``gen``: the prefill of the 4 distinct prompts, then 64 decode steps of 16 rows through every weight matrix of
  every layer (q, k, v, o, gate, up, down) and the LM head, in layer order (the weights stream from memory at
  every step, as in any decoder); at each row count (prefill, decode) the faster of ``x @ W.T`` and pre-transposed
  weights for the whole chain.
- ``ref``: one forward of the 16 packed sequences (prompt + 64 tokens each) through every matrix, the LM head on the
  1,024 response positions only.
- ``update``: the same forward plus the two backward matmuls of each (input and weight gradients).

No attention, normalisation, activation, sampling, optimiser or communication is timed, so the sum is a floor no
float32 implementation goes under on this machine. ``shared_prefix`` is the same floor for a trainer that runs each
prompt once for its group (4 x 27 prompt tokens instead of 16 x 27). With ``--trl-sec-per-step`` (TRL's median from
``grpo_vs_trl.py``) the JSON adds ``max_ratio``: TRL's time over the floor, the largest speed-up any implementation
could show on this machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, ensure_model, measure  # noqa: E402
from grpo_workload import PRESETS  # noqa: E402

PROMPTS, SAMPLES, PROMPT_TOKENS, NEW_TOKENS = 4, 4, 27, 64


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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--which", choices=sorted(PRESETS), default="grpo_small")
    p.add_argument("--model", default=None, help="HF model dir (default: the preset's, built if missing)")
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
    if a.tiny:
        preset, a.decode_steps, a.repeats = "bench-tiny", 2, 1

    import torch
    import torch.nn.functional as F

    from rlspmd.models.loader import load_causal_lm

    path = ensure_model(a.model, preset=preset)
    model = load_causal_lm(path, dtype="float32", attn_implementation="sdpa", field_name="--model").eval()
    mats = weight_matrices(model)
    head = model.get_output_embeddings().weight.detach()
    hidden = head.shape[1]
    mat_params = sum(w.numel() for w in mats)
    mats_t = [w.t().contiguous() for w in mats]
    head_t = head.t().contiguous()
    g = torch.Generator().manual_seed(0)
    rows = PROMPTS * SAMPLES

    def best_forward(n_rows: int):
        """The chain of matmuls over ``n_rows`` rows in its faster layout,
        and whether that is the pre-transposed one."""
        xs = {k: torch.randn(n_rows, k, generator=g) for k in {w.shape[1] for w in mats}}

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
    prefill, _ = best_forward(PROMPTS * PROMPT_TOKENS)
    step_chain, step_transposed = best_forward(rows)
    x_rows = torch.randn(rows, hidden, generator=g)

    def gen():
        prefill()
        for _ in range(a.decode_steps):
            step_chain()
            torch.mm(x_rows, head_t) if step_transposed else F.linear(x_rows, head)

    def train_passes(prompt_tokens: int):
        """Closures over ``prompt_tokens + rows * 64`` packed tokens: the forward, the forward + backward, and the
        decoder stack's forward + backward without the LM head; and the token count."""
        n_tok = prompt_tokens + rows * NEW_TOKENS
        n_resp = rows * NEW_TOKENS
        xs = {k: torch.randn(n_tok, k, generator=g) for k in {w.shape[1] for w in mats}}
        gs = {n: torch.randn(n_tok, n, generator=g) for n in {w.shape[0] for w in mats}}
        h_resp = torch.randn(n_resp, hidden, generator=g)
        g_logits = torch.randn(n_resp, head.shape[0], generator=g)

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

    out = {}
    with torch.no_grad():
        gen_s = measure(gen, repeats=a.repeats)["wall_s_median"]
        gen_flop = (
            2.0 * (PROMPTS * PROMPT_TOKENS + rows * a.decode_steps) * mat_params
            + 2.0 * rows * a.decode_steps * head.numel()
        )
        for name, prompt_tokens in (("full", rows * PROMPT_TOKENS), ("shared_prefix", PROMPTS * PROMPT_TOKENS)):
            fwd, fwd_bwd, body_fwd_bwd, n_tok = train_passes(prompt_tokens)
            ref_s = measure(fwd, repeats=a.repeats)["wall_s_median"]
            upd_s = measure(fwd_bwd, repeats=a.repeats)["wall_s_median"]
            total = gen_s + ref_s + upd_s
            out[name] = {
                "tokens": n_tok,
                "floor_s": {
                    "gen": round(gen_s, 6),
                    "ref": round(ref_s, 6),
                    "update": round(upd_s, 6),
                    "total": round(total, 6),
                },
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
                body_s = measure(body_fwd_bwd, repeats=a.repeats)["wall_s_median"]
            if a.trl_sec_per_step:
                out[name]["max_ratio"] = round(a.trl_sec_per_step / total, 3)
            if a.rlspmd_sec_per_step:
                out[name]["rlspmd_over_floor"] = round(a.rlspmd_sec_per_step / total, 3)
    # For scale: the Hugging Face decoder stack's own forward + backward of the same 16 x 91 tokens (every sequence has
    # the same length, so nothing is padded), matmuls and everything else: what a trainer's update pays at least.
    model.train()
    ids = torch.randint(0, head.shape[0], (rows, PROMPT_TOKENS + NEW_TOKENS), generator=g)

    def hf_stack():
        model.get_decoder()(input_ids=ids).last_hidden_state.sum().backward()
        model.zero_grad(set_to_none=True)

    hf_s = measure(hf_stack, repeats=a.repeats)["wall_s_median"]
    out["hf_decoder"] = {
        "fwd_bwd_s": round(hf_s, 6),
        "matmuls_s": round(body_s, 6),
        "outside_matmuls_s": round(hf_s - body_s, 6),
    }
    emit(
        {
            "benchmark": "grpo_floor",
            "workload": {
                "which": a.which,
                "model": path,
                "rows": rows,
                "prompt_tokens": PROMPT_TOKENS,
                "new_tokens": NEW_TOKENS,
                "decode_steps_timed": a.decode_steps,
                "dtype": "float32",
                "trl_sec_per_step": a.trl_sec_per_step,
                "rlspmd_sec_per_step": a.rlspmd_sec_per_step,
            },
            **out,
        },
        a.out,
    )


if __name__ == "__main__":
    main()
