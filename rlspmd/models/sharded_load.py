"""Sharded loading: build a model on the meta device, parallelise it, then read each rank's slices from safetensors.

Today's path (``loader.load_causal_lm``) materialises the whole model on every rank and FSDP2 then keeps a shard of
it, so a rank's peak host memory is the full model. Here (torchtitan's order) the role module is built with its
*parameters* on the meta device (``parameters_on_meta``: no memory, no init kernels), the engine applies its
parallelism (activation checkpointing, tensor parallelism, ``fully_shard``), materialises the local shards empty
(``materialize``) and ``WeightPlan.load`` fills every shard with exactly the bytes that rank owns, read with
``pread`` from the safetensors files (``SafetensorsIndex``): no memory map, no full tensor. A rank's peak is its
shards plus one slice buffer (none when the file's dtype equals the parameter's and the slice is contiguous: the
bytes land in the shard directly).

Buffers are not in checkpoints' hands: ``parameters_on_meta`` leaves them real, so a rotary table is computed by the
module's own ``__init__`` exactly as ``from_pretrained`` computes it, and ``materialize`` keeps it across FSDP2's
``to_empty``.

Which tensor feeds which parameter is decided *before* anything is sharded (``WeightPlan``), so a mismatched
directory fails in seconds with the file and tensor named: a parameter found in no file (with, for an untied LM
head, a pointer to ``tie_word_embeddings``), a tensor no parameter takes, a shape that differs, or a dtype that is no
float (quantised or integer checkpoints). Floating dtypes convert to the model's dtype as ``from_pretrained`` does
(bf16 checkpoints into float32 master weights).

Fused mixture-of-experts parameters (``mlp.experts.gate_up_proj`` ``(E, 2I, H)``, ``down_proj``) are *stacked* from the
checkpoint's per-expert tensors (``mlp.experts.{e}.gate_proj.weight``, ...; ``models/moe.py: fused_expert_keys``): a
shard reads, for each expert in its slice, the rows of each piece it holds, straight into place.

Simplifications: keys are matched by name (the module's, the module's under the checkpoint's base-model prefix, or a
tied alias); transformers' other per-architecture key conversions (old layouts) are not applied:
``model.sharded_load=False`` loads those with ``from_pretrained``. A slice that is not contiguous in the file (a
tensor-parallel ``Shard(1)``) is read as its contiguous run of rows and narrowed: a transient of those rows.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from rlspmd.models.loader import DTYPES, check_model_dir

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
LOADABLE = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
"""File dtypes converted to a floating parameter's dtype (fp8 is a quantised format: it needs its scales)."""
STALE_KEYS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
"""Keys old checkpoints carry that are buffers computed at construction today (transformers ignores them too)."""
WRAPPER_FRAGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def unwrapped_name(name: str) -> str:
    """A parameter name without the fragments activation checkpointing and ``torch.compile`` insert."""
    for frag in WRAPPER_FRAGMENTS:
        name = name.replace(frag, "")
    return name


# -- building on the meta device -------------------------------------------------------------------------------------


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device; buffers stay real (computed by ``__init__``).

    Every ``nn.Parameter`` registration is redirected, so a layer's ``reset_parameters`` and transformers'
    ``post_init`` run on meta tensors (free). ``torch.device("meta")`` would also put buffers (rotary tables) on meta,
    and recomputing them is architecture-specific."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def is_meta(module: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in module.parameters())


@torch.no_grad()
def materialize(module: nn.Module, *, device: torch.device) -> None:
    """Allocate the (sharded) parameters of a meta-built, parallelised module on ``device``, uninitialised, keeping the
    buffers' values (``to_empty`` would discard them). Fill the parameters with ``WeightPlan.load``."""
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    module.to_empty(device=device)
    for name, b in module.named_buffers():
        b.copy_(buffers[name])


# -- safetensors, read by byte ranges ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    key: str
    dtype: torch.dtype | None
    """None: a dtype torch has no name for (reported when a parameter needs it)."""
    dtype_name: str
    shape: tuple[int, ...]
    start: int
    """Absolute byte offset of the tensor's data in ``file``."""

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def where(self) -> str:
        return f"{self.file}: tensor {self.key!r}"


class SafetensorsIndex:
    """The tensors of a model directory's ``*.safetensors`` files: name -> file, dtype, shape and byte offset, from the
    headers alone (no data is read until ``read``)."""

    def __init__(self, entries: dict[str, TensorEntry], directory: Path):
        self.entries, self.directory = entries, directory

    @classmethod
    def of(cls, directory: str | Path, *, field_name: str) -> "SafetensorsIndex":
        d = check_model_dir(directory, field_name=field_name)
        index_json = d / "model.safetensors.index.json"
        if index_json.is_file():
            files = sorted({d / f for f in json.loads(index_json.read_text())["weight_map"].values()})
        else:
            files = sorted(d.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"{field_name}: {d} has no *.safetensors weights (sharded loading reads safetensors only; "
                f"set model.sharded_load=False for *.bin checkpoints)"
            )
        entries: dict[str, TensorEntry] = {}
        for f in files:
            for key, entry in _read_header(f, field_name=field_name).items():
                if key in entries:
                    raise ValueError(f"{field_name}: tensor {key!r} is stored twice, in {entries[key].file} and {f}")
                entries[key] = entry
        return cls(entries, d)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def read(
        self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The block ``[offsets, offsets + sizes)`` of tensor ``key`` in the file's dtype, on the CPU. Only its run of
        dim-0 rows is read; ``out`` (a contiguous CPU tensor of the file's dtype and the block's shape) receives it
        without a copy when the block is contiguous in the file."""
        e = self.entries[key]
        if not e.shape:  # a scalar
            offsets, sizes = (), ()
        rows = sizes[0] if sizes else 1
        row_numel = math.prod(e.shape[1:])
        contiguous = all(o == 0 and s == n for o, s, n in zip(offsets[1:], sizes[1:], e.shape[1:]))
        slab_shape = (rows, *e.shape[1:]) if e.shape else ()
        if contiguous and out is not None:
            slab = out
        else:
            slab = torch.empty(slab_shape, dtype=e.dtype)
        nbytes = rows * row_numel * e.itemsize
        if nbytes:
            start = e.start + (offsets[0] if offsets else 0) * row_numel * e.itemsize
            view = (
                memoryview(slab.view(-1).view(torch.uint8).numpy())
                if slab.dim()
                else memoryview(slab.view(1).view(torch.uint8).numpy())
            )
            with open(e.file, "rb", buffering=0) as fh:
                fh.seek(start)
                got = fh.readinto(view)
            if got != nbytes:
                raise ValueError(f"{e.where()}: read {got} of {nbytes} bytes (truncated file?)")
        if contiguous:
            return slab
        block = slab
        for dim, (o, s) in enumerate(zip(offsets[1:], sizes[1:]), start=1):
            block = block.narrow(dim, o, s)
        return block


def _read_header(path: Path, *, field_name: str) -> dict[str, TensorEntry]:
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"{field_name}: {path} is not a safetensors file (shorter than its 8-byte header length)")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise ValueError(
                f"{field_name}: {path} is truncated or not a safetensors file (header of {n} bytes, file of {size})"
            )
        try:
            header = json.loads(fh.read(n))
        except ValueError as e:
            raise ValueError(f"{field_name}: {path}: unreadable safetensors header ({e})") from None
    base = 8 + n
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        if base + end > size:
            raise ValueError(
                f"{field_name}: {path} is truncated: tensor {key!r} ends at byte {base + end}, the file has {size}"
            )
        dtype = SAFETENSORS_DTYPES.get(info["dtype"])
        shape = tuple(info["shape"])
        if dtype is not None and (end - begin) != math.prod(shape) * torch.empty((), dtype=dtype).element_size():
            raise ValueError(
                f"{field_name}: {path}: tensor {key!r} has {end - begin} bytes for shape {list(shape)} {info['dtype']}"
            )
        out[key] = TensorEntry(path, key, dtype, info["dtype"], shape, base + begin)
    return out


# -- which tensor feeds which parameter -------------------------------------------------------------------------------


Init = Callable[[], torch.Tensor]
"""A parameter that no file holds (a new value head): returns its full tensor (small), the same on every rank."""


@dataclass
class WeightPlan:
    """Where every parameter of a meta-built role module comes from: a tensor of ``index`` or an initialiser. Built
    (and checked against the files) before the module is parallelised; ``load`` fills the shards after."""

    index: SafetensorsIndex
    keys: dict[str, str] = field(default_factory=dict)
    """Parameter name (root module, unwrapped, every tied alias) -> the file key it is read from."""
    inits: dict[str, Init] = field(default_factory=dict)
    """Parameter name -> initialiser, for parameters no file holds."""
    also_used: set[str] = field(default_factory=set)
    """File keys that feed no parameter on purpose (a tied alias saved twice, a head the role does not use)."""
    stacks: dict[str, list[list[str]]] = field(default_factory=dict)
    """Parameter name -> file keys of a stacked parameter: ``param[i]`` is the concatenation (along its dim 0) of the
    tensors ``stacks[name][i]`` (fused MoE experts, ``match_stacks``)."""

    @torch.no_grad()
    def load(self, module: nn.Module) -> int:
        """Fill every parameter of ``module`` (materialised, possibly sharded) with its slice;
        returns the bytes read."""
        nbytes = 0
        for name, p in module.named_parameters():
            name = unwrapped_name(name)
            local = p.to_local() if isinstance(p, DTensor) else p.data
            offsets, sizes = _local_block(p)
            if name in self.inits:
                full = self.inits[name]()
                block = full
                for dim, (o, s) in enumerate(zip(offsets, sizes)):
                    block = block.narrow(dim, o, s)
                local.copy_(block)
                continue
            if name in self.stacks:
                nbytes += self._load_stacked(self.stacks[name], local, offsets, sizes)
                continue
            key = self.keys[name]  # WeightPlan.check guarantees it
            if local.numel() == 0:
                continue
            e = self.index.entries[key]
            direct = e.dtype == local.dtype and local.device.type == "cpu" and local.is_contiguous()
            block = self.index.read(key, offsets, sizes, out=local if direct else None)
            if block is not local:
                local.copy_(block)
            nbytes += block.numel() * e.itemsize
        return nbytes

    def _load_stacked(self, pieces: list[list[str]], local: torch.Tensor, offsets, sizes) -> int:
        """Fill the block ``[offsets, offsets + sizes)`` of a stacked parameter: each of its dim-0 entries from the
        rows of that entry's pieces that the block holds."""
        nbytes = 0
        for i in range(sizes[0]):
            row = 0  # first row of the current piece along the parameter's dim 1
            for key in pieces[offsets[0] + i]:
                e = self.index.entries[key]
                lo, hi = max(row, offsets[1]), min(row + e.shape[0], offsets[1] + sizes[1])
                if lo < hi:
                    block = self.index.read(key, (lo - row, *offsets[2:]), (hi - lo, *sizes[2:]))
                    local[i, lo - offsets[1] : hi - offsets[1]].copy_(block)
                    nbytes += block.numel() * e.itemsize
                row += e.shape[0]
        return nbytes

    def check(self, module: nn.Module, *, tied_hint: bool = False, field_name: str) -> "WeightPlan":
        """Every parameter of ``module`` has a source of the right shape and a loadable dtype, and every file tensor is
        used (or in ``also_used``); raises a ``ValueError`` naming the file and tensor otherwise."""
        used = set(self.keys.values()) | self.also_used | {k for s in self.stacks.values() for ks in s for k in ks}
        for name, p in _all_parameter_names(module):
            if name in self.inits:
                continue
            if name in self.stacks:
                self._check_stacked(name, p, field_name=field_name)
                continue
            if name not in self.keys:
                hint = (
                    (
                        " (config.json has tie_word_embeddings=false: an untied LM head needs its own weights; "
                        "a checkpoint saved with tied embeddings needs tie_word_embeddings=true)"
                    )
                    if tied_hint and "lm_head" in name
                    else ""
                )
                raise ValueError(
                    f"{field_name}: no tensor in {self.index.directory} holds parameter {name!r} "
                    f"(files: {sorted({e.file.name for e in self.index.entries.values()})}){hint}"
                )
            e = self.index.entries[self.keys[name]]
            if e.shape != tuple(p.shape):
                raise ValueError(
                    f"{field_name}: {e.where()} has shape {list(e.shape)}, but parameter {name!r} of the model "
                    f"built from config.json has {list(p.shape)}"
                )
            if e.dtype not in LOADABLE or not p.dtype.is_floating_point:
                raise ValueError(
                    f"{field_name}: {e.where()} is stored as {e.dtype_name}, which cannot load into parameter "
                    f"{name!r} ({p.dtype}): only float64/float32/float16/bfloat16 checkpoints convert "
                    f"(quantised or integer weights are not supported)"
                )
        unexpected = sorted(k for k in self.index.entries if k not in used and not STALE_KEYS.search(k))
        if unexpected:
            e = self.index.entries[unexpected[0]]
            raise ValueError(
                f"{field_name}: {e.where()} belongs to no parameter of the {type(module).__name__} built from "
                f"config.json ({len(unexpected)} such tensors: {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''})"
            )
        return self

    def _check_stacked(self, name: str, p: torch.Tensor, *, field_name: str) -> None:
        pieces = self.stacks[name]
        if len(pieces) != p.shape[0]:
            raise ValueError(
                f"{field_name}: parameter {name!r} has {p.shape[0]} entries (experts), the checkpoint {len(pieces)}"
            )
        for keys in pieces:
            entries = [self.index.entries[k] for k in keys]
            shape = (sum(e.shape[0] for e in entries), *entries[0].shape[1:])
            if shape != tuple(p.shape[1:]) or any(e.shape[1:] != entries[0].shape[1:] for e in entries):
                raise ValueError(
                    f"{field_name}: {entries[0].where()} and the tensors stacked with it "
                    f"({[e.key for e in entries]}: {[list(e.shape) for e in entries]}) do not make one "
                    f"{list(p.shape[1:])} entry of parameter {name!r} built from config.json"
                )
            bad = next((e for e in entries if e.dtype not in LOADABLE), None)
            if bad is not None:
                raise ValueError(
                    f"{field_name}: {bad.where()} is stored as {bad.dtype_name}, which cannot load into "
                    f"parameter {name!r} ({p.dtype}): only float64/float32/float16/bfloat16 convert"
                )


def _all_parameter_names(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Every name of every parameter (tied aliases included), unwrapped."""
    for name, p in module.named_parameters(remove_duplicate=False):
        yield unwrapped_name(name), p


def _local_block(p: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offsets, sizes) of this rank's piece of ``p`` (DCP's own description of a DTensor's shard)."""
    if not isinstance(p, DTensor):
        return (0,) * p.dim(), tuple(p.shape)
    (chunk,) = p.__create_chunk_list__()
    return tuple(int(o) for o in chunk.offsets), tuple(int(s) for s in chunk.sizes)


def match_keys(
    module: nn.Module, index: SafetensorsIndex, *, prefix: str, candidates: Callable[[str], list[str]]
) -> dict[str, str]:
    """``{parameter name: file key}`` for the parameters of ``module`` under ``prefix`` (the HF model inside a role
    module), each looked up by ``candidates(hf name)`` in order. Aliases share one tensor (tied embeddings, a module
    registered twice): the first alias under ``prefix`` whose candidates a file holds feeds all of them."""
    groups: dict[int, list[str]] = {}
    for name, p in _all_parameter_names(module):
        groups.setdefault(id(p), []).append(name)
    keys = {}
    for names in groups.values():
        found = next(
            (k for n in names if n.startswith(prefix) for k in candidates(n[len(prefix) :]) if k in index), None
        )
        if found is not None:
            keys.update({n: found for n in names})
    return keys


def match_stacks(
    module: nn.Module,
    index: SafetensorsIndex,
    *,
    prefix: str,
    keys: dict[str, str],
    candidates: Callable[[str], list[str]],
) -> dict[str, list[list[str]]]:
    """``{parameter name: per-entry file keys}`` for the parameters under ``prefix`` that no file key feeds directly but
    that the checkpoint stores one tensor per entry (fused MoE experts: ``models/moe.py``), each key looked up by
    ``candidates``; a parameter is stacked only when the files hold every one of its pieces."""
    from rlspmd.models.moe import fused_expert_keys

    stacks = {}
    for name, p in _all_parameter_names(module):
        if name in keys or not name.startswith(prefix):
            continue
        pieces = fused_expert_keys(name[len(prefix) :], p.shape[0])
        if pieces is None:
            continue
        found = [[next((c for c in candidates(k) if c in index), None) for k in ks] for ks in pieces]
        if all(k is not None for ks in found for k in ks):
            stacks[name] = found
    return stacks


def tied_keys(module: nn.Module, index: SafetensorsIndex, *, prefix: str, keys: dict[str, str]) -> set[str]:
    """File keys of tied aliases that another alias' tensor already feeds (e.g. ``lm_head.weight`` saved next to
    ``model.embed_tokens.weight``): present in the files, read by nobody, and expected."""
    groups: dict[int, list[str]] = {}
    for name, p in _all_parameter_names(module):
        if name.startswith(prefix):
            groups.setdefault(id(p), []).append(name[len(prefix) :])
    return {n for names in groups.values() if len(names) > 1 for n in names if n in index} - set(keys.values())


# -- the role modules, built on meta ----------------------------------------------------------------------------------


def _from_config(auto_cls, path: Path, *, dtype: str, attn_implementation: str) -> nn.Module:
    """``auto_cls`` None: the policy's class for the config (a causal LM or a vision-language model)."""
    from transformers import AutoConfig

    from rlspmd.models.vision import attn_implementation as vision_attn
    from rlspmd.models.vision import auto_class

    config = AutoConfig.from_pretrained(str(path))
    auto_cls = auto_cls or auto_class(config)
    with parameters_on_meta():
        attn = vision_attn(config, attn_implementation)
        model = auto_cls.from_config(config, dtype=DTYPES[dtype], attn_implementation=attn)
    model.config.use_cache = False
    return model


def build_policy_module(
    model_path: str,
    *,
    dtype: str,
    attn_implementation: str,
    field_name: str,
    packing: bool = False,
    attn_kernel: str = "auto",
) -> nn.Module:
    """The policy module of a model loaded whole (``model.sharded_load=False``): ``CausalLMPolicy``, or
    ``VisionLanguagePolicy`` for a vision-language model (``meta_policy_module`` below builds it on meta instead)."""
    from rlspmd.models.loader import load_causal_lm
    from rlspmd.models.packing import training_attn_implementation
    from rlspmd.models.vision import policy_module

    attn = training_attn_implementation(attn_implementation, packing=packing, field_name="model.attn_implementation")
    return policy_module(
        load_causal_lm(model_path, dtype=dtype, attn_implementation=attn, field_name=field_name),
        packing=packing,
        attn_kernel=attn_kernel,
    )


def meta_policy_module(
    path: str | Path,
    *,
    dtype: str,
    attn_implementation: str,
    field_name: str,
    packing: bool = False,
    attn_kernel: str = "auto",
    lora=None,
    seed: int = 0,
):
    """``CausalLMPolicy`` over a causal LM built on meta, and where its weights come from (checked against the files).
    ``lora`` (``LoraConfig`` with rank > 0): adapters injected (``models/lora.py``), initialised from ``seed``; the base
    weights of adapted layers (``q_proj.base_layer.weight``) read the checkpoint's ``q_proj.weight``."""
    from rlspmd.models.lora import apply_lora, base_name, initial_adapters
    from rlspmd.models.packing import training_attn_implementation
    from rlspmd.models.vision import checkpoint_keys, policy_module

    index = SafetensorsIndex.of(path, field_name=field_name)
    attn = training_attn_implementation(attn_implementation, packing=packing, field_name="model.attn_implementation")
    hf = _from_config(None, index.directory, dtype=dtype, attn_implementation=attn)
    module = policy_module(hf, packing=packing, attn_kernel=attn_kernel)
    inits: dict[str, Init] = {}
    if lora is not None and lora.enabled:
        apply_lora(hf, lora)  # peft puts the adapters where the base weights are: on meta
        inits = {name: (lambda t=t: t) for name, t in initial_adapters(module, seed=seed).items()}
    keys = match_keys(module, index, prefix="hf.", candidates=lambda n: checkpoint_keys(base_name(n)))
    stacks = match_stacks(module, index, prefix="hf.", keys=keys, candidates=lambda n: [n])
    plan = WeightPlan(index, keys, inits, also_used=tied_keys(module, index, prefix="hf.", keys=keys), stacks=stacks)
    return module, plan.check(module, tied_hint=not hf.config.tie_word_embeddings, field_name=field_name)


def meta_value_model(
    path: str | Path,
    *,
    dtype: str,
    attn_implementation: str,
    seed: int,
    field_name: str,
    packing: bool = False,
    attn_kernel: str = "auto",
):
    """``ValueModel`` (backbone + scalar head) built on meta, as ``value.load_value_model`` builds it: the backbone from
    a causal LM, base model or reward model directory (its LM head or classifier head unused), the head from the
    directory's ``value_head.*`` or one-label ``score.*`` tensors, else new (``value.initial_value_head``)."""
    from transformers import AutoModel

    from rlspmd.models.packing import training_attn_implementation
    from rlspmd.models.value import HEAD_PREFIXES, ValueModel, initial_value_head

    index = SafetensorsIndex.of(path, field_name=field_name)
    attn = training_attn_implementation(attn_implementation, packing=packing, field_name="model.attn_implementation")
    backbone = _from_config(AutoModel, index.directory, dtype=dtype, attn_implementation=attn)
    hidden = backbone.config.hidden_size
    with parameters_on_meta():
        head = nn.Linear(hidden, 1, dtype=DTYPES[dtype])
    module = ValueModel(backbone, head, packing=packing, attn_kernel=attn_kernel)
    prefix = backbone.base_model_prefix
    keys = match_keys(module, index, prefix="hf.", candidates=lambda n: [n, f"{prefix}.{n}"])
    stacks = match_stacks(module, index, prefix="hf.", keys=keys, candidates=lambda n: [n, f"{prefix}.{n}"])
    stored = next(
        (pre for pre in HEAD_PREFIXES if f"{pre}weight" in index and index.entries[f"{pre}weight"].shape[:1] == (1,)),
        None,
    )
    inits: dict[str, Init] = {}
    if stored is not None:
        keys["value_head.weight"] = f"{stored}weight"
        if f"{stored}bias" in index:
            keys["value_head.bias"] = f"{stored}bias"
        else:
            inits["value_head.bias"] = lambda: torch.zeros(1)
    else:
        inits["value_head.weight"] = lambda: initial_value_head(hidden, seed=seed)
        inits["value_head.bias"] = lambda: torch.zeros(1)
    # what the backbone does not use: the LM head of a causal LM, the classifier of a reward model
    unused = {k for k in index.entries if k.startswith(("lm_head.", *HEAD_PREFIXES))} - set(keys.values())
    plan = WeightPlan(
        index, keys, inits, also_used=unused | tied_keys(module, index, prefix="hf.", keys=keys), stacks=stacks
    )
    return module, plan.check(module, field_name=field_name)


def meta_sequence_scorer(
    path: str | Path,
    *,
    dtype: str,
    attn_implementation: str,
    field_name: str,
    packing: bool = False,
    attn_kernel: str = "auto",
):
    """``SequenceScorer`` over a ``*ForSequenceClassification`` model built on meta (``value.load_sequence_scorer``)."""
    from transformers import AutoModelForSequenceClassification

    from rlspmd.models.packing import training_attn_implementation
    from rlspmd.models.value import SequenceScorer, check_sequence_classifier

    index = SafetensorsIndex.of(path, field_name=field_name)
    check_sequence_classifier(index.directory, field_name=field_name)
    attn = training_attn_implementation(attn_implementation, packing=packing, field_name="model.attn_implementation")
    hf = _from_config(AutoModelForSequenceClassification, index.directory, dtype=dtype, attn_implementation=attn)
    module = SequenceScorer(hf, packing=packing, attn_kernel=attn_kernel)
    keys = match_keys(module, index, prefix="hf.", candidates=lambda n: [n])
    stacks = match_stacks(module, index, prefix="hf.", keys=keys, candidates=lambda n: [n])
    plan = WeightPlan(index, keys, also_used=tied_keys(module, index, prefix="hf.", keys=keys), stacks=stacks)
    return module, plan.check(module, field_name=field_name)
