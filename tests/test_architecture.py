"""The package's layering (README, "Architecture"): the import-linter contracts in pyproject.toml hold on the real
package, and each of them breaks on a small package that violates it (so a contract cannot silently check nothing)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from conftest import CI, ROOT

LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())"]


def lint(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """lint-imports in `cwd` as .ci/run runs it: PYTHONPATH=.ci finds the private_names contract type."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cwd), str(CI)]), "COLUMNS": "300"}
    return subprocess.run([*LINT, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # lint-imports in a process of its own (.ci/run runs it too)
def test_the_package_keeps_every_contract():
    proc = lint(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 kept, 0 broken" in proc.stdout


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.slow  # lint-imports in a process of its own per case
@pytest.mark.parametrize("case, files, broken", [
    ("core imports observe", {"fake/core/loop.py": "from ..observe import observer\n"},
     "Layers"),
    ("a module imports the package root", {"fake/core/loop.py": "from .. import VERSION\n"},
     "package root"),
    ("an import cycle inside a function", {"fake/core/loop.py": "def f():\n    from . import meter\n",
                                           "fake/core/meter.py": "from . import loop\n"},
     "cycle"),
    ("a private name crosses a module", {"fake/core/loop.py": "from .meter import _helper\n"},
     "private name"),
    ("a private attribute of an imported module", {"fake/core/loop.py": "from . import meter\nmeter._helper()\n"},
     "private name"),
])
def test_each_contract_breaks_on_a_violation(tmp_path, case, files, broken):
    layout = ("__init__.py", "train.py", "cli.py", "sweep.py",
              "deploy/__init__.py", "config.py", "errors.py", "compat.py", "testing/__init__.py", "core/__init__.py",
              "core/loop.py", "core/meter.py",
              "observe/__init__.py", "observe/observer.py", "tasks/__init__.py", "rundir/__init__.py")
    base = {f"fake/{name}": "" for name in layout}
    base["fake/__init__.py"] = "VERSION = 1\n"
    write(tmp_path, {**base, **files})
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    lines = ["[importlinter]", "root_package = fake", "contract_types =",
             *[f"    {t}" for t in config["contract_types"]]]
    for i, contract in enumerate(config["contracts"]):
        lines.append(f"[importlinter:contract:{i}]")
        for key, value in contract.items():
            values = value if isinstance(value, list) else [value]
            values = [str(v).replace("accel_train", "fake") for v in values]
            lines.append(f"{key} =" + "".join(f"\n    {v}" for v in values) if isinstance(value, list)
                         else f"{key} = {values[0]}")
    (tmp_path / ".importlinter").write_text("\n".join(lines) + "\n")
    proc = lint(tmp_path, "--config", ".importlinter")
    assert proc.returncode != 0, f"{case}: every contract kept\n{proc.stdout}"
    broken_lines = [line for line in proc.stdout.splitlines() if "BROKEN" in line]
    assert len(broken_lines) == 1 and broken in broken_lines[0], proc.stdout


MAX_MODULE_LINES = 400  # STYLE.md: files under about 400 lines; a larger one holds two things


def test_no_module_of_the_package_is_over_400_lines():
    sizes = {str(path.relative_to(ROOT)): len(path.read_text().splitlines())
             for path in (ROOT / "accel_train").rglob("*.py")}
    over = {name: lines for name, lines in sizes.items() if lines > MAX_MODULE_LINES}
    assert not over, f"split these modules (at most {MAX_MODULE_LINES} lines each): {over}"


MAX_FUNCTION_LINES = 60  # STYLE.md: functions under about 60 lines (the body, without its docstring)


def test_no_function_of_the_package_is_over_60_lines():
    import ast

    over = {}
    for path in (ROOT / "accel_train").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body[1:] if ast.get_docstring(node) is not None and len(node.body) > 1 else node.body
                lines = node.end_lineno - body[0].lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    over[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = lines
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (split them): {over}"
