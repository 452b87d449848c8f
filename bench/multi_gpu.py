"""Our trainer on several GPUs of one host (torchrun, NCCL): throughput, MFU per GPU and peak memory per layout.

Each layout runs pretrain_gpt.py under ``torchrun --nproc_per_node N`` on the bundled corpus (tokenised with
tools/preprocess_data.py, ``bench/corpus.py``), with the flags of ``bench/gpu_throughput.py``'s ``ours`` rows; a one-GPU row of the
same shape runs in the same call as the baseline. Layouts (``--layout NAME:NPROC:MICRO:GLOBAL:FLAGS``, repeat;
the defaults below when none is given):

  1gpu     1 GPU, the recorded one-GPU 1.3B configuration (selective ``mlp_act`` recomputation in 12 layers)
  dp2      2 GPUs, data parallel, distributed optimizer, overlapped gradient reduce-scatter and param all-gather
  tp2_sp   2 GPUs, tensor parallel with sequence parallelism, no recomputation
  pp2      2 GPUs, two pipeline stages, 1F1B over 8 microbatches of 4

MFU per GPU = (tokens/s / GPUs) x model FLOPs per token / the dense bf16 peak (989 TFLOP/s on H100/H200 SXM): the
single-GPU formula of ``gpu_throughput.py`` (FLOPs from ``megatron.training.logging``) applied to each GPU's share. Peak memory is the largest ``torch.cuda.max_memory_allocated``
over the ranks. Writes ``bench/results/multi_gpu[_TAG].{json,md}`` with the GPU, versions, date and commands.

    python bench/multi_gpu.py                      # the four default layouts at 1.3B on 2 GPUs
    python bench/multi_gpu.py --shape tiny --iters 3 --warmup 2   # a quick check of the script (CPU: gloo)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from gpu_throughput import (BF16_PEAK_TFLOPS, SHAPES, environment, mfu, ours_command, parse_ours_log,  # noqa: E402
                            prepare_dataset)

SHAPES = dict(SHAPES, tiny=dict(num_layers=4, hidden_size=64, num_heads=4, seq_length=128, micro_batch_size=4))
RECOMPUTE_1_3B = "--recompute-granularity selective --recompute-modules mlp_act --recompute-num-layers 12"
DEFAULT_LAYOUTS = (
    f"1gpu:1:8:8:{RECOMPUTE_1_3B}",
    f"dp2:2:8:16:--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather {RECOMPUTE_1_3B}",
    "tp2_sp:2:8:8:--tensor-model-parallel-size 2 --sequence-parallel",
    "pp2:2:4:32:--pipeline-model-parallel-size 2",
)
# NVLink multicast stays off (shared hosts); the runs need plain NCCL only.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def parse_layout(spec: str) -> dict:
    try:
        name, nproc, micro, global_batch, flags = spec.split(":", 4)
        layout = dict(name=name, nproc=int(nproc), micro=int(micro), global_batch=int(global_batch), flags=flags)
    except ValueError:
        raise SystemExit(f"--layout {spec!r}: expected NAME:NPROC:MICRO:GLOBAL:FLAGS") from None
    if layout["nproc"] < 1 or layout["micro"] < 1 or layout["global_batch"] % layout["micro"]:
        raise SystemExit(f"--layout {spec!r}: NPROC and MICRO must be >= 1 and GLOBAL a multiple of MICRO")
    return layout


def command(shape: dict, layout: dict, iters: int, warmup: int, data_prefix: str) -> list:
    """``ours_command`` of gpu_throughput.py, under torchrun when the layout has several processes."""
    cmd = ours_command(shape, iters, warmup, data_prefix, layout["flags"], layout["micro"], layout["global_batch"])
    if layout["nproc"] > 1:
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(layout["nproc"])]
    return cmd


def run_layout(shape_name: str, layout: dict, iters: int, warmup: int, data_prefix: str, log_dir: str) -> dict:
    cmd = command(SHAPES[shape_name], layout, iters, warmup, data_prefix)
    shown = " ".join(shlex.quote(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c) for c in cmd[1:])
    print("+", shown, flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **NCCL_ENV))
    if log_dir:
        with open(os.path.join(log_dir, f"multi_gpu_{layout['name']}_{shape_name}.log"), "w") as f:
            f.write(proc.stdout)
    if proc.returncode != 0:
        print(proc.stdout[-6000:], flush=True)
        raise RuntimeError(f"layout {layout['name']}: exited with {proc.returncode}")
    res = parse_ours_log(proc.stdout, warmup)
    peaks = [int(x) for x in re.findall(r"BENCH_PEAK_MEM_BYTES\s+(\d+)", proc.stdout)]
    s = SHAPES[shape_name]
    tokens = layout["global_batch"] * s["seq_length"] / (res["ms_per_iter"] / 1000)
    per_gpu = tokens / layout["nproc"]
    return {"layout": layout["name"], "gpus": layout["nproc"], "flags": layout["flags"],
            "num_layers": s["num_layers"], "hidden_size": s["hidden_size"], "seq_length": s["seq_length"],
            "micro_batch_size": layout["micro"], "global_batch_size": layout["global_batch"],
            "ms_per_iter": round(res["ms_per_iter"], 2), "iter_ms_median": round(statistics.median(res["iter_ms"]), 2),
            "tokens_per_s": round(tokens, 1), "tokens_per_s_per_gpu": round(per_gpu, 1),
            "mfu_per_gpu": round(mfu(per_gpu, s), 4),
            "log_tflops": res["log_tflops"], "peak_mem_gib_max_rank": round(max(peaks) / 2**30, 2) if peaks else None,
            "losses": res["losses"], "iter_ms": res["iter_ms"], "wall_s": round(time.time() - t0, 1),
            "command": "python " + shown}


def write(out_json: str, meta: dict, rows: list) -> None:
    with open(out_json, "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=2)
    env = meta["env"]
    md = [f"# Our trainer on several GPUs ({meta['date']})", "",
          f"GPU: {env['gpu']} x {meta['gpus_visible']}; torch {env['torch']} (CUDA {env['cuda']}), "
          f"triton {env['triton']}, Python {env['python']}.", "", f"Command: `{meta['command']}`", "",
          "MFU per GPU = (tokens/s / GPUs) x (72 L h^2 + 12 L h s + 6 h V) / bf16 dense peak "
          f"{BF16_PEAK_TFLOPS:g} TFLOP/s, V = 50304; bf16, AdamW, "
          "dropout 0. Iterations after the warm-up averaged; peak memory is the largest over the ranks.", "",
          f"| layout | GPUs | micro / global batch | ms/iter (median) | tokens/s | tokens/s/GPU | MFU/GPU (bf16 peak {BF16_PEAK_TFLOPS:g}) | "
          "log TFLOP/s/GPU | peak mem (GiB) | last loss |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tfl = "" if r["log_tflops"] is None else f"{r['log_tflops']:.1f}"
        mem = "" if r["peak_mem_gib_max_rank"] is None else f"{r['peak_mem_gib_max_rank']:.1f}"
        loss = next((x for x in reversed(r["losses"]) if x is not None), None)
        md.append(f"| {r['layout']} | {r['gpus']} | {r['micro_batch_size']} / {r['global_batch_size']} | "
                  f"{r['ms_per_iter']:.1f} ({r['iter_ms_median']:.1f}) | {r['tokens_per_s']:,.0f} | "
                  f"{r['tokens_per_s_per_gpu']:,.0f} | {100 * r['mfu_per_gpu']:.1f}% | {tfl} | {mem} | "
                  f"{'' if loss is None else f'{loss:.3f}'} |")
    md += ["", "Per-layout commands:", ""] + [f"- {r['layout']}: `{r['command']}`" for r in rows]
    with open(out_json[:-5] + ".md", "w") as f:
        f.write("\n".join(md) + "\n")


def main() -> None:
    argv = sys.argv[1:]
    for i in range(len(argv) - 1):  # "--layout x:1:8:8:--flag": keep argparse from reading the flags as options
        if argv[i] == "--layout":
            argv[i:i + 2] = [f"--layout={argv[i + 1]}", ""]
    ap = argparse.ArgumentParser(description="Our trainer on several GPUs: throughput, MFU per GPU, peak memory.")
    ap.add_argument("--shape", default="1.3b", choices=sorted(SHAPES))
    ap.add_argument("--layout", action="append", default=[], metavar="NAME:NPROC:MICRO:GLOBAL:FLAGS")
    ap.add_argument("--iters", type=int, default=10, help="timed iterations")
    ap.add_argument("--warmup", type=int, default=5, help="untimed warm-up iterations")
    ap.add_argument("--tag", default="", help="write multi_gpu_TAG.{json,md}")
    ap.add_argument("--results-dir", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--log-dir", default=None, help="where to keep each layout's full log")
    ap.add_argument("--data-prefix", default=None, help=".bin/.idx prefix (default: preprocess the bundled corpus)")
    a = ap.parse_args([x for x in argv if x != ""])
    import torch

    layouts = [parse_layout(s) for s in (a.layout or DEFAULT_LAYOUTS)]
    visible = torch.cuda.device_count()
    for lay in layouts:
        if visible and lay["nproc"] > visible:
            raise SystemExit(f"layout {lay['name']} needs {lay['nproc']} GPUs, {visible} visible")
    os.makedirs(a.results_dir, exist_ok=True)
    if a.log_dir:
        os.makedirs(a.log_dir, exist_ok=True)
    data_prefix = a.data_prefix or prepare_dataset(tempfile.mkdtemp(prefix="bench_data_"))
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "env": environment(), "gpus_visible": visible, "shape": a.shape,
            "command": "python bench/multi_gpu.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])}
    out_json = os.path.join(a.results_dir, f"multi_gpu{'_' + a.tag if a.tag else ''}.json")
    rows, failed = [], []
    for lay in layouts:
        try:
            rows.append(run_layout(a.shape, lay, a.iters, a.warmup, data_prefix, a.log_dir))
            r = rows[-1]
            print(f"| {r['layout']} | {r['ms_per_iter']:.1f} ms | {r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU | "
                  f"MFU/GPU {100 * r['mfu_per_gpu']:.1f}% | {r['peak_mem_gib_max_rank']} GiB |", flush=True)
        except RuntimeError as exc:  # keep the other layouts' rows
            failed.append(lay["name"])
            print(f"FAILED {exc}", flush=True)
        write(out_json, meta, rows)
    if failed:
        raise SystemExit(f"failed layouts: {', '.join(failed)}")


if __name__ == "__main__":
    main()
