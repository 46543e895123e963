"""The import contracts of ``[tool.importlinter]`` in pyproject.toml hold, and would catch a
breach: code outside ``taskhoster/engine/`` uses only the engine's facade
(``taskhoster/engine/__init__.py``), and no module imports in a circle (imports inside
functions count). Two things no import graph shows are checked here by reading the code:
reaching an engine module through the facade (``engine.queues.x``), and reading item or thread
rows through the ORM outside the engine."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "taskhoster"
ENGINE = PACKAGE / "engine"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the package and pyproject.toml found in ``cwd`` (it puts ``cwd``
    first on its path); no cache, so it leaves nothing behind."""
    if not LINT_IMPORTS.exists():
        pytest.fail(f"{LINT_IMPORTS} is missing: install the dev extra (pip install -e '.[dev]')")
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_import_contracts_hold() -> None:
    done = lint_imports(REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Outside code uses only the engine's facade KEPT" in done.stdout
    assert "No module imports in a circle KEPT" in done.stdout


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A throwaway copy of the package and of pyproject.toml, to break the contracts in."""
    shutil.copytree(PACKAGE, tmp_path / "taskhoster", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_a_view_that_imports_an_engine_module_breaks_the_facade_contract(tree: Path) -> None:
    assert (tree / "taskhoster/engine/group.py").exists()
    with (tree / "taskhoster/api/views.py").open("a") as views:
        views.write("\nfrom ..engine.group import Group  # past the facade\n")
    done = lint_imports(tree)
    assert done.returncode != 0, done.stdout
    assert "Outside code uses only the engine's facade BROKEN" in done.stdout
    assert "taskhoster.api.views -> taskhoster.engine.group" in done.stdout
    assert "No module imports in a circle KEPT" in done.stdout


def test_a_circle_through_an_import_inside_a_function_breaks_the_circle_contract(
    tree: Path,
) -> None:
    # status is at the bottom (the engine and health import it); health imports the engine.
    with (tree / "taskhoster/status.py").open("a") as status:
        status.write("\n\ndef _up() -> None:\n    from . import health  # noqa: F401\n")
    done = lint_imports(tree)
    assert done.returncode != 0, done.stdout
    assert "No module imports in a circle BROKEN" in done.stdout
    assert "No cycles are allowed in taskhoster." in done.stdout
    assert "Outside code uses only the engine's facade KEPT" in done.stdout


def parse(path: Path) -> ast.Module:
    """``ast.parse``, again if CPython 3.11 raises its spurious ``SystemError`` "AST
    constructor recursion depth mismatch" (python/cpython#106905: the AST builder's depth
    counter is the interpreter's, and a thread of an earlier test parsing at the same moment
    leaves it off; fixed in later releases). Parsing is pure: a second try is the answer."""
    for attempt in range(3):
        try:
            return ast.parse(path.read_text(), str(path))
        except SystemError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def outside_the_engine() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        if ENGINE in path.parents or "migrations" in path.parts:
            continue
        yield str(path.relative_to(REPO)), parse(path)


def _engine_modules() -> set[str]:
    """The engine's modules, but those whose name the facade gives to something it exports
    (``engine.repair`` is the function ``repair``, not its module)."""
    facade = parse(ENGINE / "__init__.py")
    exported = {
        alias.asname or alias.name
        for node in facade.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }
    return {p.stem for p in ENGINE.glob("*.py") if p.stem != "__init__"} - exported


ENGINE_MODULES = _engine_modules()


def test_outside_code_reaches_no_engine_module_through_the_facade() -> None:
    """``from .. import engine`` then ``engine.queues.x`` passes the import contract (only
    ``taskhoster.engine`` is imported) but uses an engine module all the same."""
    found = []
    for name, tree in outside_the_engine():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "engine"
                and node.attr in ENGINE_MODULES
            ):
                found.append(f"{name}:{node.lineno}: engine.{node.attr}")
    assert not found, "use what taskhoster/engine/__init__.py exports:\n" + "\n".join(found)


ROW_MODELS = {"Item", "Thread"}
MANAGERS = {"objects", "_default_manager", "_base_manager"}
WRITES = {"update", "delete", "create", "bulk_create", "bulk_update", "get_or_create"}
WRITES |= {"update_or_create", "raw"}
READERS_ALLOWED = "taskhoster/admin/"


def _manager(node: ast.AST) -> str | None:
    """``Item`` for ``Item.objects`` (or ``models.Item.objects``, ``Item._base_manager``)."""
    if not isinstance(node, ast.Attribute) or node.attr not in MANAGERS:
        return None
    base = node.value
    model = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
    return model if model in ROW_MODELS else None


def _rooted_at_manager(node: ast.AST) -> str | None:
    """The model whose manager a chain (``Item.objects.filter(...).update``) starts from."""
    while True:
        model = _manager(node)
        if model is not None:
            return model
        if isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Attribute | ast.Subscript):
            node = node.value
        else:
            return None


def test_outside_the_engine_only_the_admin_reads_item_and_thread_rows_and_none_writes_them() -> (
    None
):
    """Item state is the engine's: code outside ``taskhoster/engine/`` learns it from the
    facade (``engine.get_item``, ``engine.item_queue``, ``engine.thread_members``, ...), never
    from ``Item.objects`` or ``Thread.objects``.

    The one exception is the admin (``taskhoster/admin/``), and it only reads: its ModelAdmin
    pages browse the index through the ORM by Django's design (lists, filters, search, the
    detail pages), and the queue pages and the overview count over it. Nothing outside the
    engine writes these rows: the admin's actions go through the engine (``delete_items``,
    ``restart``) and its item and thread pages allow no add, change or delete. (What this
    reading cannot see: a row's ``save()``, and a queryset handed in from elsewhere.)"""
    found = []
    for name, tree in outside_the_engine():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and (model := _manager(node)) is not None
                and not name.startswith(READERS_ALLOWED)
            ):
                found.append(f"{name}:{node.lineno}: reads {model} rows through the ORM")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in WRITES
                and (model := _rooted_at_manager(node.func.value)) is not None
            ):
                found.append(f"{name}:{node.lineno}: writes {model} rows ({node.func.attr})")
    assert not found, "ask the engine (its facade) instead:\n" + "\n".join(found)
