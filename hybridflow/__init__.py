"""hybridflow: RL post-training for LLMs in the HybridFlow single-controller style."""
__version__ = "0.1.0"
