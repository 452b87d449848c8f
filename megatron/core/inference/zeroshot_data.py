"""Zero-shot evaluation samples: WikiText windows and LAMBADA passages, each ``seq_length + 1`` tokens and a
target mask. Shared by ``tasks/main.py`` and the training loop's ``--eval-tasks``.

A sample is ``(tokens, mask)``: ``tokens`` has ``seq_length + 1`` ids (inputs are ``tokens[:-1]``, targets
``tokens[1:]``), ``mask`` has ``seq_length`` entries, 1 where a target counts.

WikiText is detokenized first (spaces around punctuation, ``@-@`` number separators undone) with the rules
Megatron-LM and lm-evaluation-harness apply, so perplexities compare.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import List, Tuple

from megatron.core.inference.start_token import continuation_ids

Sample = Tuple[List[int], List[int]]

# (old, new) literal replacements, in order
_BEFORE_BRACKETS = [
    ("s '", "s'"),
    (" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."),
    (" : ", ": "), (" ; ", "; "), (" . ", ". "), (" ! ", "! "), (" ? ", "? "), (" , ", ", "),
]
# spaces just inside paired brackets and quotes are removed: "( a b )" -> "(a b)"
_PAIRS = [
    (re.compile(r"\(\s*([^\)]*?)\s*\)"), r"(\1)"),
    (re.compile(r"\[\s*([^\]]*?)\s*\]"), r"[\1]"),
    (re.compile(r"{\s*([^}]*?)\s*}"), r"{\1}"),
    (re.compile(r"\"\s*([^\"]*?)\s*\""), r'"\1"'),
    (re.compile(r"'\s*([^']*?)\s*'"), r"'\1'"),
]
_AFTER_BRACKETS = [
    ("= = = =", "===="), ("= = =", "==="), ("= =", "=="),
    (" \N{DEGREE SIGN} ", "\N{DEGREE SIGN}"),
    (" \n", "\n"), ("\n ", "\n"),
    (" N ", " 1 "), (" 's", "'s"),
]


def wikitext_detokenize(text: str) -> str:
    for old, new in _BEFORE_BRACKETS[:1]:
        text = text.replace(old, new)
    text = re.sub(r"/' [0-9]/", r"/'[0-9]/", text)  # kept for parity with the reference rules (a no-op in practice)
    for old, new in _BEFORE_BRACKETS[1:]:
        text = text.replace(old, new)
    for pattern, repl in _PAIRS:
        text = pattern.sub(repl, text)
    for old, new in _AFTER_BRACKETS:
        text = text.replace(old, new)
    return text


@dataclass
class WikiTextData:
    samples: List[Sample]
    num_original_tokens: int  # whitespace-separated words of the raw file
    num_tokenized_tokens: int  # BPE tokens of the detokenized text

    @property
    def token_ratio(self) -> float:
        """BPE targets per word target: ``adjusted ppl`` = exp(loss per token x this ratio)."""
        return (self.num_tokenized_tokens - 1) / max(self.num_original_tokens - 1, 1)


def lm_windows(tokens: List[int], seq_length: int, pad: int, overlapping_eval: int) -> List[Sample]:
    """Windows of ``seq_length`` targets starting every ``overlapping_eval`` tokens; after the first window only
    the last ``overlapping_eval`` targets count, so every target is scored once, with the longest context the
    stride allows."""
    stride = max(1, min(overlapping_eval, seq_length))
    total_targets = len(tokens) - 1
    count = max(math.ceil(max(total_targets - stride, 0) / stride) + 1, 1)
    samples = []
    for i in range(count):
        window = tokens[i * stride:i * stride + seq_length + 1]
        mask = [1] * (len(window) - 1) + [0] * (seq_length + 1 - len(window))
        window = window + [pad] * (seq_length + 1 - len(window))
        if i > 0 and stride != seq_length:
            mask = [0] * (seq_length - stride) + mask[seq_length - stride:]
        samples.append((window, mask))
    return samples


def read_text(path: str, flag: str) -> str:
    """The UTF-8 text of ``path``; a file that is not UTF-8 is one ``ValueError`` line naming ``flag`` and the
    file."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ValueError(f"{flag} {path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} on line {line})") from None


def build_wikitext(path: str, tokenizer, seq_length: int, overlapping_eval: int,
                   flag: str = "--valid-data") -> WikiTextData:
    """The windows of a raw WikiText file; ``flag`` names the file's flag in error messages."""
    raw = read_text(path, flag)
    num_original = len(raw.strip().split(" "))
    tokens = tokenizer.tokenize(wikitext_detokenize(raw))
    if len(tokens) < 2:
        raise ValueError(f"{flag} {path}: fewer than two tokens to score")
    return WikiTextData(lm_windows(tokens, seq_length, tokenizer.eod, overlapping_eval), num_original, len(tokens))


def lambada_split(text: str, tokenizer, strict: bool) -> Tuple[List[int], List[int]]:
    """``(context tokens, last-word tokens)``. Non-strict: the last BPE token is the target; strict: every token
    of the whole last whitespace-separated word (encoded with its leading space)."""
    if not strict:
        ids = tokenizer.tokenize(text)
        return ids[:-1], ids[-1:]
    word = text.split()[-1]
    start = text.rfind(word)
    return tokenizer.tokenize(text[:start].strip()), continuation_ids(tokenizer, " " + word)


def build_lambada(path: str, tokenizer, seq_length: int, strict: bool, flag: str = "--valid-data") -> List[Sample]:
    """One sample per ``{"text": ...}`` line; ``flag`` names the file's flag in error messages."""
    samples = []
    for n, line in enumerate(read_text(path, flag).split("\n"), 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["text"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{flag} {path} line {n}: expected a JSON object with a 'text' string") from None
        if not isinstance(text, str) or not text.split():
            raise ValueError(f"{flag} {path} line {n}: 'text' must be a non-empty string")
        context, target = lambada_split(text, tokenizer, strict)
        tokens = context + target
        if len(tokens) < 2 or not target:
            raise ValueError(f"{flag} {path} line {n}: too short to score")
        tokens = tokens[-(seq_length + 1):]  # keep the end (the target) of an over-long passage
        n_target = min(len(target), len(tokens) - 1)
        mask = [0] * (len(tokens) - 1 - n_target) + [1] * n_target
        pad = seq_length + 1 - len(tokens)
        samples.append((tokens + [tokenizer.eod] * pad, mask + [0] * pad))
    if not samples:
        raise ValueError(f"{flag} {path}: no passages")
    return samples
