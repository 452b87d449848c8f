"""Generation speed of our inference engine next to Hugging Face ``generate`` on the same weights, in one run.

All decode greedily with a KV cache from the same random prompts, for exactly ``--new-tokens`` tokens (no early
stop), on the same randomly initialised model (our GPT, its weights copied into ``transformers``'
``GPT2LMHeadModel`` by ``megatron/core/inference/hf_gpt2.py``). Our engine runs in the variants of
``--variants``: ``graph`` (the static decoding step replayed from a CUDA graph, the default on CUDA), ``eager``
(the same step run eagerly, ``use_cuda_graph=False``) and ``dynamic`` (the dynamic step, ``static_decode=False``).
Reported per shape, batch size and variant: generated tokens per second (batch x new tokens / wall time of the
whole call, prompt included), milliseconds per decoding step (that wall time / new tokens), peak memory, the
ratio to Hugging Face, and how many generated tokens agree with Hugging Face's (bf16 arithmetic of two different
kernel sequences may pick different argmaxes once logits nearly tie, so agreement is a sanity check, not a test).
The first call of each variant is an untimed warm-up (for ``graph`` it captures the step).

Shapes (``--shapes``): ``124m`` (12 layers, h 768, 12 heads) and ``1.3b`` (24 layers, h 2048, 16 heads), 2048
positions, vocabulary 50,304; ``tiny`` (2 layers, h 64) for a smoke run on the CPU.

    python bench/generation.py                          # 124m and 1.3b, batch 1 and 16, bf16, graph + eager + HF
    python bench/generation.py --variants graph,eager,dynamic --shapes 124m
    python bench/generation.py --shapes tiny --device cpu --dtype fp32 --batch-sizes 1,4 --new-tokens 16 --no-write

Writes ``bench/results/generation[_TAG].json`` and ``.md`` (with the GPU, versions, date and this command).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.results_io import run_meta, write_results  # noqa: E402
from megatron.core.inference import InferenceEngine, SamplingParams  # noqa: E402
from megatron.core.inference.hf_gpt2 import to_hf_gpt2  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.init import initialize_model_parameters  # noqa: E402
from megatron.core.parallel_state import ParallelState  # noqa: E402
from megatron.core.transformer.config import TransformerConfig  # noqa: E402

SHAPES = {"tiny": (2, 64, 4), "124m": (12, 768, 12), "1.3b": (24, 2048, 16)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
VOCAB = 50304
VARIANTS = {"graph": dict(use_cuda_graph=True), "eager": dict(use_cuda_graph=False),
            "dynamic": dict(static_decode=False)}


def build(shape: str, dtype: torch.dtype, device: torch.device, positions: int) -> GPTModel:
    layers, hidden, heads = SHAPES[shape]
    cfg = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=positions,
                            max_position_embeddings=positions, padded_vocab_size=VOCAB, attention_dropout=0.0,
                            hidden_dropout=0.0, params_dtype=dtype, gradient_accumulation_fusion=False)
    model = GPTModel(cfg, ParallelState.single()).to(device)
    initialize_model_parameters(model, 1234, cfg, ParallelState.single())
    return model.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, warmup: int, repeats: int):
    """``(median seconds, last result)`` of ``fn()`` after ``warmup`` untimed calls."""
    result = None
    for _ in range(warmup):
        result = fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        result = fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], result


def bench_shape(shape: str, args, device: torch.device, clock: float) -> list:
    dtype = DTYPES[args.dtype]
    model = build(shape, dtype, device, args.positions)
    engines = {name: InferenceEngine(model, eod=0, **VARIANTS[name]) for name in args.variants}
    hf = to_hf_gpt2(model, dtype=dtype, attn_implementation="sdpa").to(device)
    print(f"[{time.perf_counter() - clock:6.1f} s] {shape}: built ({sum(p.numel() for p in model.parameters()):,} "
          "parameters)", flush=True)
    params = SamplingParams(max_new_tokens=args.new_tokens, greedy=True, stop_on_eod=False)
    rows = []
    for batch in args.batch_sizes:
        gen = torch.Generator().manual_seed(batch)
        prompts = torch.randint(0, 50257, (batch, args.prompt_len), generator=gen)
        row = {"shape": shape, "batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
               "dtype": args.dtype}
        runs = [(name, lambda e=engine: e.generate(prompts.tolist(), params)) for name, engine in engines.items()]
        runs.append(("hf", lambda: _hf_generate(hf, prompts.to(device), args.new_tokens)))
        tokens = {}
        for name, fn in runs:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            with torch.no_grad():
                seconds, out = timed(fn, device, args.warmup, args.repeats)
            tokens[name] = out[:, args.prompt_len:].tolist() if name == "hf" else [o.generated for o in out]
            row[name] = {"seconds": seconds, "tokens_per_s": batch * args.new_tokens / seconds,
                         "ms_per_step": 1000.0 * seconds / args.new_tokens,
                         "peak_mem_gib": (torch.cuda.max_memory_allocated(device) / 2**30
                                          if device.type == "cuda" else None)}
            print(f"[{time.perf_counter() - clock:6.1f} s] {shape} batch {batch}: {name:>7} "
                  f"{row[name]['tokens_per_s']:9.1f} tok/s, {row[name]['ms_per_step']:6.2f} ms/step", flush=True)
        for name in engines:
            same = sum(a == b for x, y in zip(tokens[name], tokens["hf"]) for a, b in zip(x, y))
            row[name]["agreement_with_hf"] = same / (batch * args.new_tokens)
            row[name]["speedup_vs_hf"] = row[name]["tokens_per_s"] / row["hf"]["tokens_per_s"]
        summary = ", ".join(f"{n} x{row[n]['speedup_vs_hf']:.2f} (agreement {row[n]['agreement_with_hf']:.3f})"
                            for n in engines)
        print(f"{shape:>5} batch {batch:>3} vs hf: {summary}", flush=True)
        rows.append(row)
    return rows


def _hf_generate(hf, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    mask = torch.ones_like(prompts)
    return hf.generate(prompts, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, use_cache=True, pad_token_id=0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="124m,1.3b")
    p.add_argument("--variants", default=None,
                   help="our engine's variants, comma-separated from graph, eager, dynamic (default: graph,eager "
                        "on CUDA, eager,dynamic on the CPU)")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--positions", type=int, default=2048, help="max position embeddings of the models")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tag", default="")
    p.add_argument("--results-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        p.error(f"--shapes: unknown {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device (use --device cpu for a smoke run)")
    if args.prompt_len < 1 or args.new_tokens < 1 or args.prompt_len + args.new_tokens > args.positions:
        p.error("need 1 <= --prompt-len, 1 <= --new-tokens and their sum <= --positions")
    args.variants = (args.variants or ("graph,eager" if args.device == "cuda" else "eager,dynamic")).split(",")
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or not args.variants or len(set(args.variants)) != len(args.variants):
        p.error(f"--variants: give distinct names from {', '.join(VARIANTS)}, got {','.join(args.variants)}")
    if "graph" in args.variants and args.device != "cuda":
        p.error("--variants graph needs --device cuda (CUDA graphs)")
    if args.warmup < 1 or args.repeats < 1:
        p.error("--warmup and --repeats must be >= 1 (the warm-up call captures the graph)")
    device = torch.device(args.device)
    clock = time.perf_counter()
    rows = []
    for shape in shapes:
        rows += bench_shape(shape, args, device, clock)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the shape's models are gone with bench_shape's frame
    print(f"[{time.perf_counter() - clock:6.1f} s] done", flush=True)
    if not args.no_write:
        table = ["| shape | batch | engine | tok/s | ms/step | vs HF | peak GiB | greedy agreement with HF |",
                 "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            for name in [*args.variants, "hf"]:
                m = r[name]
                mem = f"{m['peak_mem_gib']:.2f}" if m["peak_mem_gib"] is not None else "-"
                vs = f"{m['speedup_vs_hf']:.2f}" if name != "hf" else "1"
                agree = f"{m['agreement_with_hf']:.3f}" if name != "hf" else "-"
                label = "Hugging Face" if name == "hf" else f"ours, {name}"
                table.append(f"| {r['shape']} | {r['batch']} | {label} | {m['tokens_per_s']:.1f} | "
                             f"{m['ms_per_step']:.2f} | {vs} | {mem} | {agree} |")
        stem = "generation" + (f"_{args.tag}" if args.tag else "")
        write_results(args.results_dir, stem, run_meta("generation.py"), rows,
                      "Generation speed: our engine and Hugging Face generate", [
                          f"Greedy, prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, {args.dtype}; "
                          "tokens/s = batch x new tokens / wall time of the whole call (prompt included); median "
                          f"of {args.repeats} calls after {args.warmup} warm-up call(s). Ours: graph = the static "
                          "decoding step replayed from a CUDA graph (the default on CUDA), eager = the same step "
                          "run eagerly, dynamic = the dynamic step.", "",
                          *table])
    return 0


if __name__ == "__main__":
    sys.exit(main())
