"""Models: HF causal LMs from local paths, random-init presets, the built-in tokenizer, value/reward heads."""
