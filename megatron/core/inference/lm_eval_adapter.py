"""lm-evaluation-harness backend for this framework's checkpoints (``pip install lm_eval``; optional).

Run it as a module, not as ``lm_eval``: the harness finds models only in its own registry, which this module fills
when it is imported, so ``lm_eval --model megatron_lite`` (a new process) does not know the model. The command

    python -m megatron.core.inference.lm_eval_adapter --model_args load=CKPT --tasks lambada_local \\
        --include_path my_tasks/ --batch_size 8

is ``lm_eval --model megatron_lite ...`` with the model registered: every other ``lm_eval`` flag works as usual
(``--model`` is set by the module and refused). In Python, importing this module registers the model:
``lm_eval.simple_evaluate(model="megatron_lite", model_args="load=CKPT", ...)``, or pass a ``MegatronLiteLM``
instance. Model arguments (``--model_args k=v,...``; any other key is refused with the list below): ``load``
(required), ``iteration``, ``batch_size``, ``max_batch_size`` (the batch for ``--batch_size auto``), ``device``,
``dtype`` (fp32, bf16, fp16), ``max_length`` (default: the model's positions), ``tokenizer_type``,
``vocab_file``, ``merge_file``, ``tokenizer_model``, ``vocab_size`` (NullTokenizer).

Requests: ``loglikelihood`` (context, continuation) -> (sum of the continuation's log-probs, whether greedy
decoding reproduces it), ``loglikelihood_rolling`` (the whole text's log-likelihood in disjoint windows of
``max_length`` after an end-of-document token) and ``generate_until`` (greedy unless ``do_sample``, stopping at
the ``until`` strings, at most ``max_gen_toks`` tokens). One process, any checkpoint the trainer reads (ours,
Megatron-LM's, at any layout; loaded at TP=1).
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Tuple

import torch

from megatron.core.inference.checkpoint import load_gpt_for_inference
from megatron.core.inference.engine import InferenceEngine
from megatron.core.inference.launch import DTYPES, build_tokenizer_from
from megatron.core.inference.sampling import SamplingParams
from megatron.core.inference.start_token import continuation_ids, start_token, with_start_token

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    LM_EVAL_MISSING = None
except ImportError as exc:  # optional: the class below then refuses to build, main() says how to install
    LM, LM_EVAL_MISSING = object, exc

    def register_model(name):
        return lambda cls: cls

MODEL_NAME = "megatron_lite"
MODEL_ARGS = ("load", "iteration", "batch_size", "max_batch_size", "device", "dtype", "max_length",
              "tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "vocab_size")
USAGE = (f"usage: python -m megatron.core.inference.lm_eval_adapter --model_args load=CKPT[,key=value...] "
         f"--tasks TASKS [lm_eval flags]\n  model_args keys: {', '.join(MODEL_ARGS)}")


@register_model(MODEL_NAME)
class MegatronLiteLM(LM):
    def __init__(self, load: str = None, iteration=None, batch_size=8, max_batch_size=None, device=None,
                 dtype=None, max_length=None, tokenizer_type=None, vocab_file=None, merge_file=None,
                 tokenizer_model=None, vocab_size=None, **unknown):
        if LM_EVAL_MISSING is not None:
            raise ImportError(f"lm_eval is not installed (pip install lm_eval): {LM_EVAL_MISSING}")
        if unknown:
            raise ValueError(f"--model_args: unknown key {', '.join(sorted(unknown))}; accepted: "
                             f"{', '.join(MODEL_ARGS)}")
        if not load:
            raise ValueError("--model_args: load=CKPT (the checkpoint directory) is required")
        super().__init__()
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"--model_args dtype must be one of {', '.join(DTYPES)}, got {dtype}")
        loaded = load_gpt_for_inference(load, iteration=None if iteration is None else int(iteration),
                                        dtype=DTYPES[dtype] if dtype else torch.float32,
                                        device=torch.device(device))
        flags = argparse.Namespace(vocab_file=vocab_file, merge_file=merge_file, tokenizer_type=tokenizer_type,
                                   tokenizer_model=tokenizer_model,
                                   vocab_size=None if vocab_size is None else int(vocab_size))
        self.tokenizer = build_tokenizer_from(flags, loaded.args)
        self.engine = InferenceEngine(loaded.model, tokenizer=self.tokenizer)
        if str(batch_size).isdigit() and int(batch_size) >= 1:
            self.batch_size = int(batch_size)
        elif str(batch_size).startswith("auto"):
            self.batch_size = int(max_batch_size) if max_batch_size else 8
        else:
            raise ValueError(f"--batch_size must be a positive integer or auto, got {batch_size}")
        self.max_length = int(max_length) if max_length else self.engine.max_length
        if not 2 <= self.max_length <= self.engine.max_length:
            raise ValueError(f"--model_args max_length must be in [2, {self.engine.max_length}], "
                             f"got {self.max_length}")

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config=None):
        """``--model_args`` first; the harness's own ``--batch_size``, ``--max_batch_size`` and ``--device`` fill
        what they leave unset."""
        args = dict(arg_dict)
        for key, value in (additional_config or {}).items():
            if value is not None and key in MODEL_ARGS and key not in args:
                args[key] = value
        return cls(**args)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config=None):
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    # ---- scoring -----------------------------------------------------------------------------------------
    def _score(self, pairs: List[Tuple[List[int], List[int]]]) -> List[Tuple[float, bool]]:
        """``(context ids, target ids)`` -> (sum of the targets' log-probs, every target the argmax)."""
        results = []
        for start in range(0, len(pairs), self.batch_size):
            chunk = pairs[start:start + self.batch_size]
            seqs = [(ctx + tgt)[-(self.max_length + 1):] for ctx, tgt in chunk]
            width = max(len(s) for s in seqs) - 1
            inputs = torch.full((len(seqs), width), self.tokenizer.eod, dtype=torch.long)
            for i, s in enumerate(seqs):
                inputs[i, :len(s) - 1] = torch.tensor(s[:-1])
            # over the real vocabulary, as the server's log-probs and the Hugging Face export: padding rows get no mass
            logits = self.engine.forward_logits(inputs)[..., :self.tokenizer.vocab_size]
            logp = logits.log_softmax(-1).cpu()  # [b, width, V]
            for i, ((_, tgt), s) in enumerate(zip(chunk, seqs)):
                n = min(len(tgt), len(s) - 1)
                rows = logp[i, len(s) - 1 - n:len(s) - 1]  # [n, V]
                target = torch.tensor(s[-n:])
                results.append((float(rows.gather(-1, target.unsqueeze(-1)).sum()),
                                bool((rows.argmax(-1) == target).all())))
        return results

    def _encode_pair(self, context: str, continuation: str) -> Tuple[List[int], List[int]]:
        spaces = len(context) - len(context.rstrip(" "))
        if spaces:  # a trailing space belongs to the continuation's first token in BPE
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        ctx = self.tokenizer.tokenize(context) if context else [start_token(self.tokenizer)]
        return ctx, continuation_ids(self.tokenizer, continuation)

    def loglikelihood(self, requests) -> List[Tuple[float, bool]]:
        return self._score([self._encode_pair(*req.args) for req in requests])

    def loglikelihood_rolling(self, requests) -> List[float]:
        out = []
        for req in requests:
            ids = with_start_token(self.tokenizer, self.tokenizer.tokenize(req.args[0]))
            windows = []
            for start in range(0, len(ids) - 1, self.max_length):
                window = ids[start:start + self.max_length + 1]
                windows.append((window[:1], window[1:]))
            out.append(sum(lp for lp, _ in self._score(windows)))
        return out

    # ---- generation --------------------------------------------------------------------------------------
    def generate_until(self, requests) -> List[str]:
        out = []
        for req in requests:
            context, kwargs = req.args[0], dict(req.args[1] if len(req.args) > 1 else {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", 256))
            sample = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 1.0 if sample else 0.0))
            ids = self.tokenizer.tokenize(context) or [start_token(self.tokenizer)]
            max_new = max(0, min(max_new, self.max_length - 1))
            ids = ids[-(self.max_length - max_new):]
            params = SamplingParams(max_new_tokens=max_new, greedy=not sample or temperature == 0.0,
                                    temperature=temperature, top_p=float(kwargs.pop("top_p", 0.0) or 0.0),
                                    top_k=int(kwargs.pop("top_k", 0) or 0), seed=kwargs.pop("seed", 1234),
                                    stop_strings=tuple(s for s in until if s))
            out.append(self.engine.generate([ids], params)[0].text)
        return out


def main(argv=None) -> int:
    """``lm_eval`` with ``--model megatron_lite``: the harness's command line, our model registered."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE + "\n  every other flag is lm_eval's:\n")
    if any(a == "--model" or a.startswith("--model=") for a in argv):
        print(f"error: --model is set to {MODEL_NAME} by this module; give the checkpoint with "
              "--model_args load=CKPT", file=sys.stderr)
        return 2
    if LM_EVAL_MISSING is not None:
        print(f"error: lm_eval is not installed (pip install lm_eval, or the eval extra): {LM_EVAL_MISSING}",
              file=sys.stderr)
        return 2
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["python -m megatron.core.inference.lm_eval_adapter", "--model", MODEL_NAME, *argv]
    try:
        cli_evaluate()
    except ValueError as exc:  # a bad --model_args key or value
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
