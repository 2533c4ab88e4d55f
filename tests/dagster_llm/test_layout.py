"""The Dagster side's house: `dagster_llm/core` sits below it and above the engine.

The core imports no Dagster (`dagster`, any `dagster_*` package) and no module of
`dagster_llm` outside the core, and it takes from the engine only through `SURFACE`, the one
module that names what it takes. Every import counts: at module level, inside a function
(lazy), under `TYPE_CHECKING`, and by string (`importlib.import_module`, `__import__`, and
the values of an `_EXPORTS` table of lazy names). A static check cannot see what a module
loads through another package, so a subprocess also imports each core module and looks at
what it loaded.
"""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

from dagster_llm.core import engine_surface
from tests.imports import ModuleImport, module_imports, package_modules

ROOT = Path(__file__).resolve().parents[2]
CORE = "dagster_llm.core"
SURFACE = "dagster_llm.core.engine_surface"


def core_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the core by dotted name (a package by its own name)."""
    return package_modules(root / "dagster_llm" / "core", root)


def above_the_core(module: str) -> bool:
    """Whether `module` is Dagster, a `dagster_*` package, or `dagster_llm` outside the core
    (its package face included: its names load the Dagster side)."""
    top = module.partition(".")[0]
    if top == "dagster_llm":
        return module != CORE and not module.startswith(CORE + ".")
    return top == "dagster" or top.startswith("dagster_")


def dagster_problem(edge: ModuleImport) -> str | None:
    """Why this import reaches above the core, or None."""
    if not above_the_core(edge.target):
        return None
    return f"{edge}: the core imports no Dagster and no dagster_llm module outside {CORE}"


def engine_problem(edge: ModuleImport) -> str | None:
    """Why this import takes from the engine around the surface, or None."""
    if edge.target.partition(".")[0] != "engine" or edge.source == SURFACE:
        return None
    return f"{edge}: only {SURFACE} imports the engine; take the name from there (add it to its _EXPORTS)"


# Run in a fresh interpreter: imports the modules named in argv one after another, and prints
# each module loaded meanwhile -> the modules on the stack when it was imported, innermost first.
_WHO_IMPORTS = """
import importlib, json, sys
chains = {}
class Spy:
    def find_spec(self, name, path=None, target=None):
        chain, frame = [], sys._getframe(1)
        while frame:
            module = frame.f_globals.get("__name__", "")
            if not module.startswith(("importlib", "_frozen_importlib")) and module not in chain[-1:]:
                chain.append(module)
            frame = frame.f_back
        chains.setdefault(name, [m for m in chain if m != "__main__"])
sys.meta_path.insert(0, Spy())
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps({name: chains[name] for name in sys.modules if name in chains}))
"""


def imported_by(names: list[str], path: Path | None = None) -> dict[str, list[str]]:
    """Each module a fresh interpreter loads while importing `names` -> who imported it: the
    modules on the stack at that moment, innermost first (`path` goes first on sys.path)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in [path, ROOT] if p)}
    done = subprocess.run([sys.executable, "-c", _WHO_IMPORTS, *names], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def loaded_above_the_core(loaded: dict[str, list[str]]) -> list[str]:
    """The modules of `loaded` above the core that something below it imported, each with who
    did (what those modules import in turn goes unsaid). `dagster_llm` itself loads with any
    of its modules: its face is lazy and Dagster-free."""
    above = {module for module in loaded if above_the_core(module) and module != "dagster_llm"}
    return sorted(f"{module}, imported by {' <- '.join(loaded[module])}" for module in above
                  if module.rpartition(".")[0] not in above and not above.intersection(loaded[module][:1]))


MODULES = core_modules()
EDGES = list(module_imports(MODULES))


def test_the_core_imports_no_dagster_and_nothing_of_dagster_llm_above_it():
    problems = [problem for edge in EDGES if (problem := dagster_problem(edge))]
    assert not problems, "imports above the core:\n" + "\n".join(problems)


def test_the_core_takes_from_the_engine_only_through_its_surface():
    problems = [problem for edge in EDGES if (problem := engine_problem(edge))]
    assert not problems, "engine imports around the surface:\n" + "\n".join(problems)


def test_the_surface_names_what_the_core_takes_and_nothing_more():
    taken = {edge.target.removeprefix(SURFACE + ".") for edge in EDGES if edge.target.startswith(SURFACE + ".")}
    unused = sorted(set(engine_surface._EXPORTS) - taken)
    assert not unused, f"{SURFACE} names what no core module takes: {unused}"
    missing = sorted(f"{name} from {module}" for name, module in engine_surface._EXPORTS.items()
                     if name not in dir(importlib.import_module(module)))
    assert not missing, f"{SURFACE} names what the engine does not have: {missing}"


def test_importing_a_core_module_loads_no_dagster():
    """A core module may load Dagster through a package it imports; only importing it says so."""
    found = loaded_above_the_core(imported_by(sorted(MODULES)))
    assert not found, "importing the core loads the Dagster side:\n" + "\n".join(found)


def test_the_checks_see_imports_of_every_kind(tmp_path):
    """A lazy, a type-only and a string import of Dagster, dagster_llm or the engine are reported."""
    source = tmp_path / "dagster_llm" / "core" / "fake.py"
    source.parent.mkdir(parents=True)
    source.write_text("import importlib\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from dagster_llm.resource import LLMResource\n"
                      "def f():\n    import dagster\n    from engine.entrypoints.chat_utils import render_chat\n"
                      "    return importlib.import_module('dagster_aws.s3')\n"
                      "from . import engine_surface\n_EXPORTS = {'X': 'engine.outputs'}\n")
    edges = list(module_imports(core_modules(tmp_path)))
    assert [(e.target, e.line) for e in edges] == [
        ("importlib", 1), ("typing.TYPE_CHECKING", 2), ("dagster_llm.core.engine_surface", 9),
        ("engine.outputs.X", 10), ("dagster_llm.resource.LLMResource", 4), ("dagster", 6),
        ("engine.entrypoints.chat_utils.render_chat", 7), ("dagster_aws.s3", 8)]
    assert [e.line for e in edges if dagster_problem(e)] == [4, 6, 8]
    assert [e.line for e in edges if engine_problem(e)] == [10, 7]
    as_surface = [ModuleImport(SURFACE, e.target, e.path, e.line) for e in edges]
    assert not any(engine_problem(e) for e in as_surface)
    assert above_the_core("dagster_llm") and not above_the_core("dagster_llm.core")


def test_the_import_check_sees_dagster_loaded_through_another_package(tmp_path):
    (tmp_path / "fake_core.py").write_text("import fake_glue\n")
    (tmp_path / "fake_glue.py").write_text("def f():\n    import dagster_pretend.sub\nf()\n")
    (tmp_path / "dagster_pretend").mkdir()
    (tmp_path / "dagster_pretend" / "__init__.py").write_text("")
    (tmp_path / "dagster_pretend" / "sub.py").write_text("")
    loaded = imported_by(["fake_core"], tmp_path)
    assert loaded_above_the_core(loaded) == ["dagster_pretend, imported by fake_glue <- fake_core"]


def test_the_import_check_sees_dagster_llm_above_the_core_but_not_its_lazy_face():
    loaded = dict.fromkeys(["dagster_llm", "dagster_llm.assets", "dagster_llm.core.sampling"], ["dagster_llm.core.x"])
    assert loaded_above_the_core(loaded) == ["dagster_llm.assets, imported by dagster_llm.core.x"]
