"""Command-line setup shared by the inference tools: flags, process group, checkpoint, tokenizer, engine.

One process runs the whole model; under ``torchrun --nproc_per_node N`` the N processes form one model-parallel
group of N / ``--pipeline-model-parallel-size`` tensor-parallel ranks times that many pipeline stages (the
checkpoint may have been saved at any TP and PP size).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron.core.inference.checkpoint import CheckpointLoadError, load_gpt_for_inference
from megatron.core.inference.engine import InferenceEngine
from megatron.core.parallel_state import ParallelState

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--load", required=True, help="checkpoint directory (holds latest_checkpointed_iteration.txt)")
    g.add_argument("--iteration", type=int, default=None, help="checkpoint iteration (default: the tracker's)")
    g.add_argument("--tokenizer-type", default=None, help="default: the checkpoint's")
    g.add_argument("--vocab-file", default=None, help="default: the checkpoint's")
    g.add_argument("--merge-file", default=None, help="default: the checkpoint's")
    g.add_argument("--tokenizer-model", default=None, help="default: the checkpoint's")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="--tokenizer-type NullTokenizer: the number of ids before the end-of-document id "
                        "(default: the checkpoint's)")
    g.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="parameter dtype (default: the checkpoint's on GPU, fp32 on CPU)")
    g.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    g.add_argument("--attention-backend", choices=["sdpa", "unfused"], default="sdpa")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="pipeline stages (the processes not in it form the tensor-parallel size)")
    g.add_argument("--no-cuda-graph", action="store_true",
                   help="generation on CUDA: run every decoding step eagerly instead of replaying it from a CUDA "
                        "graph (the same tokens, slower; for comparison)")


def _init_distributed(device: str, pp: int) -> ParallelState:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if pp < 1 or world % pp:
        raise ValueError(f"--pipeline-model-parallel-size {pp} does not divide the {world} processes")
    if world == 1:
        return ParallelState.single()
    if not dist.is_initialized():
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return ParallelState.build(tensor_model_parallel_size=world // pp, pipeline_model_parallel_size=pp)


def build_tokenizer_from(args: argparse.Namespace, saved: dict):
    from megatron.core.tokenizer import build_tokenizer

    kind = args.tokenizer_type or saved.get("tokenizer_type") or "GPT2BPETokenizer"
    files = {k: getattr(args, k) or saved.get(k) for k in ("vocab_file", "merge_file", "tokenizer_model")}
    for key, path in files.items():
        if path and not os.path.exists(path) and not getattr(args, key):
            raise ValueError(f"the checkpoint's tokenizer file {path} does not exist here; give "
                             f"--{key.replace('_', '-')}")
    vocab_size = None
    if kind == "NullTokenizer":
        vocab_size = args.vocab_size if args.vocab_size is not None else saved.get("vocab_size")
    elif args.vocab_size is not None:
        raise ValueError(f"--vocab-size {args.vocab_size} is read by --tokenizer-type NullTokenizer only, not {kind}")
    return build_tokenizer(kind, vocab_size=vocab_size, **files)


def build_engine(args: argparse.Namespace) -> tuple:
    """``(engine, pstate, loaded)`` from the parsed flags; raises ``ValueError`` with one clear line."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    pstate = _init_distributed(device, args.pipeline_model_parallel_size)
    dtype: Optional[torch.dtype] = DTYPES[args.dtype] if args.dtype else (None if device == "cuda" else torch.float32)
    try:
        loaded = load_gpt_for_inference(args.load, pstate, iteration=args.iteration, dtype=dtype,
                                        device=torch.device(device), attention_backend=args.attention_backend)
    except CheckpointLoadError as exc:
        raise ValueError(str(exc)) from exc
    tokenizer = build_tokenizer_from(args, loaded.args)
    engine = InferenceEngine(loaded.model, pstate, tokenizer=tokenizer,
                             use_cuda_graph=False if args.no_cuda_graph else None)
    return engine, pstate, loaded


def is_output_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def run_tool(body: Callable[[], object]) -> int:
    """Run a command-line tool's ``body``: a bad input (``ValueError``) is one ``error:`` line and exit status 2;
    the process group is torn down either way."""
    try:
        body()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
