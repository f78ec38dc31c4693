"""What a role needs from a training backend, written down as ``typing.Protocol``s.

A role (policy, reference, critic, reward model; ``rlspmd/roles/``) owns one engine: the role's module sharded over
the role's DP mesh, with an optimiser when the role trains. The roles call nothing else, so a backend that offers these
methods (FSDP2 in ``engines/fsdp``; megatron-core behind the same calls) slots in without touching a role:

* ``module(...)``: the role module's forward on one micro-batch (a policy returns ``(logprobs_BR, entropy_BR)``, a
  critic ``values_BR``, a reward model ``scores_B``); the engine has already applied its parallelism to it;
* ``optimizer_step(micro_batches, loss_fn)``: one optimiser update, accumulating ``loss_fn(module, mb)`` over the
  micro-batches (losses are normalised by the global batch, so gradients are *summed* over DP ranks);
* ``weight_stream(dtype)``: the weights as ``(Hugging Face name, full tensor)`` for a rollout engine (collective);
* ``state_dict`` / ``load_state_dict``: DCP-compatible training state (a ``Stateful``), ``param_shapes`` to check a
  checkpoint against, ``hf_state_dict`` for export;
* ``offload_params`` / ``load_params``: a frozen role's parameters to host memory between uses and back;
* ``hf_model``: the Hugging Face model the role's module stands for (its ``config``; ``save_pretrained`` writes an HF
  directory from ``hf_state_dict``).

Both engines build their optimiser with ``engines/optim.py`` and resolve their compute dtype with ``compute_dtype``.

``InPlaceEngine`` adds what the colocated native rollout engine needs to read the weights where they are (no copy).

Which engine a role trains on is a config component (``TrainingEngineConfig``: ``FSDPConfig`` in ``fsdp.py``,
``MegatronConfig`` in ``megatron/config.py``), registered in ``TRAINING_ENGINES``: its options, its checks and a
``build`` that returns the role's engine. ``actor.engine`` / ``critic.engine`` hold one (``actor.engine:megatron
--actor.engine.tp 2`` on the command line); a user's engine is a subclass in their own file.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol, TypedDict, runtime_checkable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from rlspmd.components import Component, Registry
from rlspmd.models.loader import DTYPES

if TYPE_CHECKING:
    from rlspmd.engines.optim import OptimConfig
    from rlspmd.models.loader import ModelConfig
    from rlspmd.models.lora import LoraConfig


@functools.cache
def cpu_bf16_features() -> tuple[str, ...]:
    """This CPU's hardware bfloat16 matrix instructions that torch's oneDNN uses (``AVX512-BF16``, ``AMX``: Intel
    Cooper Lake and Sapphire Rapids on, AMD Zen 4 on); empty where bfloat16 is converted in software."""
    if not torch.backends.mkldnn.is_available():
        return ()
    found = [("AVX512-BF16", torch.cpu._is_avx512_bf16_supported()), ("AMX", torch.cpu._is_amx_tile_supported())]
    return tuple(name for name, present in found if present)


CPU_BF16_ENV = "RLSPMD_CPU_BF16"
"""Environment override of ``native_bf16``: ``0`` (``auto`` computes in float32 on every CPU: runs, and tests, that
must give the same numbers on CPUs with and without hardware bfloat16) or ``1`` (bfloat16 even where it is emulated);
unset: detected."""


def native_bf16() -> bool:
    """Whether ``param_dtype=auto`` computes in bfloat16 on this CPU: where it multiplies bfloat16 matrices in hardware
    (oneDNN's bfloat16 GEMMs run several times faster than float32 ones there; elsewhere bfloat16 is emulated and
    slower than float32), unless ``RLSPMD_CPU_BF16`` says otherwise."""
    override = os.environ.get(CPU_BF16_ENV, "").strip()
    if override not in ("", "0", "1"):
        raise ValueError(f"{CPU_BF16_ENV}={override!r}: use 0 (float32), 1 (bfloat16) or leave it unset (detect)")
    return override == "1" if override else bool(cpu_bf16_features())


def precision_summary(engine: TrainingEngineConfig, device: torch.device, *, master: str, rollout: torch.dtype) -> str:
    """One line for the run's log: the compute dtype ``engine.param_dtype`` resolved to and why, the master weights'
    dtype and the rollout's."""
    compute = engine.compute_dtype(device)
    name = str(compute).removeprefix("torch.")
    if engine.param_dtype != "auto":
        why = f"actor.engine.param_dtype={engine.param_dtype}"
    elif device.type == "cuda":
        why = "auto on CUDA"
    elif not engine.cpu_bf16:
        why = f"auto: the {engine.name} engine computes in float32 on CPU"
    elif os.environ.get(CPU_BF16_ENV, "").strip():
        why = f"auto with {CPU_BF16_ENV}={os.environ[CPU_BF16_ENV].strip()}"
    elif native_bf16():
        why = f"auto: this CPU has hardware bfloat16 ({', '.join(cpu_bf16_features())})"
    else:
        why = "auto: this CPU has no hardware bfloat16 (AVX512-BF16 / AMX), where float32 is faster"
    return (
        f"compute dtype: {name} ({why}); master weights and optimiser state {master}; "
        f"rollout {str(rollout).removeprefix('torch.')}"
    )


def compute_dtype(param_dtype: str, device: torch.device, *, cpu_bf16: bool = False) -> torch.dtype:
    """The dtype an engine's forwards compute in, from its config's ``param_dtype`` (``FSDPConfig``,
    ``MegatronConfig``): ``auto`` is bfloat16 on CUDA and, where ``cpu_bf16`` (an engine that computes in bfloat16 on
    CPU), on a CPU with hardware bfloat16 (``native_bf16``); float32 elsewhere."""
    if param_dtype == "auto":
        fast = device.type == "cuda" or (device.type == "cpu" and cpu_bf16 and native_bf16())
        return torch.bfloat16 if fast else torch.float32
    return DTYPES[param_dtype]


class UpdateStats(TypedDict):
    """0-dim tensors (on the device, read with the step's metrics) or Python floats."""

    grad_norm: torch.Tensor | float
    """Global gradient norm before clipping (non-finite: the update was skipped)."""
    skipped: torch.Tensor | float
    """1.0 when a non-finite norm skipped the update, else 0.0."""


LossFn = Callable[[nn.Module, object], torch.Tensor]
"""``loss_fn(module, micro_batch)``: the micro-batch's share of the globally normalised loss."""


class WeightStream(Protocol):
    """A training engine's weights for a rollout engine, re-iterable once per sync (collective on the engine's mesh)."""

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def stats(self) -> dict[str, float]:
        """What the last pass moved, as ``weight_sync/*`` metrics of this rank."""


@runtime_checkable
class TrainingEngine(Protocol):
    mesh: DeviceMesh
    """The DP mesh the engine shards over; its collectives run there."""
    device: torch.device
    module: nn.Module
    """The role module, parallelised; call it on a micro-batch."""

    def optimizer_step(self, micro_batches: Iterable, loss_fn: LossFn) -> UpdateStats: ...

    @property
    def lr(self) -> float: ...

    def weight_stream(self, dtype: torch.dtype) -> WeightStream: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def param_shapes(self) -> dict[str, torch.Size]: ...

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights under Hugging Face names on the mesh's first rank (empty elsewhere); collective."""

    def offload_params(self) -> None:
        """Move the (frozen) parameters to host memory until ``load_params``."""

    def load_params(self) -> None: ...

    @property
    def hf_model(self) -> nn.Module:
        """The Hugging Face model of the role's weights, for its ``config`` and for writing an HF directory
        (``save_pretrained(state_dict=hf_state_dict())``): FSDP, the sharded HF module inside the role's module;
        megatron, a skeleton on the meta device (no memory)."""


@runtime_checkable
class InPlaceEngine(TrainingEngine, Protocol):
    def gathered_hf_model(self) -> AbstractContextManager[nn.Module]:
        """The full Hugging Face model, its parameters gathered in place for the duration (no copy)."""


# -- the engine a role trains on: a config component ------------------------------------------------------------------

ModuleKind = Literal["policy", "value", "scorer"]
"""What a role's module computes: a causal LM's log-probs (``policy``: actor, reference), per-token values
(``value``: critic) or one score per sequence (``scorer``: a reward model, frozen)."""

TRAINING_ENGINES = Registry("training engine")
"""Every training engine by its name (``actor.engine:NAME``)."""


class TrainingEngineConfig(Component):
    """``actor.engine`` / ``critic.engine``: a training backend with its options (the dataclass fields of a subclass).

    Traits the rest of the run reads: ``supports_lora`` (``actor.lora``), ``supports_mesh_tp`` (``mesh.actor_tp``
    is this engine's tensor parallelism), ``supports_vision`` (vision-language models, ``docs/vision.md``),
    ``supports_moe`` (mixture-of-experts models and ``mesh.actor_ep``, ``docs/moe.md``), ``supports_mesh_sp``
    (``mesh.actor_sp`` is this engine's sequence parallelism, ``docs/sequence-parallel.md``), ``lends_weights`` (a
    colocated native rollout engine reads the gathered weights in place: an ``InPlaceEngine``), ``vocab_outputs`` (its
    policy module computes what needs the whole vocabulary at each token on request: the ``extras`` and ``jsd`` of
    ``rlspmd.models.policy.CausalLMPolicy``, for the optimal token baseline and GKD)."""

    registry = TRAINING_ENGINES
    supports_lora: ClassVar[bool] = False
    supports_mesh_tp: ClassVar[bool] = False
    supports_vision: ClassVar[bool] = False
    supports_moe: ClassVar[bool] = False
    supports_mesh_sp: ClassVar[bool] = False
    lends_weights: ClassVar[bool] = False
    vocab_outputs: ClassVar[bool] = False
    cpu_bf16: ClassVar[bool] = False
    param_dtype: str = "auto"

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype of the role's forwards on ``device``."""
        return compute_dtype(self.param_dtype, device, cpu_bf16=self.cpu_bf16)

    def params_on_host(self) -> bool:
        """Whether the sharded parameters live in host memory (a frozen role's offload then has nothing to do)."""
        return False

    def build(
        self,
        kind: ModuleKind,
        model_path: str,
        *,
        model: ModelConfig,
        mesh: DeviceMesh,
        device: torch.device,
        optim: OptimConfig | None,
        total_optim_steps: int = 1,
        gradient_checkpointing: bool = False,
        seed: int = 0,
        field_name: str,
        section: str,
        lora: LoraConfig | None = None,
        train_mesh: DeviceMesh | None = None,
        expert_mesh: DeviceMesh | None = None,
        sequence_mesh: DeviceMesh | None = None,
        sequence_mode: str = "auto",
        freeze_vision: bool = False,
    ) -> TrainingEngine:
        """A role's model on this engine. ``kind``: what the module computes; ``optim=None``: frozen; ``field_name``
        and ``section`` name the config fields in errors (``actor.model.path``, ``actor``); ``lora``: a policy training
        LoRA adapters only (engines with ``supports_lora``); ``train_mesh``: the ``(dp, tp)`` mesh of
        ``mesh.actor_tp`` > 1 (engines with ``supports_mesh_tp``); ``expert_mesh``: the ``(edp, ep)`` mesh of
        ``mesh.actor_ep`` > 1 (engines with ``supports_moe``); ``sequence_mesh``: this rank's sequence-parallel group
        of ``mesh.actor_sp`` > 1 and ``sequence_mode`` its attention (engines with ``supports_mesh_sp``);
        ``freeze_vision``: a vision-language policy trains its language model only (``actor.freeze_vision_tower``).
        Collective over ``mesh``."""
        raise NotImplementedError
