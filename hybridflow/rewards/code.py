"""`code` scorer: runs the response's last ```python block in the sandbox against the ground-truth tests.

ground_truth is a dict (or its JSON string) with either `inputs` + `outputs` (stdin → expected stdout, compared
after stripping trailing whitespace) or `test_code` (run after the program, in its globals, by `code_harness.py`;
passes only when the tests run to their end: exiting early, exit code 0, a raised SystemExit or faked output do not
pass). The score is the fraction of tests passed (1.0 = all); `extra_info` may set `timeout_s` and `memory_mb` per
test, which only lower the caps of `reward.sandbox`. Programs run isolated (see `sandbox.py`); where no sandbox
works the scorer refuses unless `reward.sandbox.allow_unisolated=true`.
"""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path
from typing import Any

from hybridflow.rewards.registry import REWARD_FUNCTIONS
from hybridflow.sandbox import SandboxResult, current_config, run_python

_BLOCK = re.compile(r"```(?:python|py)?\n(.*?)```", re.DOTALL)
_HARNESS = Path(__file__).with_name("code_harness.py").read_text()


def extract_code(solution: str) -> str | None:
    blocks = _BLOCK.findall(solution)
    return blocks[-1] if blocks else None


def _same_output(got: str, want: str) -> bool:
    return [line.rstrip() for line in got.strip().splitlines()] == [line.rstrip() for line in want.strip().splitlines()]


@REWARD_FUNCTIONS.register("code")
def code(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict[str, Any]:
    tests = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    if not isinstance(tests, dict):
        raise ValueError(f"code ground_truth must be a dict with inputs/outputs or test_code, got {type(tests)}")
    program = extract_code(solution_str)
    if program is None:
        return {"score": 0.0, "passed": 0, "total": 0}
    limits = {k: (extra_info or {})[k] for k in ("timeout_s", "memory_mb") if k in (extra_info or {})}
    if "test_code" in tests:
        ok = _tests_pass(program, tests["test_code"], limits)
        return {"score": float(ok), "passed": int(ok), "total": 1}
    pairs = list(zip(tests["inputs"], tests["outputs"]))
    passed = 0
    for stdin, want in pairs:
        result = _checked(run_python(program, stdin=stdin, **limits))
        passed += int(result.ok and _same_output(result.stdout, want))
    return {"score": passed / max(1, len(pairs)), "passed": passed, "total": len(pairs)}


def _tests_pass(program: str, test_code: str, limits: dict[str, Any]) -> bool:
    """The harness prints `<nonce> passed` only after the tests returned; the nonce is fresh per run."""
    nonce = secrets.token_hex(16)
    stdin = nonce + "\n" + json.dumps({"program": program, "tests": test_code})
    result = _checked(run_python(_HARNESS, stdin=stdin, **limits))
    return result.ok and f"{nonce} passed" in result.stdout.splitlines()


def _checked(result: SandboxResult) -> SandboxResult:
    """The isolation actually used is part of the result: an unisolated run counts only when it was allowed."""
    if not result.isolated and not current_config().allow_unisolated:
        raise RuntimeError(f"code reward ran in sandbox mode {result.mode!r} (unisolated) while "
                           "reward.sandbox.allow_unisolated=false; install bubblewrap or set it to true")
    return result
