"""Zero-shot evaluation of a GPT: WikiText-103 perplexity and LAMBADA last-word accuracy."""
