"""Command-line setup shared by the inference tools: flags, process group, checkpoint, tokenizer, engine.

One process runs the whole model; under ``torchrun --nproc_per_node N`` the N processes form one model-parallel
group of N / ``--pipeline-model-parallel-size`` tensor-parallel ranks times that many pipeline stages (the
checkpoint may have been saved at any TP and PP size).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron.core.inference.checkpoint import CheckpointLoadError, load_gpt_for_inference
from megatron.core.inference.engine import InferenceEngine
from megatron.core.parallel_state import ParallelState

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# Megatron-LM's model flags, as its evaluation and serving scripts pass them: each given one must equal the
# checkpoint's stored value (the model is always built from the checkpoint)
CHECKED_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings")


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
    g.add_argument("--fp16", action="store_true", help="the same as --dtype fp16")
    g.add_argument("--bf16", action="store_true", help="the same as --dtype bf16")
    g.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    g.add_argument("--attention-backend", choices=["sdpa", "unfused"], default="sdpa")
    g.add_argument("--tensor-model-parallel-size", type=int, default=None,
                   help="checked: must equal the number of processes / --pipeline-model-parallel-size (the "
                        "checkpoint may have been saved at any size)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="pipeline stages (the processes not in it form the tensor-parallel size)")
    g.add_argument("--no-cuda-graph", action="store_true",
                   help="generation on CUDA: run every decoding step eagerly instead of replaying it from a CUDA "
                        "graph (the same tokens, slower; for comparison)")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="timeout of the process group's collectives (a server's idle ranks wait without it)")
    g = parser.add_argument_group("Megatron-LM's model flags (the model is built from the checkpoint's arguments; "
                                  "a flag given is checked against them)")
    for name in CHECKED_FLAGS:
        g.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help="checked against the checkpoint")
    g.add_argument("--seq-length", type=int, default=None,
                   help="sequence length; must not exceed the checkpoint's --max-position-embeddings")
    g.add_argument("--micro-batch-size", type=int, default=None, help="prompts or windows run together")
    g.add_argument("--use-checkpoint-args", action="store_true", help="always so here; accepted")
    g.add_argument("--no-load-optim", action="store_true", help="inference reads model weights only; accepted")
    g.add_argument("--no-load-rng", action="store_true", help="inference reads model weights only; accepted")
    g.add_argument("--local-rank", "--local_rank", type=int, default=None,
                   help="passed by python -m torch.distributed.launch; the LOCAL_RANK variable is read instead")


def check_model_arguments(args: argparse.Namespace) -> None:
    """The flags' own consistency, before any process group exists: raises ``ValueError`` naming the flag."""
    for name in (*CHECKED_FLAGS, "seq_length", "micro_batch_size", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if args.distributed_timeout_minutes <= 0:
        raise ValueError(f"--distributed-timeout-minutes must be > 0, got {args.distributed_timeout_minutes}")
    chosen = {flag: value for flag, value in (("--fp16", "fp16" if args.fp16 else None),
                                              ("--bf16", "bf16" if args.bf16 else None),
                                              (f"--dtype {args.dtype}", args.dtype)) if value}
    if len(set(chosen.values())) > 1:
        raise ValueError(f"conflicting parameter dtypes: {', '.join(chosen)}")
    if chosen:
        args.dtype = next(iter(chosen.values()))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pp = args.pipeline_model_parallel_size
    if world % pp:
        raise ValueError(f"--pipeline-model-parallel-size {pp} does not divide the {world} processes")
    tp = args.tensor_model_parallel_size
    if tp is not None and tp != world // pp:
        raise ValueError(f"--tensor-model-parallel-size {tp} must equal the number of processes ({world}) / "
                         f"--pipeline-model-parallel-size ({pp}) = {world // pp}")


def check_against_checkpoint(args: argparse.Namespace, stored: dict, where: str) -> None:
    """Each of Megatron-LM's model flags that was given must equal the checkpoint's value: one line naming every
    mismatch (flag, value given, checkpoint's)."""
    stored = dict(stored)
    if stored.get("ffn_hidden_size") is None and stored.get("hidden_size") is not None:
        stored["ffn_hidden_size"] = 4 * int(stored["hidden_size"])
    if stored.get("max_position_embeddings") is None:
        stored["max_position_embeddings"] = stored.get("seq_length")
    bad = [f"--{k.replace('_', '-')} {getattr(args, k)} (the checkpoint's is {stored.get(k)})"
           for k in CHECKED_FLAGS if getattr(args, k) is not None and getattr(args, k) != stored.get(k)]
    if bad:
        raise ValueError(f"{where} does not match: {'; '.join(bad)}")
    positions = stored.get("max_position_embeddings")
    if args.seq_length is not None and positions is not None and args.seq_length > int(positions):
        raise ValueError(f"--seq-length {args.seq_length} exceeds the checkpoint's {positions} positions "
                         f"(--max-position-embeddings) in {where}")


def _init_distributed(device: str, pp: int, timeout_minutes: float = 10.0) -> ParallelState:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return ParallelState.single()
    if not dist.is_initialized():
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device == "cuda" else "gloo",
                                timeout=datetime.timedelta(minutes=timeout_minutes))
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
    check_model_arguments(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    pstate = _init_distributed(device, args.pipeline_model_parallel_size, args.distributed_timeout_minutes)
    dtype: Optional[torch.dtype] = DTYPES[args.dtype] if args.dtype else (None if device == "cuda" else torch.float32)
    try:
        loaded = load_gpt_for_inference(args.load, pstate, iteration=args.iteration, dtype=dtype,
                                        device=torch.device(device), attention_backend=args.attention_backend)
    except CheckpointLoadError as exc:
        raise ValueError(str(exc)) from exc
    check_against_checkpoint(args, loaded.args, f"--load {args.load} ({loaded.path})")
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
