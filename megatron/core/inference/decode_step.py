"""The static decoding step: one position of a batch at shapes that do not depend on the position, run eagerly or
replayed from a CUDA graph.

After the prompt pass, each decoding step runs the model on one token per sequence. In the dynamic form (the
engine's ``static_decode=False``) the step attends over the positions filled so far, so every step has other
shapes and the host launches every kernel of every layer again: at small batches decoding is bound by the host.
Here the step's inputs live in fixed device buffers (the token ids ``[b, 1]`` and the position ``[1]``), the key
and value are written at the position held in that device tensor, and attention covers the whole preallocated
cache with the positions after the current one masked out (``kv_cache.LayerKV.attend``). The
same kernels with the same arguments run at every position, so on CUDA the step is captured once in a
``torch.cuda.CUDAGraph`` and replayed: one launch per step instead of one per kernel.

A step owns its key/value buffers and is kept for the next call with the same batch size and capacity (the total
length rounded up to a multiple of ``CAPACITY_MULTIPLE``, at most the model's positions), so a graph is captured
once per (batch, capacity). The graph reads the model's parameters in place: weights loaded into the same
tensors (``load_state_dict``) are seen by later replays; a model whose parameter tensors are replaced needs a new
engine (or ``InferenceEngine.drop_decode_steps()``).
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch

from megatron.core.inference.kv_cache import AttentionShape, KVCache

CAPACITY_MULTIPLE = 64
WARMUP_RUNS = 2  # eager runs on the capture stream before capturing (Triton compiles, cuBLAS sets up)


def static_capacity(total: int, max_length: int) -> int:
    """Positions a static step buffers for sequences of ``total`` positions: ``total`` rounded up to a multiple
    of ``CAPACITY_MULTIPLE`` (so that calls of similar lengths share one graph), at most ``max_length``."""
    return min(-(-total // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE, max_length)


class StaticDecodeStep:
    """One decoding position for a batch of ``batch`` sequences of up to ``capacity`` positions.

    ``forward(tokens [b, 1], positions [b, 1])`` runs the model (this rank's stage) with ``cache`` in static mode
    and returns the float32 logits ``[b, 1, V_padded]`` (``None`` off the last pipeline stage). ``shape``: the key/value
    heads of the stage's layers (``kv_cache.attention_shape``).
    """

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor], Optional[torch.Tensor]], cache: KVCache,
                 batch: int, capacity: int, shape: AttentionShape, dtype: torch.dtype,
                 device: torch.device, use_graph: bool):
        if use_graph and device.type != "cuda":
            raise ValueError(f"a CUDA graph needs the model on a CUDA device, not {device}")
        n_layers, groups, head_dim = shape
        buffer = (batch, groups, capacity, head_dim)
        # zeros, not empty: masked positions get no weight, but a NaN in an unwritten value would still spread
        self.keys: List[torch.Tensor] = [torch.zeros(buffer, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values: List[torch.Tensor] = [torch.zeros(buffer, dtype=dtype, device=device)
                                           for _ in range(n_layers)]
        self.forward, self.cache = forward, cache
        self.batch, self.capacity, self.use_graph = batch, capacity, use_graph
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)  # static input [b, 1]
        self.position = torch.zeros(1, dtype=torch.long, device=device)  # static input: the step's position
        self.all_positions = torch.arange(capacity, device=device)  # [T]
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.logits: Optional[torch.Tensor] = None  # the graph's output buffer [b, 1, V]

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def bind(self) -> None:
        """Make this step's buffers the cache's, for a generation call (the prompt pass writes into them)."""
        self.cache.use(self.keys, self.values)

    def __call__(self, tokens: torch.Tensor, position: int) -> Optional[torch.Tensor]:
        """Run the step on ``tokens [b, 1]`` at ``position`` (the cache holds every earlier position): the logits
        ``[b, 1, V]`` predicting the next position, valid until the next call."""
        if not 0 <= position < self.capacity:
            raise ValueError(f"position {position} is outside the static step's {self.capacity} positions")
        self.tokens.copy_(tokens)
        self.position.fill_(position)
        if not self.use_graph:
            return self._run()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.logits

    def _run(self) -> Optional[torch.Tensor]:
        """The step's kernels, in the order the graph records them."""
        self.cache.position = self.position
        self.cache.visible = (self.all_positions <= self.position).view(1, 1, 1, self.capacity)  # [1, 1, 1, T]
        try:
            positions = self.position.view(1, 1).expand(self.batch, 1)  # [b, 1]
            return self.forward(self.tokens, positions)
        finally:
            self.cache.position = self.cache.visible = None

    def _capture(self) -> None:
        """Warm up on a side stream, then record the step. The warm-up runs write the same key and value at the
        same position as the replay that follows, so the cache is left as the eager step would leave it."""
        device = self.position.device
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                self._run()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: only this thread's calls are checked during the capture; other threads (a server's
            # connection handlers) go on
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                self.logits = self._run()
        except RuntimeError as exc:
            raise RuntimeError(f"capturing the decoding step in a CUDA graph failed: {exc} (use_cuda_graph=False, "
                               "or --no-cuda-graph in the tools, runs the step eagerly)") from exc
        self.graph = graph
