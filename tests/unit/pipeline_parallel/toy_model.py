"""A tiny pipeline-able model for the schedule tests: a stack of Linear+tanh layers and an MSE loss.

``ToyStage(layers, offset, count, is_first, is_last)`` holds layers ``offset .. offset+count-1`` of a
``full_layers(num_layers, hidden, seed)`` stack (deep copies, so every stage starts from the same full
weights). A non-first stage reads its input from ``set_input_tensor``; the first reads ``x`` from the batch.
Activations are ``[s, b, h]`` as in the real model. ``reference_step`` runs the unsplit stack in one process
with the same loss normalisation as the schedules (mean over microbatches of each microbatch's mean loss).
"""

from __future__ import annotations

import copy
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F

SEQ, MBS, HIDDEN = 4, 2, 8


class ToyStage(torch.nn.Module):
    """Layers ``offset .. offset+count-1`` of the toy stack."""

    def __init__(self, layers: torch.nn.ModuleList, offset: int, count: int, is_first: bool, is_last: bool):
        super().__init__()
        self.layers = torch.nn.ModuleList(copy.deepcopy(layers[i]) for i in range(offset, offset + count))
        self.offset, self.is_first, self.is_last = offset, is_first, is_last
        self.input_tensor = None
        self.set_input_calls = 0

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor
        self.set_input_calls += 1

    def forward(self, x):  # x: [s, b, h] on the first stage, ignored elsewhere
        h = x if self.is_first else self.input_tensor
        for layer in self.layers:
            h = torch.tanh(layer(h))  # [s, b, h]
        return h


def build_chunks(layers: torch.nn.ModuleList, pstate, num_chunks: int) -> List[ToyStage]:
    """This rank's model chunks: chunk ``c`` is virtual stage ``c * pp + pp_rank`` (layers from layers_for_stage)."""
    from megatron.core.pipeline_parallel.partition import layers_for_stage

    chunks = []
    for c in range(num_chunks):
        offset, count = layers_for_stage(len(layers), pstate.pp_size, pstate.pp_rank,
                                         num_chunks if num_chunks > 1 else None, c)
        stage = c * pstate.pp_size + pstate.pp_rank
        chunks.append(ToyStage(layers, offset, count, stage == 0, stage == pstate.pp_size * num_chunks - 1))
    return chunks


def full_layers(num_layers: int, hidden: int = HIDDEN, seed: int = 1234) -> torch.nn.ModuleList:
    gen = torch.Generator().manual_seed(seed)
    layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(num_layers))
    with torch.no_grad():
        for layer in layers:
            layer.weight.copy_(torch.randn(hidden, hidden, generator=gen) / hidden ** 0.5)
            layer.bias.copy_(torch.randn(hidden, generator=gen) * 0.1)
    return layers


def make_batches(num_microbatches: int, seed: int = 99, dp_rank: int = 0) -> List[Dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed + 1000 * dp_rank)
    return [
        {"x": torch.randn(SEQ, MBS, HIDDEN, generator=gen), "y": torch.randn(SEQ, MBS, HIDDEN, generator=gen)}
        for _ in range(num_microbatches)
    ]


def forward_step_func(data_iterator, chunk):
    """Pull this chunk's next microbatch, run the chunk, return (output, loss_func)."""
    batch = next(data_iterator)
    out = chunk(batch["x"])

    def loss_func(output):
        loss = F.mse_loss(output, batch["y"])
        return loss, {"loss": loss.detach().clone()}

    return out, loss_func


def reference_step(layers: torch.nn.ModuleList, batches, backward: bool = True) -> Tuple[List[float], Dict]:
    """Per-microbatch losses and the gradients of the mean loss, from the unsplit stack in one process."""
    model = ToyStage(layers, 0, len(layers), True, True)
    model.zero_grad()
    losses = []
    total = 0.0
    for b in batches:
        loss = F.mse_loss(model(b["x"]), b["y"])
        losses.append(loss.item())
        total = total + loss / len(batches)
    if backward:
        total.backward()
    grads = {f"layers.{i}.{n}": p.grad.clone() for i, layer in enumerate(model.layers)
             for n, p in layer.named_parameters()} if backward else {}
    return losses, grads
