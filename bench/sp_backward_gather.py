"""CPU cost of the all-gather that a sequence-parallel column-parallel layer repeats in its backward.

Under sequence parallelism ``ColumnParallelLinear`` keeps only its ``[s/t, b, h]`` input shard for the weight
gradient and all-gathers it again in the backward (overlapped with the input-gradient GEMM on CUDA). This times,
on ``t`` gloo processes, forward + backward of that layer against the same GEMMs fed by the gathered input kept
from the forward (``gather_from_sequence_parallel_region`` then ``F.linear``: no second all-gather, ``t`` times the
saved bytes), and one all-gather of the shard alone. Medians over ``--reps`` after ``--warmup``, the three run in
turns.

    python bench/sp_backward_gather.py            # CPU: writes bench/results/sp_backward_gather.{json,md}
    python bench/sp_backward_gather.py --cuda --seq 8192 --hidden 8192 --out-features 32768 --tp 2
                                                  # GPUs: bench/results/sp_backward_gather_cuda.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.results_io import run_meta, write_results  # noqa: E402
from megatron.core.collectives import all_gather_dim0  # noqa: E402
from megatron.core.parallel_state import ParallelState  # noqa: E402
from megatron.core.tensor_parallel import ColumnParallelLinear  # noqa: E402
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region  # noqa: E402
from megatron.core.transformer.config import TransformerConfig  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402


def _median_ms(fns: dict, warmup: int, reps: int, group) -> dict:
    """Median ms of each function, run in turns (A, B, C, A, B, C, ...) so that load from other work on the
    machine falls on all of them alike."""
    import torch.distributed as dist

    times = {k: [] for k in fns}
    on_gpu = torch.cuda.is_available() and "nccl" in str(dist.get_backend(group))
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    for i in range(warmup + reps):
        for name, fn in fns.items():
            sync()
            dist.barrier(group)
            t0 = time.perf_counter()
            fn()
            sync()
            if i >= warmup:
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {f"{k}_ms": statistics.median(v) for k, v in times.items()}


def _worker(rank, world_size, s, b, h, out, warmup, reps, cuda, path):
    pstate = ParallelState.build(tensor_model_parallel_size=world_size)
    dtype, device = (torch.bfloat16, "cuda") if cuda else (torch.float32, "cpu")
    cfg = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=8, seq_length=s, sequence_parallel=True,
                            params_dtype=dtype)
    col = ColumnParallelLinear(h, out, config=cfg, pstate=pstate).to(device)
    with torch.no_grad():
        col.weight.normal_(0.0, 0.02)
        col.bias.zero_()
    x = torch.randn(s // world_size, b, h, dtype=dtype, device=device, requires_grad=True)
    dy = torch.randn(s, b, out // world_size, dtype=dtype, device=device)
    group = pstate.tp_group

    def shard_kept():  # the layer as it runs: keeps the shard, gathers it again in backward
        col(x)[0].backward(dy)

    def gathered_kept():  # the same GEMMs keeping the gathered input from the forward
        F.linear(gather_from_sequence_parallel_region(x, group), col.weight, col.bias).backward(dy)

    def gather_only():
        all_gather_dim0(x.detach(), group)

    row = {"tp": world_size, "s": s, "b": b, "h": h, "out": out,
           **_median_ms({"shard_kept": shard_kept, "gathered_kept": gathered_kept, "all_gather": gather_only},
                        warmup, reps, group),
           "saved_input_bytes_shard": x.numel() * 4, "saved_input_bytes_gathered": x.numel() * 4 * world_size}
    if rank == 0:
        with open(path, "w") as f:
            json.dump(row, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", default="2,4", help="TP sizes (gloo processes)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--out-features", type=int, default=2048, help="output features of the layer (FC1: 4h)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=31)
    ap.add_argument("--cuda", action="store_true", help="one GPU per process, NCCL, bf16 (writes *_cuda results)")
    ap.add_argument("--results-dir", default=os.path.join(ROOT, "bench", "results"))
    a = ap.parse_args()
    meta = run_meta("sp_backward_gather.py")
    rows = []
    for tp in (int(x) for x in a.tp.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "row.json")
            run_distributed(_worker, tp, (a.seq, a.batch, a.hidden, a.out_features, a.warmup, a.reps, a.cuda, path),
                            backend="nccl" if a.cuda else "gloo", cuda=a.cuda)
            with open(path) as f:
                rows.append(json.load(f))
        print(rows[-1], flush=True)
    where = "bf16 on GPUs (NCCL)" if a.cuda else \
        f"fp32 on the CPU (gloo, 1 thread per process, {os.cpu_count()} cores shared with other work)"
    body = [f"{where}, "
            f"medians of {a.reps} forward + backward passes after {a.warmup}, the variants in turns; "
            f"input [s/t, b, h] = "
            f"[{a.seq}/t, {a.batch}, {a.hidden}], weight [{a.out_features}/t, {a.hidden}].", "",
            "| TP | shard kept, gathered again in backward (ms) | gathered input kept (ms) | difference (ms) | "
            "one all-gather alone (ms) | saved input: shard / gathered (MiB) |",
            "|---|---|---|---|---|---|"]
    for r in rows:
        body.append(f"| {r['tp']} | {r['shard_kept_ms']:.2f} | {r['gathered_kept_ms']:.2f} | "
                    f"{r['shard_kept_ms'] - r['gathered_kept_ms']:+.2f} | {r['all_gather_ms']:.2f} | "
                    f"{r['saved_input_bytes_shard'] / 2 ** 20:.2f} / {r['saved_input_bytes_gathered'] / 2 ** 20:.2f} |")
    body += ["", "difference: what keeping only the shard costs per forward + backward of the layer (the second "
             "all-gather, partly overlapped: gloo runs asynchronous collectives on its own threads, competing for "
             "the same cores here). On CUDA the all-gather runs on the NCCL stream while the input-gradient GEMM "
             "computes; `--cuda` measures that on GPUs (NCCL, bf16)."]
    write_results(a.results_dir, "sp_backward_gather_cuda" if a.cuda else "sp_backward_gather", meta, rows,
                  f"Backward all-gather of the sequence-parallel column-parallel layer ({'GPU' if a.cuda else 'CPU'})",
                  body)
    print("\n".join(body))


if __name__ == "__main__":
    main()
