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
    stdout = run(["-m", "rlspmd.train", "--config", "configs/bench/grpo_tiny.py", "--actor.model.path", str(tiny_model),
                  "--data.train-files", str(prompts), "--data.val-files", str(prompts),
                  "--trainer.total-steps", "2", "--trainer.output-dir", str(out), "--rollout.max-response-length", "16"])
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
    assert r["full"]["gflop"]["gen"] == pytest.approx((2 * (4 * 27 + 16 * 2) * mats + 2 * 16 * 2 * head) / 1e9, abs=1e-3)
    for name in ("full", "shared_prefix"):
        f = r[name]["floor_s"]
        assert f["total"] == pytest.approx(f["gen"] + f["ref"] + f["update"], abs=1e-5)
        assert r[name]["max_ratio"] == pytest.approx(10 / f["total"], rel=1e-2)
