"""``rlspmd.engines.pipeline`` (the CPU pipeline schedule of the megatron engine) on a toy model, no megatron-core.

usage: pipeline_check.py OUT_DIR   (torchrun, N ranks = N stages)

A stack of ``2 N`` tanh-linear layers split into N stages of 2; 3 micro-batches of different lengths (the shape
header), the loss on the last stage. Each rank saves its stage's gradients and the losses the last stage computed,
and the same model run whole on every rank (the reference): the test compares them.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from rlspmd.engines.pipeline import StageP2P, gpipe_forward_backward

H = 8


class Stage(nn.Module):
    """Layers ``[2 s, 2 s + 2)`` of the toy model; like megatron's stages it reads the previous stage's output from
    ``set_input_tensor`` (the first stage embeds its input instead)."""

    def __init__(self, layers: nn.ModuleList):
        super().__init__()
        self.layers, self.input_tensor = layers, None

    def set_input_tensor(self, x):
        self.input_tensor = x

    def forward(self, x):
        h = x if self.input_tensor is None else self.input_tensor
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h


def main():
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    full = nn.ModuleList(nn.Linear(H, H) for _ in range(2 * n))  # the same weights on every rank
    g = torch.Generator().manual_seed(1)
    micro = [(torch.randn(length, H, generator=g), torch.randn(length, H, generator=g)) for length in (3, 5, 2)]

    def loss_of(out, target):
        return ((out - target) ** 2).sum() * 0.5

    # Reference: the whole model on this rank.
    ref_losses = []
    for x, target in micro:
        h = x
        for layer in full:
            h = torch.tanh(layer(h))
        loss = loss_of(h, target)
        loss.backward()
        ref_losses.append(loss.detach())
    ref_grads = {f"{i}.{k}": p.grad.clone() for i, layer in enumerate(full) for k, p in layer.named_parameters()}
    full.zero_grad(set_to_none=True)

    stage = Stage(nn.ModuleList(full[2 * rank : 2 * rank + 2]))
    losses = []

    def forward_step(data_iterator, model):
        x, target = next(data_iterator)
        out = model(x)

        def loss_func(output):
            loss = loss_of(output, target)
            losses.append(loss.detach())
            return loss, None, {}

        return out, loss_func

    p2p = StageP2P(dist.group.WORLD, dtype=torch.float32, device=torch.device("cpu"))
    gpipe_forward_backward(forward_step, iter(micro), model=stage, num_micro_batches=len(micro), p2p=p2p)
    grads = {f"{2 * rank + i}.{k}": p.grad.clone() for i, layer in enumerate(stage.layers) for k, p in layer.named_parameters()}
    torch.save({"grads": grads, "ref_grads": ref_grads, "losses": losses, "ref_losses": ref_losses},
               Path(sys.argv[1]) / f"pipeline_rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
