"""An independent pure-Python BERT WordPiece tokenizer: the rules of Megatron-LM's BERT tokenizer restated.

Basic tokenisation (drop NUL, U+FFFD and control characters, map whitespace to spaces, put spaces around
CJK ideographs, split on whitespace; with lower-casing: lower-case, then NFD and drop combining marks;
split off every punctuation character) followed by greedy longest-match WordPiece with ``##``
continuations, a word over 200 characters or without a match becoming [UNK]. Ids are line numbers of
vocab.txt, with [BOS] and [EOS] appended when absent.
"""

import unicodedata


def _is_whitespace(ch):
    return ch in " \t\n\r" or unicodedata.category(ch) == "Zs"


def _is_control(ch):
    return ch not in "\t\n\r" and unicodedata.category(ch) in ("Cc", "Cf")


def _is_punctuation(ch):
    cp = ord(ch)
    return 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126 or \
        unicodedata.category(ch).startswith("P")


def _is_cjk(cp):
    ranges = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
              (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))
    return any(lo <= cp <= hi for lo, hi in ranges)


class ReferenceWordPiece:
    MAX_WORD_CHARS = 200

    def __init__(self, vocab_path, lower_case=True):
        with open(vocab_path, encoding="utf-8") as f:
            tokens = [line.strip() for line in f]
        self.vocab = {}
        for i, t in enumerate(tokens):
            self.vocab[t] = i
        for extra in ("[BOS]", "[EOS]"):
            if extra not in self.vocab:
                self.vocab[extra] = len(self.vocab)
        self.lower_case = lower_case

    def _words(self, text):
        chars = []
        for ch in text:
            cp = ord(ch)
            if cp == 0 or cp == 0xFFFD or _is_control(ch):
                continue
            if _is_whitespace(ch):
                chars.append(" ")
            elif _is_cjk(cp):
                chars.extend((" ", ch, " "))
            else:
                chars.append(ch)
        words = []
        for word in "".join(chars).split():
            if self.lower_case:
                word = "".join(c for c in unicodedata.normalize("NFD", word.lower())
                               if unicodedata.category(c) != "Mn")
            piece = ""
            for ch in word:
                if _is_punctuation(ch):
                    if piece:
                        words.append(piece)
                    words.append(ch)
                    piece = ""
                else:
                    piece += ch
            if piece:
                words.append(piece)
        return words

    def _wordpieces(self, word):
        if len(word) > self.MAX_WORD_CHARS:
            return ["[UNK]"]
        out, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                sub = word[start:end] if start == 0 else "##" + word[start:end]
                if sub in self.vocab:
                    break
                end -= 1
            if end == start:
                return ["[UNK]"]
            out.append(sub)
            start = end
        return out

    def tokenize(self, text):
        return [self.vocab[p] for w in self._words(text) for p in self._wordpieces(w)]
