"""The engine's house: its folders in one tier order, every import running down it, no import
circle, and cheap imports of one part.

`TIERS` is the one declaration of the allowed direction: top to bottom, each row a tier, each
name in it a part (a folder or a module; a module belongs to the longest name that prefixes
it). The top part, `engine`, is the package face (`engine/__init__.py`) alone: every other
module needs a part of its own, so a new module fails until it is listed (or sits in a listed
folder) rather than falling silently into the top tier.

A module may import its own part and any part of a lower tier; parts of one tier do not
import each other. Every import counts: at module level, inside a function (lazy) and under
`TYPE_CHECKING` (a type-only reference between tiers goes through a Protocol in the lower
one, as `layers.linear.StoredTensor` and `LoRADeltas`, `core.sequence.BeamGroupState` do).
Imports by string count too, at the line of the string: `importlib.import_module` and
`__import__` of a literal name, and each module of a package's `_EXPORTS` table (its public
names, loaded on first use by `engine.lazy_exports`). The face's `_EXPORTS` are imports by
`engine`, the top tier, so they may point at any part; nothing below may import the face, so
they cannot close a circle. A child process's target (`"engine.worker.tp_worker:serve"`) is
no import: it is loaded in another process, and counting it would make a circle of
`worker_group` starting the rank whose loop drives a `worker_group`.

docs/engine.md's "Where the code is" table is checked against the tree: every package of the
engine is named in a row, and every file or folder a row names exists (`where_rows` says how
a name resolves).
"""

import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.imports import ModuleImport as EngineImport
from tests.imports import module_imports, package_modules

ROOT = Path(__file__).resolve().parents[2]
FACE = "engine"  # the package face, engine/__init__.py: the top tier, and no other module's part

TIERS: list[list[str]] = [
    [FACE],  # the package: lazy public names
    ["engine.run_batch"],  # python -m engine.run_batch, the short form of the command below
    # the entry points' packages (their __init__ imports nothing); a new module there is an entry point
    ["engine.entrypoints", "engine.entrypoints.openai"],
    ["engine.entrypoints.openai.run_batch"],  # OpenAI batch files from the command line
    ["engine.entrypoints.openai.batch"],  # a whole OpenAI batch file run, with resume; runs on LLM
    ["engine.entrypoints.openai.runner"],  # OpenAI batch lines of one task fanned out onto a loaded LLM
    ["engine.entrypoints.openai.serving"],  # OpenAI request bodies -> engine inputs, engine outputs -> response bodies
    ["engine.entrypoints.openai.protocol"],  # OpenAI batch lines: their checks, the engine inputs, the output lines
    ["engine.entrypoints.llm"],  # LLM, the offline entry point
    # LLM.score's pairs, cross-encoder inputs and scores; LLM.transcribe's windows and prompts
    ["engine.entrypoints.score_utils", "engine.entrypoints.transcription"],
    ["engine.entrypoints.data_parallel"],  # replicas as whole engines
    ["engine.entrypoints.inputs"],  # prompts -> requests
    ["engine.llm_engine"],  # add_request / step / outputs
    ["engine.output_processor"],  # what a sampled token does: stops, grammar, text, logprobs; the outputs
    ["engine.worker"],  # the device side of a step
    ["engine.spec_decode"],  # speculative decoding: proposals and their worth
    ["engine.core"],  # the scheduler side: bookkeeping only
    ["engine.model_loader"],  # model folder -> built, loaded, routed model
    ["engine.models"],  # model families
    ["engine.lora", "engine.multimodal", "engine.quantization"],  # adapters, images in prompts, quantized products
    ["engine.attention", "engine.layers", "engine.sample"],
    ["engine.structured_output"],
    # compiled and Triton kernels, and the PyTorch reference of a scaled KV cache (kv_cache_quant); process plumbing
    ["engine.kernels", "engine.distributed"],
    # a completion's reasoning, answer and tool calls apart; what the output processor keeps of a sequence
    ["engine.output_processor.parsing", "engine.output_processor.state"],
    ["engine.config"],  # settings, one module per group of them: a leaf above the API types
    ["engine.entrypoints.tool_choice"],  # tool_choice: a forced call's grammar, and the calls read from what it made
    ["engine.entrypoints.chat_utils", "engine.entrypoints.progress_bar", "engine.output_processor.detokenizer",
     "engine.reasoning", "engine.tool_parsers"],
    ["engine.beam_search"],  # API types, from here down
    ["engine.pooling_params", "engine.sampling_params"],
    ["engine.outputs", "engine.structured_output.params"],
    ["engine.exceptions", "engine.hardware", "engine.lazy_exports", "engine.lora.request"],
]
RANK = {part: rank for rank, row in enumerate(TIERS) for part in row}


def engine_modules() -> dict[str, Path]:
    """Every module of the engine by dotted name (a package by its own name)."""
    return package_modules(ROOT / FACE)


def _import_edge(edge: EngineImport, modules: dict[str, Path]) -> EngineImport | None:
    """The import as an edge to the engine module holding its target; None when that is no
    engine module or the importing module itself."""
    name = edge.target
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return EngineImport(edge.source, name, edge.path, edge.line) if name and name != edge.source else None


def engine_imports(modules: dict[str, Path]) -> Iterator[EngineImport]:
    """Each import of one engine module by another, wherever it stands in the file, by
    statement or by string (`tests/imports.py`)."""
    for edge in module_imports(modules):
        if (found := _import_edge(edge, modules)) is not None:
            yield found


def part_of(module: str) -> str | None:
    """The longest part of `TIERS` that is `module` or a package above it; None when that is
    only the package face, which is the part of `engine/__init__.py` alone."""
    part = module
    while part and part not in RANK:
        part = part.rpartition(".")[0]
    return part if part and (part != FACE or module == FACE) else None


def placement_problems(modules: Iterable[str]) -> list[str]:
    """Each module without a part of its own in `TIERS`, and where to give it one."""
    return [f"{module} has no part in TIERS (only the package face {FACE!r} prefixes it): list it, "
            f"or a folder above it, in the tier it belongs to in TIERS in {Path(__file__).relative_to(ROOT)}"
            for module in sorted(modules) if part_of(module) is None]


def import_problem(edge: EngineImport) -> str | None:
    """Why this import runs against the tiers, or None."""
    source, target = part_of(edge.source), part_of(edge.target)
    if source is None or target is None:
        return f"{edge}: {edge.source if source is None else edge.target} has no part in TIERS to judge it by"
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


@dataclass(frozen=True)
class WhereRow:
    tier: str
    paths: list[str]  # relative to engine/; a folder ends in "/"


def where_rows(markdown: str) -> list[WhereRow]:
    """The rows of the table under "## Where the code is" (up to the next "## "), each with
    the paths its "where" (second) cell names. A path is a backticked name ending in ".py" or
    "/"; other backticked names (`LLM`, `__init__`) are not. A folder, or a name with a "/"
    inside it, is relative to engine/; a bare file name is relative to the last folder named
    before it in the cell (`worker/`: `tp_worker.py` is engine/worker/tp_worker.py), or to
    engine/ when none was, so a row names its root files before its folders."""
    section = re.search(r"^## Where the code is\n(.*?)(?=^## |\Z)", markdown, re.M | re.S)
    rows = []
    for line in section.group(1).splitlines() if section else []:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 2 or set(cells[0]) <= set("-:") or cells[1] == "where":
            continue
        folder, paths = "", []
        for name in re.findall(r"`([^`]+)`", cells[1]):
            if name.endswith("/"):
                folder = name
            if name.endswith(("/", ".py")):
                paths.append(name if "/" in name else folder + name)
        rows.append(WhereRow(cells[0], paths))
    return rows


def where_table_problems(markdown: str, engine_dir: Path) -> list[str]:
    """How the "Where the code is" table disagrees with the tree at `engine_dir`: a package
    (a folder with an `__init__.py`, so neither `__pycache__` nor a folder of C++ sources;
    the kernels' C++ files sit beside their loaders in `kernels/`) that no row names, and a
    named file or folder that is not there."""
    rows = where_rows(markdown)
    named = {path for row in rows for path in row.paths}
    packages = sorted(f"{p.parent.relative_to(engine_dir).as_posix()}/" for p in engine_dir.rglob("*/__init__.py"))
    where = 'docs/engine.md, "Where the code is"'
    problems = [f"{where}: no row names the folder engine/{package}; add it to the row of its tier"
                for package in packages if package not in named]
    for row in rows:
        problems += [f"{where}: the {row.tier!r} row names engine/{path}, which does not exist" for path in row.paths
                     if not ((engine_dir / path).is_dir() if path.endswith("/") else (engine_dir / path).is_file())]
    return problems


MODULES = engine_modules()
EDGES = list(engine_imports(MODULES))


def test_every_engine_module_has_a_place_in_the_tiers():
    unplaced = placement_problems(MODULES)
    assert not unplaced, "\n".join(unplaced)
    missing = sorted(part for part in RANK if part not in MODULES)
    assert not missing, f"TIERS names parts that no longer exist: {missing}"


def test_every_engine_import_runs_down_the_tiers():
    problems = [problem for edge in EDGES if (problem := import_problem(edge))]
    assert not problems, "imports against the tiers:\n" + "\n".join(problems)


def test_the_engine_has_no_import_circle():
    found = circles(EDGES)
    details = [[str(e) for e in EDGES if e.source in group and e.target in group] for group in found]
    assert not found, "import circles:\n" + "\n\n".join("\n".join(lines) for lines in details)


def test_the_docs_table_of_the_code_matches_the_tree():
    problems = where_table_problems((ROOT / "docs" / "engine.md").read_text(), ROOT / "engine")
    assert not problems, "\n".join(problems)


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
    assert all(import_problem(edge) for edge in edges)
    back = EngineImport("engine.config", "engine.hardware", ROOT / "engine" / "config" / "__init__.py", 1)
    assert import_problem(back) is None
    assert circles([edges[0], back]) == [["engine.config", "engine.hardware"]]


def test_imports_by_string_are_checked(tmp_path):
    """`import_module`, `__import__` and `_EXPORTS` of a literal name are imports (a computed
    name is not); the face's `_EXPORTS` may point anywhere below it, a lower module's may not."""
    source = tmp_path / "hardware.py"
    source.write_text("import importlib\ndef f(name):\n    importlib.import_module(name)\n"
                      "    importlib.import_module('engine.config')\n    __import__('engine.core.scheduler')\n"
                      "_EXPORTS = {\n    'EngineConfig': 'engine.config',\n}\n")
    face = tmp_path / "__init__.py"
    face.write_text("_EXPORTS = {'Scheduler': 'engine.core.scheduler'}\n")
    empty = tmp_path / "empty.py"
    empty.write_text("")
    modules = {"engine": face, "engine.hardware": source, "engine.config": empty, "engine.core.scheduler": empty}
    edges = sorted(engine_imports(modules), key=lambda e: (e.source, e.line))
    assert [(e.source, e.target, e.line) for e in edges] == [
        ("engine", "engine.core.scheduler", 1), ("engine.hardware", "engine.config", 4),
        ("engine.hardware", "engine.core.scheduler", 5), ("engine.hardware", "engine.config", 7)]
    assert [bool(import_problem(edge)) for edge in edges] == [False, True, True, True]


def test_a_module_no_tier_lists_is_reported():
    """A new root module has no part (the face is `engine/__init__.py` alone), and an import
    of it cannot be judged; a new module of a listed folder is that folder's."""
    assert part_of("engine") == "engine"
    assert part_of("engine.core.new_module") == "engine.core"
    problems = placement_problems(["engine", "engine.core.new_module", "engine.new_module"])
    assert len(problems) == 1 and problems[0].startswith("engine.new_module has no part in TIERS")
    assert "in TIERS in tests/engine/test_layout.py" in problems[0]
    edge = EngineImport("engine.entrypoints.llm", "engine.new_module", ROOT / "engine" / "entrypoints" / "llm.py", 1)
    assert import_problem(edge) == "engine/entrypoints/llm.py:1: engine.entrypoints.llm imports engine.new_module: " \
                                   "engine.new_module has no part in TIERS to judge it by"


def test_where_rows_resolve_names_against_the_row_folder():
    """A bare file name is in the last folder named before it in its cell; other names are
    from engine/; the vLLM column, other backticked names and other sections are not read."""
    table = ("## Where the code is\n\n| tier | where | vLLM's |\n|---|---|---|\n"
             "| a | `llm.py` (`LLM`), `worker/`: `worker.py`, `core/scheduler.py`, "
             "`attention/backends/`: `cpu_attn.py` | `v1/worker/` |\n\n"
             "## Measurements\n| b | `not_in_the_section.py` | |\n")
    assert where_rows(table) == [WhereRow("a", ["llm.py", "worker/", "worker/worker.py", "core/scheduler.py",
                                                "attention/backends/", "attention/backends/cpu_attn.py"])]


def test_the_docs_table_check_sees_a_missing_file_and_an_unnamed_folder(tmp_path):
    for package in ("core", "worker", "worker/ops"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "core" / "scheduler.py").write_text("")
    table = ("## Where the code is\n\n| tier | where | vLLM's |\n|---|---|---|\n"
             "| scheduler side | `core/`: `scheduler.py`, `sequence.py` | |\n| device | `worker/` | |\n")
    where = 'docs/engine.md, "Where the code is"'
    assert where_table_problems(table, tmp_path) == [
        f"{where}: no row names the folder engine/worker/ops/; add it to the row of its tier",
        f"{where}: the 'scheduler side' row names engine/core/sequence.py, which does not exist"]
