"""The package's shape: the layered import graph without cycles, and a wheel that holds only the library.

The layers themselves are declared once, as import-linter contracts in pyproject.toml (docs/development.md).
"""

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "bdlora_train"


def test_imports_follow_the_layers_declared_in_pyproject():
    """`lint-imports` (import-linter) checks every import statement, function-level ones included."""
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_no_import_cycle_between_modules():
    """Within a layer too: no module reaches itself again through imports (function-level imports included)."""
    import grimp

    graph = grimp.build_graph("bdlora_train", include_external_packages=False)
    edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module, path):
        state[module] = 1
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                cycle = path[path.index(target) :] + [target]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])


def test_no_library_module_writes_into_docs():
    """Docs generators live in tools/; the library never names the docs/ directory."""
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value == "docs":
                pytest.fail(f"{path.relative_to(ROOT)} names the docs/ directory: move that code to tools/")


def test_the_wheel_holds_the_library_and_nothing_else(tmp_path):
    """`pip wheel .`: the package, its bundled configs and data; no tools, tests, engine harness or docs generator."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = tmp_path.glob("bdlora_train-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert top == {"bdlora_train", next(t for t in top if t.endswith(".dist-info"))}, top
    for forbidden in ("fixtures.py", "engine_job.py", "probe.py", "coverage.py", "families_table.py"):
        assert not any(name.endswith("/" + forbidden) for name in names), forbidden
    assert any(name.startswith("bdlora_train/models/snapshots/") and name.endswith(".json") for name in names)
    assert "bdlora_train/data/tiny_sums.jsonl" in names
    assert sum(name.endswith(".py") for name in names) == len(list(PACKAGE.rglob("*.py")))
