"""Shared by the GPU micro-benchmarks: the run's metadata and the JSON + Markdown pair they write."""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch


def run_meta(script: str) -> dict:
    """Date (UTC), GPU, torch and CUDA versions, and the exact command of this run of ``bench/<script>``."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "command": f"python bench/{script} " + " ".join(sys.argv[1:])}


def write_results(results_dir: str, stem: str, meta: dict, rows: list, title: str, body: list) -> None:
    """``STEM.json`` (meta + rows) and ``STEM.md`` (title with the date, the environment line, then ``body``)."""
    os.makedirs(results_dir, exist_ok=True)
    with open(os.path.join(results_dir, stem + ".json"), "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=2)
    md = [f"# {title} ({meta['date']})", "",
          f"GPU: {meta['gpu']}; torch {meta['torch']} (CUDA {meta['cuda']}). Command: `{meta['command']}`", "",
          *body]
    with open(os.path.join(results_dir, stem + ".md"), "w") as f:
        f.write("\n".join(md) + "\n")
