"""``--eval-tasks``: zero-shot LAMBADA accuracy and WikiText perplexity of the model being trained.

At every ``--eval-interval`` and at the end (with the validation loss) the trainer calls
``DownstreamEvaluator.evaluate`` on its model chunks, as they are, at any TP/PP/DP layout: the scoring is
``tasks/main.py``'s (``megatron.core.inference.zeroshot``), run through ``ModelChunksForward``, with the examples
split over the data-parallel replicas and the sums reduced. The files are read and tokenized once, at start-up;
an evaluation costs only its own forward passes. The chunks are put in eval mode and back in their previous
mode, and every random-number generator (Python, NumPy, torch, CUDA, the tensor-parallel tracker) is restored,
so training continues exactly as without ``--eval-tasks``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from megatron.core.inference.zeroshot import ModelChunksForward, count_targets, score_samples, wikitext_metrics
from megatron.core.inference.zeroshot_data import build_lambada, build_wikitext
from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel.random import get_all_rng_states, set_all_rng_states
from megatron.training.flag_table import ConfigError, SharedError

TASKS = ("lambada", "wikitext")
_DATA_FLAG = {"lambada": "--eval-lambada-data", "wikitext": "--eval-wikitext-data"}


def validate_eval_tasks(ns: argparse.Namespace) -> None:
    """Check the ``--eval-*`` flags and turn ``--eval-tasks`` into a tuple (empty without the flag)."""
    names = [] if ns.eval_tasks is None else [t.strip() for t in ns.eval_tasks.split(",")]
    for name in names:
        if name not in TASKS:
            raise ConfigError(f"--eval-tasks {ns.eval_tasks}: unknown task '{name}'; known: {', '.join(TASKS)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"--eval-tasks {ns.eval_tasks} names a task twice")
    for task, flag in _DATA_FLAG.items():
        path = getattr(ns, flag[2:].replace("-", "_"))
        if task in names and path is None:
            raise ConfigError(f"--eval-tasks {task} needs {flag} FILE")
        if task not in names and path is not None:
            raise ConfigError(f"{flag} is given but --eval-tasks does not include {task}")
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"{flag} {path}: no such file")
    if ns.eval_strict_lambada and "lambada" not in names:
        raise ConfigError("--eval-strict-lambada needs --eval-tasks lambada")
    if ns.eval_overlapping_eval is not None:
        if "wikitext" not in names:
            raise ConfigError("--eval-overlapping-eval needs --eval-tasks wikitext")
        if ns.eval_overlapping_eval < 1:
            raise ConfigError(f"--eval-overlapping-eval must be >= 1, got {ns.eval_overlapping_eval}")
    if ns.eval_tasks_max_examples is not None:
        if not names:
            raise ConfigError("--eval-tasks-max-examples needs --eval-tasks")
        if ns.eval_tasks_max_examples < 1:
            raise ConfigError(f"--eval-tasks-max-examples must be >= 1, got {ns.eval_tasks_max_examples}")
    ns.eval_tasks = tuple(names)


@dataclass
class _Task:
    name: str
    samples: List[tuple]  # (tokens, mask) pairs of seq_length + 1 / seq_length entries
    token_ratio: float = 1.0  # wikitext: BPE tokens per word


class DownstreamEvaluator:
    """The tokenized tasks of one run and the micro-batch size to score them with."""

    def __init__(self, cfg, tokenizer, seq_length: int, micro_batch_size: int, pstate: ParallelState):
        self.pstate, self.micro_batch_size = pstate, micro_batch_size
        self.vocab_size = tokenizer.vocab_size  # scores over the real vocabulary, as tasks/main.py's
        self.tasks: List[_Task] = []
        limit = cfg.eval_tasks_max_examples
        try:
            for name in cfg.eval_tasks:
                if name == "lambada":
                    samples = build_lambada(cfg.eval_lambada_data, tokenizer, seq_length, cfg.eval_strict_lambada,
                                            flag="--eval-lambada-data")
                    self.tasks.append(_Task(name, samples[:limit]))
                else:
                    data = build_wikitext(cfg.eval_wikitext_data, tokenizer, seq_length,
                                          cfg.eval_overlapping_eval or seq_length, flag="--eval-wikitext-data")
                    self.tasks.append(_Task(name, data.samples[:limit], data.token_ratio))
        except (OSError, UnicodeDecodeError) as exc:
            raise SharedError(f"--eval-tasks: reading the task data: {exc}") from None
        except ValueError as exc:  # every rank reads the same files and fails alike
            raise SharedError(str(exc)) from None

    def describe(self) -> str:
        return ", ".join(f"{t.name} ({len(t.samples)} {'passages' if t.name == 'lambada' else 'windows'})"
                         for t in self.tasks)

    def evaluate(self, chunks: Sequence[torch.nn.Module]) -> Dict[str, float]:
        """``{"lambada acc", "wikitext ppl", "wikitext adjusted ppl"}`` (those of the configured tasks), the same on
        every rank. Collective over all ranks."""
        rng = get_all_rng_states()
        modes = [chunk.training for chunk in chunks]
        for chunk in chunks:
            chunk.eval()
        try:
            runner = ModelChunksForward(chunks, self.pstate, self.vocab_size)
            results: Dict[str, float] = {}
            for task in self.tasks:
                if task.name == "lambada":
                    correct = score_samples(runner, task.samples, self.micro_batch_size, "accuracy")
                    results["lambada acc"] = correct / len(task.samples)
                else:
                    total = score_samples(runner, task.samples, self.micro_batch_size, "loss")
                    m = wikitext_metrics(total, count_targets(task.samples), task.token_ratio)
                    results["wikitext ppl"] = m["ppl"]
                    results["wikitext adjusted ppl"] = m["adjusted ppl"]
        finally:
            for chunk, mode in zip(chunks, modes):
                chunk.train(mode)
            set_all_rng_states(rng)
        return results


def build_downstream_evaluator(cfg, tokenizer, chunks: Sequence[torch.nn.Module],
                               pstate: ParallelState) -> Optional[DownstreamEvaluator]:
    """The evaluator of ``cfg.downstream_eval`` (None without ``--eval-tasks``); ``cfg`` is the ``RunConfig``."""
    if not cfg.downstream_eval.eval_tasks:
        return None
    from megatron.core.models.gpt import GPTModel

    inner = getattr(chunks[0], "module", chunks[0])
    if not isinstance(inner, GPTModel):
        raise SharedError(f"--eval-tasks scores GPT models; this run trains a {type(inner).__name__}")
    return DownstreamEvaluator(cfg.downstream_eval, tokenizer, cfg.model.seq_length,
                               cfg.training.micro_batch_size, pstate)
