"""The test scheduler's order (tests/helpers/file_order.py): longest files first, tests inside a
file in their own order, measured seconds over estimates."""

from __future__ import annotations

from dataclasses import dataclass

from helpers.file_order import estimated_seconds, longest_files_first


@dataclass
class Item:  # what the ordering reads of a pytest.Item
    nodeid: str
    slow: bool = False

    def get_closest_marker(self, name: str) -> object | None:
        return object() if (name == "slow" and self.slow) else None


def test_longest_files_first_keeps_each_files_own_order() -> None:
    items = [Item("a.py::t1"), Item("a.py::t2"), Item("b.py::t1", slow=True), Item("c.py::t1"),
             Item("a.py::t3"), Item("c.py::t2")]  # fmt: skip
    # a: 3 x 0.5 = 1.5 s, b: 30 s (slow), c: measured 100 s
    assert estimated_seconds(items, {"c.py": 100.0}) == {"a.py": 1.5, "b.py": 30.0, "c.py": 100.0}
    order = [i.nodeid for i in longest_files_first(items, {"c.py": 100.0})]  # type: ignore[arg-type]
    assert order == ["c.py::t1", "c.py::t2", "b.py::t1", "a.py::t1", "a.py::t2", "a.py::t3"]
    # equal estimates: by path, so every worker collects the same order
    same = [Item("z.py::t"), Item("y.py::t")]
    assert [i.nodeid for i in longest_files_first(same, {})] == ["y.py::t", "z.py::t"]  # type: ignore[arg-type]
