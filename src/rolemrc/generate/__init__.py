"""The one generation engine (layer 3, above intervene): continuous batching over any transformers causal LM with a
paged KV cache under a budget, chunked prefill, per-slot restraints, sampling, stop strings, seeds, log-probabilities and,
on CUDA, the decode step as graphs. `offline.generate` runs it over a list of prompts; serve's transformers engine
drives it from a scheduler thread."""
