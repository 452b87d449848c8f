"""The tensor- and pipeline-parallel body of the zero-shot test, in a module that does not import
``transformers`` (the spawned processes import it)."""

import json
import os

from tasks.main import parse_args, run

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
WIKI, LAMBADA = os.path.join(FIXTURES, "wikitext_tiny.raw"), os.path.join(FIXTURES, "lambada_tiny.jsonl")


def tp2_body(rank, world_size, ckpt, out, lambada=LAMBADA):
    results = []
    for layout in (["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]):
        results.append(run(parse_args(["--load", ckpt, "--task", "WIKITEXT103", "--valid-data", WIKI, *layout])))
        results.append(run(parse_args(["--load", ckpt, "--task", "LAMBADA", "--valid-data", lambada, *layout])))
    if rank == 0:
        json.dump(results, open(out, "w"))
