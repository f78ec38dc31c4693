"""The rollout role: turns a DP shard of prompts into ``n`` scored-ready samples per prompt, in any placement.

Sampling randomness comes from a generator seeded by ``(seed, step, rollout DP rank, purpose, round)``, so a
step's samples do not depend on how many steps ran before in this process (exact resume), differ between rollout
DP ranks and between the generation rounds of one step (dynamic sampling), and are the same on the ranks of one
rollout TP group (which generate the same prompts).

Placements (``build_rollout`` picks one; the trainer's call sites are the same in all of them):

* **Colocated** (``Rollout``): the engine runs on the actor's ranks. The native engine reads the actor's
  gathered FSDP2 weights in place (no copy, weight sync free) when the rollout dtype is the actor's compute
  dtype; otherwise, and for vLLM, the engine is fed by the weight stream (``rollout/weight_sync.py``).
  With ``mesh.rollout_tp > 1`` the ranks of a TP group all-gather their prompts, generate the same batch, and
  each keeps its own rows.
* **Split** (actor and rollout on disjoint ranks): on the actor ranks ``RemoteRollout`` stands in for the role.
  Each call sends a small command plus the prompts over the link mesh (one all-to-all, rows spread evenly over
  the rollout ranks in order), and gets each actor rank's own samples back the same way. The rollout-only ranks
  run ``RolloutWorker.fit``: a loop that executes those commands on a local ``Rollout``. The weight sync gathers
  each unit on the actor mesh and broadcasts it from the actor's first rank to the rollout ranks.

Why commands: the rollout-only ranks follow whatever the trainer does (validation rounds, several generation
rounds per step, early stops) without knowing its control flow, and every collective on the link is entered by
all of its ranks in the same order: each call is a fixed sequence of link collectives on both sides.

Per-step metrics (``sync_weights`` returns them, reduced; rank 0 logs them). Bytes: ``weight_sync/gathered_bytes``
(per actor rank, the unit all-gathers), ``weight_sync/broadcast_bytes`` (per rollout rank, split placement),
``weight_sync/loaded_bytes`` (per engine; 0 when reading in place). Seconds (wall clock, so under ``timing/``):
``timing/rollout/weight_sync`` (every sync of the step, lazy re-syncs included), ``timing/rollout/wake``,
``timing/rollout/sleep``, ``timing/rollout/gen`` (engine time of the training generations), and
``throughput/rollout/gen_tokens_per_s``.
"""

from __future__ import annotations

import time

import torch

from rlspmd.config import RolloutConfig
from rlspmd.distributed.dispatch import MetricBuffer, all_gather_objects, even_split, redistribute_batch
from rlspmd.distributed.mesh import DP, TP, RoleMeshes
from rlspmd.models.loader import DTYPES, load_causal_lm
from rlspmd.protocol import Batch
from rlspmd.rollout.native import ColocatedWeights, NativeEngine, OwnWeights
from rlspmd.rollout.sampling import SamplingParams
from rlspmd.rollout.weight_sync import WeightBridge, WeightStream

TRAIN, VALIDATION = 0, 1  # generator purposes
SYNC_S = "timing/rollout/weight_sync"


def truncated(batch: Batch, *, eos_ids: list[int], max_response_length: int) -> torch.Tensor:
    """Samples that hit ``max_response_length`` without producing EOS."""
    lengths = batch["response_mask_BR"].sum(-1)
    R = batch["responses_BR"].shape[1]
    last = batch["responses_BR"].gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
    ended = torch.isin(last, torch.tensor(eos_ids, device=last.device))
    return (lengths >= max_response_length) & ~ended & (R >= max_response_length)


def sampling_params(cfg: RolloutConfig) -> tuple[SamplingParams, SamplingParams]:
    """(training, validation) sampling parameters."""
    train = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_new_tokens=cfg.max_response_length, n=cfg.n,
                           ignore_eos=cfg.ignore_eos)
    val = SamplingParams(temperature=cfg.val_temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_new_tokens=cfg.max_response_length, n=1)
    return train, val


class InPlaceWeights:
    """The colocated native engine reads the actor's weights in place: nothing to sync."""

    def stream(self):
        return None


class StreamedWeights:
    """Colocated: every rank gathers the actor's weights unit by unit and loads its own engine."""

    def __init__(self, stream: WeightStream):
        self.source = stream

    def stream(self):
        return iter(self.source)

    def stats(self) -> dict[str, float]:
        return {"weight_sync/gathered_bytes": float(self.source.stats.gathered_bytes)}


class BridgedWeights:
    """Split placement, rollout side: the units broadcast from the actor mesh."""

    def __init__(self, bridge: WeightBridge):
        self.bridge = bridge

    def stream(self):
        return self.bridge.receive()

    def stats(self) -> dict[str, float]:
        return {"weight_sync/broadcast_bytes": float(self.bridge.received_bytes)}


class Rollout:
    """Generation on this rank's engine (colocated placement; the rollout ranks of a split placement)."""

    def __init__(self, cfg: RolloutConfig, *, engine, weights, mesh, seed: int, eos_ids: list[int], device: torch.device,
                 syncs_itself: bool = True):
        """``mesh``: the rollout role's 2-D (dp, tp) mesh. ``syncs_itself``: sync lazily when the engine has no
        current weights (colocated); in split placement the actor side orders every sync."""
        self.cfg, self.engine, self.weights = cfg, engine, weights
        self.dp_mesh, self.tp_mesh = mesh[DP], mesh[TP]
        self.seed, self.dp_rank, self.device = seed, self.dp_mesh.get_local_rank(), device
        self.eos_ids = eos_ids
        self.syncs_itself = syncs_itself
        self.train_params, self.val_params = sampling_params(cfg)
        self.greedy_params = SamplingParams(temperature=0.0, max_new_tokens=cfg.max_response_length, n=1)
        self.synced = isinstance(weights, InPlaceWeights)
        self._stats = MetricBuffer()
        self._sync_stats: dict[str, float] = {}

    def _generator(self, step: int, purpose: int, round: int = 0) -> torch.Generator:
        g = torch.Generator(device=self.device)
        key = (self.seed, step, self.dp_rank, purpose) + ((round,) if round else ())  # round 0: the single-round seed
        g.manual_seed(hash(key) & (2**63 - 1))
        return g

    def generate(self, prompts: Batch, *, step: int, round: int = 0) -> Batch:
        return self._run(prompts, self.train_params, self._generator(step, TRAIN, round), record=True)

    def generate_greedy(self, prompts: Batch) -> Batch:
        """One greedy response per prompt (ReMax's baseline)."""
        return self._run(prompts, self.greedy_params, None, record=False)

    def generate_validation(self, prompts: Batch, *, step: int) -> Batch:
        return self._run(prompts, self.val_params, self._generator(step, VALIDATION), record=False)

    def _run(self, prompts: Batch, params: SamplingParams, generator: torch.Generator | None, *, record: bool) -> Batch:
        if not (self.synced and self.engine.holds_weights):
            if not self.syncs_itself:
                raise RuntimeError("rollout: generate before the first weight sync (the actor side orders syncs)")
            self._sync()
        parts = [prompts.to("cpu")]
        if self.tp_mesh.size() > 1:  # a TP group's ranks generate the same prompts: the union of their shards
            parts = all_gather_objects(parts[0], mesh=self.tp_mesh)
        nonempty = [p for p in parts if len(p)]
        if not nonempty:
            return prompts
        group = Batch.concat(nonempty).to(self.device)
        self.engine.wake()
        t0 = time.perf_counter()
        out = self.engine.generate(group, params, generator=generator)
        gen_s = time.perf_counter() - t0
        self.engine.sleep()
        if record:
            self._stats.max("timing/rollout/gen", gen_s)
            self._stats.sum("rollout/gen_tokens", out["response_mask_BR"].sum())
        me = self.tp_mesh.get_local_rank() if len(parts) > 1 else 0
        start = sum(len(p) for p in parts[:me]) * params.n
        return out.slice(start, start + len(prompts) * params.n)

    def _sync(self) -> None:
        t0 = time.perf_counter()
        stream = self.weights.stream()
        loaded = 0 if stream is None else self.engine.update_weights(stream)
        self.synced = True
        # seconds add up over the syncs of a step (a level-2 sleep before validation costs one more); bytes are per sync
        seconds = self._sync_stats.get(SYNC_S, 0.0) + time.perf_counter() - t0
        self._sync_stats = {SYNC_S: seconds, "weight_sync/loaded_bytes": float(loaded)}
        if stream is not None:
            self._sync_stats.update(self.weights.stats())

    def sync_weights(self, policy=None) -> dict[str, float]:
        """Actor -> rollout after the update; returns this step's rollout metrics, reduced over the rollout ranks.

        Colocated native in place: nothing moves. Otherwise the stream is loaded now (and again before a generate
        that finds the weights dropped by a level-2 sleep)."""
        self._sync()
        return self.step_metrics()

    def step_metrics(self) -> dict[str, float]:
        m = self._stats
        for k in (SYNC_S, "weight_sync/gathered_bytes", "weight_sync/broadcast_bytes", "weight_sync/loaded_bytes"):
            m.max(k, self._sync_stats.get(k, 0.0))
        for k, v in self.engine.take_times().items():  # wake_s, sleep_s
            m.max(f"timing/rollout/{k.removesuffix('_s')}", v)
        m.max("timing/rollout/gen", 0.0)
        m.sum("rollout/gen_tokens", 0.0)
        # TP peers generate the same tokens: reduce over the DP dim only (each group counted once)
        out = m.reduce(mesh=self.dp_mesh)
        out["throughput/rollout/gen_tokens_per_s"] = out.pop("rollout/gen_tokens") / max(out["timing/rollout/gen"], 1e-9)
        self._stats, self._sync_stats = MetricBuffer(), {}
        return out

    def truncated(self, batch: Batch) -> torch.Tensor:
        return truncated(batch, eos_ids=self.eos_ids, max_response_length=self.cfg.max_response_length)

    def close(self) -> None:
        pass


def _plan(link, rollout_ranks: list[int], total: int) -> list[int]:
    """Rows per link rank: ``total`` spread evenly over the rollout ranks (in rank order), none on actor ranks."""
    share = dict(zip(rollout_ranks, even_split(total, len(rollout_ranks))))
    return [share.get(g, 0) for g in link.mesh.tolist()]


class RemoteRollout:
    """The actor ranks' handle on a rollout that runs on disjoint ranks (split placement). Same methods as
    ``Rollout``; every call is a command executed by ``RolloutWorker`` on the rollout ranks."""

    def __init__(self, cfg: RolloutConfig, *, link, bridge: WeightBridge, stream: WeightStream, rollout_ranks: list[int],
                 eos_ids: list[int], device: torch.device):
        self.cfg, self.link, self.bridge, self.stream = cfg, link, bridge, stream
        self.rollout_ranks, self.eos_ids, self.device = rollout_ranks, eos_ids, device
        self.synced = False  # the rollout engine starts with disk (native) or dummy (vLLM) weights

    def generate(self, prompts: Batch, *, step: int, **kwargs) -> Batch:
        return self._call("generate", prompts, step=step, **kwargs)

    def generate_validation(self, prompts: Batch, *, step: int) -> Batch:
        return self._call("generate_validation", prompts, step=step)

    def generate_greedy(self, prompts: Batch) -> Batch:
        return self._call("generate_greedy", prompts)

    def _command(self, method: str, n_rows: int, **kwargs) -> list[int]:
        entries = all_gather_objects(((method, kwargs), n_rows), mesh=self.link)
        return [n for _, n in entries]

    def _call(self, method: str, prompts: Batch, **kwargs) -> Batch:
        if not self.synced:
            self.sync_weights()
        counts = self._command(method, len(prompts), **kwargs)
        plan = _plan(self.link, self.rollout_ranks, sum(counts))
        redistribute_batch(prompts, mesh=self.link, sizes_in=counts, sizes_out=plan)
        back_in = all_gather_objects(0, mesh=self.link)  # rows each rollout rank returns
        per_prompt = sum(back_in) // max(sum(counts), 1)
        return redistribute_batch(None, mesh=self.link, sizes_in=back_in, sizes_out=[n * per_prompt for n in counts], device=self.device)

    def sync_weights(self, policy=None) -> dict[str, float]:
        t0 = time.perf_counter()
        self._command("sync_weights", 0)
        stats = self.bridge.send(self.stream)
        self.synced = True
        elapsed = time.perf_counter() - t0
        remote = next(m for m in all_gather_objects(None, mesh=self.link) if m is not None)
        remote[SYNC_S] = max(remote[SYNC_S], elapsed)
        remote["weight_sync/gathered_bytes"] = float(stats.gathered_bytes)
        return remote

    def truncated(self, batch: Batch) -> torch.Tensor:
        return truncated(batch, eos_ids=self.eos_ids, max_response_length=self.cfg.max_response_length)

    def close(self) -> None:
        """Ends ``RolloutWorker.fit`` on the rollout ranks."""
        self._command("stop", 0)


class RolloutWorker:
    """What a rollout-only rank runs in split placement: execute the actor side's commands until ``stop``."""

    def __init__(self, local: Rollout, *, link, rollout_ranks: list[int]):
        self.local, self.link, self.rollout_ranks = local, link, rollout_ranks

    def fit(self) -> dict[str, float]:
        while True:
            entries = all_gather_objects((None, 0), mesh=self.link)
            (method, kwargs), counts = entries[0][0], [n for _, n in entries]
            if method == "stop":
                return {}
            if method == "sync_weights":
                metrics = self.local.sync_weights()  # receives the broadcast units, reduces over the rollout ranks
                all_gather_objects(metrics, mesh=self.link)
                continue
            plan = _plan(self.link, self.rollout_ranks, sum(counts))
            prompts = redistribute_batch(None, mesh=self.link, sizes_in=counts, sizes_out=plan, device=self.local.device)
            out = getattr(self.local, method)(prompts, **kwargs)  # also with no rows: TP peers gather together
            back_in = all_gather_objects(len(out), mesh=self.link)
            per_prompt = sum(back_in) // max(sum(counts), 1)
            redistribute_batch(out if len(out) else None, mesh=self.link, sizes_in=back_in,
                               sizes_out=[n * per_prompt for n in counts])


def _engine(cfg: RolloutConfig, *, policy, model_path: str, dtype: torch.dtype, in_place: bool, sleeps: bool, tp: int,
            seed: int, eos_ids: list[int], pad_id: int, device: torch.device, max_model_len: int):
    if cfg.engine == "native":
        if in_place:
            weights = ColocatedWeights(policy.engine)
        else:  # a private copy; its initial weights are replaced by the first sync
            dtype_name = next(k for k, v in DTYPES.items() if v == dtype)
            weights = OwnWeights(load_causal_lm(model_path, dtype=dtype_name, attn_implementation="sdpa", field_name="actor.model.path").to(device))
        return NativeEngine(weights, eos_ids=eos_ids, pad_id=pad_id, max_batch_size=cfg.max_batch_size, device=device,
                            compile_decode=cfg.compile_decode)
    from rlspmd.rollout.vllm import VllmEngine
    from third_party.vllm_adapter import VllmBackend

    v = cfg.vllm
    backend = VllmBackend(
        model_path, tensor_parallel_size=tp, seed=seed, dtype=dtype, max_model_len=v.max_model_len or max_model_len,
        gpu_memory_utilization=v.gpu_memory_utilization, kv_cache_memory_bytes=v.kv_cache_memory_bytes,
        max_num_seqs=v.max_num_seqs, enforce_eager=v.enforce_eager, enable_prefix_caching=v.enable_prefix_caching, sleeps=sleeps,
    )
    return VllmEngine(backend, sleeps=sleeps, sleep_level=v.sleep_level, eos_ids=eos_ids, pad_id=pad_id, device=device)


def build_rollout(cfg: RolloutConfig, *, meshes: RoleMeshes, policy, model_path: str, compute_dtype: torch.dtype,
                  eos_ids: list[int], pad_id: int, device: torch.device, seed: int, max_prompt_length: int):
    """The rollout role for this rank: ``Rollout`` (colocated), ``RemoteRollout`` (split, actor ranks) or
    ``RolloutWorker`` (split, rollout ranks; ``policy`` is None there).

    Construction is collective (weight-stream manifests are local, but a vLLM engine's is over the whole world).
    """
    dims = meshes.dims
    dtype = compute_dtype if cfg.dtype == "auto" else DTYPES[cfg.dtype]
    split = dims.disjoint("actor", "rollout")
    tp = dims.role_tp["rollout"]
    kw = dict(model_path=model_path, dtype=dtype, tp=tp, eos_ids=eos_ids, pad_id=pad_id, device=device,
              max_model_len=max_prompt_length + cfg.max_response_length)
    if not split:
        in_place = cfg.engine == "native" and dtype == compute_dtype
        weights = InPlaceWeights() if in_place else StreamedWeights(WeightStream(policy.engine, dtype=dtype))
        engine = _engine(cfg, policy=policy, in_place=in_place, sleeps=True, seed=seed + meshes.dp_rank("rollout"), **kw)
        return Rollout(cfg, engine=engine, weights=weights, mesh=meshes.get("rollout"), seed=seed, eos_ids=eos_ids, device=device)
    link = meshes.link("actor", "rollout")
    bridge = WeightBridge(meshes.link("actor", "rollout", first_only=True), src=dims.role_ranks["actor"][0], device=device)
    rollout_ranks = dims.role_ranks["rollout"]
    if policy is not None:
        return RemoteRollout(cfg, link=link, bridge=bridge, stream=WeightStream(policy.engine, dtype=dtype),
                             rollout_ranks=rollout_ranks, eos_ids=eos_ids, device=device)
    engine = _engine(cfg, policy=None, in_place=False, sleeps=False, seed=seed + meshes.dp_rank("rollout"), **kw)
    local = Rollout(cfg, engine=engine, weights=BridgedWeights(bridge), mesh=meshes.get("rollout"), seed=seed,
                    eos_ids=eos_ids, device=device, syncs_itself=False)
    return RolloutWorker(local, link=link, rollout_ranks=rollout_ranks)
