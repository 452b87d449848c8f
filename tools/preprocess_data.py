#!/usr/bin/env python
"""Turn a loose-JSON corpus (one JSON object per line, plain or .gz) into Megatron .bin/.idx files.

Example:
    python tools/preprocess_data.py --input data/tinyshakespeare.jsonl.gz --output-prefix runs/data/quickstart \\
        --tokenizer-type GPT2BPETokenizer --vocab-file data/gpt2-vocab.json --merge-file data/gpt2-merges.txt \\
        --append-eod --workers 2
writes runs/data/quickstart_text_document.bin and .idx (``_sentence`` instead of ``_document`` with
--split-sentences). The flags are Megatron-LM's; the output is byte-identical to Megatron-LM's for the same
input and flags. See docs/data.md.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.core.datasets.preprocessing import BadInputError, PreprocessConfig, preprocess  # noqa: E402
from megatron.core.tokenizer import TOKENIZER_TYPES  # noqa: E402


def get_args(argv=None) -> PreprocessConfig:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="loose JSON file (.gz allowed; a glob matches several files)")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each JSON object")
    g.add_argument("--split-sentences", action="store_true", help="split documents into sentences (NLTK Punkt)")
    g.add_argument("--keep-newlines", action="store_true", help="keep newlines between sentences when splitting")
    g.add_argument("--lang", default="english", help="Punkt language for --split-sentences")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file", default=None, help="vocab.json (GPT-2) or vocab.txt (BERT)")
    g.add_argument("--vocab", default=None,
                   help="--vocab-file as older how-tos spell it (Megatron-LM took it as an abbreviation of "
                        "--vocab-file until it added --vocab-size); accepted with a note")
    g.add_argument("--merge-file", default=None, help="merges.txt (GPT-2)")
    g.add_argument("--tokenizer-model", default=None, help="tokenizer.json, or its directory (HuggingFaceTokenizer); a "
                   "SentencePiece .model (SentencePieceTokenizer, Llama2Tokenizer)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer: ids 0..N-1 written as decimal numbers, end of document N")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document token to every document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="output path without the _{key}_{level}.bin/.idx suffix")
    g.add_argument("--dataset-impl", "--data-impl", dest="dataset_impl", default="mmap", choices=["mmap"],
                   help="output format: mmap, Megatron-LM's memory-mapped .bin/.idx (the only one; accepted for "
                        "scripts that name it)")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="worker processes (about the number of cores)")
    g.add_argument("--partitions", type=int, default=1,
                   help="Megatron-LM's input partitions: documents are dealt round-robin to partitions that are "
                        "merged in order (only the document order changes)")
    g.add_argument("--keep-sequential-samples", action="store_true",
                   help="with --partitions, keep the input order (as Megatron-LM's flag)")
    g.add_argument("--chunk-size", type=int, default=None,
                   help="Megatron-LM's documents per worker task (2022-2023); accepted with a note: the input is "
                        "handed to the workers in byte ranges here, and the output does not depend on it")
    g.add_argument("--log-interval", type=int, default=1000, help="documents between progress lines")
    g.add_argument("--strict", action="store_true", help="stop at the first bad input line instead of skipping it")
    g.add_argument("--quiet", action="store_true", help="no progress output")
    a = p.parse_args(argv)
    if a.vocab is not None:
        if a.vocab_file is not None and a.vocab_file != a.vocab:
            p.error(f"--vocab {a.vocab} (the older spelling of --vocab-file) contradicts --vocab-file {a.vocab_file}")
        print(f"note: --vocab is read as --vocab-file {a.vocab} (Megatron-LM's abbreviation of it)", file=sys.stderr)
        a.vocab_file = a.vocab
    if a.chunk_size is not None:
        if a.chunk_size < 1:
            p.error(f"--chunk-size must be >= 1, got {a.chunk_size}")
        print(f"note: --chunk-size {a.chunk_size} has no effect: the workers take the input in byte ranges and "
              "the output is the same for any chunking", file=sys.stderr)
    return PreprocessConfig(
        input=a.input, output_prefix=a.output_prefix, tokenizer_type=a.tokenizer_type, json_keys=tuple(a.json_keys),
        vocab_file=a.vocab_file, merge_file=a.merge_file, tokenizer_model=a.tokenizer_model,
        append_eod=a.append_eod, split_sentences=a.split_sentences, keep_newlines=a.keep_newlines, lang=a.lang,
        workers=a.workers, partitions=a.partitions, keep_sequential_samples=a.keep_sequential_samples,
        log_interval=a.log_interval, strict=a.strict, quiet=a.quiet, vocab_size=a.vocab_size,
    )


def main(argv=None) -> int:
    cfg = get_args(argv)
    try:
        stats = preprocess(cfg)
    except (BadInputError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: partial output removed", file=sys.stderr)
        return 130
    return 0 if stats.documents or not stats.bad_count else 1


if __name__ == "__main__":
    code = main()
    # The outputs are complete and closed: leave without tearing down the tokenizer's tables one object at
    # a time (a tenth of a second of a short run).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
