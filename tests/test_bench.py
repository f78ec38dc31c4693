"""The benchmark workload and scripts run and print what the README says they print (smoke runs; speed is
measured by the scripts themselves, never asserted here)."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.dist


def run(args, timeout=600):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_grpo_bench_config_runs_the_fixed_workload_and_prints_json(tiny_model, tmp_path):
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    from grpo_workload import write_prompts

    prompts = write_prompts(str(tiny_model), tmp_path / "prompts.jsonl", num_prompts=8, prompt_tokens=27)
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    for r in rows:  # every prompt is exactly 27 tokens once templated
        ids = tok.apply_chat_template(r["prompt"], tokenize=True, add_generation_prompt=True)
        assert len(ids["input_ids"] if hasattr(ids, "keys") else ids) == 27
    out = tmp_path / "run"
    stdout = run(
        [
            "-m",
            "rlspmd.train",
            "--config",
            "configs/bench/grpo_tiny.py",
            "--actor.model.path",
            str(tiny_model),
            "--data.train-files",
            str(prompts),
            "--data.val-files",
            str(prompts),
            "--trainer.total-steps",
            "2",
            "--trainer.output-dir",
            str(out),
            "--rollout.max-response-length",
            "16",
        ]
    )
    summary = json.loads(stdout.strip().splitlines()[-1])["summary"]
    assert summary["steps"] == 2 and summary["sec_per_step"] > 0 and summary["gen_tokens_per_sec"] > 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:  # 4 prompts x 4 samples, every response exactly max_response_length (EOS suppressed)
        assert m["tokens/response"] == 16 * 16 and m["response_length/clip_ratio"] == 1.0
        assert m["adv/max"] == 0 and m["adv/min"] == 0  # no reward: zero advantages, and the step still updates
        assert "actor/grad_norm" in m and m["timing/update_actor"] > 0 and m["timing/ref"] > 0


@pytest.mark.parametrize("script", ["gen_vs_hf.py", "packed_vs_padded.py"])
def test_micro_benchmarks_smoke(script):
    result = json.loads(run([f"scripts/bench/{script}", "--tiny"]).strip().splitlines()[-1])
    assert result["ratio"] > 0 and "machine" in result


def test_grpo_floor_counts_the_workload_matmuls():
    """The floor benchmark times the matmuls of exactly the workload: FLOP counts checked by hand for bench-tiny
    (hidden 64, 2 layers, 2/1 heads of 32, intermediate 128, vocab 512): per layer q 64x64, k and v 32x64, o 64x64,
    gate and up 128x64, down 64x128 = 36,864 weights; 2 layers = 73,728."""
    r = json.loads(run(["scripts/bench/grpo_floor.py", "--tiny", "--trl-sec-per-step", "10"]).strip().splitlines()[-1])
    mats, head = 73_728, 512 * 64
    full_tokens, shared_tokens, resp = 16 * 27 + 16 * 64, 4 * 27 + 16 * 64, 16 * 64
    assert r["full"]["tokens"] == full_tokens and r["shared_prefix"]["tokens"] == shared_tokens
    ref = 2 * full_tokens * mats + 2 * resp * head
    assert r["full"]["gflop"]["ref"] == pytest.approx(ref / 1e9, abs=1e-3)
    assert r["full"]["gflop"]["update"] == pytest.approx(3 * ref / 1e9, abs=1e-3)
    assert r["full"]["gflop"]["gen"] == pytest.approx(
        (2 * (4 * 27 + 16 * 2) * mats + 2 * 16 * 2 * head) / 1e9, abs=1e-3
    )
    for name in ("full", "shared_prefix"):
        f = r[name]["floor_s"]
        assert f["total"] == pytest.approx(f["gen"] + f["ref"] + f["update"], abs=1e-5)
        assert r[name]["max_ratio"] == pytest.approx(10 / f["total"], rel=1e-2)


@pytest.mark.slow
def test_gpu_suite_smoke_runs_every_phase_and_reports_json(tmp_path):
    """``gpu_suite.py --smoke``: every phase runs end to end on tiny shapes (on CPU here), each benchmark prints one
    JSON line, and the figures follow from the measured fields (MFU inputs checked by hand for bench-tiny)."""
    out = tmp_path / "suite"
    stdout = run(["scripts/bench/gpu_suite.py", "--smoke", "--out-dir", str(out)], timeout=1500)
    lines = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
    assert lines == [json.loads(x) for x in (out / "gpu_suite.jsonl").read_text().splitlines()]
    by = {}
    for x in lines:
        by.setdefault(x.get("bench") or x.get("benchmark"), []).append(x)
    for phase in ("build", "attention", "rlspmd", "trl", "generation", "tests", "moe", "q15", "sequence_parallel"):
        (status,) = by[f"gpu_suite/{phase}"]
        assert status["returncode"] == 0 and not status["timed_out"], status
        assert (out / f"{phase}.log").is_file()
    kernels = {x["kernel"]: x for x in by["attn_kernel"]}
    assert set(kernels) == {"sdpa_loop", "varlen", "flex", "flash_attn"} and kernels["sdpa_loop"]["fwd_bwd_ms"] > 0
    import torch

    if not torch.cuda.is_available():  # CPU: the CUDA kernels say why they did not run
        assert all(kernels[k]["skipped"] for k in ("varlen", "flex", "flash_attn"))
    q05, q15 = sorted(by["grpo_stages"], key=lambda x: x["config"])
    assert q05["config"] == "configs/bench/grpo_q05.py:smoke" and q05["steps_done"] == 2
    # bench-tiny: hidden 64, 2 layers, 2 / 1 heads of 32, intermediate 128, vocab 512 (tied); per layer q 64x64 + 64,
    # k and v 32x64 + 32, o 64x64, MLP 3 x 64x128, two norms of 64: 37,120; 2 layers + embedding 32,768 + final norm 64
    assert q05["n_params"] == 2 * 37_120 + 32_768 + 64 == 107_072
    assert q05["tokens_per_step"] == 4 * 2 * (27 + 16)  # 4 prompts x 2 samples, 27-token prompts, 16 new tokens
    s = q05["stages_s"]
    assert s["step"] >= s["gen"] + s["ref"] + s["update"] > 0
    assert q05["tflops"]["update"] == pytest.approx(6 * 107_072 * 344 / s["update"] / 1e12)
    assert q05["tflops"]["ref"] == pytest.approx(2 * 107_072 * 344 / s["ref"] / 1e12)
    assert q05["gen_tokens_per_s"] == pytest.approx(4 * 2 * 16 / s["gen"])
    if q05["device"] == "cpu":  # no dense-bf16 peak, memory counter or kernels to report on CPU
        assert q05["mfu"] is None and q05["peak_mem_gib"] is None
        # on CPU generation is profiled too (no CUDA graphs to hide from the profiler), each stage with its top ops
        assert set(q05["gpu_busy"]) == {"gen", "update", "ref"} and q05["gpu_busy"]["update"]["busy"] is None
        top = q05["gpu_busy"]["update"]["top_cpu_ops"]
        assert top and all(op["ms"] >= 0 and op["calls"] > 0 for op in top)
        assert any(op["op"] in ("aten::mm", "aten::addmm", "aten::bmm") for op in top), top
    assert q15["config"] == "configs/bench/grpo_q15.py:smoke" and q15["gpu_busy"] is None  # --profile-step 0
    (trl,) = by["trl_grpo"]
    assert "skipped" in trl or trl["sec_per_step"] > 0
    (ratio,) = by["grpo_vs_trl"]
    assert ratio["ratio"] == (None if "skipped" in trl else pytest.approx(trl["sec_per_step"] / q05["sec_per_step"]))
    gens = {(x["workload"]["batch"], x["workload"]["new_tokens"]): x for x in by["gen_vs_hf"]}
    assert set(gens) == {(8, 8), (4, 8)} and all(g["ratio"] > 0 for g in gens.values())
    (tests,) = by["gpu_tests"]
    assert tests["failed"] == 0 and (tests["passed"] > 0 or not torch.cuda.is_available())
    moe = {x["path"]: x for x in by["moe_experts"]}
    assert moe["loop"]["ms"] > 0 and moe["loop"]["rel_err"] < 1e-5  # float32 loop against itself (smoke)
    assert "skipped" in moe["grouped"] or moe["grouped"]["rel_err"] < 2e-2
    (sp,) = by["sequence_parallel"]
    if torch.cuda.device_count() < 2:  # CPU: 2 ranks, SP 1 and 2 (a 1-GPU machine: skipped)
        assert "skipped" in sp or {r["sp"]: r["mode"] for r in sp["runs"]} == {1: None, 2: "ulysses"}
    (summary,) = by["gpu_suite/summary"]
    targets = summary["targets"]
    assert targets["gen_tokens_per_s_256x256"]["value"] == gens[(8, 8)]["native"]["tokens_per_s"]
    assert targets["gen_ratio_vs_hf_64x256"]["value"] == gens[(4, 8)]["ratio"]
    assert targets["grpo_vs_trl"]["target"] == 4.0 and summary["elapsed_s"] > 0


def test_gpu_suite_kills_a_phase_that_runs_over_its_limit(tmp_path):
    """A phase past its time limit is killed with its whole process group (children included) and reported."""
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    from gpu_suite import run_phase

    marker = tmp_path / "child_survived"
    child = f"import time; time.sleep(4); open({str(marker)!r}, 'w').write('x')"
    code = (
        f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); "
        "print('started', flush=True); time.sleep(60)"
    )
    lines, status = run_phase("sleepy", ["-c", code], 2.0, tmp_path)
    assert status["timed_out"] and status["seconds"] < 30 and lines == []
    assert "started" in (tmp_path / "sleepy.log").read_text()
    import time

    time.sleep(5)
    assert not marker.exists()  # the grandchild went down with the group


def test_stage_ablation_swaps_attention_out_of_the_update_and_reports_every_variant(tiny_model, tmp_path):
    """``stage_ablation.py``: each variant's calls of the update ran, and the ablated ones really ran the stand-in
    instead of the packed-attention kernel (counted per variant), alternating in one process."""
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    from grpo_workload import write_prompts

    prompts = write_prompts(str(tiny_model), tmp_path / "prompts.jsonl", num_prompts=8, prompt_tokens=27)
    config = tmp_path / "ablate.py"
    config.write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT / 'configs' / 'bench')!r})\nfrom grpo_tiny import workload\n"
        f"config = workload({str(tiny_model)!r}, 'ablate', steps=2, data={str(prompts)!r})\n"
    )
    variants = ["baseline", "no_attention", "no_attention_kernel", "heap_malloc"]
    args = ["--config", str(config), "--variants", ",".join(variants), "--rounds", "2"]
    r = json.loads(
        run(["scripts/bench/stage_ablation.py", *args, "--output-dir", str(tmp_path / "out")]).strip().splitlines()[-1]
    )
    assert r["bench"] == "stage_ablation" and r["stage"] == "update"
    assert sorted(r["median_s"]) == sorted(variants) and all(len(r["all_s"][v]) == 2 for v in variants)
    assert all(s > 0 for v in variants for s in r["all_s"][v])
    calls = r["attention_calls"]
    layers = json.loads((tiny_model / "config.json").read_text())["num_hidden_layers"]
    # one micro-batch per update (the workload's 16 sequences), one kernel call per layer
    assert calls["baseline"] == {"kernel": 2 * layers, "stand_in": 0}
    assert calls["heap_malloc"] == calls["baseline"]
    for v in ("no_attention", "no_attention_kernel"):
        assert calls[v] == {"kernel": 0, "stand_in": calls["baseline"]["kernel"]}
    assert set(r["saving_s"]) == set(variants) - {"baseline"}
