"""Engine tests use `dist_group` (a 1-rank gloo process group) from tests/conftest.py."""
