"""Token datasets: the mmapped .bin/.idx format, GPT samples, blending and the pretraining sampler."""
