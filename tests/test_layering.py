"""Arrows point down only: no module imports a package on a higher floor than its own, and
none imports a command-line module (``__main__``: the top of its package, which only parses argv).

The floors, from the ground up: ``kernels`` < ``shared`` < ``robot_sdk`` < ``edged`` < ``cloudd``
< ``soak`` (the top-level harness, which may import anything). Every import counts, at module
level or inside a function; only those under ``if TYPE_CHECKING:`` are allowed to point up
(they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

FLOORS = ("kernels", "shared", "robot_sdk", "edged", "cloudd", "soak")
ROOT = Path(__file__).resolve().parent.parent


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(node: ast.AST) -> list[tuple[int, str]]:
    """(line, imported module) of every import under ``node`` that can run: the bodies of
    ``if TYPE_CHECKING:`` are skipped (their ``else:`` branches are not)."""
    found = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                found += _runtime_imports(ast.Module(body=[other], type_ignores=[]))
            continue
        if isinstance(child, ast.Import):
            found += [(child.lineno, alias.name) for alias in child.names]
        elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
            found.append((child.lineno, child.module))
        found += _runtime_imports(child)
    return found


def imports_of(package: str) -> list[tuple[str, str]]:
    """(``path:line``, imported module) for each runtime import in ``package``'s modules."""
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        found += [(f"{path.relative_to(ROOT)}:{line}", module) for line, module in _runtime_imports(tree)]
    return found


def upward_imports(package: str) -> list[str]:
    """``path:line imports module`` for each runtime import in ``package`` of a higher floor."""
    higher = set(FLOORS[FLOORS.index(package) + 1 :])
    return [f"{where} imports {module}" for where, module in imports_of(package) if module.split(".")[0] in higher]


def test_type_checking_imports_are_skipped_and_function_level_ones_count():
    tree = ast.parse("import a\nif TYPE_CHECKING:\n    import b\nelse:\n    import c\n"
                     "def f():\n    from d.e import g\n")
    assert [module for _, module in _runtime_imports(tree)] == ["a", "c", "d.e"]


@pytest.mark.parametrize("package", FLOORS)
def test_no_import_points_to_a_higher_floor(package):
    found = upward_imports(package)
    assert not found, "imports that point up:\n" + "\n".join(found)


@pytest.mark.parametrize("package", FLOORS)
def test_no_module_imports_a_command_line_module(package):
    found = [f"{where} imports {module}" for where, module in imports_of(package)
             if module.split(".")[-1] == "__main__"]
    assert not found, "imports of a __main__ module:\n" + "\n".join(found)
