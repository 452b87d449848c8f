"""Export a fine-tuned BERT (``tasks/main.py --task MNLI|QQP|RACE --save DIR``) to a Hugging Face folder.

    python tools/checkpoint/export_finetuned.py --load-dir DIR/best --save-dir hf_mnli [--vocab-file vocab.txt]

A classifier (MNLI, QQP) becomes ``BertForSequenceClassification``, a RACE model ``BertForMultipleChoice`` (the
``MegatronBert`` classes for a pre-LN model); any TP/PP layout is merged first. The vocabulary (and the tokenizer
files) come from ``--vocab-file``, else from the checkpoint's arguments; the classes are named as GLUE names them
(``id2label``: MNLI contradiction / entailment / neutral, QQP not_duplicate / duplicate).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.core.checkpoint_formats import CheckpointFormatError, dims_from_args, merge_tp_pp  # noqa: E402
from megatron.core.checkpoint_formats import read_our_checkpoint  # noqa: E402
from megatron.core.checkpoint_formats.hf_bert import save_hf_bert_finetuned, wordpiece_vocab_size  # noqa: E402
from megatron.core.checkpoint_formats.layout import BERT_FINETUNED  # noqa: E402
from megatron.core.datasets.finetune_data import LABEL_NAMES  # noqa: E402


def export(load_dir: str, save_dir: str, vocab_file=None) -> list:
    ckpt = read_our_checkpoint(load_dir, load_optim=False, load_rng=False)
    args = ckpt.args_dict
    full = merge_tp_pp(ckpt.model_state_per_rank, BERT_FINETUNED, tied=False)
    vocab_file = vocab_file or args.get("vocab_file")
    if not vocab_file or not os.path.isfile(vocab_file):
        raise CheckpointFormatError(f"the vocabulary file {vocab_file!r} of the checkpoint's arguments is not there; "
                                    "pass --vocab-file")
    dims = dims_from_args(args, full, vocab_size=wordpiece_vocab_size(vocab_file)[0])
    post_ln = bool(args.get("apply_residual_connection_post_layernorm", False))
    dropout = (float(args.get("hidden_dropout") or 0.0), float(args.get("attention_dropout") or 0.0))
    return save_hf_bert_finetuned(save_dir, full, dims, post_ln, vocab_file=vocab_file,
                                  lower_case=args.get("tokenizer_type") != "BertWordPieceCase", dropout=dropout,
                                  init_std=float(args.get("init_method_std") or 0.02),
                                  labels=LABEL_NAMES.get(args.get("task")))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--load-dir", required=True, help="the fine-tuning run's checkpoint folder (or its best/)")
    p.add_argument("--save-dir", required=True, help="the Hugging Face folder to write")
    p.add_argument("--vocab-file", default=None, help="WordPiece vocab.txt (default: the checkpoint's)")
    opts = p.parse_args(argv)
    try:
        files = export(opts.load_dir, opts.save_dir, opts.vocab_file)
    except (CheckpointFormatError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    print(f"saved Hugging Face model to {opts.save_dir}: {', '.join(files)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
