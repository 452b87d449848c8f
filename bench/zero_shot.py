"""Zero-shot record: train a GPT-2-124M-shaped model from scratch, evaluate it with tasks/main.py, and recompute the
same numbers independently with Hugging Face ``transformers`` on the exported model.

1. ``tools/preprocess_data.py`` tokenizes ``corpus/prose.jsonl.gz`` (GPT-2 BPE, end-of-document appended);
2. ``pretrain_gpt.py`` trains 12 layers x 768 hidden x 12 heads, 1024 positions, bf16, for ``--train-iters``
   iterations (or until ``--train-minutes``), with ``--eval-tasks lambada,wikitext`` scored in the loop at the end;
3. ``tasks/main.py`` (fp32) scores WIKITEXT103 (perplexity, adjusted perplexity) and LAMBADA (plain and strict;
   in windows of ``--lambada-seq-length`` 512, which cuts no passage of the test set: the longest has 224 tokens);
4. ``tools/checkpoint/convert.py --saver hf`` exports the checkpoint; ``transformers``' ``GPT2LMHeadModel`` (fp32)
   with its own GPT-2 tokenizer recomputes the WikiText loss and both LAMBADA accuracies here, windows and
   passages cut by its own code. The export keeps the 50,257 real vocabulary rows; our softmax, as Megatron-LM's,
   also spans the padding rows up to a multiple of 128 (47 here), so the reference is computed both ways: over
   the real rows, and with our padding rows' logits (the export's final hidden states x those rows) appended;
5. the agreement (WikiText loss within 1e-4, LAMBADA correct counts equal, both against the padded-vocabulary
   reference) is written with the numbers, and the real-vocabulary difference beside it.

    python bench/zero_shot.py --data-dir scratch/data                 # one GPU; ../shared/data copied to scratch/
    python bench/zero_shot.py --tiny --device cpu --results-dir /tmp/zs   # CPU smoke run on the bundled files

``--data-dir`` holds ``gpt2/vocab.json``, ``gpt2/merges.txt``, ``corpus/prose.jsonl.gz``, ``eval/wikitext-test.raw``
and ``eval/lambada_test.jsonl``. ``--tiny`` without it uses the repository's Shakespeare sample and the zero-shot test
fixtures. Results go to ``bench/results/zero_shot.{json,md}`` (``zero_shot_tiny`` with ``--tiny``) after every
step, so a run stopped by a time limit still leaves what it measured. Progress lines start with ``[zero_shot``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.results_io import run_meta, write_results  # noqa: E402
from megatron.core.inference.zeroshot_data import wikitext_detokenize  # noqa: E402

START = time.time()
FULL = dict(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024, micro_batch_size=16,
            global_batch_size=32, train_iters=1200, lr=6e-4, lr_warmup_iters=100)
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, micro_batch_size=4,
            global_batch_size=8, train_iters=20, lr=3e-3, lr_warmup_iters=2)


def log(msg: str) -> None:
    print(f"[zero_shot {time.time() - START:6.1f}s] {msg}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--data-dir", default=None, help="folder with gpt2/, corpus/ and eval/ (required without --tiny)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model for a CPU smoke run")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--work-dir", default=os.path.join(ROOT, "scratch", "zero_shot"),
                   help="preprocessed data, checkpoint, Hugging Face export and logs")
    p.add_argument("--results-dir", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--train-iters", type=int, default=None, help="default 1200 (20 with --tiny)")
    p.add_argument("--train-minutes", type=float, default=2.0, help="stop training (and save) after this long")
    p.add_argument("--lambada-seq-length", type=int, default=512,
                   help="LAMBADA window for tasks/main.py and the reference (a passage longer than this + 1 tokens "
                        "keeps its end; the record gives the longest passage); at most the model's")
    p.add_argument("--overlapping-eval", type=int, default=None,
                   help="WikiText window stride (default: the sequence length, no overlap)")
    args = p.parse_args(argv)
    if args.data_dir is None and not args.tiny:
        p.error("--data-dir is required (a copy of the shared data folder); or --tiny for the bundled sample")
    return args


def data_paths(args) -> dict:
    if args.data_dir is None:  # --tiny: the files that ship with the repository
        fixtures = os.path.join(ROOT, "tests", "unit", "zeroshot", "fixtures")
        paths = {"vocab": os.path.join(ROOT, "data", "gpt2-vocab.json"),
                 "merges": os.path.join(ROOT, "data", "gpt2-merges.txt"),
                 "corpus": os.path.join(ROOT, "data", "tinyshakespeare.jsonl.gz"),
                 "wikitext": os.path.join(fixtures, "wikitext_tiny.raw"),
                 "lambada": os.path.join(fixtures, "lambada_tiny.jsonl")}
    else:
        d = args.data_dir
        paths = {"vocab": os.path.join(d, "gpt2", "vocab.json"), "merges": os.path.join(d, "gpt2", "merges.txt"),
                 "corpus": os.path.join(d, "corpus", "prose.jsonl.gz"),
                 "wikitext": os.path.join(d, "eval", "wikitext-test.raw"),
                 "lambada": os.path.join(d, "eval", "lambada_test.jsonl")}
    for name, path in paths.items():
        if not os.path.isfile(path):
            raise SystemExit(f"error: --data-dir: {name} file {path} is missing")
    return paths


def run(cmd: list, log_path: str, wait: bool = True):
    """Run ``cmd`` from the repository root with its output in ``log_path``; return the Popen when not waiting."""
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    out = open(log_path, "w")
    proc = subprocess.Popen([sys.executable] + cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    proc.cmd, proc.log_path = cmd, log_path
    return finish(proc) if wait else proc


def finish(proc) -> str:
    proc.wait()
    text = open(proc.log_path).read()
    if proc.returncode != 0:
        raise SystemExit(f"error: python {' '.join(proc.cmd)} failed ({proc.returncode}):\n{text[-3000:]}")
    return text


# ---- the independent Hugging Face computation ------------------------------------------------------------------
def _forward(model, batch, device, pad_rows):
    """``(ids [b, s + 1], logits [b, s, V], logits with the padding rows [b, s, V + p])`` of right-padded token rows
    ``batch``. ``pad_rows [p, h]``: our output layer's rows past the real vocabulary, which the export leaves out
    but our softmax (Megatron's) includes."""
    width = max(len(r) for r in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    attn = torch.zeros(len(batch), width, dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, :len(r)], attn[i, :len(r)] = torch.tensor(r), 1
    ids, attn = ids.to(device), attn.to(device)
    with torch.no_grad():
        hidden = model.transformer(input_ids=ids[:, :-1], attention_mask=attn[:, :-1]).last_hidden_state  # [b, s, h]
        logits = model.lm_head(hidden).float()  # [b, s, V]
        padded = torch.cat([logits, (hidden @ pad_rows.T).float()], dim=-1)  # [b, s, V + p]
    return ids, logits, padded


def _nll(logits, ids):
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # [b, s]


def hf_wikitext(model, tok, path, seq, stride, device, batch_size, pad_rows) -> dict:
    """Each target scored once, by the first window (starting at 0, stride, 2 stride, ...) that reaches it; the
    loss over the real vocabulary (``avg loss``) and over it plus the padding rows (``avg loss, padded vocab``)."""
    with open(path, "rb") as f:  # bytes decoded as they are: the file's "\r\n" line ends are part of the text
        raw = f.read().decode("utf-8")  # (as Megatron-LM's evaluation reads it); text mode would fold them to "\n"
    words = len(raw.strip().split(" "))
    ids = tok(wikitext_detokenize(raw))["input_ids"]
    windows, scored, start = [], 0, 0
    while scored < len(ids) - 1:
        window = ids[start:start + seq + 1]
        windows.append((window, max(scored - start, 0)))  # targets from this index on count
        scored = start + len(window) - 1
        start += stride
    totals = [0.0, 0.0]
    for b in range(0, len(windows), batch_size):
        chunk = windows[b:b + batch_size]
        rows, logits, padded = _forward(model, [w for w, _ in chunk], device, pad_rows)
        for k, lg in enumerate((logits, padded)):
            nll = _nll(lg, rows)  # [b, s]
            for i, (w, first) in enumerate(chunk):
                totals[k] += float(nll[i, first:len(w) - 1].double().sum())
    ratio = (len(ids) - 1) / (words - 1)
    loss, loss_padded = (t / (len(ids) - 1) for t in totals)
    return {"avg loss": loss, "ppl": math.exp(min(20.0, loss)), "adjusted ppl": math.exp(min(20.0, loss * ratio)),
            "avg loss, padded vocab": loss_padded, "ppl, padded vocab": math.exp(min(20.0, loss_padded)),
            "adjusted ppl, padded vocab": math.exp(min(20.0, loss_padded * ratio)),
            "tokens": len(ids), "windows": len(windows)}


def hf_lambada(model, tok, path, seq, strict, device, batch_size, pad_rows) -> dict:
    rows, longest = [], 0
    for line in open(path, encoding="utf-8"):
        if not line.strip():
            continue
        text = json.loads(line)["text"]
        if strict:
            word = text.split()[-1]
            context, target = tok(text[:text.rfind(word)].strip())["input_ids"], tok(" " + word)["input_ids"]
        else:
            all_ids = tok(text)["input_ids"]
            context, target = all_ids[:-1], all_ids[-1:]
        longest = max(longest, len(context) + len(target))
        row = (context + target)[-(seq + 1):]
        rows.append((row, target[-min(len(target), len(row) - 1):]))
    correct = [0, 0]
    for b in range(0, len(rows), batch_size):
        chunk = rows[b:b + batch_size]
        _, logits, padded = _forward(model, [r for r, _ in chunk], device, pad_rows)
        for k, lg in enumerate((logits, padded)):
            for i, (row, target) in enumerate(chunk):
                end = len(row) - 1  # logits at positions end - n .. end - 1 predict the target tokens
                correct[k] += int(lg[i, end - len(target):end].argmax(-1).tolist() == target)
    return {"number correct": correct[0], "number correct, padded vocab": correct[1], "total examples": len(rows),
            "avg accuracy": correct[0] / len(rows), "longest passage (tokens)": longest, "window": seq}


# ---- the record -----------------------------------------------------------------------------------------------
def save(args, meta, record) -> None:
    stem = "zero_shot_tiny" if args.tiny else "zero_shot"
    rows = [record]
    body = []
    ours, hf = record.get("tasks/main.py (fp32)"), record.get("transformers (fp32)")
    if ours:
        w, lam, strict = ours["WIKITEXT103"], ours["LAMBADA"], ours["LAMBADA strict"]
        body += ["| metric | tasks/main.py (fp32) | transformers, padded vocabulary | transformers, real vocabulary |",
                 "|---|---|---|---|"]
        hw = hf["WIKITEXT103"] if hf else {}
        for key in ("avg loss", "ppl", "adjusted ppl"):
            body.append(f"| WikiText {key} | {w[key]:.6f} | {hw.get(key + ', padded vocab', float('nan')):.6f} | "
                        f"{hw.get(key, float('nan')):.6f} |")
        for name, res in (("LAMBADA", lam), ("LAMBADA strict", strict)):
            h = hf[name] if hf else {}
            body.append(f"| {name} correct / {res['total examples']} | {res['number correct']} | "
                        f"{h.get('number correct, padded vocab', '')} | {h.get('number correct', '')} |")
        body.append("")
    body += ["| step | result |", "|---|---|"]
    for key, value in record.items():
        if key not in ("commands",):
            cell = json.dumps(value).replace("|", "\\|")  # log lines hold table bars
            body.append(f"| {key} | `{cell}` |")
    body += ["", "Commands:", ""] + [f"- `{c}`" for c in record.get("commands", [])]
    write_results(args.results_dir, stem, meta, rows, "Zero-shot WikiText and LAMBADA of a model trained here", body)
    log(f"results written to {os.path.join(args.results_dir, stem)}.{{json,md}}")


def main(argv=None) -> int:
    args = parse_args(argv)
    shape = dict(TINY if args.tiny else FULL)
    if args.train_iters is not None:
        shape["train_iters"] = args.train_iters
    paths = data_paths(args)
    meta = run_meta("zero_shot.py")
    work = args.work_dir
    os.makedirs(work, exist_ok=True)
    record = {"status": "started", "device": meta["gpu"] if args.device == "cuda" else "cpu", "model": shape,
              "commands": []}
    seq = shape["seq_length"]
    stride = args.overlapping_eval or seq
    lam_seq = min(args.lambada_seq_length, seq)

    prefix = os.path.join(work, "corpus")
    pre = ["tools/preprocess_data.py", "--input", paths["corpus"], "--output-prefix", prefix, "--tokenizer-type",
           "GPT2BPETokenizer", "--vocab-file", paths["vocab"], "--merge-file", paths["merges"], "--append-eod",
           "--workers", str(min(16, os.cpu_count() or 1))]
    if not os.path.exists(prefix + "_text_document.idx"):
        log("preprocessing the corpus")
        run(pre, os.path.join(work, "preprocess.log"))
    record["commands"].append("python " + " ".join(pre))

    ckpt = os.path.join(work, "checkpoint")
    train = ["pretrain_gpt.py", *[f"--{k.replace('_', '-')}={v}" for k, v in shape.items()],
             f"--max-position-embeddings={seq}", "--min-lr", str(shape["lr"] / 10), "--lr-decay-style", "cosine",
             "--weight-decay", "0.1", "--adam-beta2", "0.95", "--clip-grad", "1.0", "--attention-dropout", "0.0",
             "--hidden-dropout", "0.0", "--data-path", prefix + "_text_document", "--split", "100,0,0",
             "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", paths["vocab"], "--merge-file", paths["merges"],
             "--make-vocab-size-divisible-by", "128", "--eval-iters", "0", "--eval-interval", str(shape["train_iters"]),
             "--log-interval", "50" if not args.tiny else "5", "--seed", "1234", "--num-workers", "2", "--save", ckpt,
             "--exit-duration-in-mins", str(args.train_minutes), "--eval-tasks", "lambada,wikitext",
             "--eval-lambada-data", paths["lambada"], "--eval-wikitext-data", paths["wikitext"],
             "--eval-overlapping-eval", str(stride)]
    if args.device == "cuda":
        train.append("--bf16")
    log(f"training {shape['num_layers']} layers x {shape['hidden_size']} for up to {shape['train_iters']} iterations")
    out = run(train, os.path.join(work, "train.log"))
    record["commands"].append("python " + " ".join(train))
    lines = [line for line in out.splitlines() if " iteration " in line and "lm loss" in line]
    record["training"] = {"last log line": lines[-1].strip() if lines else None,
                          "finished": "training finished" in out}
    in_loop = [line for line in out.splitlines() if "validation loss at iteration" in line]
    record["in-loop --eval-tasks (training dtype)"] = in_loop[-1].strip() if in_loop else "not reached"
    record["status"] = "trained"
    save(args, meta, record)

    # tasks/main.py (three processes side by side) and the Hugging Face export
    common = ["tasks/main.py", "--load", ckpt, "--dtype", "fp32", "--device", args.device, "--micro-batch-size", "16"]
    jobs = {"WIKITEXT103": ["--task", "WIKITEXT103", "--valid-data", paths["wikitext"], "--overlapping-eval",
                            str(stride)],
            "LAMBADA": ["--task", "LAMBADA", "--valid-data", paths["lambada"], "--seq-length", str(lam_seq)],
            "LAMBADA strict": ["--task", "LAMBADA", "--valid-data", paths["lambada"], "--seq-length", str(lam_seq),
                               "--strict-lambada"]}
    procs = {}
    for name, extra in jobs.items():
        result_file = os.path.join(work, name.replace(" ", "_") + ".json")
        cmd = common + extra + ["--results-file", result_file]
        procs[name] = (run(cmd, result_file + ".log", wait=False), result_file)
        record["commands"].append("python " + " ".join(cmd))
    hf_dir = os.path.join(work, "hf")
    convert = ["tools/checkpoint/convert.py", "--model-type", "GPT", "--loader", "ours", "--saver", "hf",
               "--load-dir", ckpt, "--save-dir", hf_dir, "--vocab-file", paths["vocab"], "--merge-file",
               paths["merges"]]
    log("tasks/main.py x 3 and the Hugging Face export")
    finish(run(convert, os.path.join(work, "convert.log"), wait=False))
    record["commands"].append("python " + " ".join(convert))
    ours = {}
    for name, (proc, result_file) in procs.items():
        finish(proc)
        ours[name] = json.load(open(result_file))
    record["tasks/main.py (fp32)"] = ours
    record["status"] = "evaluated"
    save(args, meta, record)

    log("recomputing with transformers (fp32)")
    from transformers import GPT2LMHeadModel, GPT2TokenizerFast

    tok = GPT2TokenizerFast(paths["vocab"], paths["merges"])  # its own BPE, not ours
    tok.model_max_length = 10**9  # the WikiText file is tokenized whole, then windowed
    device = torch.device(args.device)
    model = GPT2LMHeadModel.from_pretrained(hf_dir, torch_dtype=torch.float32).to(device).eval()
    from megatron.core.inference import load_gpt_for_inference

    ours_model = load_gpt_for_inference(ckpt, dtype=torch.float32, device=torch.device("cpu")).model
    pad_rows = ours_model.output_weight()[model.config.vocab_size:].detach().to(device)  # [p, h]
    del ours_model
    hf = {"WIKITEXT103": hf_wikitext(model, tok, paths["wikitext"], seq, stride, device, 8, pad_rows),
          "LAMBADA": hf_lambada(model, tok, paths["lambada"], lam_seq, False, device, 32, pad_rows),
          "LAMBADA strict": hf_lambada(model, tok, paths["lambada"], lam_seq, True, device, 32, pad_rows)}
    record["transformers (fp32)"] = hf
    ow, hw = ours["WIKITEXT103"], hf["WIKITEXT103"]
    padded_diff = abs(ow["avg loss"] - hw["avg loss, padded vocab"])
    record["agreement"] = {
        "padding rows of the output layer (in our softmax, not in the export)": int(pad_rows.shape[0]),
        "wikitext loss |ours - hf, padded vocab|": padded_diff, "within 1e-4": padded_diff <= 1e-4,
        "wikitext loss |ours - hf, real vocab| (the padding rows' share)": abs(ow["avg loss"] - hw["avg loss"]),
        "wikitext tokens equal": ow["tokens"] == hw["tokens"],
        "lambada correct equal (padded vocab)": (ours["LAMBADA"]["number correct"]
                                                 == hf["LAMBADA"]["number correct, padded vocab"]),
        "lambada strict correct equal (padded vocab)": (ours["LAMBADA strict"]["number correct"]
                                                        == hf["LAMBADA strict"]["number correct, padded vocab"]),
        "lambada correct equal (real vocab)": ours["LAMBADA"]["number correct"] == hf["LAMBADA"]["number correct"],
    }
    record["status"] = "complete"
    record["seconds"] = round(time.time() - START, 1)
    save(args, meta, record)
    log(f"agreement: {record['agreement']}")
    checks = ("within 1e-4", "wikitext tokens equal", "lambada correct equal (padded vocab)",
              "lambada strict correct equal (padded vocab)")
    return 0 if all(record["agreement"][k] for k in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
