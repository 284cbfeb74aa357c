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


def test_no_library_module_names_the_docs_directory():
    """Docs generators live in tools/; the library never names the docs/ directory, in any spelling a path takes
    (a "docs" part, "docs/...", "../docs", a Path("docs") / ... join)."""
    import re

    pattern = re.compile(r"(^|[/\\.])docs($|[/\\])")
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and pattern.search(node.value.strip()):
                where = path.relative_to(ROOT)
                pytest.fail(f"{where} names the docs/ directory ({node.value!r}): move that code to tools/")


def _string_imports() -> list[tuple[str, str]]:
    """(importing module, imported module) for every import the graph tools cannot see: a "package.module" or
    "package.module:function" string literal of this package handed to importlib (the command table, the lazy
    package exports, the boundary's targets)."""
    import re

    found = []
    name = re.compile(r"^bdlora_train(\.\w+)+(:\w+)?$")
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and name.match(node.value):
                found.append((module, node.value.split(":")[0]))
    return found


def test_string_imports_name_real_modules_and_point_down_or_into_their_own_package():
    """importlib by name is invisible to import-linter: each such name must exist, and point into the importing
    package itself (a lazy export, train/__main__ -> train.entry) or, for the command table, into commands/."""
    import importlib.util

    not_imports = {  # names that are data, not imports: why
        ("bdlora_train.serving.engines", "bdlora_train.vllm_plugin"): "the entry-point value compared with metadata",
    }
    imports = [pair for pair in _string_imports() if pair not in not_imports]
    assert ("bdlora_train.cli", "bdlora_train.commands.train") in imports  # the scan sees the command table
    for importer, target in imports:
        assert importlib.util.find_spec(target) is not None, f"{importer} names {target}, which does not exist"
        package = importer if (PACKAGE / Path(*importer.split(".")[1:]) / "__init__.py").exists() else (
            importer.rsplit(".", 1)[0])
        if importer == "bdlora_train.cli":
            assert target.startswith("bdlora_train.commands."), (importer, target)
        elif not (target == package or target.startswith((package + ".", "bdlora_train.core."))):
            pytest.fail(f"{importer} imports {target} by name, outside its own package: import it as a statement")


def test_the_command_table_names_a_function_of_commands_for_every_command():
    """`bdlora <command>` resolves its module by name: every entry is a module of commands/ with that function, and
    every module of commands/ is some command's."""
    import importlib

    from bdlora_train.cli import COMMANDS

    used = set()
    for command, (target, help_text) in COMMANDS.items():
        module, func = target.split(":")
        assert module.startswith("bdlora_train.commands."), (command, target)
        assert callable(getattr(importlib.import_module(module), func)), (command, target)
        assert help_text, command
        used.add(module.rsplit(".", 1)[-1])
    files = {p.stem for p in (PACKAGE / "commands").glob("*.py") if p.stem != "__init__"}
    assert files == used, f"modules of commands/ no command runs: {sorted(files - used)}"


def test_torchruns_entry_point_imports_nothing_above_train():
    """`python -m bdlora_train.train` (torchrun, accelerate launch) runs train/entry.py inside core/boundary.py."""
    tree = ast.parse((PACKAGE / "train" / "__main__.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in imported if m.startswith("bdlora_train")} == {"bdlora_train.core.boundary"}, imported
    targets = [t for i, t in _string_imports() if i == "bdlora_train.train.__main__"]
    assert targets == ["bdlora_train.train.entry"], targets


def test_the_wheel_holds_the_library_and_nothing_else(tmp_path):
    """`pip wheel .`: the package, its bundled configs and data; no tools, tests, engine harness or docs generator.
    Built from a copy of what git tracks, so a stale build/ of this checkout (setuptools keeps build/lib/ between
    builds, removed modules included) neither leaks into the wheel nor is touched."""
    import shutil

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    source = tmp_path / "src"
    for name in tracked.splitlines():
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    for path in PACKAGE.rglob("*.py"):  # modules not committed yet belong to the tree under test too
        (source / path.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, source / path.relative_to(ROOT))
    wheels = tmp_path / "wheels"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels)],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = wheels.glob("bdlora_train-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert top == {"bdlora_train", next(t for t in top if t.endswith(".dist-info"))}, top
    for forbidden in ("fixtures.py", "engine_job.py", "probe.py", "coverage.py", "families_table.py"):
        assert not any(name.endswith("/" + forbidden) for name in names), forbidden
    assert any(name.startswith("bdlora_train/models/snapshots/") and name.endswith(".json") for name in names)
    assert "bdlora_train/data/tiny_sums.jsonl" in names
    assert sum(name.endswith(".py") for name in names) == len(list(PACKAGE.rglob("*.py")))


# Library modules no test imports by name, and why each is covered all the same. A module that gains a direct test
# must leave this table (the test below fails on a stale entry).
NOT_IMPORTED_BY_A_TEST = {
    "bdlora_train.commands.export": "a command: run through bdlora_train.cli.main (tests/test_export.py)",
    "bdlora_train.commands.inspect": "a command: run through bdlora_train.cli.main (tests/test_adapters.py)",
    "bdlora_train.commands.train": "train/entry.py's main under `bdlora train` (tests/test_train.py runs both)",
    "bdlora_train.commands.push": "a command: run through bdlora_train.cli.main (tests/test_hub.py)",
    "bdlora_train.commands.serving": "a command: run through bdlora_train.cli.main (tests/test_serving.py)",
    "bdlora_train.sweep.summary": "the sweep's records -> rows: read back from results.json in tests/test_compare.py",
    "bdlora_train.tp_proofs.sharded_experts": "runs in the ranks tp_check spawns (tests/test_tp.py, test_families.py)",
    "bdlora_train.tp_proofs.sharded_lora": "runs inside the spawned ranks of tp_check (tests/test_tp.py)",
    "bdlora_train.tp_proofs.shard_model": "runs in the ranks tp_check spawns (tests/test_tp.py, test_families.py)",
}


def _imported_by_tests() -> set[str]:
    """Modules of the package a test file names: `import m`, `from m import ...`, `from package import m`, `-m m`."""
    found = set()
    for path in (ROOT / "tests").rglob("*.py"):
        if path.resolve() == Path(__file__).resolve():
            continue  # this file names modules in its table and its checks, and tests none of them
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
                found |= {f"{node.module}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("bdlora_"):
                name = node.value.split(":")[0]  # `python -m bdlora_train.train`, "module:function"
                found |= {name, f"{name}.__main__"}
    return found


def test_every_library_module_is_imported_by_a_test_or_says_why_not():
    modules = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__") for p in PACKAGE.rglob("*.py")
    }
    imported = _imported_by_tests()
    imported |= {".".join(m.split(".")[:i]) for m in imported for i in range(1, m.count(".") + 1)}  # its packages
    untested = sorted(m for m in modules if m not in imported and m not in NOT_IMPORTED_BY_A_TEST)
    assert not untested, f"modules no test imports (add a test, or say why in NOT_IMPORTED_BY_A_TEST): {untested}"
    stale = sorted(m for m in NOT_IMPORTED_BY_A_TEST if m in imported or m not in modules)
    assert not stale, f"NOT_IMPORTED_BY_A_TEST names modules that are imported by a test now, or gone: {stale}"
