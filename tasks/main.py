"""Zero-shot evaluation of a trained GPT checkpoint, and BERT fine-tuning (MNLI, QQP, RACE).

    python tasks/main.py --task MNLI --train-data train.tsv --valid-data dev_matched.tsv \
        --pretrained-checkpoint BERT_CKPT --epochs 3 --seq-length 128 --micro-batch-size 32 --lr 2e-5 ...
        (the trainer's flags; docs/finetune.md)

    python tasks/main.py --task WIKITEXT103 --valid-data wiki.test.tokens --load CKPT --overlapping-eval 32
    python tasks/main.py --task LAMBADA --valid-data lambada_test.jsonl --load CKPT --strict-lambada
    torchrun --nproc_per_node 2 tasks/main.py --task LAMBADA ...                      # tensor parallel
    torchrun --nproc_per_node 2 tasks/main.py --pipeline-model-parallel-size 2 ...    # pipeline parallel

WIKITEXT103: the raw text is detokenized, BPE-encoded and scored in windows of ``--seq-length`` tokens
starting every ``--overlapping-eval`` tokens (default: no overlap; after the first window only the last
``--overlapping-eval`` targets of a window count). Prints the average loss per token, its perplexity, the
word-level (adjusted) perplexity ``exp(loss x (tokens - 1) / (words - 1))`` and that token ratio.
LAMBADA: one ``{"text": ...}`` passage per line; a passage is right when the model's argmax reproduces its last
token, or with ``--strict-lambada`` every token of its whole last word.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from megatron.core.inference.launch import add_model_arguments, build_engine, is_output_rank, run_tool  # noqa: E402
from megatron.core.inference.zeroshot import count_targets, score_samples, wikitext_metrics  # noqa: E402
from megatron.core.inference.zeroshot_data import build_lambada, build_wikitext  # noqa: E402

TASKS = ("WIKITEXT103", "LAMBADA")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Zero-shot WikiText-103 perplexity and LAMBADA accuracy",
                                allow_abbrev=False)
    add_model_arguments(p)
    g = p.add_argument_group("task")
    g.add_argument("--task", required=True, choices=TASKS)
    g.add_argument("--valid-data", nargs="+", required=True, help="the evaluation file")
    g.add_argument("--overlapping-eval", type=int, default=None,
                   help="WikiText window stride; only the last this many targets of later windows count")
    g.add_argument("--strict-lambada", action="store_true", help="require every token of the whole last word")
    g.add_argument("--batch-size", type=int, default=None,
                   help="Megatron-LM's old name of --micro-batch-size (used by its older evaluation scripts)")
    g.add_argument("--log-interval", type=int, default=0, help="report progress every N batches (0: never)")
    g.add_argument("--results-file", default=None, help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.batch_size is not None:
        if args.micro_batch_size is not None and args.micro_batch_size != args.batch_size:
            p.error(f"--batch-size {args.batch_size} (the old name of --micro-batch-size) contradicts "
                    f"--micro-batch-size {args.micro_batch_size}")
        print(f"note: --batch-size is Megatron-LM's old name of --micro-batch-size; using --micro-batch-size "
              f"{args.batch_size}", file=sys.stderr)
        args.micro_batch_size = args.batch_size
    if args.micro_batch_size is None:
        args.micro_batch_size = 8
    if len(args.valid_data) != 1:
        p.error(f"--valid-data takes one file, got {len(args.valid_data)}")
    args.valid_data = args.valid_data[0]
    if not os.path.isfile(args.valid_data):
        p.error(f"--valid-data {args.valid_data}: no such file")
    if args.overlapping_eval is not None and args.overlapping_eval < 1:
        p.error(f"--overlapping-eval must be >= 1, got {args.overlapping_eval}")
    if args.overlapping_eval is not None and args.task != "WIKITEXT103":
        p.error("--overlapping-eval applies to --task WIKITEXT103")
    if args.strict_lambada and args.task != "LAMBADA":
        p.error("--strict-lambada applies to --task LAMBADA")
    return args


def run(args) -> dict:
    engine, _, _ = build_engine(args)
    seq = args.seq_length or engine.model.config.seq_length  # checked against the model's positions
    tok = engine.tokenizer
    log = print if is_output_rank() else None
    if args.task == "WIKITEXT103":
        stride = args.overlapping_eval or seq
        data = build_wikitext(args.valid_data, tok, seq, stride)
        total = score_samples(engine, data.samples, args.micro_batch_size, "loss", log, args.log_interval)
        ratio = data.token_ratio
        metrics = wikitext_metrics(total, count_targets(data.samples), ratio)
        loss = metrics["avg loss"]
        result = {"task": args.task, **metrics, "token ratio": ratio,
                  "tokens": data.num_tokenized_tokens, "words": data.num_original_tokens,
                  "windows": len(data.samples), "seq length": seq, "overlapping eval": stride}
        line = (f"validation results on {args.task} | avg loss: {loss:.4E} | ppl: {result['ppl']:.4E} | "
                f"adjusted ppl: {result['adjusted ppl']:.4E} | token ratio: {ratio} |")
    else:
        samples = build_lambada(args.valid_data, tok, seq, args.strict_lambada)
        correct = score_samples(engine, samples, args.micro_batch_size, "accuracy", log, args.log_interval)
        result = {"task": args.task, "number correct": int(correct), "total examples": len(samples),
                  "avg accuracy": correct / len(samples), "strict": args.strict_lambada, "seq length": seq}
        line = (f"validation results on {args.task} | number correct: {correct:.4E} | total examples: "
                f"{len(samples):.4E} | avg accuracy: {result['avg accuracy']:.4E} |")
    if is_output_rank():
        print(line, flush=True)
        if args.results_file:
            with open(args.results_file, "w") as f:
                json.dump(result, f, indent=1)
    return result


FINETUNE_TASKS = ("MNLI", "QQP", "RACE")


def _task_of(argv) -> str:
    """The value of --task (``--task X`` or ``--task=X``), or "" without one."""
    for i, arg in enumerate(argv):
        if arg == "--task" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--task="):
            return arg.split("=", 1)[1]
    return ""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if _task_of(argv) in FINETUNE_TASKS:  # BERT fine-tuning on the trainer (megatron/training/finetune.py)
        from megatron.training.finetune import finetune
        from megatron.training.setup import main_entry

        main_entry(lambda: finetune(argv))
        return 0
    args = parse_args(argv)
    return run_tool(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
