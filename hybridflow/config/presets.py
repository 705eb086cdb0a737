"""Named algorithm presets (`algorithm.preset`): a list of `a.b=c` overrides applied where the preset is chosen.

Decision: a preset is an overrides list, not a second set of defaults, so the frozen-config loader stays one merge
order. The preset's values replace defaults.yaml and every config file loaded *before* the layer that names it;
values set in that same layer (the same YAML file, or the command line) and in later files win. So
`hybridflow train my.yaml algorithm.preset=robust actor.optim.lr=1e-4` gets the preset with lr 1e-4.
"""

from __future__ import annotations

# `robust`: an lr warm-up, the one model-size-independent change that never hurt in the learning measurements (the
# quickstart's GRPO from 8 warm starts on a Xeon: gains 29.7 / 35.2 / 43.4 with it, 29.3 / 35.2 / 42.2 without). It
# sets no lr: the lr that works depends on the model (1e-4 for the tiny model, 1e-6 to 3e-6 at 1B+), and lr 3e-4 with
# warm-up recovered a weak start LESS than 1e-4 without (docs/benchmarks.md, "Weak-start recovery vs TRL").
ALGORITHM_PRESETS: dict[str, list[str]] = {
    "robust": [
        "actor.optim.lr_warmup_steps=5",  # Adam's first steps are its largest: warm up before the full lr
    ],
}


def preset_overrides(name: str) -> list[str]:
    """The overrides of preset `name`; ValueError naming the key and the valid presets otherwise."""
    if name not in ALGORITHM_PRESETS:
        raise ValueError(f"algorithm.preset={name!r}: no such preset; choose one of "
                         f"{', '.join(sorted(ALGORITHM_PRESETS))} or null")
    return list(ALGORITHM_PRESETS[name])
