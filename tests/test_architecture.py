"""The package's import graph, read from the source with `ast`: no cycles, and no layer imports a higher one.

Every import counts, also those inside functions (a lazy import is still a dependency). `conversion/` and
`model_cards/` install as `hf_eagle3.conversion` and `hf_eagle3.model_cards`, and are read under those names.
"""

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "hf_eagle3"
# where each package's source lives (the shipped draft folder under assets/ is data, not part of the package)
SOURCES = {"hf_eagle3": REPO_ROOT / "hf_eagle3", "hf_eagle3.conversion": REPO_ROOT / "conversion",
           "hf_eagle3.model_cards": REPO_ROOT / "model_cards"}
DATA_FOLDERS = {REPO_ROOT / "hf_eagle3" / "assets"}

# Low to high: a module may import its own layer and the layers above it in this list, never one below it.
LAYERS = [
    ("utils", ["hf_eagle3.utils"]),
    ("configuration", ["hf_eagle3.configuration_eagle3"]),
    ("modeling", ["hf_eagle3.modeling_eagle3"]),
    ("conversion", ["hf_eagle3.conversion"]),
    ("decoding", ["hf_eagle3.decoding", "hf_eagle3.generation"]),
    # models and prompt sets by name, what training and commands load (`hf_eagle3.smollm2`: its earlier import path)
    ("resources", ["hf_eagle3.resources", "hf_eagle3.smollm2"]),
    # the engines users deploy, in processes of their own, as `hf-eagle3 bench` methods and `make engines` run them
    ("engines", ["hf_eagle3.engines"]),
    ("training", ["hf_eagle3.training"]),
    ("publishing", ["hf_eagle3.publishing", "hf_eagle3.model_cards"]),
    ("commands", ["hf_eagle3.commands"]),
]
# The public API (`hf_eagle3/__init__.py`) and `python -m hf_eagle3` are in no layer: they may import anything.
UNLAYERED = {"hf_eagle3", "hf_eagle3.__main__"}


def _module_files() -> dict[str, Path]:
    """Every module of the package, by its import name."""
    modules = {}
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            if any(data in path.parents for data in DATA_FOLDERS):
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _imported_names(path: Path, module: str) -> set[str]:
    """The absolute names `module` imports anywhere in its file: `import a.b` gives `a.b`; `from a import b` gives
    `a.b` (resolved below to the module `a.b` or, when `b` is a name defined in `a`, to `a`)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            source = ".".join(part for part in (base, node.module) if part)
            names.update(f"{source}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """Each module of the package and the modules of the package it imports."""
    modules = _module_files()
    graph = {}
    for module, path in modules.items():
        imported = set()
        for name in _imported_names(path, module):
            while name and name not in modules:  # `from a import b` of a name b, or a module outside the package
                name = name.rpartition(".")[0]
            if name and name != module:
                imported.add(name)
        graph[module] = imported
    return graph


def layer_of(module: str) -> int | None:
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes):
            return rank
    return None


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, marking modules on the current path)."""
    done, path = set(), []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done:
            return None
        path.append(module)
        for imported in sorted(graph[module]):
            if cycle := visit(imported):
                return cycle
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        if cycle := visit(module):
            return cycle
    return None


def test_the_graph_reads_every_module_and_its_lazy_and_relative_imports():
    graph = import_graph()
    assert {"hf_eagle3", "hf_eagle3.conversion.convert", "hf_eagle3.model_cards"} <= graph.keys()
    assert not any(module.startswith("hf_eagle3.assets") for module in graph)
    assert "hf_eagle3.conversion.official" in graph["hf_eagle3.conversion.convert"]  # `from . import official`
    assert "hf_eagle3" in graph["hf_eagle3.commands.cli"]  # `from .. import __version__`, inside a function
    assert "hf_eagle3.configuration_eagle3" in graph["hf_eagle3.modeling_eagle3"]


def test_every_module_is_in_a_layer():
    unplaced = [module for module in import_graph() if layer_of(module) is None and module not in UNLAYERED]
    assert not unplaced, f"add {unplaced} to a layer of LAYERS in {Path(__file__).name}"


def test_there_are_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_module_imports_a_higher_layer():
    graph = import_graph()
    upward = []
    for module, imported in graph.items():
        if (rank := layer_of(module)) is None:
            continue
        for name in sorted(imported):
            # importing the package root imports what the root imports
            for reached in sorted(graph[PACKAGE]) if name == PACKAGE else [name]:
                if layer_of(reached) > rank:
                    upward.append(f"{module} ({LAYERS[rank][0]}) imports {reached} ({LAYERS[layer_of(reached)][0]})"
                                  + (" through the package root" if name == PACKAGE else ""))
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)
