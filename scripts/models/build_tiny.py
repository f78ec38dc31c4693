"""Build a tiny, randomly initialised Hugging Face causal LM directory, offline and deterministically.

Tests, the quickstart and the benchmarks need a real HF model directory (config, safetensors, tokenizer
with a chat template) that loads with ``AutoModelForCausalLM``/``AutoTokenizer`` and never touches the
Hub. This script makes one from nothing:

* Tokenizer: a byte-level BPE trained with `tokenizers` on a fixed synthetic corpus (arithmetic
  problems and solutions in the dataset format of ``scripts/data/arithmetic.py``, small word problems,
  filler English). Every digit is its own pre-token, so numbers are spelled out digit by digit.
  Special tokens follow Qwen2 (ChatML): ``<|endoftext|>`` pads, ``<|im_end|>`` ends a turn; no BOS
  token is added. The corpus does not depend on ``--seed``, so every model built with the same
  vocabulary arguments shares one tokenizer.
* Pre-tokenization is Qwen2's (NFC, its split regex, byte-level without regex) rather than a
  ``Digits`` + ``ByteLevel`` sequence: for ``model_type == "qwen2"`` transformers 5's ``AutoTokenizer``
  loads ``Qwen2Tokenizer``, which discards the normalizer and pre-tokenizer in ``tokenizer.json`` and
  installs Qwen2's. Training with that same pipeline keeps ``tokenizer.json`` and ``AutoTokenizer``
  in exact agreement for both architectures. Its regex isolates every numeric character, so digits
  still tokenize one per token.
* Model: a Qwen2 or Llama config with random weights drawn under ``torch.manual_seed(seed)``; with ``--moe`` (or
  ``--arch qwen3_moe``) a Qwen3-MoE (every layer sparse: ``--num-experts`` experts of ``--moe-intermediate-size``,
  ``--top-k`` per token, normalised top-k probabilities), with ``--arch qwen2_moe`` a Qwen2-MoE (the same plus a
  gated shared expert of ``--intermediate-size``). Experts are saved one tensor each, as transformers writes them.
* Model: a Qwen2 or Llama config with random weights drawn under ``torch.manual_seed(seed)``.
* ``--vision``: a Qwen2.5-VL-style model instead: the same tokenizer plus Qwen2-VL's vision tokens
  (``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>``, special), a chat template whose
  message content may also be a list of parts (``{"type": "image"}`` renders as
  ``<|vision_start|><|image_pad|><|vision_end|>``), a small vision tower (``VISION_DEFAULTS``) and Qwen2-VL's image
  processor (``preprocessor_config.json``; transformers' PIL backend, which needs no torchvision), sized for small
  images: at most ``--max-pixels`` pixels, so a 112 x 112 image is 8 x 8 patches and 16 image tokens.
* ``--vision qwen3_vl``: a Qwen3-VL-style model instead of Qwen2.5-VL: a Qwen3 language model (q/k norms) with
  interleaved M-RoPE, Qwen3-VL's vision tower (``QWEN3_VISION_DEFAULTS``: 16-pixel patches, learned position
  embeddings, two DeepStack mergers whose features go into the first two decoder layers) and the same image
  processor with 16-pixel patches.

Same arguments give byte-identical ``tokenizer.json`` and ``model.safetensors``.

    python scripts/models/build_tiny.py --out models/tiny
    python scripts/models/build_tiny.py --out models/b256 --hidden-size 256 --intermediate-size 688 --vocab-size 8192
    python scripts/models/build_tiny.py --out models/tiny-moe --moe        # Qwen3-MoE, 8 experts, top-2
    python scripts/models/build_tiny.py --out models/tiny-vl3 --vision qwen3_vl
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
# BPE target when --vocab-size is not given; the model's vocab is then the trained size rounded up to 64.
DEFAULT_TOKENIZER_VOCAB = 1024
# Every byte plus the special tokens must fit: a smaller vocabulary cannot encode arbitrary text.
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)

# Qwen2's pre-tokenization regex (see the module docstring for why it must be exactly this): contractions,
# words with one leading non-letter, single digits, punctuation runs, newlines, whitespace.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML without a default system prompt: a system turn appears only when the caller passes one.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The same ChatML plus tools (``--tools``): the schemas as a compact system turn ("Tools:" then one
# ``name(arguments): description`` line per tool, short on purpose for a model this small), tool results as a user
# turn of ``<tool_response>`` blocks (Qwen2.5's layout), assistant ``tool_calls`` as ``<tool_call>`` JSON. Without tools
# and tool messages it renders exactly what CHAT_TEMPLATE renders.
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n' }}{% endif %}"
    "{{ 'Tools:' }}"
    "{% for tool in tools %}{% set f = tool['function'] if 'function' in tool else tool %}"
    "{{ '\\n' + f['name'] + '(' + (f['parameters']['properties'] | list | join(', ')) + '): ' + f['description'] }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and tools and loop.first %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{% if message['tool_calls'] is defined %}{% for call in message['tool_calls'] %}"
    "{% set fn = call['function'] if 'function' in call else call %}"
    "{{ '<tool_call>' + ({'name': fn['name'], 'arguments': fn['arguments']} | tojson) + '</tool_call>' }}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
"""Special tokens of a ``--vision`` model (Qwen2-VL's): an image in a prompt is ``<|vision_start|><|image_pad|>
<|vision_end|>``, and the processor repeats ``<|image_pad|>`` once per image token."""
VISION_CONTENT = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
)
"""Prepended to a ``--vision`` model's template; its messages' ``content`` is rendered through ``render``."""
VISION_DEFAULTS = dict(
    depth=2,
    hidden_size=64,
    intermediate_size=128,
    num_heads=2,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=56,
    fullatt_block_indexes=[1],
    tokens_per_second=2,
)
"""The tiny vision tower: two blocks (the first with window attention over 2 x 2 merged patches, the second full)."""
QWEN3_VISION_DEFAULTS = dict(
    depth=2,
    hidden_size=64,
    intermediate_size=128,
    num_heads=2,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=64,
    deepstack_visual_indexes=[0, 1],
)
"""The tiny Qwen3-VL vision tower: two blocks, an 8 x 8 grid of learned position embeddings (interpolated to each
image's grid), and a DeepStack merger after each block (their features are added to decoder layers 0 and 1)."""
VISION_ARCHS = ("qwen2_5_vl", "qwen3_vl")


def vision_template(template: str) -> str:
    """``template`` with message content that may be a list of text and image parts (``VISION_CONTENT``)."""
    return VISION_CONTENT + template.replace("message['content']", "render(message['content'])")


TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
"""Added (not special) tokens of a ``--tools`` model, as in Qwen2.5: a call's tags are one token each and survive
decoding, where the parser reads them."""

_NAMES = "Tom Anna James Maria Li Sara Omar Kate Ben Nina John Emma Raj Mia Paul Zoe".split()
_ITEMS = "apple book coin pencil cookie marble ticket flower card stamp egg shell box cup toy bottle".split()
_WORDS = (
    "the a an of to and in is it that for on with as at by from this be are was were has have had not "
    "but or if then so because when while each every some many more less most first last next after "
    "before step answer final total number sum difference result value think let us find how much what "
    "which who does do did can will would should make take give buy sell pay cost price money dollars "
    "cents hours minutes days weeks year time people children friends school store market house garden "
    "train car road water tree bird dog cat small large new old good best long short left right again "
    "only also very all both half twice three four five six seven eight nine ten hundred thousand"
).split()


def _load_arithmetic() -> ModuleType:
    """The dataset script, so the corpus uses exactly the expression and solution format the task uses."""
    path = Path(__file__).resolve().parents[1] / "data" / "arithmetic.py"
    spec = importlib.util.spec_from_file_location("rlspmd_scripts_data_arithmetic", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def synthetic_corpus(num_lines: int = 6000) -> list[str]:
    """Deterministic training text for the tokenizer (fixed seed on purpose, see the module docstring)."""
    arithmetic = _load_arithmetic()
    rng = random.Random("rlspmd/tiny-tokenizer-corpus/v1")
    lines = [
        "You are a helpful assistant.",
        'Let\'s think step by step and output the final answer after "####".',
        'Output the final answer after "####".',
        "user assistant system",
    ]
    for i in range(num_lines):
        kind = i % 3
        if kind == 0:
            expression = arithmetic.make_problem(rng, min_terms=1, max_terms=4, max_value=999, ops="+-*")
            lines += [f"Calculate {expression}.", arithmetic.solve(expression)[0]]
        elif kind == 1:
            name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
            a, b = rng.randint(2, 99), rng.randint(1, 50)
            lines += [
                f"{name} has {a} {item}s and buys {b} more. How many {item}s does {name} have now?",
                f"{name} has {a} + {b} = {a + b} {item}s. #### {a + b}",
            ]
        else:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 14))]
            lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
    return lines


def train_tokenizer(vocab_size: int) -> Any:
    """Byte-level BPE with Qwen2 pre-tokenization (one digit per pre-token); returns a `tokenizers.Tokenizer`."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,  # ids 0, 1, 2 in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(synthetic_corpus(), trainer=trainer)
    return tokenizer


def build(
    out: str | Path = "models/tiny",
    *,
    arch: str = "qwen2",
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 352,
    vocab_size: int | None = None,
    max_position: int = 512,
    tie_embeddings: bool = True,
    dtype: str = "float32",
    seed: int = 0,
    tools: bool = False,
    vision: bool | str = False,
    max_pixels: int = 112 * 112,
    num_experts: int = 8,
    top_k: int = 2,
    moe_intermediate_size: int = 192,
) -> Path:
    """Write the tokenizer and model to ``out`` and return it. ``vocab_size=None`` sizes the model from
    the trained tokenizer (rounded up to a multiple of 64, for matmul-friendly shapes). ``tools``: the tool-calling
    chat template and the ``TOOL_TOKENS`` (agentic RL); the same weights as without (the default vocabulary has room
    for the added tokens). ``vision``: a vision-language model (see the module docstring): True or ``"qwen2_5_vl"``
    for Qwen2.5-VL, ``"qwen3_vl"`` for Qwen3-VL; ``max_pixels``: the image processor's largest image (pixels; larger
    images are scaled down, keeping their aspect ratio). ``num_experts``, ``top_k``, ``moe_intermediate_size``: the
    experts of a MoE ``arch``."""
    import torch
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"--arch must be one of {list(ARCHS)}, got {arch!r}")
    vision = "qwen2_5_vl" if vision is True else vision
    if vision and vision not in VISION_ARCHS:
        raise ValueError(f"--vision must be one of {list(VISION_ARCHS)}, got {vision!r}")
    if arch in MOE_ARCHS and not 0 < top_k <= num_experts:
        raise ValueError(f"--top-k {top_k} must be between 1 and --num-experts {num_experts}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--dtype must be float32 or bfloat16, got {dtype!r}")
    if hidden_size % num_heads:
        raise ValueError(f"--hidden-size {hidden_size} is not divisible by --num-heads {num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"--num-heads {num_heads} is not divisible by --num-kv-heads {num_kv_heads}")
    if vocab_size is not None and vocab_size < MIN_VOCAB:
        raise ValueError(f"--vocab-size must be >= {MIN_VOCAB} (256 bytes + special tokens), got {vocab_size}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    backend = train_tokenizer(vocab_size or DEFAULT_TOKENIZER_VOCAB)
    trained = backend.get_vocab_size()
    needed = trained + (len(TOOL_TOKENS) if tools else 0) + (len(VISION_TOKENS) if vision else 0)
    model_vocab = vocab_size if vocab_size is not None else -(-needed // 64) * 64
    if needed > model_vocab:
        raise ValueError(f"--vocab-size {model_vocab} is smaller than the tokenizer's {needed} tokens")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        padding_side="left",  # rollouts left-pad prompts so generation continues from the right edge
        model_max_length=max_position,
        chat_template=(vision_template if vision else str)(TOOLS_CHAT_TEMPLATE if tools else CHAT_TEMPLATE),
        clean_up_tokenization_spaces=False,
    )
    if tools:
        tokenizer.add_tokens(TOOL_TOKENS)
    if vision:
        tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.save_pretrained(out)

    ids = {tok: backend.token_to_id(tok) for tok in SPECIAL_TOKENS}
    special = dict(bos_token_id=ids[ENDOFTEXT], eos_token_id=ids[IM_END], pad_token_id=ids[ENDOFTEXT])
    if vision:
        return _build_vision(
            out,
            tokenizer,
            special,
            model_vocab=model_vocab,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            max_position=max_position,
            tie_embeddings=tie_embeddings,
            dtype=dtype,
            seed=seed,
            max_pixels=max_pixels,
            family=vision,
        )
    moe = {}
    if arch in MOE_ARCHS:
        moe = dict(
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=moe_intermediate_size,
            norm_topk_prob=True,
        )
        if arch == "qwen2_moe":
            moe["shared_expert_intermediate_size"] = intermediate_size
    config = _config_class(arch)(
        vocab_size=model_vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position,
        tie_word_embeddings=tie_embeddings,
        **special,
        **moe,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Initialise in float32 and cast, so a bf16 model holds the rounded float32 weights of the same seed.
    model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    transformers.GenerationConfig(**special).save_pretrained(out)
    return out


def _build_vision(
    out: Path,
    tokenizer,
    special: dict,
    *,
    model_vocab: int,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    max_position: int,
    tie_embeddings: bool,
    dtype: str,
    seed: int,
    max_pixels: int,
    family: str,
) -> Path:
    """The Qwen2.5-VL- or Qwen3-VL-style (``family``) model and its image processor (``build(vision=...)``)."""
    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    # M-RoPE splits the head's frequency pairs into (temporal, height, width) sections, in Qwen2.5-VL's 2:3:3 ratio
    # (Qwen3-VL: 24:20:20, interleaved)
    pairs = hidden_size // num_heads // 2
    hw = (pairs - pairs // 4) // 2 if family == "qwen2_5_vl" else pairs * 5 // 16
    mrope_section = [pairs - 2 * hw, hw, hw]
    vocab = tokenizer.get_vocab()
    qwen3 = family == "qwen3_vl"
    vision = QWEN3_VISION_DEFAULTS if qwen3 else VISION_DEFAULTS
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section}
    if qwen3:
        rope["mrope_interleaved"] = True
    config_class = transformers.Qwen3VLConfig if qwen3 else transformers.Qwen2_5_VLConfig
    config = config_class(
        text_config=dict(
            vocab_size=model_vocab,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            max_position_embeddings=max_position,
            rope_parameters=rope,
            **({"head_dim": hidden_size // num_heads} if qwen3 else {}),
            **special,
        ),
        vision_config=dict(vision, out_hidden_size=hidden_size),
        image_token_id=vocab["<|image_pad|>"],
        video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"],
        tie_word_embeddings=tie_embeddings,
        **special,
    )
    torch.manual_seed(seed)
    model_class = (
        transformers.Qwen3VLForConditionalGeneration if qwen3 else transformers.Qwen2_5_VLForConditionalGeneration
    )
    model = model_class._from_config(config, dtype=torch.float32)
    model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    transformers.GenerationConfig(**special).save_pretrained(out)
    patch, merge = vision["patch_size"], vision["spatial_merge_size"]
    unit = (patch * merge) ** 2  # the smallest image: one merged patch
    Qwen2VLImageProcessorPil(
        size={"shortest_edge": 4 * unit, "longest_edge": max(max_pixels, 4 * unit)},
        patch_size=patch,
        merge_size=merge,
        temporal_patch_size=vision["temporal_patch_size"],
        **(dict(image_mean=[0.5] * 3, image_std=[0.5] * 3) if qwen3 else {}),  # Qwen3-VL's normalisation
    ).save_pretrained(out)
    # the class name real Qwen2.5-VL checkpoints carry: transformers picks its PIL backend without torchvision
    pre = out / "preprocessor_config.json"
    pre.write_text(pre.read_text().replace('"Qwen2VLImageProcessorPil"', '"Qwen2VLImageProcessor"'))
    return out


ARCHS = ("qwen2", "llama", "qwen3_moe", "qwen2_moe")
MOE_ARCHS = ("qwen3_moe", "qwen2_moe")


def _config_class(arch: str) -> Any:
    import transformers

    return {
        "qwen2": transformers.Qwen2Config,
        "llama": transformers.LlamaConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
    }[arch]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("models/tiny"))
    p.add_argument("--arch", choices=list(ARCHS), default="qwen2")
    p.add_argument("--moe", action="store_true", help="a Qwen3-MoE (same as --arch qwen3_moe)")
    p.add_argument("--num-experts", type=int, default=8, help="experts per MoE layer")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument(
        "--moe-intermediate-size",
        type=int,
        default=192,
        help="an expert's intermediate size (vLLM's CPU build needs a multiple of 32)",
    )
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=352)
    p.add_argument("--vocab-size", type=int, default=None, help="model vocab (default: tokenizer size, rounded to 64)")
    p.add_argument("--max-position", type=int, default=512)
    p.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tools", action="store_true", help="tool-calling chat template and tool-call tokens (agentic RL)")
    p.add_argument(
        "--vision",
        nargs="?",
        const="qwen2_5_vl",
        default=False,
        choices=list(VISION_ARCHS),
        help="a vision-language model (Qwen2.5-VL-style, or --vision qwen3_vl) with a tiny vision tower and image "
        "processor",
    )
    p.add_argument("--max-pixels", type=int, default=112 * 112, help="--vision: the image processor's largest image")
    args = p.parse_args(argv)

    start = time.perf_counter()
    out = build(
        args.out,
        arch="qwen3_moe" if args.moe else args.arch,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        intermediate_size=args.intermediate_size,
        vocab_size=args.vocab_size,
        max_position=args.max_position,
        tie_embeddings=args.tie_embeddings,
        dtype=args.dtype,
        seed=args.seed,
        tools=args.tools,
        vision=args.vision,
        max_pixels=args.max_pixels,
        num_experts=args.num_experts,
        top_k=args.top_k,
        moe_intermediate_size=args.moe_intermediate_size,
    )
    config = json.loads((out / "config.json").read_text())
    text = config.get("text_config", config)
    print(
        f"built {config['model_type']} (vocab {text['vocab_size']}, hidden {text['hidden_size']}, "
        f"{text['num_hidden_layers']} layers) at {out} in {time.perf_counter() - start:.1f}s"
    )


if __name__ == "__main__":
    main()
