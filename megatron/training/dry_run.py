"""``--dry-run [NUM_GPUS]`` for any entry point: the flags validated as a run on NUM_GPUS GPUs (default: the
launcher's world size), then the planner's memory and time prediction. No process group, GPU or data file is
touched. The planner reads the validated configuration itself (``plan_inputs.inputs_from_namespace``).

    text, fits = dry_run(argv, num_gpus=8)   # the same prediction for a command line not validated as a run
"""

from __future__ import annotations

import argparse
import os
from typing import List, Optional, Sequence, Tuple

from megatron.training.arguments import parse_namespace, world_size_from_env
from megatron.training.flag_table import ConfigError


def wants_dry_run(argv: Sequence[str]) -> bool:
    return any(a == "--dry-run" or a.startswith("--dry-run=") for a in argv)


def _report(ns: argparse.Namespace, num_gpus: int, model: str, vocab_size: Optional[int],
            gpu_memory_gb: Optional[float] = None, gpus_per_node: int = 8, gpu_kind: str = "h200",
            calibration: Optional[str] = None) -> Tuple[str, bool]:
    from megatron.core.planner import format_prediction, load_calibration, predict
    from megatron.core.planner.timing import calibrated_gpu_memory_gb
    from megatron.training.plan_inputs import inputs_from_namespace

    cal = load_calibration(calibration or gpu_kind)
    memory = gpu_memory_gb if gpu_memory_gb is not None else calibrated_gpu_memory_gb(cal)
    shape, layout, cluster, gbs = inputs_from_namespace(ns, num_gpus, model, vocab_size, memory, gpus_per_node,
                                                        gpu_kind)
    pred = predict(shape, layout, cluster, cal, gbs)
    head = (f"dry run: {shape.model.upper()} on {num_gpus} x {gpu_kind} ({memory:g} GB each), calibration "
            f"{cal['_path']}")
    return head + "\n" + format_prediction(pred), pred.fits


def dry_run(argv: Sequence[str], num_gpus: int, model: str = "gpt", gpu_memory_gb: Optional[float] = None,
            gpus_per_node: int = 8, gpu_kind: str = "h200", calibration: Optional[str] = None) -> Tuple[str, bool]:
    """``(report, fits)`` for the trainer flags ``argv`` on ``num_gpus`` GPUs, read by the trainer's parser without
    the checks of a training run (no --lr or data needed). ``gpu_memory_gb`` defaults to the calibration's
    (``timing.calibrated_gpu_memory_gb``); ``model`` is ``bert`` for ``pretrain_bert.py``."""
    from megatron.training.plan_inputs import parse_planner_argv

    ns = parse_planner_argv(argv)
    return _report(ns, num_gpus, ns.model if model == "gpt" else model, None, gpu_memory_gb, gpus_per_node, gpu_kind, calibration)


def dry_run_report(argv: Sequence[str], model: str, extra_sections=()) -> str:
    """The planner's report for the run ``argv`` describes; ``model``: ``gpt`` or ``bert``."""
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
    text, _ = _report(ns, num_gpus, model, vocab)
    return "\n".join(notes + [text])


def print_dry_run(argv: Optional[Sequence[str]], model: str, extra_sections=()) -> None:
    """Print the report on rank 0 (every rank validates the same flags)."""
    report = dry_run_report(argv, model, extra_sections)
    if int(os.environ.get("RANK", "0")) == 0:
        print(report, flush=True)


__all__: List[str] = ["wants_dry_run", "dry_run", "dry_run_report", "print_dry_run"]
