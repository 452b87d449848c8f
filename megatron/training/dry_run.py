"""``--dry-run [NUM_GPUS]`` for any entry point: the flags validated as a run on NUM_GPUS GPUs (default: the
launcher's world size), then the planner's memory and time prediction. No process group, GPU or data file is
touched."""

from __future__ import annotations

import argparse
import os
from typing import List, Optional, Sequence

from megatron.training.arguments import parse_namespace, world_size_from_env
from megatron.training.flag_table import ConfigError


def wants_dry_run(argv: Sequence[str]) -> bool:
    return any(a == "--dry-run" or a.startswith("--dry-run=") for a in argv)


def dry_run_report(argv: Sequence[str], model: str, extra_sections=()) -> str:
    """The planner's report for the run ``argv`` describes; ``model``: ``gpt`` or ``bert``."""
    from megatron.core.planner import dry_run
    from megatron.core.planner.flags import planner_argv
    from megatron.core.tokenizer import build_tokenizer

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--dry-run", nargs="?", type=int, const=0, default=None)
    num_gpus = pre.parse_known_args(list(argv))[0].dry_run or world_size_from_env()
    if num_gpus < 1:
        raise ConfigError(f"--dry-run {num_gpus}: the number of GPUs must be >= 1")
    ns, notes = parse_namespace(argv, world_size=num_gpus, extra_sections=extra_sections)
    vocab = None
    if ns.vocab_file or ns.tokenizer_model or ns.vocab_size:  # the vocabulary the run pads (else the planner's)
        try:
            vocab = build_tokenizer(ns.tokenizer_type, vocab_file=ns.vocab_file, merge_file=ns.merge_file,
                                    tokenizer_model=ns.tokenizer_model, vocab_size=ns.vocab_size).vocab_size
        except (ValueError, OSError) as exc:
            raise ConfigError(f"--tokenizer-type {ns.tokenizer_type}: {exc}") from None
    text, _ = dry_run(planner_argv(ns, vocab_size=vocab), num_gpus=num_gpus, model=model)
    return "\n".join(notes + [text])


def print_dry_run(argv: Optional[Sequence[str]], model: str, extra_sections=()) -> None:
    """Print the report on rank 0 (every rank validates the same flags)."""
    report = dry_run_report(argv, model, extra_sections)
    if int(os.environ.get("RANK", "0")) == 0:
        print(report, flush=True)


__all__: List[str] = ["wants_dry_run", "dry_run_report", "print_dry_run"]
