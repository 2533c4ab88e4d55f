"""The engine's house: its folders in one tier order, every import running down it, no import
circle, and cheap imports of one part.

`TIERS` is the one declaration of the allowed direction: top to bottom, each row a tier, each
name in it a part (a folder or a module; a module belongs to the longest name that prefixes
it). A module may import its own part and any part of a lower tier; parts of one tier do not
import each other. Every import counts: at module level, inside a function (lazy) and under
`TYPE_CHECKING` (a type-only reference between tiers goes through a Protocol in the lower
one, as `layers.linear.StoredTensor` and `LoRADeltas`, `core.sequence.BeamGroupState` do).
"""

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TIERS: list[list[str]] = [
    ["engine"],  # the package: lazy public names
    ["engine.run_batch"],  # python -m engine.run_batch: OpenAI batch files from the command line
    ["engine.openai_batch"],  # OpenAI batch lines and bodies <-> engine inputs and outputs; runs on LLM
    ["engine.llm"],  # LLM, the offline entry point
    ["engine.data_parallel"],  # replicas as whole engines
    ["engine.inputs"],  # prompts -> requests
    ["engine.llm_engine"],  # add_request / step / outputs
    ["engine.worker"],  # the device side of a step
    ["engine.spec_decode"],  # speculative decoding: proposals, their worth, their verification rows
    ["engine.core"],  # the scheduler side: bookkeeping only
    ["engine.model_loader"],  # model folder -> built, loaded, routed model
    ["engine.models"],  # model families
    ["engine.lora", "engine.multimodal", "engine.quantization"],  # adapters, images in prompts, quantized products
    ["engine.attention", "engine.layers", "engine.sample"],
    ["engine.structured_output"],
    ["engine.kernels", "engine.distributed"],  # compiled and Triton kernels; process plumbing
    ["engine.output_parsing"],  # a completion's reasoning, answer and tool calls apart
    ["engine.config"],  # settings: a leaf above the API types
    ["engine.tool_choice"],  # tool_choice: a forced call's grammar, and the calls read from what it made
    ["engine.chat_utils", "engine.detokenizer", "engine.progress_bar", "engine.reasoning",
     "engine.tool_parsers"],
    ["engine.beam_search"],  # API types, from here down
    ["engine.pooling_params", "engine.sampling_params"],
    ["engine.outputs", "engine.sampling_rules", "engine.structured_output.params", "engine.spec_decode.config"],
    ["engine.exceptions", "engine.hardware", "engine.kv_cache_dtype", "engine.lazy_exports", "engine.lora.request",
     "engine.step_cost"],
]
RANK = {part: rank for rank, row in enumerate(TIERS) for part in row}


@dataclass(frozen=True)
class EngineImport:
    source: str
    target: str
    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.source} imports {self.target}"


def engine_modules() -> dict[str, Path]:
    """Every module of the engine by dotted name (a package by its own name)."""
    found = {}
    for path in sorted((ROOT / "engine").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported_names(node: ast.AST, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        return [f"{base}.{alias.name}" for alias in node.names]
    return []


def engine_imports(modules: dict[str, Path]) -> Iterator[EngineImport]:
    """Each import of one engine module by another, wherever it stands in the file."""
    for source, path in modules.items():
        package = source if path.name == "__init__.py" else source.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for name in _imported_names(node, package):
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != source:
                    yield EngineImport(source, name, path, node.lineno)


def part_of(module: str) -> str | None:
    """The longest part of `TIERS` that is `module` or a package above it."""
    while module and module not in RANK:
        module = module.rpartition(".")[0]
    return module or None


def import_problem(edge: EngineImport) -> str | None:
    """Why this import runs against the tiers, or None."""
    source, target = part_of(edge.source), part_of(edge.target)
    if source == target or RANK[target] > RANK[source]:
        return None
    where = "a peer of its tier" if RANK[target] == RANK[source] else "a higher tier"
    return f"{edge}: {target} is {where} than {source}"


def circles(edges: list[EngineImport]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
        graph.setdefault(edge.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while (member := stack.pop()) != node:
                group.append(member)
            if group:
                found.append(sorted([node, *group]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


MODULES = engine_modules()
EDGES = list(engine_imports(MODULES))


def test_every_engine_module_has_a_place_in_the_tiers():
    unplaced = sorted(m for m in MODULES if part_of(m) is None)
    assert not unplaced, f"add these to a tier of TIERS in {Path(__file__).name}: {unplaced}"
    missing = sorted(part for part in RANK if part not in MODULES)
    assert not missing, f"TIERS names parts that no longer exist: {missing}"


def test_every_engine_import_runs_down_the_tiers():
    problems = [problem for edge in EDGES if (problem := import_problem(edge))]
    assert not problems, "imports against the tiers:\n" + "\n".join(problems)


def test_the_engine_has_no_import_circle():
    found = circles(EDGES)
    details = [[str(e) for e in EDGES if e.source in group and e.target in group] for group in found]
    assert not found, "import circles:\n" + "\n\n".join("\n".join(lines) for lines in details)


@pytest.mark.parametrize(("statement", "at_most"), [("import engine", 2), ("import engine.core.scheduler", 20)])
def test_importing_one_part_of_the_engine_loads_little_of_it(statement, at_most):
    loaded = subprocess.run(
        [sys.executable, "-c", f"{statement}; import sys; print(sorted(m for m in sys.modules if m.split('.')[0] == 'engine'))"],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout
    modules = eval(loaded)  # a printed list of module names
    assert len(modules) <= at_most, f"{statement} loads {len(modules)} engine modules: {modules}"


def test_the_checks_see_imports_of_every_kind(tmp_path):
    """A lazy and a type-only import against the tiers are reported, and a circle is found."""
    source = tmp_path / "engine" / "hardware.py"
    source.parent.mkdir()
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.config import X\n"
                      "def f():\n    from engine.core.scheduler import Scheduler\n")
    empty = tmp_path / "empty.py"
    empty.write_text("")
    modules = {"engine.hardware": source, "engine.config": empty, "engine.core.scheduler": empty}
    edges = list(engine_imports(modules))
    assert [(e.target, e.line) for e in edges] == [("engine.config", 3), ("engine.core.scheduler", 5)]
    edges = [EngineImport(e.source, e.target, ROOT / "engine" / "hardware.py", e.line) for e in edges]
    assert all(import_problem(edge) for edge in edges)
    back = EngineImport("engine.config", "engine.hardware", ROOT / "engine" / "config.py", 1)
    assert import_problem(back) is None
    assert circles([edges[0], back]) == [["engine.config", "engine.hardware"]]
