"""Named algorithm presets (`algorithm.preset`): a list of `a.b=c` overrides applied where the preset is chosen.

Decision: a preset is an overrides list, not a second set of defaults, so the frozen-config loader stays one merge
order. The preset's values replace defaults.yaml and every config file loaded *before* the layer that names it;
values set in that same layer (the same YAML file, or the command line) and in later files win. So
`hybridflow train my.yaml algorithm.preset=robust actor.optim.lr=1e-4` gets the preset with lr 1e-4.
"""

from __future__ import annotations

# `robust`: GRPO that recovers from a weak (blurred) SFT start; measured in benchmarks/learning.py
# (docs/benchmarks.md, "Weak-start recovery vs TRL"; the reasoning per value in docs/tuning.md).
ALGORITHM_PRESETS: dict[str, list[str]] = {
    "robust": [
        "actor.optim.lr_warmup_steps=10",  # Adam's first steps are its largest: warm up before the full lr
        "actor.optim.lr=3.0e-4",
    ],
}


def preset_overrides(name: str) -> list[str]:
    """The overrides of preset `name`; ValueError naming the key and the valid presets otherwise."""
    if name not in ALGORITHM_PRESETS:
        raise ValueError(f"algorithm.preset={name!r}: no such preset; choose one of "
                         f"{', '.join(sorted(ALGORITHM_PRESETS))} or null")
    return list(ALGORITHM_PRESETS[name])
