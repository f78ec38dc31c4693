"""The megatron-core engine against the FSDP engine (``tests/dist/megatron_check.py`` computes, these tests compare).

On CPU (Gloo): log-probs, entropy and values equal the FSDP engine's on the same HF weights; one update's gradient
(AdamW's first moment: 0.1 x the clipped gradient), gradient norm and weights equal; tensor parallelism (tp=2) and
megatron data parallelism (dp=2) on 2 ranks equal FSDP on 2 ranks; pipeline parallelism (pp=2 on 2 ranks, pp=2 x
tp=2 on 4) equals pp=1 on 1 rank; a checkpoint resumes bit-identically at tp=1 and pp=2, tp=2 and pp=2 checkpoints
load exactly at tp=pp=1, and export reads them; the weight stream gives HF names and full tensors on every rank.
Skipped where megatron-core is absent (``pip install -e ".[megatron]"``). The GPU tests at the bottom run the same
checks on CUDA (megatron's own forward-backward schedule there) and on a real model.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, dist_script, load_script, torchrun

HAS_MEGATRON = (
    importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
)
needs_megatron = pytest.mark.skipif(not HAS_MEGATRON, reason="needs megatron-core (pip install -e '.[megatron]')")

STATE_KEYS = ("model", "exp_avg", "exp_avg_sq", "step")


def test_without_megatron_rlspmd_imports_and_the_engine_says_how_to_install(tiny_model):
    """rlspmd never imports megatron-core at import time;
    building a megatron module without it is a clear ImportError."""
    code = (
        "import sys; sys.modules['megatron'] = None; sys.modules['megatron.core'] = None\n"
        "import rlspmd.config, rlspmd.engines.megatron, rlspmd.models.megatron_convert\n"
        "assert 'third_party.megatron_adapter' not in sys.modules\n"
        "from rlspmd.config import MegatronConfig\n"
        "from rlspmd.engines.megatron import build_megatron_module\n"
        "try:\n"
        f"    build_megatron_module('policy', {str(tiny_model)!r}, mesh=None, device=None, cfg=MegatronConfig())\n"
        "except ImportError as e:\n"
        "    print('IMPORT ERROR:', e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "IMPORT ERROR: the megatron engine needs megatron-core" in proc.stdout
    assert 'pip install -e ".[megatron]"' in proc.stdout


def assert_engines_agree(ref: dict, got: dict, *, what: str) -> None:
    """Same outputs, gradient and update (float32, different kernels: tolerances at float32 rounding)."""
    torch.testing.assert_close(
        got["logprobs"], ref["logprobs"], rtol=0, atol=1e-5, msg=lambda m: f"{what} logprobs: {m}"
    )
    torch.testing.assert_close(got["entropy"], ref["entropy"], rtol=0, atol=2e-5, msg=lambda m: f"{what} entropy: {m}")
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), what
    assert got["lr"] == ref["lr"]
    assert sorted(got["model"]) == sorted(ref["model"]), what  # the FSDP root module's names, tied head included
    assert sorted(got["exp_avg"]) == sorted(ref["exp_avg"]), what
    for name, m in ref["exp_avg"].items():  # 0.1 x the clipped gradient
        torch.testing.assert_close(
            got["exp_avg"][name],
            m,
            rtol=1e-4,
            atol=1e-5 * float(m.abs().max()) + 1e-12,
            msg=lambda msg: f"{what} gradient of {name}: {msg}",
        )
    for name, w in ref["model"].items():
        torch.testing.assert_close(
            got["model"][name], w, rtol=0, atol=5e-5, msg=lambda m: f"{what} {name} after the update: {m}"
        )


def assert_same_state(a: dict, b: dict, *, what: str) -> None:
    assert a["lr"] == b["lr"], what
    for part in STATE_KEYS:
        assert sorted(a[part]) == sorted(b[part]), (what, part)
        for name, t in a[part].items():
            assert torch.equal(b[part][name], t), f"{what}: {part} {name} differs"


def untied_llama(tmp_path: Path) -> Path:
    return load_script("scripts/models/build_tiny.py").build(
        tmp_path / "llama_untied", arch="llama", tie_embeddings=False
    )


def run_single(out: Path, models: list[Path]) -> dict:
    torchrun([dist_script("megatron_check.py"), "single", str(out), *map(str, models)], 1, timeout=900)
    return torch.load(out / "single_rank0.pt", weights_only=False)


@needs_megatron
@pytest.mark.dist
@pytest.mark.slow
def test_one_rank_matches_fsdp_and_resumes_exactly(tiny_model, tmp_path):
    """Qwen2 (GQA, qkv bias, tied embeddings) and an untied Llama: forward and one update equal FSDP's; the critic's
    values equal ``ValueModel``'s; 2 updates + save + load + 1 update is bit-identical to 3 updates; the checkpoint
    reads back under the HF names export uses; an HF directory written from the engine gives its log-probs."""
    llama = untied_llama(tmp_path)
    r = run_single(tmp_path, [tiny_model, llama])
    for model in (tiny_model, llama):
        assert_engines_agree(r[str(model)]["fsdp"], r[str(model)]["megatron"], what=model.name)
    assert 0.5 < r[str(tiny_model)]["fsdp"]["grad_norm"]  # grad_clip=0.5 is active: clipping is compared too
    assert "hf.lm_head.weight" in r[str(llama)]["megatron"]["exp_avg"]  # untied: the head is trained separately
    torch.testing.assert_close(r["values"]["megatron"], r["values"]["fsdp"], rtol=0, atol=1e-6)
    assert r["values"]["fsdp"].abs().max() > 1e-3
    assert_same_state(r["resume"]["straight"], r["resume"]["resumed"], what="resume")
    assert r["resume"]["straight"]["step"]["hf.model.norm.weight"] == 3
    e = r["hf_export"]
    torch.testing.assert_close(e["hf_dir"][0], e["engine"][0], rtol=0, atol=1e-5)
    exported, engine = r["export"]["read"], r["export"]["engine"]
    assert sorted(exported) == sorted(engine) and all(torch.equal(exported[k], engine[k]) for k in engine)


@needs_megatron
@pytest.mark.dist
@pytest.mark.slow
def test_tensor_and_data_parallel_match_fsdp_and_reshard(tiny_model, tmp_path):
    """2 ranks, each with its own half of the batch: megatron tp=2 and megatron dp=2 equal FSDP on 2 ranks; the tp=2
    weight stream yields every HF tensor in full (the same on both ranks); its checkpoint loads exactly at tp=1."""
    torchrun([dist_script("megatron_check.py"), "parallel", str(tmp_path), str(tiny_model)], 2, timeout=900)
    ranks = [torch.load(tmp_path / f"parallel_rank{r}.pt", weights_only=False) for r in (0, 1)]
    for r, res in enumerate(ranks):
        for name in ("megatron_tp2", "megatron_dp2"):
            assert_engines_agree(res["fsdp"], res[name], what=f"rank {r} {name}")
    assert [res["rank"] for res in ranks] == [[0, 0], [1, 0]]  # (tp rank, dp rank): both ranks in one TP group
    full = ranks[0]["full_state_dict"]
    assert ranks[1]["full_state_dict"] == {}  # on the mesh's first rank only
    assert all(torch.equal(full[k], ranks[0]["tp2_state"]["model"][k]) for k in full)
    stream = ranks[0]["stream"]["tensors"]
    names = [n for n, _ in stream]
    assert names == ranks[0]["stream"]["manifest"] and len(names) == len(set(names)) == len(full) - 1  # tied head once
    for name, t in stream:
        assert t.dtype == torch.bfloat16 and torch.equal(t, full["hf." + name].to(torch.bfloat16)), name
    assert [n for n, _ in ranks[1]["stream"]["tensors"]] == names
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(stream, ranks[1]["stream"]["tensors"]))
    assert ranks[0]["stream"]["gathered_bytes"] > 0
    torchrun([dist_script("megatron_check.py"), "reshard", str(tmp_path), str(tiny_model)], 1, timeout=900)
    resharded = torch.load(tmp_path / "reshard_rank0.pt", weights_only=False)["state"]
    assert_same_state(ranks[0]["tp2_state"], resharded, what="tp=2 checkpoint loaded at tp=1")


def merged_stages(ranks: list[dict]) -> dict:
    """The union of the pipeline stages' training states (a key two stages hold, the tied embedding, must agree)."""
    out = {"lr": ranks[0]["lr"]}
    for part in STATE_KEYS:
        out[part] = {}
        for res in ranks:
            for name, t in res[part].items():
                if name in out[part]:
                    assert torch.equal(out[part][name], t), f"the stages disagree on {part} {name}"
                out[part][name] = t
    return out


def assert_pipeline_matches(ref: dict, ranks: list[dict], models: list[str], *, what: str) -> None:
    """Each rank's outputs equal the reference's rows of its share of the batch; the merged stages' gradient and
    update equal the reference's; every rank streams the whole HF state dict; pp resume is bit-identical."""
    n = 8 // len(ranks)
    rows = [slice(r * n, (r + 1) * n) for r in range(len(ranks))]  # each rank's rows of the reference batch
    for model in models:
        want = ref[model]["megatron"]
        got = [res[model]["megatron"] for res in ranks]
        for r, g in enumerate(got):
            torch.testing.assert_close(g["logprobs"], want["logprobs"][rows[r]], rtol=0, atol=1e-5)
            torch.testing.assert_close(g["entropy"], want["entropy"][rows[r]], rtol=0, atol=2e-5)
            assert g["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), what
            assert g["lr"] == want["lr"]
        merged = merged_stages(got)
        assert sorted(merged["model"]) == sorted(want["model"]), (what, model)
        for name, m in want[
            "exp_avg"
        ].items():  # 0.1 x the clipped gradient, summed over micro-batches in another order
            torch.testing.assert_close(
                merged["exp_avg"][name],
                m,
                rtol=0,
                atol=1e-5 * float(m.abs().max()) + 1e-12,
                msg=lambda msg: f"{what} {model} gradient of {name}: {msg}",
            )
        # Adam's first step moves every weight by ~lr: elements whose gradient is ~eps amplify float32 rounding.
        for name, w in want["model"].items():
            torch.testing.assert_close(
                merged["model"][name], w, rtol=0, atol=5e-5, msg=lambda m: f"{what} {model} {name}: {m}"
            )
    for r, res in enumerate(ranks):
        torch.testing.assert_close(res["values"], ref["values"][rows[r]], rtol=0, atol=1e-6)
    full = ref["full_state_dict"]
    assert all(res["full_state_dict"] == {} for res in ranks[1:])  # on the mesh's first rank only
    assert sorted(ranks[0]["full_state_dict"]) == sorted(full)
    for name, t in ranks[0]["full_state_dict"].items():
        torch.testing.assert_close(
            t, full[name], rtol=0, atol=5e-5, msg=lambda m: f"{what} full_state_dict {name}: {m}"
        )
    streams = [res["stream"] for res in ranks]
    for stream in streams:
        assert [n for n, _ in stream] == [k[len("hf.") :] for k in full if k != "hf.lm_head.weight"]  # tied head once
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(stream, streams[0]))  # every rank streams the same
    assert all(torch.equal(t, ranks[0]["full_state_dict"]["hf." + n]) for n, t in streams[0])
    assert all(res["param_shapes"] == ref["param_shapes"] for res in ranks)
    for res in ranks:
        assert_same_state(res["resume"]["straight"], res["resume"]["resumed"], what=f"{what} resume")
        assert "runs without autograd only" in res["grad_call"]


@needs_megatron
@pytest.mark.dist
@pytest.mark.slow
def test_pipeline_parallel_matches_one_rank(tiny_model, tmp_path):
    """pp=2 on 2 ranks and pp=2 x tp=2 on 4 ranks (each rank with its own share of the batch; the loss on the last
    stage, GPipe over Gloo) against pp=1 on 1 rank with the whole batch, for the tied Qwen2 (the embedding on both
    end stages) and an untied Llama (the head on the last stage): the same log-probs, entropy, values, gradient norm,
    gradient (AdamW's first moment) and weights after one update; every rank's weight stream and the
    ``full_state_dict`` are the whole HF state dict; a pp=2 checkpoint resumes bit-identically and loads exactly at
    pp=1."""
    llama = untied_llama(tmp_path)
    models = [str(tiny_model), str(llama)]
    torchrun([dist_script("megatron_check.py"), "pipeline_ref", str(tmp_path), *models], 1, timeout=900)
    ref = torch.load(tmp_path / "pipeline_ref_rank0.pt", weights_only=False)
    torchrun([dist_script("megatron_check.py"), "pipeline", str(tmp_path), *models], 2, timeout=900)
    ranks = [torch.load(tmp_path / f"pipeline_rank{r}.pt", weights_only=False) for r in range(2)]
    for model in models:  # tied: both end stages hold (and save) the embedding
        got = [res[model]["megatron"]["model"] for res in ranks]
        assert set(got[0]).isdisjoint(got[1]) == (model == str(llama))
    assert_pipeline_matches(ref, ranks, models, what="pp=2")
    torchrun(
        [dist_script("megatron_check.py"), "reshard", str(tmp_path), str(tiny_model), "ckpt_pp2_tp1"], 1, timeout=900
    )
    resharded = torch.load(tmp_path / "reshard_rank0.pt", weights_only=False)["state"]
    assert_same_state(merged_stages([res["saved"] for res in ranks]), resharded, what="pp=2 checkpoint loaded at pp=1")
    torchrun([dist_script("megatron_check.py"), "pipeline_tp", str(tmp_path), *models], 4, timeout=900)
    ranks = [torch.load(tmp_path / f"pipeline_tp_rank{r}.pt", weights_only=False) for r in range(4)]
    assert_pipeline_matches(ref, ranks, models, what="pp=2 x tp=2")


@needs_megatron
@pytest.mark.dist
@pytest.mark.slow
def test_trainer_with_pipeline_stages_logs_what_one_stage_logs(tiny_model, arithmetic_data, tmp_path):
    """PPO (GAE) through the trainer with the actor and the critic on ``engine=megatron``, at pp=2 and at pp=1 (2 ranks,
    2 steps): the loss functions' metrics, recorded on the last stage for both ranks' rows, reduce to the same values
    as with every rank recording its own, and the second step sees the same updated policy and critic."""

    def run(pp: int) -> list[dict]:
        out = tmp_path / f"pp{pp}"
        torchrun(
            [
                "-m",
                "rlspmd.train",
                "--config",
                "configs/quickstart.py",
                "--actor.model.path",
                str(tiny_model),
                "--data.train-files",
                str(arithmetic_data / "train.parquet"),
                "--data.val-files",
                str(arithmetic_data / "test.parquet"),
                "--data.train-batch-size",
                "4",
                "--actor.mini-batch-size",
                "4",
                "--actor.micro-batch-size",
                "2",
                "--critic.mini-batch-size",
                "4",
                "--critic.micro-batch-size",
                "2",
                "algorithm.adv-estimator:gae",
                "--rollout.n",
                "2",
                "--rollout.max-response-length",
                "8",
                "--data.max-val-samples",
                "8",
                "--trainer.total-steps",
                "2",
                "--trainer.val-every",
                "0",
                "--trainer.output-dir",
                str(out),
                "actor.engine:megatron",
                "--actor.engine.pp",
                str(pp),
                "critic.engine:megatron",
                "--critic.engine.pp",
                str(pp),
            ],
            2,
        )
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    one, two = run(1), run(2)
    assert [r["step"] for r in one] == [r["step"] for r in two] == [0, 1, 2]
    for a, b in zip(one, two):
        keys = sorted(k for k in a if k.startswith(("actor/", "critic/")))
        assert keys == sorted(k for k in b if k.startswith(("actor/", "critic/")))
        for k in keys:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (a["step"], k)
    assert one[-1]["actor/grad_norm"] > 0 and one[-1]["critic/grad_norm"] > 0 and one[-1]["critic/vf_loss"] > 0


# -- GPU ------------------------------------------------------------------------------------------------------------

Q05 = Path(os.environ.get("RLSPMD_Q05_MODEL", ROOT / "models" / "Qwen2.5-0.5B-Instruct"))


@pytest.mark.gpu
@needs_megatron
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_one_rank_matches_fsdp(tiny_model, tmp_path):
    """One GPU (TP=PP=1, float32 compute): the CPU checks on CUDA, where the update runs through megatron's
    ``forward_backward_no_pipelining``."""
    llama = untied_llama(tmp_path)
    r = run_single(tmp_path, [tiny_model, llama])
    for model in (tiny_model, llama):
        assert_engines_agree(r[str(model)]["fsdp"], r[str(model)]["megatron"], what=f"cuda {model.name}")
    assert_same_state(r["resume"]["straight"], r["resume"]["resumed"], what="cuda resume")


@pytest.mark.gpu
@needs_megatron
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(
    not (Q05 / "config.json").is_file(), reason=f"needs Qwen2.5-0.5B-Instruct at {Q05} (RLSPMD_Q05_MODEL)"
)
def test_gpu_q05_matches_fsdp(tmp_path):
    r = run_single(tmp_path, [Q05])
    assert_engines_agree(r[str(Q05)]["fsdp"], r[str(Q05)]["megatron"], what="q05")


@pytest.mark.gpu
@needs_megatron
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_tensor_parallel_matches_fsdp(tiny_model, tmp_path):
    torchrun([dist_script("megatron_check.py"), "parallel", str(tmp_path), str(tiny_model)], 2, timeout=900)
    for r in (0, 1):
        res = torch.load(tmp_path / f"parallel_rank{r}.pt", weights_only=False)
        for name in ("megatron_tp2", "megatron_dp2"):
            assert_engines_agree(res["fsdp"], res[name], what=f"cuda rank {r} {name}")


@pytest.mark.gpu
@needs_megatron
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_pipeline_parallel_matches_one_rank(tiny_model, tmp_path):
    """pp=2 on 2 GPUs through megatron's own 1F1B schedule (NCCL p2p) against pp=1 on one GPU."""
    llama = untied_llama(tmp_path)
    models = [str(tiny_model), str(llama)]
    torchrun([dist_script("megatron_check.py"), "pipeline_ref", str(tmp_path), *models], 1, timeout=900)
    torchrun([dist_script("megatron_check.py"), "pipeline", str(tmp_path), *models], 2, timeout=900)
    ref = torch.load(tmp_path / "pipeline_ref_rank0.pt", weights_only=False)
    ranks = [torch.load(tmp_path / f"pipeline_rank{r}.pt", weights_only=False) for r in range(2)]
    assert_pipeline_matches(ref, ranks, models, what="cuda pp=2")
