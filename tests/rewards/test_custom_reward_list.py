"""`reward.custom` as a list of {path, name, weight} from YAML: each function is a source named after it (metrics
`reward/<name>/mean`, as `hybridflow.train(reward_fns=[...])` gives), mixed by the `custom` source's weight times
its own; the single-function form keeps the source name `custom`; bad lists fail at load naming the key."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from hybridflow.config import ConfigError, load_config
from hybridflow.models.tokenizer import builtin_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.rewards import RewardManager

TOK = builtin_tokenizer()
R = 16
EXACT = "def exact(data_source, solution_str, ground_truth, extra_info=None):\n" \
        "    return float(solution_str.strip() == ground_truth)\n"
LENGTH = "def short(data_source, solution_str, ground_truth, extra_info=None):\n" \
         "    return {'score': 1.0 - len(solution_str) / 10, 'chars': len(solution_str)}\n"


def _batch(texts: list[str], truths: list[str]) -> DataProto:
    resp = torch.full((len(texts), R), TOK.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(resp)
    for i, text in enumerate(texts):
        ids = TOK(text, add_special_tokens=False)["input_ids"]
        resp[i, : len(ids)], mask[i, : len(ids)] = torch.tensor(ids), 1
    return DataProto.from_dict({"responses": resp, "response_mask": mask},
                               {"data_source": ["my/task"] * len(texts),
                                "reward_model": [{"ground_truth": t} for t in truths]})


def _files(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "exact.py").write_text(EXACT)
    (tmp_path / "short.py").write_text(LENGTH)
    return tmp_path / "exact.py", tmp_path / "short.py"


def test_a_yaml_list_mixes_functions_as_named_sources(tmp_path: Path) -> None:
    exact, short = _files(tmp_path)
    config = tmp_path / "task.yaml"
    config.write_text(yaml.safe_dump({"reward": {"num_workers": 0, "custom": [
        {"path": str(exact), "name": "exact", "weight": 0.8},
        {"path": str(short), "name": "short", "weight": 0.2}]}}))
    cfg = load_config([config], ["reward.sources=[{name: custom, weight: 0.5}]"]).reward
    texts, truths = ["12", "7", "123456"], ["12", "8", "123456"]
    with RewardManager(cfg, TOK, R) as manager:
        out = manager.score(_batch(texts, truths))
    want_exact, want_short = np.array([1.0, 0.0, 1.0]), np.array([0.8, 0.9, 0.4])
    np.testing.assert_allclose(out.scores, 0.5 * (0.8 * want_exact + 0.2 * want_short), rtol=1e-6)
    m = out.metrics
    assert m["reward/exact/mean"] == pytest.approx(2 / 3) and m["reward/short/mean"] == pytest.approx(0.7)
    assert m["reward/short/chars"] == pytest.approx(3.0)  # a function's extras under its own name
    assert "reward/custom/mean" not in m


def test_the_list_form_from_a_cli_override_and_the_single_form_unchanged(tmp_path: Path) -> None:
    exact, short = _files(tmp_path)
    listed = load_config([], ["reward.num_workers=0",
                              f"reward.custom=[{{path: {exact}, name: exact}}, {{path: {short}, name: short}}]"])
    assert listed.reward.sources[0].name == "custom"  # sources unset: the custom functions are the reward
    assert [f.name for f in listed.reward.custom_functions] == ["exact", "short"]
    with RewardManager(listed.reward, TOK, R) as manager:
        assert manager.sources == [("exact", 1.0), ("short", 1.0)]
        m = manager.score(_batch(["12"], ["12"])).metrics
    assert m["reward/exact/mean"] == 1.0 and m["reward/short/mean"] == pytest.approx(0.8)
    single = load_config([], ["reward.num_workers=0", f"reward.custom.path={exact}", "reward.custom.name=exact"])
    with RewardManager(single.reward, TOK, R) as manager:
        assert manager.sources == [("custom", 1.0)]
        assert manager.score(_batch(["12", "3"], ["12", "4"])).scores.tolist() == [1.0, 0.0]


@pytest.mark.parametrize(("custom", "key"), [
    ("[{path: EXACT, name: exact}, {path: SHORT, name: exact}]", r"reward.custom\[1\].name"),  # same name twice
    ("[{path: EXACT, name: rule}]", r"reward.custom\[0\].name"),  # another source's name
    ("[{path: null, name: exact}]", r"reward.custom\[0\].path"),
    ("[]", "reward.custom"),
])
def test_a_bad_list_names_the_key(tmp_path: Path, custom: str, key: str) -> None:
    exact, short = _files(tmp_path)
    with pytest.raises(ConfigError, match=key):
        load_config([], [f"reward.custom={custom.replace('EXACT', str(exact)).replace('SHORT', str(short))}"])


def test_validate_names_the_list_entry_whose_function_is_missing(tmp_path: Path, capsys) -> None:
    from hybridflow.cli import main

    exact, _ = _files(tmp_path)
    assert main(["config", "validate", f"reward.custom=[{{path: {exact}, name: exact}}, {{path: {exact}, name: nope}}]"]) == 2
    err = capsys.readouterr().err
    assert "reward.custom[1]: reward.custom.name='nope' is not a function" in err and "reward.custom[0]" not in err
