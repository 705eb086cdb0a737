"""tests/conftest.py hands test files out longest first: files with more `slow` tests, then files with more tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# by path: `import conftest` finds whichever directory's conftest this worker imported first
_SPEC = importlib.util.spec_from_file_location("tests_root_conftest", Path(__file__).with_name("conftest.py"))
conftest = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(conftest)


class _Item:
    def __init__(self, nodeid: str, slow: bool = False) -> None:
        self.nodeid, self.slow = nodeid, slow

    def get_closest_marker(self, name: str) -> object | None:
        return object() if name == "slow" and self.slow else None


def test_files_with_slow_tests_come_first_and_tests_keep_their_order_in_a_file() -> None:
    items = [_Item("a.py::t1"), _Item("a.py::t2", slow=True), _Item("b.py::t1"), _Item("b.py::t2"),
             _Item("b.py::t3"), _Item("c.py::t1", slow=True), _Item("c.py::t2", slow=True), _Item("d.py::t1")]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == ["c.py::t1", "c.py::t2", "a.py::t1", "a.py::t2", "b.py::t1", "b.py::t2",
                                         "b.py::t3", "d.py::t1"]
