"""Undo WikiText's tokenization (spaces around punctuation, ``@-@`` number separators) before BPE encoding.

The rules are those Megatron-LM and lm-evaluation-harness apply to WikiText, so perplexities compare.
"""

from __future__ import annotations

import re

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
