"""Tokenizers built on the compiled Hugging Face ``tokenizers`` library (and Megatron-LM's ``NullTokenizer``; the
SentencePiece ones are in sentencepiece_tokenizers.py, built by ``build_tokenizer`` too).

Every tokenizer exposes the same small surface that preprocessing, the datasets and the trainer need:

* ``vocab_size``: number of ids the tokenizer can emit (Megatron's definition, before any padding to a
  multiple of 128 for tensor parallelism);
* ``eod``: the end-of-document id that ``--append-eod`` appends;
* ``tokenize(text) -> list[int]`` and ``tokenize_batch(texts) -> list[list[int]]`` (the batched form runs
  in the Rust library's own thread pool and is what makes preprocessing fast);
* ``detokenize(ids) -> str``.

The ids equal those of Megatron-LM's tokenizers for the same vocabulary files: GPT-2 byte-level BPE
(``vocab.json`` + ``merges.txt``, the same pre-tokenising regular expression and merge ranks) and BERT
WordPiece (``vocab.txt``, BERT's basic tokenizer then greedy longest-match-first word pieces).
"""

from __future__ import annotations

import abc
import json
import os
from typing import Iterable, List, Optional, Sequence

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from megatron.core.tokenizer.base import DictVocabulary, require_file

TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "HuggingFaceTokenizer",
    "SentencePieceTokenizer",
    "Llama2Tokenizer",
    "NullTokenizer",
)


class _HFBackedTokenizer(abc.ABC):
    """Common behaviour of the tokenizers: a ``tokenizers.Tokenizer`` plus Megatron's special ids."""

    name = "abstract"

    def __init__(self, tokenizer: Tokenizer, add_special_tokens: bool = False):
        self._tok = tokenizer
        self._add_special = add_special_tokens

    @property
    def vocab_size(self) -> int:
        """Number of distinct ids (Megatron's ``vocab_size``; padding for TP is the trainer's job)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def vocab(self) -> dict:
        """Mapping token string -> id."""
        return self._tok.get_vocab(with_added_tokens=True)

    @property
    @abc.abstractmethod
    def eod(self) -> int:
        """The end-of-document id (each concrete tokenizer defines it)."""

    def tokenize(self, text: str) -> List[int]:
        """Token ids of one text."""
        return self._tok.encode(text, add_special_tokens=self._add_special).ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Token ids of many texts at once (parallel inside the Rust library)."""
        if not texts:
            return []
        encs = self._tok.encode_batch(list(texts), add_special_tokens=self._add_special)
        return [e.ids for e in encs]

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of a list of ids."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"


class GPT2BPETokenizer(DictVocabulary, _HFBackedTokenizer):
    """OpenAI GPT-2 byte-level BPE from ``vocab.json`` and ``merges.txt``; ``eod`` is ``<|endoftext|>``."""

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str):
        require_file(vocab_file, "--vocab-file", "GPT2BPETokenizer")
        require_file(merge_file, "--merge-file", "GPT2BPETokenizer")
        self._vocab_file, self._merge_file = vocab_file, merge_file
        self._add_special = False
        try:
            with open(vocab_file, encoding="utf-8") as f:
                vocab = json.load(f)
        except ValueError as err:
            raise ValueError(f"--vocab-file {vocab_file}: not a JSON vocabulary ({err})") from err
        if not isinstance(vocab, dict):
            raise ValueError(f"--vocab-file {vocab_file}: expected a JSON object of token -> id")
        self._vocab = vocab
        eod = vocab.get("<|endoftext|>")
        if eod is None:
            raise ValueError(f"--vocab-file {vocab_file} has no '<|endoftext|>' token (not a GPT-2 vocabulary?)")
        self._eod = eod
        self._hf = None  # the Hugging Face tokenizer, built on first use (bulk encoding may never need it)
        self._fast = None

    @property
    def _tok(self) -> Tokenizer:
        if self._hf is None:
            tok = Tokenizer(models.BPE.from_file(self._vocab_file, self._merge_file))
            # GPT-2 pre-tokenises with its regular expression and maps bytes to printable characters;
            # no prefix space is added (Megatron's tokenizer adds none either).
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
            tok.decoder = decoders.ByteLevel()
            self._hf = tok
        return self._hf

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def uses_tiktoken(self) -> bool:
        """Whether bulk encoding (``tokenize_batch_flat``) BPE-encodes new pieces with ``tiktoken``."""
        self.tokenize_batch_flat([])
        return self._fast is not None and self._fast._piece_encoder is not None

    def prepare_bulk(self, max_chars: int) -> None:
        """Build the bulk encoder and its tables for batches of up to ``max_chars`` characters now (before
        forking preprocessing workers, which then share them)."""
        self.tokenize_batch_flat([])
        self._fast.reserve(max_chars)

    def tokenize_batch_flat(self, texts: Sequence[str]):
        """(int64 ids of all texts back to back, int64 number of ids per text), for bulk preprocessing.

        Uses ``FastGPT2Encoder`` (vectorised pre-tokenisation and a piece cache; same ids), whose unseen pieces
        go to ``tiktoken``'s compiled BPE when it is installed (optional) and else to the Hugging Face model.
        """
        if self._fast is None:
            self._fast = self._build_fast()
        return self._fast.encode_batch_flat(texts)

    def _build_fast(self):
        """The bulk encoder; with tiktoken, its checked ranks and seeded pieces come from ``gpt2_cache``."""
        from megatron.core.tokenizer import gpt2_cache, gpt2_fast

        tk, seed = None, None
        key = None
        if os.environ.get("MEGATRON_NO_TIKTOKEN", "0") in ("", "0"):
            try:
                import tiktoken

                bases = gpt2_cache.hash_bases()
                key = gpt2_cache.files_key(self._vocab_file, self._merge_file,
                                           extra=f"tiktoken {tiktoken.__version__} bases {bases}")
            except (ImportError, OSError):
                key = None
        if key is not None:
            packed, seed = gpt2_cache.load(f"gpt2_ranks_{key}"), gpt2_cache.load(f"gpt2_seed_{key}")
            if packed is not None and seed is not None and seed.ndim == 2 and seed.shape[0] == 3:
                tk = gpt2_fast.tiktoken_from_ranks(gpt2_cache.unpack_ranks(packed))
        if tk is None:
            tk = gpt2_fast.tiktoken_piece_encoder(self._vocab, gpt2_fast.read_merges(self._merge_file))
            seed = None
        fast = gpt2_fast.FastGPT2Encoder(lambda: self._tok, fallback=self,
                                         piece_encoder=None if tk is None else tk.encode)
        if tk is not None:  # tiktoken's rule: a piece equal to a token is that token
            if seed is not None:
                fast.set_seed(seed)
            else:
                fast.seed_single_tokens(*gpt2_fast.single_token_pieces(tk.ranks))
                if key is not None:
                    gpt2_cache.save(f"gpt2_ranks_{key}", gpt2_cache.pack_ranks(tk.ranks))
                    gpt2_cache.save(f"gpt2_seed_{key}", fast.seed)
        return fast


class BertWordPieceTokenizer(_HFBackedTokenizer):
    """BERT WordPiece from ``vocab.txt`` (lower-cased and accent-stripped, or cased).

    As in Megatron-LM, ``[BOS]`` and ``[EOS]`` are appended to the vocabulary when absent (so
    bert-base-uncased has ``vocab_size`` 30,524) and ``eod`` is the ``[EOS]`` id.
    """

    def __init__(self, vocab_file: str, lower_case: bool):
        self.name = "BertWordPieceLowerCase" if lower_case else "BertWordPieceCase"
        require_file(vocab_file, "--vocab-file", self.name)
        # Megatron appends [BOS] then [EOS] as ordinary vocabulary entries (not special tokens matched in the text);
        # like Megatron's WordPiece, a word of over 200 characters is [UNK].
        vocab = models.WordPiece.read_file(vocab_file)
        for extra in ("[BOS]", "[EOS]"):
            vocab.setdefault(extra, len(vocab))
        tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=200))
        tok.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, strip_accents=lower_case, lowercase=lower_case
        )
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(prefix="##")
        vocab = tok.get_vocab()
        for special in ("[CLS]", "[SEP]", "[PAD]", "[MASK]"):
            if special not in vocab:
                raise ValueError(f"--vocab-file {vocab_file} lacks the BERT special token {special}")
        super().__init__(tok)
        self.cls = tok.token_to_id("[CLS]")
        self.sep = tok.token_to_id("[SEP]")
        self.pad = tok.token_to_id("[PAD]")
        self.mask = tok.token_to_id("[MASK]")
        self.bos = tok.token_to_id("[BOS]")
        self.eos = tok.token_to_id("[EOS]")

    @property
    def eod(self) -> int:
        return self.eos

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


_BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]", "<|im_end|>")


class HuggingFaceTokenizer(_HFBackedTokenizer):
    """Any Hugging Face ``tokenizer.json`` (a file, or a directory holding one).

    Special tokens are added as the tokenizer's post-processor defines (as ``AutoTokenizer(text)``
    does in Megatron-LM). ``eod`` is the ``eos_token`` of a ``tokenizer_config.json`` next to the file
    when there is one, else the first of the usual end-of-text tokens present in the vocabulary; ``bos`` likewise
    from ``bos_token`` or the usual beginning-of-text tokens (None when there is none).
    """

    name = "HuggingFaceTokenizer"

    def __init__(self, tokenizer_model: str, eod_token: Optional[str] = None):
        if not tokenizer_model:
            raise ValueError("HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json file or its directory)")
        path = tokenizer_model
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        require_file(path, "--tokenizer-model", self.name)
        try:
            tok = Tokenizer.from_file(path)
        except Exception as err:  # the Rust library raises a bare Exception for a malformed file
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"--tokenizer-model {path!r}: not a Hugging Face tokenizer.json ({reason})") from None
        super().__init__(tok, add_special_tokens=True)
        config = self._read_config(os.path.join(os.path.dirname(path), "tokenizer_config.json"))
        names = ([eod_token] if eod_token else []) + [t for t in (config.get("eos_token"),) if t] + \
            list(_EOS_CANDIDATES)
        found = [i for i in (tok.token_to_id(n) for n in names) if i is not None]
        if not found:
            raise ValueError(
                "HuggingFaceTokenizer: could not find an end-of-document token in the tokenizer "
                f"(looked for {names}); add a tokenizer_config.json with 'eos_token' next to tokenizer.json")
        self._eod = found[0]
        bos = [i for i in (tok.token_to_id(n) for n in [config.get("bos_token")] + list(_BOS_CANDIDATES) if n)
               if i is not None]
        self.bos: Optional[int] = bos[0] if bos else None  # the beginning-of-text id, when the vocabulary has one

    @staticmethod
    def _read_config(cfg: str) -> dict:
        """``{"eos_token": ..., "bos_token": ...}`` (strings or None) of a ``tokenizer_config.json``, if present."""
        if not os.path.isfile(cfg):
            return {}
        try:
            with open(cfg, encoding="utf-8") as f:
                raw = json.load(f)
            tokens = {key: raw.get(key) for key in ("eos_token", "bos_token")}
        except (OSError, ValueError, AttributeError) as err:
            raise ValueError(f"--tokenizer-model: {cfg!r} next to the tokenizer is not a readable JSON object "
                             f"({err})") from None
        return {k: (v.get("content") if isinstance(v, dict) else v) if isinstance(v, (dict, str)) else None
                for k, v in tokens.items()}

    @property
    def eod(self) -> int:
        return self._eod


class NullTokenizer:
    """Megatron-LM's ``NullTokenizer``: the text is already token ids, written as decimal numbers separated by
    spaces (``"5 17 3"``); ``--vocab-size N`` names the ids ``0 .. N-1`` and the end-of-document id is ``N``, so the
    tokenizer has ``N + 1`` ids (padded like any vocabulary). For data preprocessed elsewhere and for checkpoints
    trained on synthetic ids."""

    name = "NullTokenizer"

    def __init__(self, vocab_size: Optional[int]):
        if vocab_size is None or int(vocab_size) < 1:
            raise ValueError(f"NullTokenizer needs --vocab-size N >= 1 (the number of ids before the end-of-document "
                             f"id), got {vocab_size}")
        self._ids = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._ids + 1

    @property
    def eod(self) -> int:
        return self._ids

    def tokenize(self, text: str) -> List[int]:
        try:
            ids = [int(piece) for piece in text.split()]
        except ValueError:
            raise ValueError(f"NullTokenizer reads decimal token ids separated by spaces, got {text[:40]!r}") from None
        bad = [i for i in ids if not 0 <= i <= self._ids]
        if bad:
            raise ValueError(f"NullTokenizer: id {bad[0]} is outside 0..{self._ids} (--vocab-size {self._ids})")
        return ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def __repr__(self) -> str:
        return f"NullTokenizer(vocab_size={self.vocab_size}, eod={self.eod})"


def build_tokenizer(
    tokenizer_type: str,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
    tokenizer_model: Optional[str] = None,
    vocab_size: Optional[int] = None,
):
    """Build one of Megatron's tokenizer types (``--tokenizer-type``) from its files (``NullTokenizer``: from
    ``vocab_size``, Megatron-LM's ``--vocab-size``)."""
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "BertWordPieceLowerCase":
        return BertWordPieceTokenizer(vocab_file, lower_case=True)
    if tokenizer_type == "BertWordPieceCase":
        return BertWordPieceTokenizer(vocab_file, lower_case=False)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type in ("SentencePieceTokenizer", "Llama2Tokenizer"):
        from megatron.core.tokenizer import sentencepiece_tokenizers

        return getattr(sentencepiece_tokenizers, tokenizer_type)(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise ValueError(f"--tokenizer-type {tokenizer_type!r} is not supported; choose one of {list(TOKENIZER_TYPES)}")
