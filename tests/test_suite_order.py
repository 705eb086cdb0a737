"""tests/conftest.py hands test files out longest first: files with more `slow` tests, then more `ray` tests, then
more tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# by path: `import conftest` finds whichever directory's conftest this worker imported first
_SPEC = importlib.util.spec_from_file_location("tests_root_conftest", Path(__file__).with_name("conftest.py"))
conftest = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(conftest)


class _Item:
    def __init__(self, nodeid: str, slow: bool = False, ray: bool = False) -> None:
        self.nodeid, self.markers = nodeid, {name for name, on in (("slow", slow), ("ray", ray)) if on}

    def get_closest_marker(self, name: str) -> object | None:
        return object() if name in self.markers else None


def test_files_with_slow_tests_come_first_and_tests_keep_their_order_in_a_file() -> None:
    items = [_Item("a.py::t1"), _Item("a.py::t2", slow=True), _Item("b.py::t1"), _Item("b.py::t2"),
             _Item("b.py::t3"), _Item("c.py::t1", slow=True), _Item("c.py::t2", slow=True), _Item("d.py::t1")]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == ["c.py::t1", "c.py::t2", "a.py::t1", "a.py::t2", "b.py::t1", "b.py::t2",
                                         "b.py::t3", "d.py::t1"]


def test_files_with_ray_tests_come_after_slow_ones_and_before_larger_files_without() -> None:
    items = [_Item("many.py::t1"), _Item("many.py::t2"), _Item("many.py::t3"), _Item("ray.py::t1", ray=True),
             _Item("ray.py::t2"), _Item("slow.py::t1", slow=True, ray=True), _Item("one.py::t1")]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == ["slow.py::t1", "ray.py::t1", "ray.py::t2", "many.py::t1", "many.py::t2",
                                         "many.py::t3", "one.py::t1"]
