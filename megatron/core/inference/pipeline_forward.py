"""One batch forward through a GPT's pipeline stages, by the trainer's own pipeline schedule.

Generation (``engine.InferenceEngine``), zero-shot scoring of a loaded checkpoint (``tasks/main.py``) and of the
model being trained (``--eval-tasks``) run their forwards here: the schedule the trainer's evaluation uses
(``pipeline_parallel.get_forward_backward_func`` with ``forward_only``), one microbatch holding the whole batch, so
stages exchange their activations through the same batched point-to-point layer as in training, with sequence
parallelism and virtual pipeline chunks alike.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron.core.parallel_state import ParallelState
from megatron.core.pipeline_parallel import get_forward_backward_func


def pipeline_forward(chunks: Sequence[torch.nn.Module], pstate: ParallelState, tokens: torch.Tensor,
                     positions: torch.Tensor, labels: Optional[torch.Tensor] = None,
                     inference_context=None) -> Optional[torch.Tensor]:
    """Run ``tokens`` and ``positions [b, s]`` through this rank's model ``chunks`` (GPT chunks, possibly in
    data-parallel wrappers; one per virtual stage) and the other ranks' stages.

    Returns, on the rank holding the last stage, the model's output: vocab-parallel logits ``[b, s, V/tp]``, or the
    per-token losses ``[b, s]`` given ``labels``; ``None`` on the other ranks. ``inference_context``: the key/value
    cache handed to every chunk (``kv_cache.KVCache``). Collective over the pipeline group; runs without autograd.
    """
    chunks = list(chunks)
    first = getattr(chunks[0], "module", chunks[0])
    config = first.config
    param = next(first.parameters())
    b, s = tokens.shape

    def forward_step(_data_iterator, chunk):
        last = getattr(chunk, "module", chunk).post_process
        out = chunk(tokens, positions, labels=labels if last else None, inference_context=inference_context)
        return out, keep_output

    schedule = get_forward_backward_func(pstate)
    stats = schedule(forward_step_func=forward_step, data_iterator=None, model=chunks, num_microbatches=1,
                     seq_length=s, micro_batch_size=b, hidden_size=config.hidden_size, dtype=param.dtype,
                     pstate=pstate, sequence_parallel=config.sequence_parallel, forward_only=True)
    return stats[0]["output"] if stats else None


def keep_output(output: torch.Tensor):
    """The schedule's loss function for a forward whose output is the result: no loss, the output kept in the
    microbatch's stats."""
    return output.new_zeros(()), {"output": output}
