"""SentencePiece tokenizers with Megatron-LM's semantics (``--tokenizer-type SentencePieceTokenizer`` and
``Llama2Tokenizer`` with ``--tokenizer-model x.model``).

``SentencePieceTokenizer``: the model's pieces, then Megatron's special tokens added to the vocabulary where the
model lacks them, in this order: ``<CLS>``, ``<SEP>``, ``<EOD>``, ``<MASK>``, then the model's pad, BOS and EOS
pieces (``<PAD>``, ``<BOS>``, ``<EOS>`` when the model has none). ``eod`` is ``<EOD>``. A special token written in the
text is its id (the text is cut at each one, leftmost first, and the pieces between are encoded); detokenizing
writes each special token between spaces.

``Llama2Tokenizer``: the model's vocabulary as it is; ``tokenize`` puts the model's BOS id first, ``eod`` is the
model's EOS id (so ``--append-eod`` ends each document with ``</s>``), ``detokenize`` is the model's decoding.
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, List, Sequence

from megatron.core.tokenizer.base import DictVocabulary, require_file


def load_sentencepiece(model_file: str, kind: str):
    """A ``sentencepiece.SentencePieceProcessor`` of ``model_file``; a missing, unreadable or malformed file is a
    ``ValueError`` naming ``--tokenizer-model`` and the file."""
    require_file(model_file, "--tokenizer-model", kind)
    import sentencepiece

    try:
        return sentencepiece.SentencePieceProcessor(model_file=model_file)
    except (OSError, RuntimeError) as err:
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise ValueError(f"--tokenizer-model {model_file!r}: not a SentencePiece model ({reason})") from None


class _SentencePieceBase(DictVocabulary):
    """What both SentencePiece tokenizers share: the processor and the piece vocabulary."""

    name = "abstract"

    def __init__(self, model_file: str):
        self._sp = load_sentencepiece(model_file, self.name)
        self._vocab: Dict[str, int] = {self._sp.id_to_piece(i): i for i in range(self._sp.get_piece_size())}

    def _model_piece(self, piece_id: int, fallback: str) -> str:
        """The model's piece of ``piece_id`` (-1 when the model has none: then ``fallback``)."""
        return self._sp.id_to_piece(piece_id) if 0 <= piece_id < self._sp.get_piece_size() else fallback

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"


class SentencePieceTokenizer(_SentencePieceBase):
    """Megatron-LM's ``SentencePieceTokenizer`` (see the module docstring)."""

    name = "SentencePieceTokenizer"

    def __init__(self, model_file: str):
        super().__init__(model_file)
        pad = self._model_piece(self._sp.pad_id(), "<PAD>")
        bos = self._model_piece(self._sp.bos_id(), "<BOS>")
        eos = self._model_piece(self._sp.eos_id(), "<EOS>")
        self._special: Dict[str, int] = {}
        for token in ("<CLS>", "<SEP>", "<EOD>", "<MASK>", pad, bos, eos):
            self._special[token] = self._vocab.setdefault(token, len(self._vocab))
        self._special_text = {i: t for t, i in self._special.items()}
        # leftmost special token first; at one position the earlier-added token wins
        self._split = re.compile("|".join(re.escape(t) for t in self._special))
        self.cls, self.sep, self.mask = self._special["<CLS>"], self._special["<SEP>"], self._special["<MASK>"]
        self.pad, self.bos, self.eos = self._special[pad], self._special[bos], self._special[eos]

    @property
    def eod(self) -> int:
        return self._special["<EOD>"]

    def _segments(self, text: str) -> List[object]:
        """``text`` cut at its special tokens: plain strings and the special ids between them."""
        out: List[object] = []
        start = 0
        for m in self._split.finditer(text):
            out += [text[start:m.start()], self._special[m.group()]]
            start = m.end()
        out.append(text[start:])
        return out

    def tokenize(self, text: str) -> List[int]:
        return self.tokenize_batch([text])[0]

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        segments = [self._segments(t) for t in texts]
        plain = [s for segs in segments for s in segs if isinstance(s, str)]
        encoded = iter(self._sp.encode(plain) if plain else [])
        return [[i for s in segs for i in (next(encoded) if isinstance(s, str) else [s])] for segs in segments]

    def detokenize(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        text, last = "", 0
        for k, i in enumerate(ids):
            if i in self._special_text:
                text += self._sp.decode_ids(ids[last:k]) + " " + self._special_text[i] + " "
                last = k + 1
        return text + self._sp.decode_ids(ids[last:])


class Llama2Tokenizer(_SentencePieceBase):
    """Megatron-LM's ``Llama2Tokenizer`` (see the module docstring)."""

    name = "Llama2Tokenizer"

    def __init__(self, model_file: str):
        super().__init__(model_file)
        self.bos, self.eos, self.pad = self._sp.bos_id(), self._sp.eos_id(), self._sp.pad_id()
        if self.bos < 0 or self.eos < 0:
            raise ValueError(f"--tokenizer-model {model_file!r}: the SentencePiece model has no "
                             f"{'BOS' if self.bos < 0 else 'EOS'} piece, which Llama2Tokenizer needs")

    @property
    def eod(self) -> int:
        return self.eos

    def tokenize(self, text: str) -> List[int]:
        return [self.bos] + self._sp.encode(text)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [[self.bos] + ids for ids in self._sp.encode(list(texts))] if texts else []

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._sp.decode_ids([int(i) for i in ids])
