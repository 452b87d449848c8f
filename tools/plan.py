"""Which parallel layouts fit a model on a cluster, how much memory each needs, and how fast it runs.

    python tools/plan.py --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 \\
        --global-batch-size 512 --num-gpus 8

lists the layouts that fit, fastest first: TP, PP, virtual stages, DP, sequence parallelism, distributed
optimizer, recomputation, micro-batch and bf16/FP8, each with the predicted peak memory of its heaviest pipeline
stage, iteration time, tokens/s and MFU. Layout flags given on the command line are fixed; the others are
searched. ``--explain N`` prints the memory and time breakdown of the first N layouts, ``--json`` everything as
JSON. ``--calibrate`` measures the time model's rates on this machine's GPU and writes a calibration file.
Memory model and assumptions: docs/planner.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.core.planner.predict import (  # noqa: E402
    SearchSpace, format_prediction, format_table, predict, search,
)
from megatron.core.planner.timing import dump_calibration, load_calibration  # noqa: E402
from megatron.training.plan_inputs import (  # noqa: E402
    cluster_from_args, layout_from_args, layout_switches, model_shape, parse_planner_argv, planner_parser,
    precision_of,
)


CALIBRATE_HELP = """calibration mode (python tools/plan.py --calibrate --help):
  --calibrate --calibration-out FILE   measure GEMM (bf16, FP8), causal and masked attention, element-wise and copy
                                       bandwidth, the host floor per layer and, with 2+ GPUs, NCCL bandwidth on
                                       this machine and write FILE (under 90 s on one H200); no model flags needed
  --calibrate-device cuda|cpu          the GPU (default) or the CPU, to try the routine out
  --gpu-kind NAME                      name stored in the file (default: the device's name)
  --calibration BASE                   where the values not measurable in that time come from (default h200)
  --quick                              shorten every timing loop (a smoke test, not a calibration to keep)"""


def _ints(text: str, flag: str):
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise SystemExit(f"error: {flag} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"error: {flag} takes positive integers, got {text!r}")
    return values


def _calibrate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=CALIBRATE_HELP)
    p.add_argument("--calibrate", action="store_true",
                   help="measure GEMM, attention, element-wise and collective rates on this machine")
    p.add_argument("--calibration-out", required=True, help="where to write the measured calibration JSON")
    p.add_argument("--calibrate-device", default="cuda", choices=["cuda", "cpu"],
                   help="cuda (the GPU to calibrate) or cpu (small sizes, to try the routine out)")
    p.add_argument("--gpu-kind", default=None, help="name stored in the file (default: the device's name)")
    p.add_argument("--calibration", default="h200",
                   help="base calibration for what cannot be measured in two minutes")
    p.add_argument("--quick", action="store_true",
                   help="shorten every timing loop (tries the routine out; not a calibration to keep)")
    return p


def add_search_arguments(p: argparse.ArgumentParser) -> None:
    """The search and output flags (every model and layout flag is the trainer's own)."""
    g = p.add_argument_group("search and output")
    g.add_argument("--calibration", default=None,
                   help="calibration JSON (default: the shipped file of --gpu-kind); see --calibrate")
    g.add_argument("--micro-batch-sizes", default="1,2,4,8,16",
                   help="micro-batch sizes searched when --micro-batch-size is not given")
    g.add_argument("--precisions", default="bf16,fp8",
                   help="precisions searched when neither --bf16/--fp16 nor --fp8-format is given (bf16, fp8)")
    g.add_argument("--recompute-options", default="none,selective,full",
                   help="recomputation searched when --recompute-granularity is not given (full = uniform, 1 layer)")
    g.add_argument("--virtual-stages", default="1,2",
                   help="virtual pipeline stages searched when --virtual-pipeline-model-parallel-size is not given")
    g.add_argument("--top", type=int, default=15, help="rows of the table (default 15)")
    g.add_argument("--all", action="store_true", help="also list the layouts that do not fit")
    g.add_argument("--explain", type=int, default=1, help="print the breakdown of the first N layouts (default 1)")
    g.add_argument("--json", action="store_true", help="print every prediction as JSON instead of the table")
    g.add_argument("--calibrate", action="store_true",
                   help="measure the rates on this machine's GPU and write --calibration-out (see below)")


PARSER_TEXT = dict(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=CALIBRATE_HELP)


def build_parser() -> argparse.ArgumentParser:
    """The trainer's parser (its model, layout and precision flags, with the BERT section) plus the planner's."""
    if "--calibrate" in sys.argv:  # the model flags are not needed to calibrate
        return _calibrate_parser()
    p = planner_parser(search=True, **PARSER_TEXT)
    add_search_arguments(p)
    return p


def _space(args) -> SearchSpace:
    precisions = [precision_of(args)] if (args.bf16 or args.fp16 or args.fp8_format) else \
        [x for x in args.precisions.split(",") if x]
    for x in precisions:
        if x not in ("bf16", "fp8", "fp16", "fp32"):
            raise SystemExit(f"error: --precisions accepts bf16, fp8, fp16, fp32; got {x!r}")
    rec = [x for x in args.recompute_options.split(",") if x]
    for x in rec:
        if x not in ("none", "selective", "full"):
            raise SystemExit(f"error: --recompute-options accepts none, selective, full; got {x!r}")
    vpp = ([args.virtual_pipeline_model_parallel_size] if args.virtual_pipeline_model_parallel_size
           else _ints(args.virtual_stages, "--virtual-stages"))
    return SearchSpace(
        tp=[args.tensor_model_parallel_size] if args.tensor_model_parallel_size else None,
        pp=[args.pipeline_model_parallel_size] if args.pipeline_model_parallel_size else None,
        vpp=[None if v == 1 else v for v in vpp],
        micro_batch_sizes=[args.micro_batch_size] if args.micro_batch_size else
        _ints(args.micro_batch_sizes, "--micro-batch-sizes"),
        precisions=precisions, recompute=rec if not args.recompute_granularity else ["none"],
        distributed_optimizer=[True] if args.use_distributed_optimizer else [False, True],
        sequence_parallel=[True] if args.sequence_parallel else [False, True])


def _calibrate(args) -> int:
    from megatron.core.planner.calibrate import calibrate

    base = load_calibration(args.calibration)
    cal = calibrate(base, device=args.calibrate_device, gpu_kind=args.gpu_kind,
                    log=lambda m: print(m, file=sys.stderr, flush=True), quick=args.quick)
    dump_calibration(cal, args.calibration_out)
    print(f"wrote {args.calibration_out}")
    return 0


def main(argv=None) -> int:
    if argv is not None:
        sys.argv[1:] = argv
    try:
        if "--calibrate" in sys.argv:
            return _calibrate(_calibrate_parser().parse_args())
        args = parse_planner_argv(sys.argv[1:], search=True, parser_extension=add_search_arguments, **PARSER_TEXT)
        if args.global_batch_size is None:
            raise ValueError("--global-batch-size is required")
        calibration = load_calibration(args.calibration or args.gpu_kind)
        shape = model_shape(args, args.model)
        cluster = cluster_from_args(args, calibration)
        base = layout_switches(args)
        if args.recompute_granularity:
            base.update(recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
                        recompute_num_layers=args.recompute_num_layers)
        preds = search(shape, cluster, calibration, args.global_batch_size, _space(args), base)
        if not preds and args.tensor_model_parallel_size and args.pipeline_model_parallel_size:
            # a fixed layout that the search skipped: predict it anyway so the error names the flag
            predict(shape, layout_from_args(args, cluster.num_gpus), cluster, calibration, args.global_batch_size)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    shown = preds if args.all else [p for p in preds if p.fits]
    if args.json:
        print(json.dumps({"calibration": calibration["_path"], "num_layouts": len(preds),
                          "num_fitting": sum(p.fits for p in preds),
                          "predictions": [p.to_dict() for p in shown]}, indent=1))
        return 0
    groups = "" if shape.num_query_groups == shape.num_attention_heads else f" ({shape.num_query_groups} kv groups)"
    print(f"{shape.model.upper()} {shape.num_layers} layers, h {shape.hidden_size}, ffn {shape.ffn_hidden_size}"
          f"{' SwiGLU' if shape.swiglu else ''}, {shape.num_attention_heads} heads{groups}, seq {shape.seq_length}, "
          f"vocab {shape.vocab_size} "
          f"(padded per TP: {shape.padded_vocab(1)} at TP 1) | {cluster.num_gpus} x {cluster.gpu_kind} "
          f"{cluster.gpu_memory_gb:g} GB, {cluster.gpus_per_node} per node | global batch {args.global_batch_size}")
    print(f"{sum(p.fits for p in preds)} of {len(preds)} layouts fit; calibration {calibration['_path']}")
    if not shown:
        best = min(preds, key=lambda p: p.peak_bytes) if preds else None
        if best is None:
            print("no valid layout: check --num-gpus against the heads, layers and global batch")
        else:
            print(f"nothing fits; the smallest needs {best.peak_bytes / 2 ** 30:.1f} GiB per GPU "
                  f"({best.layout.describe()}, {best.layout.recompute_label()}, micro-batch "
                  f"{best.layout.micro_batch_size}); use --all to list them")
        return 1
    print(format_table(shown, args.top))
    print("peak GiB: the heaviest pipeline stage (its index under 'stage'); MFU: model FLOPs / "
          f"({shown[0].mfu_peak_name} x GPUs)")
    for p in shown[:args.explain]:
        print()
        print(format_prediction(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
