"""Point-to-point between pipeline stages and a GPipe schedule, in plain ``torch.distributed`` (Gloo or NCCL).

The megatron engine runs its pipeline through megatron-core's own schedule (``get_forward_backward_func``) on CUDA.
megatron-core 0.16.1's pipeline code cannot run on a CPU-only torch: ``p2p_communication.py`` allocates its shape and
receive buffers with ``device=torch.cuda.current_device()`` and calls ``torch.cuda.synchronize()``, and every
schedule allocates its token counter with ``device="cuda"`` (``schedules.py``). So on CPU the engine runs this
schedule instead, with megatron's ``forward_step`` contract unchanged: ``forward_step(data_iterator, model) ->
(output, loss_func)``, the input tensor set with ``model.set_input_tensor`` before each forward, and on the last stage
``loss_func(output)[0]`` back-propagated as returned.

The schedule is GPipe's: every micro-batch forward (activations kept), then every backward in the same order. It
is the simplest correct pipeline schedule; with blocking sends there is no overlap between stages, which costs
nothing on CPU (where it exists to test the engine) and is why CUDA runs megatron's 1F1B instead.

Tensors cross stages after a shape header (``[ndim, *shape]``, padded to a fixed length: micro-batches are padded
to their own longest row, so the shape changes per micro-batch, megatron's ``variable_seq_lengths``), in one fixed
dtype (``pipeline_dtype``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn


class StageP2P:
    """Sends and receives between this stage and its neighbours in ``group`` (the pipeline: group rank = stage)."""

    def __init__(self, group: dist.ProcessGroup, *, dtype: torch.dtype, device: torch.device):
        self.group, self.dtype, self.device = group, dtype, device
        self.stage, self.stages = group.rank(), group.size()

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    MAX_DIMS = 7

    def _send(self, tensor: torch.Tensor, stage: int) -> None:
        t = tensor.detach().to(self.dtype).contiguous()
        assert t.dim() <= self.MAX_DIMS, t.shape
        header = [t.dim(), *t.shape] + [0] * (self.MAX_DIMS - t.dim())
        dist.send(torch.tensor(header, dtype=torch.long, device=self.device), group=self.group, group_dst=stage)
        dist.send(t, group=self.group, group_dst=stage)

    def _recv(self, stage: int) -> torch.Tensor:
        header = torch.empty(1 + self.MAX_DIMS, dtype=torch.long, device=self.device)
        dist.recv(header, group=self.group, group_src=stage)
        ndim, *shape = header.tolist()
        out = torch.empty(shape[:ndim], dtype=self.dtype, device=self.device)
        dist.recv(out, group=self.group, group_src=stage)
        return out

    def send_next(self, activation: torch.Tensor) -> None:
        self._send(activation, self.stage + 1)

    def recv_prev(self) -> torch.Tensor:
        return self._recv(self.stage - 1)

    def send_prev(self, grad: torch.Tensor) -> None:
        self._send(grad, self.stage - 1)

    def recv_next(self) -> torch.Tensor:
        return self._recv(self.stage + 1)


def gpipe_forward_backward(
    forward_step: Callable,
    data: Iterator,
    *,
    model: nn.Module,
    num_micro_batches: int,
    p2p: StageP2P,
    forward_only: bool = False,
) -> None:
    """All forwards, then all backwards, over ``num_micro_batches`` (every stage of the pipeline calls this)."""
    inputs, outputs = [], []
    for _ in range(num_micro_batches):
        x = None if p2p.first else p2p.recv_prev()
        if x is not None and not forward_only:
            x.requires_grad_()
        model.set_input_tensor(x)
        out, loss_func = forward_step(data, model)
        if p2p.last:
            out = loss_func(out)[0]
        else:
            p2p.send_next(out)
        inputs.append(x)
        outputs.append(out)
    model.set_input_tensor(None)
    if forward_only:
        return
    for x, out in zip(inputs, outputs):
        if p2p.last:
            out.backward()
        else:
            torch.autograd.backward(out, p2p.recv_next().to(out.dtype))
        if not p2p.first:
            p2p.send_prev(x.grad)
