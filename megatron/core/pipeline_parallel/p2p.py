"""Point-to-point communication between neighbouring pipeline stages.

Every tensor crossing a stage boundary has the same shape, ``[s, b, h]`` (``[s/tp, b, h]`` under sequence
parallelism, where each tensor-parallel rank holds a slice of the sequence) and the same dtype, so the
receiver allocates its buffers without any shape handshake. One call to ``P2PCommunicator.exchange`` posts
a whole batch of sends and receives with ``torch.distributed.batch_isend_irecv`` and waits for all of them:
batching lets two neighbours send to each other at the same time without deadlocking, on gloo and NCCL,
as long as each posts the operations that match the other's batch in one batch of its own (a schedule
phase: ``actions.steps``).

Peers are *global* ranks (``pstate.next_pp_rank`` / ``pstate.prev_pp_rank``); the ops run on
``pstate.pp_group``. With gloo tensors travel through host memory; with NCCL on the current CUDA device.
Received tensors are handed over on the model's device. Between two ranks, sends are matched with receives in the order they are posted, so a schedule must
post them in the same order on both sides (the schedules in ``schedules.py`` guarantee it).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core.parallel_state import default_device

_WARMED_UP_GROUPS = set()


def pipeline_tensor_shape(
    seq_length: int, micro_batch_size: int, hidden_size: int, tp_size: int = 1, sequence_parallel: bool = False
) -> Tuple[int, int, int]:
    """Shape of the activations exchanged between stages: ``[s, b, h]``, or ``[s/tp, b, h]`` with SP."""
    for name, value in (("--seq-length", seq_length), ("--micro-batch-size", micro_batch_size),
                        ("--hidden-size", hidden_size)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1 for pipeline communication, got {value}")
    if sequence_parallel and tp_size > 1:
        if seq_length % tp_size != 0:
            raise ValueError(
                f"--sequence-parallel needs --seq-length ({seq_length}) divisible by "
                f"--tensor-model-parallel-size ({tp_size})"
            )
        seq_length //= tp_size
    return (seq_length, micro_batch_size, hidden_size)


class P2PCommunicator:
    """Batched isend/irecv of ``[s(/tp), b, h]`` tensors of one dtype over the pipeline group."""

    def __init__(self, pstate, tensor_shape: Sequence[int], dtype: torch.dtype,
                 device: Optional[torch.device] = None):
        """``device``: where received tensors are handed to the model (default: ``default_device()``)."""
        if pstate.pp_size > 1 and (pstate.pp_group is None or not dist.is_initialized()):
            raise RuntimeError(
                f"pipeline parallelism with {pstate.pp_size} stages needs torch.distributed and "
                "pstate.pp_group (build the ParallelState with ParallelState.build)"
            )
        self.pstate = pstate
        self.group = pstate.pp_group
        self.shape = tuple(int(d) for d in tensor_shape)
        self.dtype = dtype
        self.compute_device = torch.device(device) if device is not None else default_device()
        backend = str(dist.get_backend(self.group)) if self.group is not None else "gloo"
        self.uses_nccl = "nccl" in backend
        # gloo moves host tensors; NCCL device tensors
        self.wire_device = (torch.device("cuda", torch.cuda.current_device()) if self.uses_nccl
                            else torch.device("cpu"))

    def _warm_up(self) -> None:
        """Create the NCCL communicator with a collective every rank of the group joins.

        ``batch_isend_irecv`` requires all ranks of a group to take part in its first NCCL operation; the
        first batch of a pipeline schedule only involves some of them, so a tiny all-reduce goes first.
        """
        key = id(self.group)
        if not self.uses_nccl or key in _WARMED_UP_GROUPS:
            return
        dist.all_reduce(torch.zeros(1, device=self.wire_device), group=self.group)
        _WARMED_UP_GROUPS.add(key)

    def check(self, tensor: torch.Tensor, what: str) -> None:
        """Raise a clear error if ``tensor`` is not what the receiving stage will allocate."""
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise RuntimeError(
                f"{what}: pipeline stages exchange tensors of shape {list(self.shape)} and dtype {self.dtype} "
                f"([seq/tp under sequence parallelism, micro batch, hidden]), got shape {list(tensor.shape)} "
                f"and dtype {tensor.dtype}"
            )

    def exchange(self, sends: List[Tuple[torch.Tensor, int]], recv_from: List[int]) -> List[torch.Tensor]:
        """Send each ``(tensor, global_peer)``, receive one tensor from each peer in ``recv_from``.

        All operations are posted as one batch and waited for; returns the received tensors (on the
        compute device, in ``recv_from`` order).
        """
        if not sends and not recv_from:
            return []
        self._warm_up()
        ops = []
        for tensor, peer in sends:
            self.check(tensor, f"send to rank {peer}")
            wire = tensor.detach().to(self.wire_device).contiguous()
            ops.append(dist.P2POp(dist.isend, wire, peer=peer, group=self.group))
        buffers = [torch.empty(self.shape, dtype=self.dtype, device=self.wire_device) for _ in recv_from]
        for buf, peer in zip(buffers, recv_from):
            ops.append(dist.P2POp(dist.irecv, buf, peer=peer, group=self.group))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if self.uses_nccl:
            # Guard against reusing/reading the buffers while NCCL's stream still touches them (the
            # batched p2p path has had such races); the cost is small next to a stage's compute.
            torch.cuda.synchronize()
        return [buf.to(self.compute_device) for buf in buffers]
