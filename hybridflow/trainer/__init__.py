"""Trainers: the PPO/GRPO fit loop (`ppo.py`), SFT and reward-model trainers, validation, metrics, timing."""
