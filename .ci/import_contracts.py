"""A custom import-linter contract type (registered in pyproject.toml's [tool.importlinter] as
`import_contracts.PrivateNamesContract`, found through `PYTHONPATH=.ci lint-imports`): no private name crosses a module
border inside the package.

A private name is one that starts with an underscore (dunders such as `__version__` aside). The contract reads the
source of every module of the root package and reports

* `from <package module> import _name` (absolute or relative), and
* `<alias>._name` where <alias> is a package module imported into the file (`from . import checkpoint as ckpt`,
  then `ckpt._sha256`).

import-linter's graph knows which modules import which, not which names; so this contract parses the files itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

from importlinter.domain.contract import Contract, ContractCheck


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names, seen from `module`."""
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def violations(package_dir: Path, root: str) -> list[str]:
    """Every place a private name of one package module is used by another."""
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        relative = path.relative_to(package_dir.parent).with_suffix("")
        is_package = path.name == "__init__.py"
        module = ".".join(relative.parts[:-1] if is_package else relative.parts)
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _absolute(module, is_package, node)
                if not (source == root or source.startswith(root + ".")):
                    continue
                for name in node.names:
                    if _private(name.name):
                        found.append(f"{module}:{node.lineno} imports {name.name} from {source}")
                    else:
                        aliases.add(name.asname or name.name)  # may be a module: `from . import checkpoint`
            elif isinstance(node, ast.Import):
                aliases.update(a.asname or a.name for a in node.names if a.name.startswith(root + "."))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases):
                found.append(f"{module}:{node.lineno} uses {node.value.id}.{node.attr}")
    return found


class PrivateNamesContract(Contract):
    """type = private_names; checks the root package (no options)."""

    type_name = "private_names"

    def check(self, graph, verbose: bool) -> ContractCheck:
        import importlib.util

        root = sorted(self.session_options["root_packages"])[0]
        package_dir = Path(importlib.util.find_spec(root).submodule_search_locations[0])
        found = violations(package_dir, root)
        return ContractCheck(kept=not found, metadata={"violations": found})

    def render_broken_contract(self, check: ContractCheck) -> None:
        from importlinter.application import output

        for line in check.metadata["violations"]:
            output.print_error(f"- {line}")
