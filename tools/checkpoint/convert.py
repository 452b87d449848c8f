"""Convert checkpoints between Megatron-LM, ours and Hugging Face, resharding tensor/pipeline parallelism.

    python tools/checkpoint/convert.py --model-type GPT --loader megatron --saver ours \
        --load-dir /ckpt/megatron --save-dir /ckpt/ours --target-tensor-parallel-size 2 \
        --target-pipeline-parallel-size 2 --reshard-optimizer

Loaders: ``megatron`` (Megatron-LM legacy torch format, also pre-Core files of ``checkpoint_version`` 0-3, and
``torch_dist``, read through an allowlist, never executing code),
``ours`` (our checkpoint folders), ``hf`` (Hugging Face GPT-2 or, by ``config.json``'s ``model_type``,
``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM``; for BERT ``BertForPreTraining`` post-LN or
``MegatronBertForPreTraining`` pre-LN). Savers: ``ours``, ``megatron`` (any target TP/PP;
``--reshard-optimizer`` carries optimizer, scheduler and, when the layout is unchanged, RNG state), ``torch_dist``
(Megatron-LM's ``--ckpt-format torch_dist``; the optimizer as its distributed optimizer's) and ``hf``.
Prints what it converted; refuses shapes and options it does not understand, naming them. See docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(os.path.dirname(_HERE))]

from megatron.core.checkpoint_formats import get_family  # noqa: E402
from megatron.core.checkpoint_io import CheckpointIOError  # noqa: E402

LOADERS = ("megatron", "ours", "hf")
SAVERS = ("ours", "megatron", "torch_dist", "hf")


def _positive(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a positive integer, got {text!r}")
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be a positive integer, got {value}")
        return value

    return parse


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Convert and reshard GPT/BERT checkpoints.", allow_abbrev=False)
    p.add_argument("--model-type", required=True, choices=("GPT", "BERT"))
    p.add_argument("--loader", required=True, choices=LOADERS)
    p.add_argument("--saver", required=True, choices=SAVERS)
    p.add_argument("--load-dir", required=True, help="checkpoint folder (the one with the tracker file) or HF folder")
    p.add_argument("--save-dir", required=True)
    p.add_argument("--target-tensor-parallel-size", type=_positive("--target-tensor-parallel-size"), default=None,
                   help="default: the source's")
    p.add_argument("--target-pipeline-parallel-size", type=_positive("--target-pipeline-parallel-size"),
                   default=None, help="default: the source's")
    p.add_argument("--reshard-optimizer", action="store_true",
                   help="carry optimizer and scheduler state (resharded to the target layout) and keep the iteration")
    p.add_argument("--target-optimizer-layout", choices=("fp32", "mixed", "distributed"), default=None,
                   help="--saver ours: our optimizer wrapper to write for (mixed: --bf16/--fp16; distributed: "
                        "--use-distributed-optimizer); default: the source's")
    p.add_argument("--true-vocab-size", type=_positive("--true-vocab-size"), default=None,
                   help="real vocabulary size when the saved arguments name no vocabulary file")
    p.add_argument("--vocab-file", default=None,
                   help="GPT-2 vocab.json or BERT WordPiece vocab.txt (default: the saved arguments')")
    p.add_argument("--merge-file", default=None, help="GPT-2 merges.txt (default: the saved arguments')")
    p.add_argument("--num-attention-heads", type=_positive("--num-attention-heads"), default=None,
                   help="--loader megatron: the model's attention heads, for a pre-Core checkpoint that stores no "
                        "arguments")
    p.add_argument("--make-vocab-size-divisible-by", type=_positive("--make-vocab-size-divisible-by"),
                   default=None, help="vocabulary padding of an hf source (default 128)")
    opts = p.parse_args(argv)
    if os.path.abspath(opts.load_dir) == os.path.abspath(opts.save_dir):
        p.error("--save-dir must differ from --load-dir")
    if opts.target_optimizer_layout and not (opts.reshard_optimizer and opts.saver == "ours"):
        p.error("--target-optimizer-layout needs --saver ours and --reshard-optimizer")
    return opts


def convert(opts) -> int:
    family = get_family(opts.model_type)
    loader = importlib.import_module(f"loader_{opts.loader}")
    saver = importlib.import_module(f"saver_{opts.saver}")
    payload = loader.load(opts, family)
    d = payload.dims
    tp, pp = payload.source_layout
    print(f"loaded {family.name} from {opts.loader} checkpoint {opts.load_dir}: TP={tp} PP={pp}, "
          f"iteration {payload.iteration}, {len(payload.full)} tensors, {payload.num_params():,} parameters "
          f"({d.num_layers} layers, hidden {d.hidden_size}, {d.num_attention_heads} heads, FFN {d.ffn_hidden_size}, "
          f"vocabulary {d.vocab_size if d.vocab_size is not None else 'unknown'} padded to {d.padded_vocab_size}, "
          f"{'tied' if d.tied_embeddings else 'untied'} embeddings)", flush=True)
    if opts.reshard_optimizer:
        n = len(payload.optimizer_ranks or {})
        print(f"optimizer state: {n} rank file(s), scheduler {'present' if payload.scheduler else 'absent'}, "
              f"consumed samples {payload.consumed_samples}", flush=True)
    files = saver.save(opts, payload)
    if opts.saver != "hf":
        ttp = opts.target_tensor_parallel_size or tp
        tpp = opts.target_pipeline_parallel_size or pp
        what = "model, optimizer and scheduler" if opts.reshard_optimizer else (
            "model" if opts.saver == "torch_dist" else "model (release checkpoint)")
        print(f"saved {what} as {opts.saver} checkpoint TP={ttp} PP={tpp} (vocabulary padded to "
              f"{d.padded_for(ttp)}): {len(files)} file(s) in {opts.save_dir}", flush=True)
    else:
        print(f"saved Hugging Face model to {opts.save_dir}: {', '.join(os.path.basename(f) for f in files)}",
              flush=True)
    for note in payload.notes:
        print(f"note: {note}", flush=True)
    return 0


def main(argv=None) -> int:
    opts = parse_args(argv)
    try:
        return convert(opts)
    except CheckpointIOError as exc:  # the checkpoint folder's errors, the formats' among them
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
