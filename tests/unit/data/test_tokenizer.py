"""Tokenizers: GPT-2 ids equal an independent pure-Python GPT-2 BPE on real text; BERT and HF basics."""

import gzip
import json
import os

import pytest

from megatron.core.tokenizer import build_tokenizer
from tests.conftest import ROOT
from tests.unit.data.reference_bpe import ReferenceGPT2BPE
from tests.unit.data.shared_files import shared_file

# the bundled GPT-2 files (byte-identical to ../shared/data/gpt2/, see data/README.md)
GPT2_VOCAB = os.path.join(ROOT, "data", "gpt2-vocab.json")
GPT2_MERGES = os.path.join(ROOT, "data", "gpt2-merges.txt")


def _real_texts(n=60):
    texts = []
    with gzip.open(shared_file("corpus", "prose.jsonl.gz"), "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i % 250 == 0:
                texts.append(json.loads(line)["text"][:3000])
            if len(texts) >= n:
                break
    texts += [
        "  leading spaces, trailing   \n\n\t tabs\r\n and CRLF  ",
        "Unicode: café naïve façade — “quotes” 日本語 🙂 emoji; numbers 3.14159 1,000,000",
        "I'm you're they've he'll she'd it's 'quoted' O'Neil's",
        "",
    ]
    return texts


def test_gpt2_matches_reference_bpe_on_real_text():
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=GPT2_VOCAB, merge_file=GPT2_MERGES)
    ref = ReferenceGPT2BPE(GPT2_VOCAB, GPT2_MERGES)
    assert tok.vocab_size == 50257 and tok.eod == 50256
    texts = _real_texts()
    batch = tok.tokenize_batch(texts)
    total = 0
    for text, got in zip(texts, batch):
        want = ref.encode(text)
        assert tok.tokenize(text) == want
        assert got == want
        assert tok.detokenize(got) == text
        total += len(want)
    assert total > 10000  # the comparison really covered a lot of real prose


def test_bert_wordpiece():
    vocab = shared_file("bert", "vocab.txt")
    low = build_tokenizer("BertWordPieceLowerCase", vocab_file=vocab)
    assert low.vocab_size == 30524  # 30,522 + [BOS] + [EOS], as Megatron-LM
    assert low.eod == 30523
    ids = low.tokenize("Hello World, Café unaffable!")
    # bert-base-uncased: hello=7592 world=2088 ,=1010 cafe=7668 un ##aff ##able !
    assert ids == [7592, 2088, 1010, 7668, 14477, 20961, 3468, 999]
    assert low.detokenize(ids) == "hello world, cafe unaffable!"
    case = build_tokenizer("BertWordPieceCase", vocab_file=vocab)
    assert case.tokenize("Hello") != low.tokenize("Hello")  # no lower-casing: 'Hello' is split or [UNK]
    assert case.tokenize_batch(["a b", "c"]) == [case.tokenize("a b"), case.tokenize("c")]


def test_huggingface_tokenizer_json(tmp_path):
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=GPT2_VOCAB, merge_file=GPT2_MERGES)
    path = tmp_path / "tokenizer.json"
    gpt2._tok.save(str(path))
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    text = "The HF path reads tokenizer.json files."
    assert hf.tokenize(text) == gpt2.tokenize(text)
    assert hf.eod == 50256


def test_bad_tokenizer_arguments(tmp_path):
    with pytest.raises(ValueError, match="--tokenizer-type"):
        build_tokenizer("NoSuchTokenizer")
    with pytest.raises(ValueError, match="--merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=GPT2_VOCAB)
    with pytest.raises(ValueError, match="--vocab-file"):
        build_tokenizer("BertWordPieceCase", vocab_file=str(tmp_path / "missing.txt"))


def test_fast_gpt2_pieces_equal_the_regex():
    """The vectorised pre-tokenisation equals GPT-2's regular expression (real text and random strings)."""
    import random

    from megatron.core.tokenizer.gpt2_fast import split_pieces

    pattern = ReferenceGPT2BPE.PATTERN
    for text in _real_texts(30):
        assert split_pieces(text) == pattern.findall(text)
    alphabet = ["a", "b", "s", "t", "r", "e", "l", "v", "d", "m", "'", " ", "  ", "\n", "\t", "\r\n", "1", "²", ".",
                "!", "é", "日", "\u00a0", "\u2003", "ll", "re", "ve", " '", "'s", "🙂"]
    rng = random.Random(0)
    for _ in range(3000):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        assert split_pieces(s) == pattern.findall(s), repr(s)


def test_fast_gpt2_batch_equals_reference_across_text_boundaries():
    """Batched ids (texts back to back) never let a piece or a rule cross from one text to the next."""
    import random

    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=GPT2_VOCAB, merge_file=GPT2_MERGES)
    ref = ReferenceGPT2BPE(GPT2_VOCAB, GPT2_MERGES)
    rng = random.Random(1)
    pieces = ["'", "s", "re", " ", "  ", "\n", "word", "ll", "7", ".", "ve", "é"]
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 6))) for _ in range(400)]
    texts += _real_texts(10)
    for _ in range(2):  # the second pass is served from the piece cache
        flat, lens = tok.tokenize_batch_flat(texts)
        want = [ref.encode(t) for t in texts]
        assert lens.tolist() == [len(w) for w in want]
        assert flat.tolist() == [i for w in want for i in w]


def _gpt2_files():
    from megatron.core.tokenizer.gpt2_fast import read_merges

    with open(GPT2_VOCAB, encoding="utf-8") as f:
        return json.load(f), read_merges(GPT2_MERGES)


def test_tiktoken_bpe_equals_the_merges_bpe(monkeypatch):
    """tiktoken's rule (lowest-id merge) gives GPT-2's ids (merges.txt order) on every vocabulary token and on
    adversarial pieces: random concatenations of whole and cut tokens, where the two rules could part."""
    import random

    pytest.importorskip("tiktoken")
    monkeypatch.delenv("MEGATRON_NO_TIKTOKEN", raising=False)
    from megatron.core.tokenizer.gpt2_fast import byte_to_char_table, tiktoken_piece_encoder

    vocab, merges = _gpt2_files()
    tk = tiktoken_piece_encoder(vocab, merges)
    assert tk is not None and len(tk.ranks) == 50256
    model = build_tokenizer("GPT2BPETokenizer", vocab_file=GPT2_VOCAB, merge_file=GPT2_MERGES)._tok.model
    table = byte_to_char_table()

    def hf(piece: bytes):
        return [t.id for t in model.tokenize(piece.decode("latin-1").translate(table))]

    for token in tk.ranks:
        assert tk.encode(token) == hf(token), token
    rng = random.Random(0)
    tokens = [t for t in tk.ranks if len(t) > 1]
    for trial in range(20000):
        parts = [rng.choice(tokens) for _ in range(rng.randint(2, 6))]
        if trial % 2:
            parts = [p[rng.randint(0, len(p) - 1):] for p in parts]
        piece = b"".join(parts)
        assert tk.encode(piece) == hf(piece), piece


def test_tiktoken_refused_when_the_files_disagree_with_its_rule(monkeypatch):
    pytest.importorskip("tiktoken")
    monkeypatch.delenv("MEGATRON_NO_TIKTOKEN", raising=False)
    from megatron.core.tokenizer.gpt2_fast import tiktoken_piece_encoder

    vocab, merges = _gpt2_files()
    swapped = list(merges)
    swapped[10], swapped[11] = swapped[11], swapped[10]  # merge order no longer the id order
    assert tiktoken_piece_encoder(vocab, swapped) is None
    assert tiktoken_piece_encoder(vocab, merges[:100] + merges[101:]) is None  # a token no merge makes
    monkeypatch.setenv("MEGATRON_NO_TIKTOKEN", "1")
    assert tiktoken_piece_encoder(vocab, merges) is None


def test_bulk_encoder_same_ids_with_and_without_tiktoken(monkeypatch):
    """Bulk ids (piece cache seeded from the vocabulary, new pieces by tiktoken) equal the Hugging Face
    path and the independent reference on real and edge-case text."""
    pytest.importorskip("tiktoken")
    texts = _real_texts(40) + ["<|endoftext|> stays text", "\u00a0\u2003 x", "a" * 3000, "😀" * 50, "'S 'LL 'Re"]
    ref = ReferenceGPT2BPE(GPT2_VOCAB, GPT2_MERGES)
    want = [ref.encode(t) for t in texts]
    for flag, uses in (("0", True), ("1", False)):
        monkeypatch.setenv("MEGATRON_NO_TIKTOKEN", flag)
        tok = build_tokenizer("GPT2BPETokenizer", vocab_file=GPT2_VOCAB, merge_file=GPT2_MERGES)
        assert tok.uses_tiktoken is uses
        if uses:
            assert tok._fast._seed[0].size > 40000  # most tokens are one GPT-2 piece and seed the cache
        for _ in range(2):
            flat, lens = tok.tokenize_batch_flat(texts)
            assert lens.tolist() == [len(w) for w in want]
            assert flat.tolist() == [i for w in want for i in w]


def test_c_loops_equal_the_numpy_path():
    """The C hash-and-probe and gather loops give the NumPy path's hashes, rows and ids (when a compiler exists)."""
    import random

    import numpy as np

    from megatron.core.tokenizer import gpt2_fast, gpt2_native

    lib = gpt2_native.load()
    if lib is None:
        pytest.skip("no C compiler (or MEGATRON_NO_C_HELPERS=1): the NumPy path is the only one")
    rng = random.Random(3)
    alphabet = ["a", "b", " the", "'s", " ", "\n\n", "1", "é", "日本", "🙂", ".", "word", "  x"]
    texts = _real_texts(20) + ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(300)]
    outs = []
    for native in (True, False):
        tok = build_tokenizer("GPT2BPETokenizer", vocab_file=GPT2_VOCAB, merge_file=GPT2_MERGES)
        tok.tokenize_batch_flat([])
        if not native:
            tok._fast._native = None
        outs.append([tok.tokenize_batch_flat(texts[i::3]) for i in range(3)] +
                    [tok.tokenize_batch_flat(texts)])  # the last batch is served from the cache
    for (fa, la), (fb, lb) in zip(*outs):
        assert np.array_equal(fa, fb) and np.array_equal(la, lb)
    # the hashes themselves, and the rows found in a table holding some of the pieces
    big = "".join(texts)
    cp = np.frombuffer(big.encode("utf-32-le"), dtype=np.uint32)
    ts = np.zeros(cp.size, dtype=bool)
    ts[0] = True
    starts = gpt2_fast.piece_starts(cp, ts)
    ends = np.append(starts[1:], cp.size)
    enc = gpt2_fast.FastGPT2Encoder(None, None)
    cp64 = cp.astype(np.uint64)
    k1 = gpt2_fast._piece_hashes(cp64, starts, ends, enc._pw1)
    k1[k1 == 0] = 1
    k2 = gpt2_fast._piece_hashes(cp64, starts, ends, enc._pw2)
    keys = np.unique(k1)[::2]
    table = gpt2_fast._HashTable()
    table.insert(keys, np.arange(keys.size))
    row_k2 = np.zeros(keys.size, dtype=np.uint64)
    row_k2[table.find(k1)[table.find(k1) >= 0]] = k2[table.find(k1) >= 0]
    c1, c2, rows, bad = gpt2_native.hash_find(lib, cp, starts, ends, enc._p1, enc._p2,
                                              gpt2_fast._LEN_MUL, int(table._MIX), table.keys, table.rows, row_k2,
                                              table.bits)
    assert np.array_equal(c1, k1) and np.array_equal(c2, k2) and bad == 0
    assert np.array_equal(rows, table.find(k1)) and (rows >= 0).any() and (rows < 0).any()
    row_k2[0] += 1  # a stored second hash that differs: reported as a collision
    assert gpt2_native.hash_find(lib, cp, starts, ends, enc._p1, enc._p2, gpt2_fast._LEN_MUL,
                                 int(table._MIX), table.keys, table.rows, row_k2, table.bits)[3] > 0


def test_bulk_encoder_cache_reset_keeps_ids_exact():
    """A piece cache over its size limit starts again from the seeded vocabulary; ids stay exact."""
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=GPT2_VOCAB, merge_file=GPT2_MERGES)
    texts = _real_texts(40)
    tok.tokenize_batch_flat(texts[:5])
    tok._fast._max_cache_tokens = tok._fast._nids + 300  # a few batches in, the cache is reset
    sizes = []
    for k in range(0, len(texts), 5):
        flat, lens = tok.tokenize_batch_flat(texts[k:k + 5])
        assert flat.tolist() == [i for t in texts[k:k + 5] for i in tok.tokenize(t)]
        assert lens.tolist() == [len(tok.tokenize(t)) for t in texts[k:k + 5]]
        sizes.append(tok._fast._nids)
    assert any(b < a for a, b in zip(sizes, sizes[1:]))  # it was reset at least once


def test_bulk_encoder_exact_on_hash_colliding_pieces():
    """Thue-Morse strings make polynomial hashes modulo 2**64 collide for every base; such long pieces are never
    cached, so a piece never takes another's ids. Long pieces repeated within and across batches stay exact."""
    swap = str.maketrans("ab", "ba")
    a = "a"
    for _ in range(11):
        a += a.translate(swap)  # 2,048 letters: one GPT-2 piece
    b = a.translate(swap)
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=GPT2_VOCAB, merge_file=GPT2_MERGES)
    texts = [a, b, "x" * 100 + " " + "y" * 65, "x" * 100, a[:64], a[:65], a[:64]]
    for _ in range(2):
        flat, lens = tok.tokenize_batch_flat(texts)
        assert lens.tolist() == [len(tok.tokenize(t)) for t in texts]
        assert flat.tolist() == [i for t in texts for i in tok.tokenize(t)]


def test_bert_wordpiece_equals_reference_on_real_and_edge_text():
    """Ids equal an independent restatement of Megatron-LM's BERT tokenizer: real prose, long words (Megatron's
    limit is 200 characters), literal "[EOS]"/"[CLS]" in the text (ordinary text, not special ids), Unicode."""
    from tests.unit.data.reference_wordpiece import ReferenceWordPiece

    vocab = shared_file("bert", "vocab.txt")
    edge = ["hello " + "ab" * 60 + " " + "ab" * 101, "x [EOS] y [BOS] [CLS] [SEP] [MASK] [PAD] [UNK]",
            "İstanbul ǅ ﬁ Ⅻ café NAÏVE", "a\u200bb\u00adc \x00 \ufffd d", "日本語 한국어 ﾊﾝ", "ß ẞ Σ ς", ""]
    texts = _real_texts(25) + edge
    for lower in (True, False):
        ours = build_tokenizer("BertWordPieceLowerCase" if lower else "BertWordPieceCase", vocab_file=vocab)
        ref = ReferenceWordPiece(vocab, lower_case=lower)
        assert ours.vocab_size == len(ref.vocab) == 30524
        for text in texts:
            assert ours.tokenize(text) == ref.tokenize(text), text[:80]
        assert ours.tokenize_batch(texts) == [ref.tokenize(t) for t in texts]
