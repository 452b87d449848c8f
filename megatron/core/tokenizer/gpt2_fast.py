"""A fast, exact GPT-2 encoder for bulk preprocessing.

GPT-2 first cuts text into pieces with the regular expression

    's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+

and then runs byte-level BPE on each piece independently. On a 2-core machine the regular expression is the
slowest step of every implementation we measured (Hugging Face ``tokenizers`` and ``tiktoken`` included),
so this module replaces it by an equivalent vectorised NumPy computation over character classes, and
replaces per-piece BPE by a dictionary of pieces already seen (natural text repeats a few hundred
thousand pieces); only unseen pieces are BPE-encoded, by ``tiktoken``'s compiled BPE when it is installed
(``tiktoken_piece_encoder``; about twice as fast per piece) and else by the Hugging Face BPE model.

Equivalence with the regular expression (checked in tests against the ``regex`` module on real text and
on random strings) follows from how the alternation behaves at each position, with characters in four
classes: whitespace S (``\\s``), letters L, numbers N, and the rest O:

* L, N and O runs are pieces; a single space ``' '`` right before such a run is glued to its front;
* a whitespace run followed by a non-space loses its last character: that character is the glued
  space when it is ``' '``, else a piece of its own; a whitespace run at the end of the text is one piece;
* an apostrophe that starts a piece, is alone in its O run and is followed by ``s t m d`` or
  ``re ve ll`` forms a contraction piece with those letters, the rest of the letters being a new piece.
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import regex

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

_S, _L, _N, _O = 0, 1, 2, 3
_APOS = ord("'")
_SPACE = ord(" ")
_ONE_LETTER = np.array([ord(c) for c in "stmd"], dtype=np.uint32)


@functools.lru_cache(maxsize=1)
def class_table() -> np.ndarray:
    """uint8[0x110000]: the class (S, L, N or O) of every code point, as the ``regex`` module sees them.

    Computing it takes a few tenths of a second, so it is cached on disk per ``regex``/Unicode version.
    """
    import os
    import unicodedata

    tag = f"{getattr(regex, '__version__', 'unknown')}-{unicodedata.unidata_version}".replace(os.sep, "_")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(base, "megatron-lite", f"gpt2_char_classes_{tag}.npy")
    try:
        table = np.load(path)
        if table.shape == (0x110000,) and table.dtype == np.uint8:
            return table
    except (OSError, ValueError):
        pass
    table = _compute_class_table()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            np.save(f, table)
        os.replace(tmp, path)
    except OSError:
        pass  # read-only home: recompute next time
    return table


def _compute_class_table() -> np.ndarray:
    cps = np.arange(0x110000, dtype=np.int64)
    valid = cps[(cps < 0xD800) | (cps > 0xDFFF)]
    everything = "".join(map(chr, valid.tolist()))
    table = np.full(0x110000, _O, dtype=np.uint8)
    for cls, pat in ((_L, r"\p{L}+"), (_N, r"\p{N}+"), (_S, r"\s+")):
        for m in regex.finditer(pat, everything):  # runs of code points: a few thousand matches
            table[valid[m.start(): m.end()]] = cls
    return table


def piece_starts(cp: np.ndarray, text_start: np.ndarray) -> np.ndarray:
    """Start offsets (int64) of the GPT-2 pieces of the code points ``cp`` (several texts back to back).

    ``text_start`` is a bool array marking the first code point of every text: no piece crosses it and the
    rules that look at a neighbour never look across it.
    """
    n = cp.size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    cls = class_table()[cp]  # [n]
    start = np.empty(n, dtype=bool)  # start[k]: a piece starts at k
    start[0] = True
    np.not_equal(cls[1:], cls[:-1], out=start[1:])
    start |= text_start
    # A whitespace run followed by a non-space at k: its last char (k-1) starts a piece; when it is ' ' it
    # is glued to the run at k, which then stops being a start.
    k = np.flatnonzero(start[1:] & ~text_start[1:] & (cls[1:] != _S) & (cls[:-1] == _S)) + 1
    start[k - 1] = True
    start[k[cp[k - 1] == _SPACE]] = False
    # Contractions: an apostrophe starting a piece, alone in its O run, followed by the letters.
    a = np.flatnonzero(cp[:-1] == _APOS)
    if a.size:
        a = a[start[a] & (cls[a + 1] == _L) & ~text_start[a + 1]]
    if a.size:
        nxt = cp[a + 1]
        ok2 = (a + 2 < n)
        a2 = np.minimum(a + 2, n - 1)
        ok2 &= ~text_start[a2]
        nxt2 = np.where(ok2, cp[a2], 0)
        two = ok2 & (nxt2 == ord("e")) & ((nxt == ord("r")) | (nxt == ord("v")))
        two |= ok2 & (nxt2 == ord("l")) & (nxt == ord("l"))
        one = np.isin(nxt, _ONE_LETTER)
        length = np.where(one, 1, np.where(two, 2, 0))
        sel = length > 0
        a, length = a[sel], length[sel]
        start[a + 1] = False
        end = a + 1 + length
        start[end[end < n]] = True  # the rest of the letters (or whatever follows) starts a new piece
    return np.flatnonzero(start)


def split_pieces(text: str) -> List[str]:
    """The GPT-2 pieces of ``text`` (equal to ``regex.findall(GPT2_PATTERN, text)``)."""
    cp = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    ts = np.zeros(cp.size, dtype=bool)
    if cp.size:
        ts[0] = True
    b = piece_starts(cp, ts).tolist() + [len(text)]
    return [text[i:j] for i, j in zip(b[:-1], b[1:])]


def byte_to_char_table() -> dict:
    """``str.translate`` table from each byte (as a Latin-1 character) to GPT-2's printable stand-in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class TiktokenBPE(NamedTuple):
    """``encode``: one GPT-2 piece (UTF-8 bytes) -> ids; ``ranks``: token bytes -> id, the BPE's tokens."""

    encode: Callable[[bytes], List[int]]
    ranks: Dict[bytes, int]


def tiktoken_piece_encoder(vocab: Dict[str, int], merges: Sequence[Tuple[str, str]]) -> Optional[TiktokenBPE]:
    """``tiktoken``'s compiled BPE for one GPT-2 piece, built offline from the vocabulary (no download).

    Returns None (callers then use the Hugging Face BPE model) when ``tiktoken`` is not installed, when
    ``MEGATRON_NO_TIKTOKEN=1`` is set, or when the files do not have the shape that makes tiktoken's rule
    equal to GPT-2's: tiktoken merges the adjacent pair whose concatenation has the lowest id, GPT-2 the pair
    listed first in merges.txt, and the two orders agree when the 256 byte tokens come first and the token
    made by merge line k is id 256 + k (true of OpenAI's GPT-2 files). Identity of the ids with the Hugging
    Face model is tested on the whole vocabulary, on real text and on adversarial token concatenations.
    """
    if os.environ.get("MEGATRON_NO_TIKTOKEN", "0") not in ("", "0"):
        return None
    try:
        from tiktoken.core import Encoding
    except ImportError:
        return None
    to_byte = str.maketrans({c: chr(b) for b, c in byte_to_char_table().items()})
    n_bpe = 256 + len(merges)  # ids above are special tokens such as <|endoftext|>, outside the BPE
    ranks: Dict[bytes, int] = {}
    for token, i in vocab.items():
        if i < n_bpe:
            try:
                ranks[token.translate(to_byte).encode("latin-1")] = i
            except UnicodeEncodeError:  # a character outside GPT-2's byte alphabet: not a byte-level BPE
                return None
    # Byte tokens are 0..255 and every merge line k makes token 256 + k: then tiktoken's rank order is
    # the merge order, and every token of the BPE is a byte or a merge result.
    if len(ranks) != n_bpe or any(ranks.get(bytes([b]), n_bpe) >= 256 for b in range(256)):
        return None
    for k, (a, b) in enumerate(merges):
        if vocab.get(a + b) != 256 + k:
            return None
    return tiktoken_from_ranks(ranks)


def tiktoken_from_ranks(ranks: Dict[bytes, int]) -> Optional[TiktokenBPE]:
    """The tiktoken BPE of ranks already checked by ``tiktoken_piece_encoder`` (e.g. cached ones)."""
    if os.environ.get("MEGATRON_NO_TIKTOKEN", "0") not in ("", "0"):
        return None
    try:
        from tiktoken.core import Encoding
    except ImportError:
        return None
    enc = Encoding("gpt2-offline", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={})
    core = getattr(enc, "_core_bpe", None)
    single = getattr(core, "encode_single_piece", None)  # bytes -> ids, straight into the compiled BPE
    if single is None:
        single = getattr(enc, "_encode_single_piece", None)  # the same through tiktoken's Python wrapper
    return None if single is None else TiktokenBPE(single, ranks)


def single_token_pieces(ranks: Dict[bytes, int]) -> Tuple[List[str], List[int]]:
    """The BPE tokens of ``TiktokenBPE.ranks`` as text (those whose bytes are valid UTF-8), with their ids.

    A piece equal to a token is that one token under tiktoken's rule (it returns the token directly), so
    these can seed the piece cache when ``TiktokenBPE.encode`` encodes the other pieces.
    """
    texts, ids = [], []
    for token, i in ranks.items():
        try:
            texts.append(token.decode("utf-8"))
        except UnicodeDecodeError:
            continue
        ids.append(i)
    return texts, ids


def read_merges(merge_file: str) -> List[Tuple[str, str]]:
    """The merge pairs of a GPT-2 ``merges.txt``, in order (the ``#version`` header skipped)."""
    with open(merge_file, encoding="utf-8") as f:
        lines = f.read().split("\n")
    return [tuple(line.rstrip("\r").split(" ", 1)) for line in lines  # type: ignore[misc]
            if line.strip() and not line.startswith("#version")]


_LEN_MUL = 0x100000001B3  # the length term of the piece hashes
# Longer pieces are never cached: each occurrence is BPE-encoded. Strings that make polynomial hashes modulo
# 2**64 collide whatever the base (Thue-Morse sequences) need lengths around a thousand; natural text has
# hardly any piece this long.
MAX_CACHED_PIECE = 64


def _inverse_mod_2_64(p: int) -> int:
    return pow(p, -1, 1 << 64)


class _Powers:
    """P**j and P**-j modulo 2**64 for j < n, grown on demand by at least a quarter (so rarely)."""

    def __init__(self, p: np.uint64):
        self.p = p
        self.inv = np.uint64(_inverse_mod_2_64(int(p)))
        self.pow = np.ones(1, dtype=np.uint64)
        self.ipow = np.ones(1, dtype=np.uint64)

    def reserve(self, n: int) -> None:
        """Tables for j < n now, from the on-disk cache (``gpt2_cache.powers``)."""
        if self.pow.size < n:
            from megatron.core.tokenizer import gpt2_cache

            self.pow, self.ipow = gpt2_cache.powers(int(self.p), int(self.inv), n)

    def get(self, n: int) -> Tuple[np.ndarray, np.ndarray]:
        if self.pow.size < n:
            m = max(n, self.pow.size + self.pow.size // 4)
            with np.errstate(over="ignore"):
                self.pow = np.full(m, self.p, dtype=np.uint64)
                self.pow[0] = 1
                np.cumprod(self.pow, out=self.pow)
                self.ipow = np.full(m, self.inv, dtype=np.uint64)
                self.ipow[0] = 1
                np.cumprod(self.ipow, out=self.ipow)
        return self.pow[:n], self.ipow[:n]


def _piece_hashes(cp64: np.ndarray, starts: np.ndarray, ends: np.ndarray, powers: _Powers) -> np.ndarray:
    """Position-independent polynomial hash of every piece (uint64, wrapping arithmetic): sum over the piece
    of cp * P**(position in the piece), plus a multiple of its length, from one prefix sum over the batch."""
    n = cp64.size
    pw, ipw = powers.get(n + 1)
    with np.errstate(over="ignore"):
        pref = np.empty(n + 1, dtype=np.uint64)
        pref[0] = 0
        np.multiply(cp64, pw[:n], out=pref[1:])
        np.cumsum(pref[1:], out=pref[1:])
        h = pref[ends]
        h -= pref[starts]
        h *= ipw[starts]  # [pieces]
        h += (ends - starts).astype(np.uint64) * np.uint64(_LEN_MUL)
        return h


class _HashTable:
    """Open-addressing hash table (linear probing) from nonzero uint64 keys to int64 rows, vectorised."""

    _MIX = np.uint64(0xFF51AFD7ED558CCD)

    def __init__(self, bits: int = 16):
        self.bits = bits
        self.keys = np.zeros(1 << bits, dtype=np.uint64)  # 0 = empty
        self.rows = np.zeros(1 << bits, dtype=np.int64)
        self.count = 0

    def _slots(self, keys: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return ((keys * self._MIX) >> np.uint64(64 - self.bits)).astype(np.int64)

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Row of every key, -1 where absent."""
        mask = (1 << self.bits) - 1
        slot = self._slots(keys)
        # First probe for every key on whole arrays (most keys end here), then only the ones still probing.
        tk = self.keys[slot]
        hit = tk == keys
        out = self.rows[slot]
        out[~hit] = -1
        go_on = ~hit & (tk != 0)
        active = np.flatnonzero(go_on)
        slot = (slot[active] + 1) & mask
        while active.size:
            tk = self.keys[slot]
            want = keys[active]
            hit = tk == want
            out[active[hit]] = self.rows[slot[hit]]
            go_on = ~(hit | (tk == 0))
            active, slot = active[go_on], (slot[go_on] + 1) & mask
        return out

    def insert(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Insert distinct keys that are not in the table yet."""
        if 2 * (self.count + keys.size) > (1 << self.bits):
            old_keys, old_rows = self.keys[self.keys != 0], self.rows[self.keys != 0]
            while 2 * (self.count + keys.size) > (1 << self.bits):
                self.bits += 1
            self.keys = np.zeros(1 << self.bits, dtype=np.uint64)
            self.rows = np.zeros(1 << self.bits, dtype=np.int64)
            self.count = 0
            self.insert(old_keys, old_rows)
        mask = (1 << self.bits) - 1
        slot = self._slots(keys)
        while keys.size:
            free = self.keys[slot] == 0
            # among keys aiming at the same free slot, the first one takes it
            cand = np.flatnonzero(free)
            _, first = np.unique(slot[cand], return_index=True)
            take = cand[first]
            self.keys[slot[take]] = keys[take]
            self.rows[slot[take]] = rows[take]
            self.count += take.size
            rest = np.ones(keys.size, dtype=bool)
            rest[take] = False
            keys, rows, slot = keys[rest], rows[rest], slot[rest]
            moved = self.keys[slot] != 0
            slot[moved] = (slot[moved] + 1) & mask


def _append(arr: np.ndarray, used: int, values: np.ndarray) -> np.ndarray:
    """Write ``values`` after the first ``used`` entries of ``arr``, doubling its capacity when needed."""
    need = used + values.size
    if need > arr.size:
        grown = np.empty(max(need, 2 * arr.size, 1024), dtype=arr.dtype)
        grown[:used] = arr[:used]
        arr = grown
    arr[used:need] = values
    return arr


class FastGPT2Encoder:
    """Exact GPT-2 ids for many texts at once, without a per-piece Python loop.

    Pieces are found with ``piece_starts``; each piece is identified by two 64-bit polynomial hashes of
    its code points; a hash table maps known pieces to their ids, and unseen pieces (the only ones ever
    turned into Python strings) are encoded by ``piece_encoder`` (UTF-8 bytes -> ids; see
    ``tiktoken_piece_encoder``) when given, else by the BPE model of ``bpe`` (a ``tokenizers.Tokenizer`` with
    the GPT-2 BPE model, or a function returning one, called when first needed) after mapping their bytes
    to GPT-2's byte alphabet. A batch whose hashes collide
    (never seen in practice) is encoded by the ``fallback`` tokenizer instead, so results are always exact.
    """

    def __init__(self, bpe, fallback, max_cache_tokens: int = 8_000_000,
                 piece_encoder: Optional[Callable[[bytes], List[int]]] = None):
        self._bpe = bpe
        self._model = None  # the BPE model alone (no pre-tokenizer, no offsets bookkeeping), on first use
        self._piece_encoder = piece_encoder
        self._byte_chars = byte_to_char_table()
        self._fallback = fallback
        self._max_cache_tokens = max_cache_tokens
        from megatron.core.tokenizer.gpt2_cache import hash_bases

        self._p1, self._p2 = hash_bases()  # secret random odd bases (see hash_bases)
        self._pw1, self._pw2 = _Powers(np.uint64(self._p1)), _Powers(np.uint64(self._p2))
        self._seed: Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]] = None
        self.timings: Optional[Dict[str, float]] = None  # set to {} to collect CPU seconds per stage (bench)
        from megatron.core.tokenizer import gpt2_native

        self._native = gpt2_native.load()  # the C hash-and-probe loop, or None (NumPy)
        self._reset()

    def _tick(self, stage: str, t0: float) -> float:
        """Add the CPU time since ``t0`` to ``timings[stage]`` when collecting; returns the time now."""
        if self.timings is None:
            return 0.0
        t = time.process_time()
        self.timings[stage] = self.timings.get(stage, 0.0) + t - t0
        return t

    def _reset(self) -> None:
        self._table = _HashTable()
        # Per cache row: second hash, offset and number of its ids in _ids. Arrays grow by doubling; only
        # the first _nrows rows and _nids ids are in use.
        self._k2 = np.zeros(0, dtype=np.uint64)
        self._off = np.zeros(0, dtype=np.int64)
        self._len = np.zeros(0, dtype=np.int64)
        self._ids = np.zeros(0, dtype=np.int64)
        self._nrows = self._nids = 0
        if self._seed is not None:  # seeded pieces survive cache resets
            k1, k2, ids = self._seed
            self._table.insert(k1, np.arange(k1.size, dtype=np.int64))
            self._k2, self._ids = k2.copy(), ids.copy()
            self._off, self._len = np.arange(k1.size, dtype=np.int64), np.ones(k1.size, dtype=np.int64)
            self._nrows = self._nids = k1.size

    def reserve(self, max_chars: int) -> None:
        """Build the hashing tables for batches of up to ``max_chars`` code points now (e.g. before forking
        workers, which then share them) instead of on the first large batch."""
        self._pw1.reserve(max_chars + 1)
        self._pw2.reserve(max_chars + 1)

    def seed_single_tokens(self, texts: Sequence[str], ids: Sequence[int]) -> int:
        """Enter strings known to encode to one id each (``single_token_pieces``) into the piece cache, before
        any encoding. Strings that are not exactly one GPT-2 piece, and any whose hash is shared, are left
        out. Returns the number entered."""
        keep = [k for k, t in enumerate(texts) if t]
        texts, ids_arr = [texts[k] for k in keep], np.asarray(ids, dtype=np.int64)[keep]
        tlen = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))  # [tokens]
        tstart = np.zeros(len(texts) + 1, dtype=np.int64)
        np.cumsum(tlen, out=tstart[1:])
        n = int(tstart[-1])
        cp = np.frombuffer("".join(texts).encode("utf-32-le"), dtype=np.uint32)  # [n]
        text_start = np.zeros(n, dtype=bool)
        text_start[tstart[:-1]] = True
        one_piece = np.diff(np.searchsorted(piece_starts(cp, text_start), tstart)) == 1  # [tokens]
        cp64 = cp.astype(np.uint64)
        k1 = _piece_hashes(cp64, tstart[:-1], tstart[1:], self._pw1)
        k1[k1 == 0] = 1
        k2 = _piece_hashes(cp64, tstart[:-1], tstart[1:], self._pw2)
        _, inv, counts = np.unique(k1, return_inverse=True, return_counts=True)
        sel = one_piece & (counts[inv] == 1) & (tlen <= MAX_CACHED_PIECE)
        self.set_seed(np.stack([k1[sel], k2[sel], ids_arr[sel].astype(np.uint64)]))
        return int(sel.sum())

    @property
    def seed(self) -> Optional[np.ndarray]:
        """uint64[3, m]: the two hashes and the id of every seeded piece (to cache; see ``set_seed``)."""
        if self._seed is None:
            return None
        k1, k2, ids = self._seed
        return np.stack([k1, k2, ids.astype(np.uint64)])

    def set_seed(self, seed: np.ndarray) -> None:
        """Install seeded pieces computed earlier by ``seed_single_tokens`` (``seed`` property)."""
        self._seed = (np.array(seed[0]), np.array(seed[1]), np.asarray(seed[2]).astype(np.int64))
        self._reset()

    def encode_batch_flat(self, texts: Sequence[str]) -> Tuple[np.ndarray, np.ndarray]:
        """(ids of all texts back to back (int64), number of ids of each text (int64))."""
        if not texts:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        t0 = time.process_time() if self.timings is not None else 0.0
        tlen = np.fromiter((len(t) for t in texts), dtype=np.int64, count=len(texts))
        tstart = np.zeros(len(texts) + 1, dtype=np.int64)
        np.cumsum(tlen, out=tstart[1:])
        n = int(tstart[-1])
        big = "".join(texts)
        cp = np.frombuffer(big.encode("utf-32-le"), dtype=np.uint32)  # [n]
        text_start = np.zeros(n + 1, dtype=bool)
        text_start[tstart[:-1]] = True
        text_start = text_start[:n]
        starts = piece_starts(cp, text_start)  # [pieces]
        ends = np.empty_like(starts)
        ends[:-1] = starts[1:]
        if ends.size:
            ends[-1] = n
        t0 = self._tick("pre-tokenise (code points, classes, piece starts)", t0)
        if self._native is not None:  # hashes and table probes in one C pass (same values)
            from megatron.core.tokenizer.gpt2_native import hash_find

            tb = self._table
            k1, k2, found_rows, bad = hash_find(self._native, cp, starts, ends, self._p1, self._p2, _LEN_MUL,
                                                int(tb._MIX), tb.keys, tb.rows, self._k2, tb.bits)
            t0 = self._tick("hash and look up pieces (C)", t0)
            row = None if bad else self._lookup(big, starts, ends, k1, k2, found_rows)
        else:
            cp64 = cp.astype(np.uint64)
            k1 = _piece_hashes(cp64, starts, ends, self._pw1)
            k1[k1 == 0] = 1  # 0 marks empty slots of the table (k2 still tells such pieces apart)
            k2 = _piece_hashes(cp64, starts, ends, self._pw2)
            t0 = self._tick("hash pieces", t0)
            row = self._lookup(big, starts, ends, k1, k2)
        t0 = self._tick("look up pieces (new ones: see BPE)", t0)
        if row is None:  # a hash collision: take the slow exact path for this batch
            lists = self._fallback.tokenize_batch(list(texts))
            lens = np.array([len(x) for x in lists], dtype=np.int64)
            flat = np.fromiter((i for x in lists for i in x), dtype=np.int64, count=int(lens.sum()))
            return flat, lens
        plen = self._len[row]  # ids per piece occurrence
        pcum = np.zeros(plen.size + 1, dtype=np.int64)
        np.cumsum(plen, out=pcum[1:])
        if self._native is not None:
            from megatron.core.tokenizer.gpt2_native import gather_ids

            flat = gather_ids(self._native, row, int(pcum[-1]), self._off, self._len, self._ids)
        else:
            gather = np.repeat(self._off[row] - pcum[:-1], plen) + np.arange(int(pcum[-1]), dtype=np.int64)
            flat = self._ids[gather]
        first_piece = np.searchsorted(starts, tstart)  # [texts + 1]
        self._tick("gather ids", t0)
        return flat, pcum[first_piece[1:]] - pcum[first_piece[:-1]]

    def _lookup(self, big, starts, ends, k1, k2, row=None) -> Optional[np.ndarray]:
        """Cache row of every piece occurrence, adding unseen pieces; None on a hash collision. ``row``: the
        rows already found (-1 where absent), collisions checked, by the C loop."""
        if row is None:
            row = self._table.find(k1)
            found = row >= 0
            if self._k2.size and np.any((self._k2[row] != k2) & found):  # (row -1 reads a masked row)
                return None
        else:
            found = row >= 0
        long = (ends - starts) > MAX_CACHED_PIECE  # [pieces] never looked up, never entered
        if long.any():
            found = found & ~long
            row = np.where(long, -1, row)
        if found.all():
            return row
        miss = np.flatnonzero(~found)
        long_miss = miss[long[miss]]  # every occurrence is encoded
        miss = miss[~long[miss]]
        uk, first, inv = np.unique(k1[miss], return_index=True, return_inverse=True)
        first = miss[first]  # an occurrence of every unseen piece
        if np.any(k2[miss] != k2[first][inv]):
            return None
        if self._nids > self._max_cache_tokens:
            self._reset()
            return self._lookup(big, starts, ends, k1, k2)  # probes the fresh table again
        t0 = time.process_time() if self.timings is not None else 0.0
        first = np.concatenate([first, long_miss])  # what gets BPE-encoded: new short pieces, long pieces
        s, e = starts[first].tolist(), ends[first].tolist()
        if self._piece_encoder is not None:  # compiled BPE on the UTF-8 bytes of each new piece
            enc = self._piece_encoder
            per_piece = [enc(big[a:b].encode("utf-8")) for a, b in zip(s, e)]
            new_len = np.fromiter(map(len, per_piece), dtype=np.int64, count=len(per_piece))
            new_ids = np.fromiter(itertools.chain.from_iterable(per_piece), dtype=np.int64, count=int(new_len.sum()))
        else:  # the Hugging Face BPE model on each new piece, written in GPT-2's byte-to-character alphabet
            if self._model is None:
                self._model = (self._bpe() if callable(self._bpe) else self._bpe).model
            table, model = self._byte_chars, self._model
            per_piece = [model.tokenize(big[a:b].encode("utf-8").decode("latin-1").translate(table))
                         for a, b in zip(s, e)]
            new_len = np.fromiter(map(len, per_piece), dtype=np.int64, count=len(per_piece))
            new_ids = np.fromiter((t.id for toks in per_piece for t in toks), dtype=np.int64,
                                  count=int(new_len.sum()))
        t1 = self._tick("BPE of new pieces", t0)
        if self.timings is not None:  # not part of the lookup stage
            self.timings["look up pieces (new ones: see BPE)"] = \
                self.timings.get("look up pieces (new ones: see BPE)", 0.0) - (t1 - t0)
            self.timings["new pieces"] = self.timings.get("new pieces", 0) + len(s)
        r0, i0 = self._nrows, self._nids
        new_off = i0 + np.concatenate([[0], np.cumsum(new_len)[:-1]]).astype(np.int64)
        new_rows = r0 + np.arange(first.size, dtype=np.int64)
        self._table.insert(uk, new_rows[: uk.size])  # long pieces get rows but stay out of the table
        self._k2 = _append(self._k2, r0, k2[first])
        self._off = _append(self._off, r0, new_off)
        self._len = _append(self._len, r0, new_len)
        self._ids = _append(self._ids, i0, new_ids)
        self._nrows, self._nids = r0 + first.size, i0 + new_ids.size
        row[miss] = new_rows[inv]
        row[long_miss] = new_rows[uk.size:]
        return row
