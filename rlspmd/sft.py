"""Supervised fine-tuning: the warm start before RL (a randomly initialised model cannot learn from reward alone).

    torchrun --nproc-per-node 2 -m rlspmd.sft --config configs/sft_quickstart.py

Same runtime, mesh and FSDP2 engine as the RL trainer. The loss is the token-mean negative log-likelihood
of the response (prompt tokens are context only), normalised over the global batch. At the end the model
is written as a Hugging Face directory (safetensors + tokenizer) that RL configs point at.

Checkpoints are the RL trainer's (``rlspmd.trainer.checkpoint``: DCP shards of the model and optimiser, the LR schedule,
the data order on rank 0): every ``checkpoint.save_every`` steps, and at ``stop_at_step`` or on SIGTERM/SIGUSR1 (the
run then stops after the step); ``--resume auto`` continues the same run bit for bit.

Multi-turn demonstrations (``data.messages_key``): whole conversations with tool calls and tool results, tokenized as
the agent loop tokenizes rollouts (prompt with the tool schemas, each assistant turn's content + EOS, the turns between
as chat-template deltas); the loss covers the assistant tokens only (``loss_mask_BR``).

A vision-language model trains on verl's multimodal rows as the RL trainer reads them (``<image>`` placeholders, an
``images`` column; ``rlspmd/data/images.py``): its images are counted when the file is read and processed when a row is
batched.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import torch

from rlspmd.agent import ChatRenderer, load_tools, tool_schemas, use_system_tool_prompt
from rlspmd.config import AgentConfig, MeshConfig, SFTConfig, to_dict
from rlspmd.data.images import MultimodalPrompts, image_parts, undecoded
from rlspmd.data.prompts import EpochSampler, read_rows
from rlspmd.distributed.dispatch import all_reduce_sum, scatter_batch
from rlspmd.distributed.mesh import DP
from rlspmd.distributed.runtime import StopRequest, exit_process, shutdown, spmd_main
from rlspmd.metrics import MetricLogger
from rlspmd.models.loader import load_tokenizer
from rlspmd.models.attn_kernels import check_attn_kernel
from rlspmd.models.vision import vision_inputs
from rlspmd.protocol import Batch, position_ids
from rlspmd.startup import parse_args, start
from rlspmd.trackers import Trackers
from rlspmd.validate import check_sft_config


def conversation_ids(
    messages: list[dict], renderer: ChatRenderer, *, eos_id: int, where: str
) -> tuple[list[int], list[int], list[int]]:
    """``(prompt ids, response ids, loss mask)`` of a whole conversation, built as the agent loop builds a rollout:
    the messages before the first assistant turn rendered as the prompt, then each assistant turn's content and EOS
    (loss 1), and the messages between assistant turns as the template's token delta (loss 0)."""
    tok = renderer.tokenizer
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if not first:
        raise ValueError(f"{where}: a conversation needs a prompt and at least one assistant message")
    prompt = tok(renderer.render(messages[:first], add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    response, loss, between = [], [], []
    for m in messages[first:]:
        if m["role"] != "assistant":
            between.append({"role": m["role"], "content": m["content"]})
            continue
        if between:
            delta = renderer.delta_ids(between, stop_text=tok.eos_token)
            response, loss, between = response + delta, loss + [0] * len(delta), []
        ids = tok(m["content"], add_special_tokens=False)["input_ids"] + [eos_id]
        response, loss = response + ids, loss + [1] * len(ids)
    if between:
        raise ValueError(f"{where}: a conversation must end with an assistant message")
    return prompt, response, loss


class SFTDataset:
    """(chat prompt, response) pairs tokenized as ``template(prompt) + response + eos``; or whole conversations
    (``messages_key``), the loss on the assistant turns only."""

    def __init__(
        self,
        files: list[str],
        tokenizer,
        *,
        prompt_key: str,
        response_key: str,
        max_length: int,
        messages_key: str | None = None,
        tools: list[dict] | None = None,
        image_key: str = "images",
        vision: MultimodalPrompts | None = None,
    ):
        """``vision``: a vision-language model's image processing: rows' ``image_key`` images (one per ``<image>`` in
        the prompt, verl's multimodal rows) become the batches' ``images``; None (a text model) refuses them."""
        self.tokenizer, self.vision = tokenizer, vision
        self.examples: list[tuple[list[int], list[int], list[int]]] = []  # prompt, response, loss mask
        self.images: list[tuple[list, str, Path] | None] = []  # per example: its image entries, where, data directory
        self.n_dropped = 0
        renderer = (
            ChatRenderer(tokenizer, tools=tools, field_name="model.tokenizer_path") if messages_key or tools else None
        )
        key = messages_key or prompt_key
        for path, ds in read_rows(files, prompt_key=key, field_name="data.train_files"):
            with_images = image_key in ds.column_names
            ds = undecoded(ds, image_key) if with_images else ds
            if messages_key is None and response_key not in ds.column_names:
                raise ValueError(f"data.train_files: {path} lacks the response column {response_key!r}")
            for i, r in enumerate(ds):
                where = f"data.train_files: {path} row {i}"
                images = list(r[image_key] or []) if with_images else []
                if images and vision is None:
                    raise ValueError(
                        f"{where}: the row has {len(images)} image(s) in `{image_key}`, but the model "
                        "reads text only (vision-language models: docs/vision.md)"
                    )
                messages = image_parts(r[key], len(images), where=where) if vision is not None else r[key]
                if messages_key is not None:
                    p, resp, m = conversation_ids(messages, renderer, eos_id=tokenizer.eos_token_id, where=where)
                else:
                    text = tokenizer.apply_chat_template(
                        messages, tools=tools, tokenize=False, add_generation_prompt=True
                    )
                    p = tokenizer(text, add_special_tokens=False)["input_ids"]
                    resp = tokenizer(r[response_key] + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
                    m = [1] * len(resp)
                if vision is not None:
                    counts = vision.token_counts(images, where=where, base=Path(path).parent)
                    p = vision.expand_ids(p, counts, where=where)
                if len(p) + len(resp) > max_length:
                    self.n_dropped += 1
                else:
                    self.examples.append((p, resp, m))
                    self.images.append((images, where, Path(path).parent) if images else None)
        if not self.examples:
            raise ValueError(f"data.train_files: no example fits data.max_length={max_length}")

    def batch(self, indices: list[int]) -> Batch:
        ex = [self.examples[i] for i in indices]
        P, R = max(len(p) for p, _, _ in ex), max(len(r) for _, r, _ in ex)
        pad = self.tokenizer.pad_token_id
        ids = torch.full((len(ex), P + R), pad, dtype=torch.long)
        mask = torch.zeros(len(ex), P + R, dtype=torch.long)
        loss = torch.zeros(len(ex), R, dtype=torch.long)
        for i, (p, r, m) in enumerate(ex):
            ids[i, P - len(p) : P + len(r)] = torch.tensor(p + r)
            mask[i, P - len(p) : P + len(r)] = 1
            loss[i, : len(m)] = torch.tensor(m)
        objects = {}
        if self.vision is not None:  # decoded and processed once, here: they travel with their rows
            objects["images"] = [
                None
                if self.images[i] is None
                else self.vision.images(self.images[i][0], where=self.images[i][1], base=self.images[i][2])
                for i in indices
            ]
        return Batch(
            {
                "input_ids_BL": ids,
                "attention_mask_BL": mask,
                "position_ids_BL": position_ids(mask),
                "responses_BR": ids[:, P:],
                "response_mask_BR": mask[:, P:],
                "loss_mask_BR": loss,
            },
            objects,
        )


def nll_loss(module, mb: Batch, global_tokens: float) -> torch.Tensor:
    R = mb["responses_BR"].shape[1]
    logp, _ = module(
        mb["input_ids_BL"],
        mb["attention_mask_BL"],
        mb["position_ids_BL"],
        response_len=R,
        with_entropy=False,
        **vision_inputs(mb),
    )
    return -(logp * mb["loss_mask_BR"]).sum() / global_tokens


def router_aux_loss(module, mb: Batch, global_tokens: float) -> torch.Tensor | float:
    """A mixture-of-experts model's load-balancing loss after ``nll_loss``'s forward, times its
    ``router_aux_loss_coef`` (as transformers adds it when fine-tuning), this micro-batch's share of the tokens; 0 for a
    dense model (``models/moe.py``)."""
    if module.moe is None:
        return 0.0
    share = mb["loss_mask_BR"].sum() / global_tokens
    return module.config.router_aux_loss_coef * module.moe.aux_loss() * share


@spmd_main
def main(argv: list[str] | None = None) -> None:
    cfg, dry_run = parse_args(argv, SFTConfig, prog="rlspmd.sft")
    check_sft_config(
        cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")), check_files=not dry_run
    )  # every rank, first
    started = start(cfg, dist=cfg.dist, mesh=MeshConfig(), seed=cfg.seed, dry_run=dry_run)  # SFT: every rank trains
    if started is None:
        return
    # heavy imports (transformers, torch.distributed.checkpoint) after the cheap checks: bad options fail in seconds
    from rlspmd.engines.fsdp import FSDPEngine
    from rlspmd.models.sharded_load import build_policy_module
    from rlspmd.trainer.checkpoint import (
        Checkpointer,
        Checkpointing,
        Counters,
        StopAndSave,
        read_meta,
        save_hf_model,
        write_model_files,
    )

    rt, meshes = started
    mesh = meshes.get("actor", DP)
    dp = mesh.size()
    assert cfg.data.batch_size % dp == 0, "check_sft_config checks data.batch_size against every rank (all DP in SFT)"
    # before anything loads: a bad checkpoint.dir or checkpoint.resume fails in seconds
    checkpointer = Checkpointer(cfg.checkpoint, output_dir=cfg.output_dir, rank=rt.rank, world_size=dp, mesh=mesh)
    resume_from = checkpointer.prepare()
    stop_request = StopRequest().install()
    m = cfg.model
    kernel = check_attn_kernel(
        m.attn_kernel,
        attn_implementation=m.attn_implementation,
        packing=m.packing,
        device=rt.device,
        dtype=cfg.fsdp.compute_dtype(rt.device),
        field_name="model.attn_kernel",
    )
    if rt.is_main:
        print(f"packed attention kernel: {kernel}", flush=True)
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path, field_name="model.tokenizer_path")
    if cfg.data.tool_prompt == "system" and cfg.data.tools:
        use_system_tool_prompt(tokenizer)  # as rollout.agent.tool_prompt=system renders them; the export keeps it
    data = sampler = None
    if rt.is_main:
        d = cfg.data
        tools = tool_schemas(load_tools(AgentConfig(tools=d.tools), field_name="data.tools"))
        data = SFTDataset(
            d.train_files,
            tokenizer,
            prompt_key=d.prompt_key,
            response_key=d.response_key,
            max_length=d.max_length,
            messages_key=d.messages_key,
            tools=tools,
            image_key=d.image_key,
            vision=MultimodalPrompts.for_model(cfg.model.path, tokenizer, field_name="model.path"),
        )
        sampler = EpochSampler(len(data.examples), d.batch_size, seed=cfg.seed, shuffle=d.shuffle)
        print(f"SFT examples: {len(data.examples)} (dropped {data.n_dropped} over data.max_length)", flush=True)
    module = build_policy_module(
        cfg.model.path,
        dtype=cfg.model.dtype,
        attn_implementation=cfg.model.attn_implementation,
        field_name="model.path",
        packing=cfg.model.packing,
        attn_kernel=cfg.model.attn_kernel,
    )
    engine = FSDPEngine(
        module,
        module.hf,
        mesh=mesh,
        device=rt.device,
        fsdp=cfg.fsdp,
        optim=cfg.optim,
        total_optim_steps=cfg.total_steps,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
    )
    trackers = Trackers(cfg.loggers, cfg.tracking, output_dir=cfg.output_dir, config=to_dict(cfg))
    saved = read_meta(resume_from).get("trainer_components", []) if resume_from is not None else None
    checkpointing = Checkpointing(
        checkpointer,
        engines={"actor": engine},
        components={
            **({"sampler": sampler} if rt.is_main else {}),
            **trackers.component(is_main=rt.is_main, saved=saved),  # their run ids: a resume continues them
        },
        mesh=mesh,
        rank=rt.rank,
        is_main=rt.is_main,
        meta={"total_steps": cfg.total_steps, "models": {"actor": m.path}, "config": to_dict(cfg)},
        write_files=partial(
            write_model_files,
            model_path=m.path,
            tokenizer_path=m.tokenizer_path,
            save_hf=cfg.checkpoint.save_hf,
            tokenizer=tokenizer,
            engine=engine,
            mesh=mesh,
        ),
    )
    counters = checkpointing.restore(resume_from) if resume_from is not None else Counters()
    logger = MetricLogger(
        cfg.loggers,
        cfg.output_dir,
        total_steps=cfg.total_steps,
        initial_step=counters.step,
        enabled=rt.is_main,
        trackers=trackers,
    )
    if resume_from is not None:
        logger.write(f"resumed from {resume_from} (step {counters.step} of {cfg.total_steps})")
    stop_and_save = StopAndSave(
        checkpointing,
        stop_request,
        device=rt.device,
        logger=logger,
        total_steps=cfg.total_steps,
        stop_at_step=cfg.stop_at_step,
        stop_field="stop_at_step",
        last=resume_from,
    )
    losses = []
    for step in range(counters.step + 1, cfg.total_steps + 1):
        batch = scatter_batch(data.batch(sampler.next_batch()) if rt.is_main else None, mesh=mesh, device=rt.device)
        tokens = float(all_reduce_sum(batch["loss_mask_BR"].sum(), mesh=mesh))
        mb_losses = []

        def loss_fn(module, mb):
            loss = nll_loss(module, mb, tokens)
            mb_losses.append(loss.detach())
            return loss + router_aux_loss(module, mb, tokens)

        stats = engine.optimizer_step(batch.split(cfg.micro_batch_size), loss_fn)
        losses.append(float(all_reduce_sum(torch.stack(mb_losses).sum(), mesh=mesh)))
        if step % cfg.log_every == 0 or step == cfg.total_steps:
            logger.log(
                step,
                {
                    "sft/loss": sum(losses) / len(losses),
                    "sft/grad_norm": float(stats["grad_norm"]),
                    "sft/lr": engine.lr,
                },
            )
            losses = []
        elif rt.is_main and logger.bar is not None:
            logger.bar.update(1)
        counters.step = step
        if stop_and_save(counters):
            break
    else:  # the last step: the run ends with its export
        out = Path(cfg.output_dir) / "hf"
        save_hf_model(engine, tokenizer, cfg.model.path, out, is_main=rt.is_main)
        logger.write(f"saved the fine-tuned model to {out}")
    logger.close()
    shutdown()


if __name__ == "__main__":
    main()
    exit_process()  # after a clean shutdown(): no interpreter teardown (see its docstring)
