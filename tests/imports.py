"""The imports a package's modules make, read from their source with `ast` (nothing is
imported): statements at module level, inside functions (lazy) and under `TYPE_CHECKING`,
and imports by a literal string (`importlib.import_module("x")`, `__import__("x")`, the
values of a lazy-exports table `_EXPORTS = {name: module}`). The layout tests of `engine`
and `dagster_llm/core` judge them."""

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_STRING_IMPORTERS = ("import_module", "__import__")


@dataclass(frozen=True)
class ModuleImport:
    """`source` (a module's dotted name) reaches `target` (a module, or a name inside one:
    `from a import b` reaches `a.b`) at `path`:`line`."""

    source: str
    target: str
    path: Path
    line: int

    def __str__(self) -> str:
        where = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{where}:{self.line}: {self.source} imports {self.target}"


def package_modules(folder: Path, root: Path = ROOT) -> dict[str, Path]:
    """Every module under `folder` (a package of `root`) by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(folder.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _statement_names(node: ast.AST, package: str) -> list[tuple[str, int]]:
    if isinstance(node, ast.Import):
        return [(alias.name, node.lineno) for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        return [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return []


def _string_names(node: ast.AST) -> list[tuple[str, int]]:
    """The literal names by which `node` imports: the first argument of `import_module` or
    `__import__`, and each `module.name` of an `_EXPORTS = {name: module}` table."""
    if isinstance(node, ast.Call) and node.args:
        called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        first = node.args[0]
        if called in _STRING_IMPORTERS and isinstance(first, ast.Constant) and isinstance(first.value, str):
            return [(first.value, first.lineno)]
    elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
          and any(getattr(target, "id", None) == "_EXPORTS" for target in node.targets)):
        return [(f"{module.value}.{name.value}", module.lineno) for name, module in zip(node.value.keys,
                                                                                       node.value.values)
                if isinstance(name, ast.Constant) and isinstance(module, ast.Constant)]
    return []


def module_imports(modules: dict[str, Path]) -> Iterator[ModuleImport]:
    """Each import the modules make, by statement or by string, wherever it stands in the file."""
    for source, path in modules.items():
        package = source if path.name == "__init__.py" else source.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for name, line in _statement_names(node, package) + _string_names(node):
                yield ModuleImport(source, name, path, line)
