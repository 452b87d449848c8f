"""Pretraining sampler and data loader: each data-parallel rank's micro-batches, resumable.

Samples are consumed in order ``0, 1, 2, ...``; a global batch of ``micro_batch_size * dp_size``
consecutive samples is cut into ``dp_size`` micro-batches, rank ``r`` taking the ``r``-th slice (Megatron's
``MegatronPretrainingSampler``). Resuming from ``consumed_samples`` (a multiple of the global micro-batch)
continues exactly where the interrupted run stopped. A last incomplete global batch is dropped.
"""

from __future__ import annotations

import functools
import os
from typing import Dict, Iterator, List, Sequence

import numpy as np
import torch

from megatron.core.process_tree import die_with_parent, ignore_stop_signals


class MegatronPretrainingSampler:
    """Yields lists of sample indices: this rank's micro-batches, from ``consumed_samples`` on."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True):
        if total_samples <= 0:
            raise ValueError(f"no sample to consume: total_samples={total_samples}")
        if micro_batch_size <= 0:
            raise ValueError(f"--micro-batch-size must be > 0, got {micro_batch_size}")
        if data_parallel_size <= 0:
            raise ValueError(f"data_parallel_size must be > 0, got {data_parallel_size}")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} is not in [0, {data_parallel_size})")
        if consumed_samples < 0 or consumed_samples >= total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} is not in [0, total_samples={total_samples})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.drop_last = drop_last
        self.global_micro = micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        return self.total_samples

    def _slice(self, batch: List[int]) -> List[int]:
        start = self.data_parallel_rank * self.micro_batch_size
        return batch[start: start + self.micro_batch_size]

    def __iter__(self) -> Iterator[List[int]]:
        batch: List[int] = []
        for idx in range(self.consumed_samples, self.total_samples):
            batch.append(idx)
            if len(batch) == self.global_micro:
                yield self._slice(batch)
                batch = []
        if batch and not self.drop_last:
            yield self._slice(batch)


def collate_text(items: Sequence[Dict[str, np.ndarray]]) -> Dict[str, torch.Tensor]:
    """``[{"text": int64[s + 1]}, ...]`` -> ``{"text": LongTensor[b, s + 1]}`` (other keys stacked too)."""
    out: Dict[str, torch.Tensor] = {"text": torch.from_numpy(np.stack([np.asarray(it["text"]) for it in items]))}
    for key in items[0]:
        if key != "text":
            out[key] = torch.as_tensor(np.array([it[key] for it in items]))
    return out


def init_worker(trainer_pid: int, worker_id: int) -> None:
    """A DataLoader worker ignores the signals that stop a run (a scheduler signals the trainer's whole process
    group: the trainer finishes its iteration, saves and shuts the loader down itself) and dies with the trainer
    (SIGKILL when the trainer ends, so a killed trainer leaves no worker holding its files or its run lock)."""
    ignore_stop_signals()
    die_with_parent(trainer_pid)


def build_pretraining_data_loader(dataset, consumed_samples: int, micro_batch_size: int,
                                  data_parallel_rank: int, data_parallel_size: int,
                                  num_workers: int = 0) -> torch.utils.data.DataLoader:
    """A ``DataLoader`` over this rank's micro-batches of ``dataset``, resuming at ``consumed_samples``; its
    workers (``num_workers`` > 0) are set up by ``init_worker``."""
    sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                         data_parallel_rank, data_parallel_size)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                       collate_fn=collate_text, pin_memory=False,
                                       persistent_workers=num_workers > 0,
                                       worker_init_fn=functools.partial(init_worker, os.getpid()))
