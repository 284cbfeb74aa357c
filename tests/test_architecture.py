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
        ("bdlora_train.launch.command", "bdlora_train.train"): "the `-m` module of the launch command it rebuilds",
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
    assert "bdlora_train/packaged_data/tiny_sums.jsonl" in names
    assert sum(name.endswith(".py") for name in names) == len(list(PACKAGE.rglob("*.py")))


# Library modules no test uses by name (`_used_in`: a name imported from it is read, or its dotted name is a string the
# test hands on), and why each is covered all the same. A module that gains a direct test must leave this table (the
# test below fails on a stale entry).
NOT_IMPORTED_BY_A_TEST = {
    "bdlora_train.commands.export": "a command: run through bdlora_train.cli.main (tests/test_export.py)",
    "bdlora_train.commands.inspect": "a command: run through bdlora_train.cli.main (tests/adapters/test_adapters.py)",
    "bdlora_train.commands.train": "train/entry.py's main under `bdlora train` (tests/train/test_train.py runs both)",
    "bdlora_train.commands.push": "a command: run through bdlora_train.cli.main (tests/test_hub.py)",
    "bdlora_train.commands.serving": "a command: run through bdlora_train.cli.main (tests/serving/test_serving.py)",
    "bdlora_train.comparison.summary": "records -> rows: read back from results.json (comparison/test_compare.py)",
    "bdlora_train.tp_runtime.node": "the one-node TP layer runs in torchrun ranks (tp_runtime/test_tp_training.py)",
    "bdlora_train.tp_diagnostics.sharded_lora": "runs in the ranks tp_check spawns (tp_diagnostics/test_tp_check.py)",
    **{f"bdlora_train.rl.{part}": "a part RolloutServer composes, each request and message checked through it against "
       "a stand-in server (rl/test_rollout_server.py)"
       for part in ("engine_client", "server_adapters", "server_check", "server_sampling")},
}


def _module_of(dotted: str, modules: set[str]) -> str | None:
    """The longest module of the package that `dotted` (a module, or a name defined in one) starts with."""
    parts = dotted.split(".")
    return next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in modules), None)


def _used_in(tree: ast.Module, modules: set[str]) -> set[str]:
    """Modules of the package one file uses: a name that importing the module (or importing from it) binds is read
    outside the import statements and the type annotations, or the module's dotted name is a string the file hands
    on (`python -m bdlora_train.train`, "module:function", a monkeypatch target). An import alone uses nothing."""
    bound: dict[str, str] = {}  # local name -> the dotted name it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                local = alias.asname or alias.name.split(".")[0]
                bound[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            bound.update({alias.asname or alias.name: f"{node.module}.{alias.name}" for alias in node.names})
    annotations = [n.annotation for n in ast.walk(tree) if isinstance(n, (ast.arg, ast.AnnAssign)) and n.annotation]
    annotations += [n.returns for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    skip = {id(n) for a in annotations if a is not None for n in ast.walk(a)}
    skip |= {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}  # read `a.b.c` whole, once

    def dotted(node) -> str | None:  # `a.b.c` read from a bound name, as the dotted name it stands for
        if isinstance(node, ast.Name):
            return bound.get(node.id)
        if isinstance(node, ast.Attribute):
            base = dotted(node.value)
            return base and f"{base}.{node.attr}"
        return None

    used = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load):
            name = dotted(node)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("bdlora_"):
            name = node.value.split(":")[0]
            used.add(_module_of(f"{name}.__main__", modules))  # `python -m package` runs its __main__
        else:
            continue
        used.add(name and _module_of(name, modules))
    return used - {None}


def _used_by_tests(modules: set[str]) -> set[str]:
    """The modules a test file (tests/**/*.py) uses (`_used_in`), with the packages they belong to."""
    used = set()
    for path in (ROOT / "tests").rglob("*.py"):
        if path.resolve() == Path(__file__).resolve():
            continue  # this file names modules in its table and its checks, and tests none of them
        used |= _used_in(ast.parse(path.read_text()), modules)
    return used | {".".join(m.split(".")[:i]) for m in used for i in range(1, m.count(".") + 1)}


def _library_modules() -> set[str]:
    paths = PACKAGE.rglob("*.py")
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__") for p in paths}


def test_an_import_alone_uses_nothing():
    """The rule the test below applies, on snippets: a module counts once a name from it is read."""
    modules = {"bdlora_train", "bdlora_train.hub", "bdlora_train.train", "bdlora_train.train.__main__"}

    def used(source):
        return _used_in(ast.parse(source), modules)

    assert used("import bdlora_train.hub  # noqa: F401\n") == set()
    assert used("from bdlora_train import hub  # noqa: F401\n") == set()
    assert used("from bdlora_train.hub import push\ndef f(x: push) -> push: ...\n") == set()  # annotations only
    assert used("from bdlora_train import hub\nhub.push()\n") == {"bdlora_train.hub"}
    assert used("import bdlora_train.hub\nbdlora_train.hub.push()\n") == {"bdlora_train.hub"}
    assert used("from bdlora_train.hub import push as p\np()\n") == {"bdlora_train.hub"}
    assert used("run(['-m', 'bdlora_train.train'])\n") == {"bdlora_train.train", "bdlora_train.train.__main__"}


def test_every_library_module_is_used_by_a_test_or_says_why_not():
    modules = _library_modules()
    used = _used_by_tests(modules)
    untested = sorted(m for m in modules if m not in used and m not in NOT_IMPORTED_BY_A_TEST)
    assert not untested, f"modules no test uses (add a test, or say why in NOT_IMPORTED_BY_A_TEST): {untested}"
    stale = sorted(m for m in NOT_IMPORTED_BY_A_TEST if m in used or m not in modules)
    assert not stale, f"NOT_IMPORTED_BY_A_TEST names modules that a test uses now, or gone: {stale}"
