"""The data-parallel wrapper: contiguous main-grad buffer, bucketed (optionally overlapped) reduction.

Gradient life cycle of one iteration::

    backward of each microbatch     param.grad --(post-accumulate-grad hook)--> param.main_grad += grad
                                    (= for the iteration's first); param.grad = None; or a fused backward
                                    stores into param.main_grad itself (megatron/core/grad_record.py)
    microbatches 1..n-1 (no_sync)   nothing else
    last microbatch                 with overlap_grad_reduce: each bucket launches its async reduction as
                                    soon as all its params' hooks fired
    finish_grad_sync()              launch what was not launched, wait for everything
    zero_grad_buffer()              clear the buffer and mark every main grad zero for the next iteration
                                    (each first gradient is then written, not added; grad_record.py)

The reduction is a mean over the data-parallel group: an all-reduce, or a reduce-scatter under the
distributed optimizer (DP rank r then holds the reduced grads of its shard; see ``grad_buffer.py``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, List

import torch
import torch.distributed as dist

from megatron.core.collectives import backend_of, group_size
from megatron.core.distributed.ddp_config import DDPConfig
from megatron.core.distributed.grad_buffer import Bucket, GradBuffer
from megatron.core.grad_record import add_grad


class DistributedDataParallel(torch.nn.Module):
    """Wrap ``module`` (one model chunk) for data parallelism over ``pstate.dp_group``.

    ``forward``, ``set_input_tensor``, ``state_dict``, ``load_state_dict`` and ``named_parameters`` pass
    through to the wrapped module, so checkpoint keys carry no ``module.`` prefix.
    """

    def __init__(self, module: torch.nn.Module, *, pstate, config: DDPConfig):
        super().__init__()
        self.module = module
        self.pstate = pstate
        self.config = config
        self.dp_group = pstate.dp_group
        self.dp_size = group_size(self.dp_group) if pstate.dp_size > 1 else 1
        self.dp_rank = pstate.dp_rank if self.dp_size > 1 else 0
        self._sync_enabled = True
        self._use_avg = (
            config.average_in_collective and self.dp_size > 1 and backend_of(self.dp_group) == "nccl"
        )

        params = [p for p in module.parameters() if p.requires_grad]
        by_dtype: Dict[torch.dtype, List[torch.nn.Parameter]] = {}
        for p in reversed(params):  # reverse order: grads of the last layers are final first
            by_dtype.setdefault(p.dtype, []).append(p)
        self.buffers: List[GradBuffer] = []
        for dtype, ps in by_dtype.items():
            grad_dtype = torch.float32 if config.grad_reduce_in_fp32 else dtype
            self.buffers.append(GradBuffer(
                ps, grad_dtype, config.bucket_size, self.dp_size, shard=config.use_distributed_optimizer,
                make_param_buffer=config.use_distributed_optimizer,
            ))
        self.param_to_buffer: Dict[torch.nn.Parameter, GradBuffer] = {
            p: buf for buf in self.buffers for p in buf.params
        }
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._grad_hook) for p in params]
        self._param_gather_hooks_installed = False

    # ---- pass-through ---------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_input_tensor(self, tensor) -> None:
        self.module.set_input_tensor(tensor)

    def state_dict(self, *args, **kwargs):
        self.finish_param_sync()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        self.finish_param_sync()
        return self.module.load_state_dict(state_dict, strict=strict)

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)

    # ---- backward hook ---------------------------------------------------------------------------------
    def _grad_hook(self, param: torch.nn.Parameter) -> None:
        """Move ``param.grad`` into ``param.main_grad``; under overlap, launch the bucket once it is complete."""
        if param.grad is not None:
            add_grad(param, param.grad)
            param.grad = None
        if self.config.overlap_grad_reduce and self._sync_enabled:
            buf = self.param_to_buffer[param]
            bucket = buf.param_to_bucket[param]
            if bucket.grad_handle is not None:
                raise RuntimeError(
                    "a gradient arrived for a parameter whose bucket was already reduced in this backward "
                    "(parameter used after its bucket was launched?); disable --overlap-grad-reduce"
                )
            bucket.ready.add(param)
            if len(bucket.ready) == len(bucket.params):
                buf.start_bucket_grad_sync(bucket, self.dp_group, self._use_avg)

    # ---- gradient synchronisation ---------------------------------------------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate grads locally (no communication) inside this context: all microbatches but the last."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def start_grad_sync(self) -> None:
        """Launch the asynchronous DP reduction of every bucket not yet launched."""
        for buf in self.buffers:
            for bucket in buf.buckets:
                buf.start_bucket_grad_sync(bucket, self.dp_group, self._use_avg)

    def finish_grad_sync(self) -> None:
        """Launch any bucket not yet launched and wait for all reductions (mean over DP)."""
        for buf in self.buffers:
            for bucket in buf.buckets:
                buf.finish_bucket_grad_sync(bucket, self.dp_group, self._use_avg)

    def make_full_grads(self, params) -> None:
        """Make the complete ``main_grad`` of ``params`` valid after a reduce-scatter (all-gather their buckets).

        Needed before a reduction over another group that pairs ranks with different buffer layouts
        (the tied embedding across the first and last pipeline stage).
        """
        if not self.config.use_distributed_optimizer or self.dp_size == 1:
            return
        seen = set()
        for p in params:
            buf = self.param_to_buffer.get(p)
            if buf is None:
                continue
            bucket = buf.param_to_bucket[p]
            if (id(buf), bucket.index) not in seen:
                seen.add((id(buf), bucket.index))
                buf.gather_bucket_grads(bucket, self.dp_group)

    def zero_grad_buffer(self) -> None:
        """Zero every main grad and forget per-iteration bucket state.

        Each parameter's record is marked zero too: the first gradient of the iteration is then written into
        ``main_grad`` instead of added, which clears the mark (``grad_record.py``).
        """
        for buf in self.buffers:
            buf.zero_grads()
            for bucket in buf.buckets:
                bucket.ready.clear()
        for p in self.param_to_buffer:
            p.grad = None

    def broadcast_params(self) -> None:
        """Copy DP rank 0's parameters to every DP rank (for runs whose replicas might start apart)."""
        if self.dp_size == 1:
            return
        src = dist.get_global_rank(self.dp_group, 0)
        for p in self.module.parameters():
            dist.broadcast(p.data, src=src, group=self.dp_group)

    # ---- parameter all-gather (distributed optimizer) ------------------------------------------------
    def start_param_sync(self, overlap: bool = False) -> None:
        """All-gather the updated parameter shards into every replica's parameters.

        With ``overlap`` the gathers are left in flight and each submodule waits for its own (and every
        earlier) bucket in a forward pre-hook; otherwise they complete before returning.
        """
        if not self.config.use_distributed_optimizer:
            return
        for buf in self.buffers:
            for bucket in reversed(buf.buckets):  # forward order: the first layers live in the last bucket
                buf.start_bucket_param_sync(bucket, self.dp_group)
        if overlap:
            self._install_param_gather_hooks()
        else:
            self.finish_param_sync()

    def finish_param_sync(self) -> None:
        """Wait for every in-flight parameter all-gather."""
        for buf in self.buffers:
            for bucket in buf.buckets:
                buf.finish_bucket_param_sync(bucket)

    def _install_param_gather_hooks(self) -> None:
        if self._param_gather_hooks_installed:
            return
        self._param_gather_hooks_installed = True
        for module in self.module.modules():
            own = [p for p in module.parameters(recurse=False) if p in self.param_to_buffer]
            if own:
                module.register_forward_pre_hook(self._make_param_wait_hook(own))

    def _make_param_wait_hook(self, params):
        # the buckets to wait for: this module's, and every bucket needed earlier in forward order
        def hook(module, args):
            for p in params:
                buf = self.param_to_buffer[p]
                first = buf.param_to_bucket[p].index
                for bucket in buf.buckets[first:]:
                    buf.finish_bucket_param_sync(bucket)
        return hook

    def buckets(self) -> List[Bucket]:
        return [b for buf in self.buffers for b in buf.buckets]
