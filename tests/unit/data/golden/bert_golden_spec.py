"""Inputs of the BERT golden file, shared by make_bert_golden.py (Megatron-Core) and the tests (ours).

A synthetic WordPiece vocabulary and sentence-split documents, so the test needs no data from outside
the repository: words ``w*`` optionally followed by continuation pieces ``##p*``, documents of 0 to 11
sentences (empty and one-sentence documents included, one sentence over 512 tokens, some sentences
starting with a continuation piece).
"""

import numpy

SHOW = 6  # samples recorded field by field per split

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
N_WORDS, N_PIECES = 300, 200


def vocab_tokens():
    """Token strings in id order; [BOS] and [EOS] appended last, as Megatron's BERT tokenizer does."""
    return SPECIALS + [f"w{i}" for i in range(N_WORDS)] + [f"##p{i}" for i in range(N_PIECES)] + ["[BOS]", "[EOS]"]


def sentence_documents(name):
    """Documents (lists of sentences, each a list of token ids) of the synthetic dataset ``name``."""
    seed, n_docs = {"S": (11, 140), "T": (12, 90)}[name]
    rs = numpy.random.RandomState(seed)
    first_word, first_piece = len(SPECIALS), len(SPECIALS) + N_WORDS
    docs = []
    for d in range(n_docs):
        sentences = []
        for _ in range(int(rs.randint(0, 12))):
            length = int(rs.randint(1, 90 if rs.random_sample() < 0.2 else 30))
            ids = []
            if rs.random_sample() < 0.1:
                ids.append(int(rs.randint(first_piece, first_piece + N_PIECES)))
            while len(ids) < length:
                ids.append(int(rs.randint(first_word, first_word + N_WORDS)))
                for _ in range(int(rs.choice([0, 0, 1, 2]))):
                    ids.append(int(rs.randint(first_piece, first_piece + N_PIECES)))
            sentences.append(ids[:length])
        if name == "S" and d == 17:
            sentences.append(list(range(first_word, first_word + 20)) * 30)  # a 600-token sentence
        docs.append(sentences)
    return docs


# data_path entries "S", "T" name the synthetic datasets above (replaced by their prefixes).
CONFIGS = {
    "binary_head": dict(data_path=["S"], split="90,8,2", seq_length=64, seed=1234, sizes=[400, 30, 10],
                        binary_head=True, mask_prob=0.15, short_seq_prob=0.1, max_ngram=3, whole_word=True),
    "no_binary_head_single_tokens": dict(data_path=["S"], split="80,20", seq_length=48, seed=7,
                                         sizes=[300, 40, 0], binary_head=False, mask_prob=0.2,
                                         short_seq_prob=0.3, max_ngram=1, whole_word=False),
    "no_binary_head_ngrams": dict(data_path=["T"], split="1", seq_length=96, seed=5, sizes=[150, 0, 0],
                                  binary_head=False, mask_prob=0.15, short_seq_prob=0.1, max_ngram=4,
                                  whole_word=True),
    "weighted_blend": dict(data_path=["0.4", "S", "0.6", "T"], split="90,10,0", seq_length=40, seed=99,
                           sizes=[200, 20, 0], binary_head=True, mask_prob=0.15, short_seq_prob=0.1,
                           max_ngram=3, whole_word=True),
}
