"""Generate text from a trained checkpoint.

    python tools/generate.py --load CKPT --prompt "Once upon a time" --max-new-tokens 64 --top-p 0.9 --seed 1
    python tools/generate.py --load CKPT --prompt-file prompts.txt --greedy --json      # one prompt per line
    echo "To be, or not" | python tools/generate.py --load CKPT --greedy                # prompts from stdin
    torchrun --nproc_per_node 2 tools/generate.py --load CKPT --prompt "..."            # tensor parallel
    python tools/generate.py --load CKPT --prompt "..." --no-cuda-graph                 # eager decoding steps

Prompts are continued in batches of ``--batch-size``; the continuation (or with ``--json`` one JSON object per
prompt: prompt, text, tokens, finish reason and optionally log-probs) goes to stdout. On CUDA each decoding step
is replayed from a CUDA graph captured once per batch size and length (``--no-cuda-graph`` runs it eagerly).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402

from megatron.core.inference.launch import add_model_arguments, build_engine, is_output_rank, run_tool  # noqa: E402
from megatron.core.inference.sampling import SamplingParams  # noqa: E402
from megatron.core.inference.zeroshot_data import read_text  # noqa: E402

# SamplingParams field -> the flag that sets it, for error messages
_FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_k": "--top-k",
          "top_p": "--top-p"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Generate text from a checkpoint", allow_abbrev=False)
    add_model_arguments(p)
    g = p.add_argument_group("prompts and sampling")
    g.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    g.add_argument("--prompt-file", default=None, help="a file with one prompt per line")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--greedy", action="store_true", help="argmax decoding (same as --temperature 0)")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eod", action="store_true", help="keep generating past the end-of-document token")
    g.add_argument("--stop-on-eol", action="store_true", help="stop at the first generated newline")
    g.add_argument("--batch-size", type=int, default=None, help="prompts run together (default: "
                   "--micro-batch-size, else 8)")
    g.add_argument("--logprobs", action="store_true", help="with --json: log-probs of every token")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt instead of plain text")
    args = p.parse_args(argv)
    if args.batch_size is None:
        args.batch_size = args.micro_batch_size or 8
    if args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    try:
        args.sampling = SamplingParams(
            max_new_tokens=args.max_new_tokens, greedy=args.greedy, temperature=args.temperature, top_k=args.top_k,
            top_p=args.top_p, seed=args.seed, stop_on_eod=not args.ignore_eod, stop_on_eol=args.stop_on_eol,
            stop_strings=tuple(args.stop), logprobs=args.logprobs)
    except ValueError as exc:
        message = str(exc)
        for field, flag in _FLAGS.items():
            message = message.replace(field, flag)
        p.error(message)
    return args


def read_prompts(args) -> list:
    prompts = list(args.prompt)
    if args.prompt_file:
        if not os.path.isfile(args.prompt_file):
            raise ValueError(f"--prompt-file {args.prompt_file}: no such file")
        prompts += [line for line in read_text(args.prompt_file, "--prompt-file").split("\n") if line.strip()]
    if not prompts and not args.prompt_file:
        prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise ValueError("no prompts: give --prompt, --prompt-file or lines on stdin")
    return prompts


def generate(args) -> None:
    """Generate for every prompt and print the results on the output rank."""
    engine, _, _ = build_engine(args)
    prompts = read_prompts(args) if is_output_rank() else None
    if dist.is_initialized():  # every tensor-parallel rank runs the same batches
        box = [prompts]
        dist.broadcast_object_list(box, src=0)
        prompts = box[0]
    for start in range(0, len(prompts), args.batch_size):
        batch = prompts[start:start + args.batch_size]
        outs = engine.generate_text(batch, args.sampling)
        if not is_output_rank():
            continue
        for prompt, out in zip(batch, outs):
            if args.json:
                record = {"prompt": prompt, "text": out.text, "tokens": out.generated,
                          "finish_reason": out.finish_reason}
                if out.logprobs is not None:
                    record["logprobs"] = out.logprobs
                print(json.dumps(record), flush=True)
            else:
                print(prompt + out.text, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_tool(lambda: generate(args))


if __name__ == "__main__":
    sys.exit(main())
