"""Predictions of a run's GPU memory and step time before it starts (`hybridflow plan`), and the settings that fit."""
