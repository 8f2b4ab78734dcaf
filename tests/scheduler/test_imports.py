"""No import cycle inside a process's package: each module reads without the ones that import it.

Walks every ``import`` of a package's modules with ``ast``, those under ``if TYPE_CHECKING:``
and inside functions included, and fails on a cycle among the package's own modules.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imports_within(package: str) -> dict[str, set[str]]:
    """Each module of ``package`` → the package's modules it imports (``package.a`` for ``from
    package import a``, whether ``a`` is a module or a name in ``package/__init__.py``)."""
    paths = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
        for path in (ROOT / package).rglob("*.py")
    }
    graph = {}
    for module, path in paths.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module)
                imported.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[module] = (imported & paths.keys()) - {module}
    return graph


def cycle_in(package: str) -> list[str] | None:
    """One import cycle among ``package``'s modules (its first module repeated last), or None."""
    try:
        graphlib.TopologicalSorter(imports_within(package)).prepare()
    except graphlib.CycleError as error:
        return error.args[1]
    return None


def test_the_scheduler_package_has_no_import_cycle():
    assert cycle_in("scheduler") is None


def test_the_worker_package_has_no_import_cycle():
    assert cycle_in("worker") is None


def test_a_cycle_under_type_checking_is_found(tmp_path, monkeypatch):
    package = tmp_path / "loop"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from loop.b import B\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from loop import a\n"
    )
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    assert cycle_in("loop") in (["loop.a", "loop.b", "loop.a"], ["loop.b", "loop.a", "loop.b"])


def test_the_hybrid_step_path_imports_nothing_of_disaggregation():
    """The hybrid placement and the interface it implements reach no module of disaggregation,
    directly or through others."""
    graph = imports_within("scheduler")
    reached, todo = set(), ["scheduler.hybrid", "scheduler.placement"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += graph.get(module, ())
    assert not {m for m in reached if m.startswith("scheduler.disaggregation")}, reached
