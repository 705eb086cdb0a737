"""`hybridflow --help` lists every command without importing any command module (no torch: it answers at once)."""

import subprocess
import sys

from hybridflow.cli import COMMANDS


def test_top_level_help_lists_commands_without_importing_torch():
    code = ("import sys\nfrom hybridflow.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('TORCH', 'torch' in sys.modules, any(m.startswith('hybridflow.commands.') and m != "
            "'hybridflow.commands.common' for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert "TORCH False False" in out
    assert all(name in out for name in COMMANDS)


def test_a_command_still_gets_its_own_arguments():
    out = subprocess.run([sys.executable, "-m", "hybridflow.cli", "config", "--help"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "--diff" in out and "{show,validate}" in out
