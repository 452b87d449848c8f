"""An independent pure-Python GPT-2 BPE encoder: the reference our tokenizers are tested against."""

import json

import regex


class ReferenceGPT2BPE:
    """Plain re-statement of OpenAI's GPT-2 encoder: regex pre-split, byte->unicode map, rank-ordered merges."""

    PATTERN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

    def __init__(self, vocab_path, merges_path):
        with open(vocab_path, encoding="utf-8") as f:
            self.encoder = json.load(f)
        with open(merges_path, encoding="utf-8") as f:
            lines = f.read().split("\n")[1:-1]
        self.ranks = {tuple(line.split()): i for i, line in enumerate(lines)}
        printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
        mapping, extra = {}, 0
        for b in range(256):
            if b in printable:
                mapping[b] = chr(b)
            else:
                mapping[b] = chr(256 + extra)
                extra += 1
        self.byte_map = mapping
        self.cache = {}

    def _bpe(self, word):
        if word in self.cache:
            return self.cache[word]
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.ranks.get((a, b), float("inf")), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            best_rank = min(p[0] for p in pairs)
            if best_rank == float("inf"):
                break
            i = min(p[1] for p in pairs if p[0] == best_rank)
            first, second = parts[i], parts[i + 1]
            merged, j = [], 0
            while j < len(parts):
                if j < len(parts) - 1 and parts[j] == first and parts[j + 1] == second:
                    merged.append(first + second)
                    j += 2
                else:
                    merged.append(parts[j])
                    j += 1
            parts = merged
        self.cache[word] = parts
        return parts

    def encode(self, text):
        ids = []
        for piece in self.PATTERN.findall(text):
            mapped = "".join(self.byte_map[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[p] for p in self._bpe(mapped))
        return ids
