"""The README's Python API example runs as written (in a scratch directory, on CPU); its custom-reward example is
short and its reward function scores as the text says."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_api_example_runs(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    example = next(b for b in blocks if "hybridflow.train(" in b)
    assert len(example.strip().splitlines()) <= 15
    monkeypatch.chdir(tmp_path)  # runs/ and checkpoints/ go to the scratch directory
    exec(compile(example, "README.md", "exec"), {})
    accuracy, reward = capsys.readouterr().out.split()[-2:]
    assert 0.0 <= float(accuracy) <= 1.0 and 0.0 <= float(reward) <= 1.0
    assert (tmp_path / "runs" / "hybridflow").is_dir()


def test_readme_custom_reward_example_is_short_and_valid():
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    example = next(b for b in blocks if "reward.custom.path=my_reward.py" in b)
    assert len(example.strip().splitlines()) <= 15
    source = re.search(r"<<'EOF'\n(.*?)\nEOF", example, flags=re.S).group(1)
    scope: dict = {}
    exec(source, scope)
    assert [scope["compute_score"]("d", s, "42") for s in ("42", "it is 42.", "7")] == [1.0, 0.5, 0.0]
