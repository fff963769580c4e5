"""The package's layers: a module imports only from its own package or from packages to its
left, function-local imports included (gattn/__init__.py draws the layers)."""

import ast
from pathlib import Path

GATTN = Path(__file__).resolve().parents[1] / "gattn"
# Left to right. Top-level modules are their own layer; the `python -m` entry points sit on top.
LAYERS = [("config",), ("variants",), ("cluster",), ("cli",), ("kernels", "data"), ("model",), ("train",), ("eval",),
          ("interop", "experiments"), ("convert", "study", "main_job", "demo", "params", "launch", "rehearse", "lm_eval", "generate", "prepare")]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def unit(module: str) -> str:
    """gattn.model.attention -> "model"; gattn.cli -> "cli"."""
    return module.split(".")[1]


def imports(path: Path) -> list[tuple[str, int]]:
    """(gattn module, line) for every import in the file, function-local ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("gattn.")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "gattn":
                out += [(f"gattn.{a.name}", node.lineno) for a in node.names]
            elif node.module.startswith("gattn."):
                out.append((node.module, node.lineno))
    return out


def modules():
    for path in sorted(GATTN.rglob("*.py")):
        rel = path.relative_to(GATTN.parent).with_suffix("")
        module = ".".join(p for p in rel.parts if p != "__init__")
        if "configs" not in rel.parts and module != "gattn":  # (presets only describe)
            yield module, path


def test_every_module_has_a_layer():
    assert {unit(m) for m, _ in modules()} <= set(RANK), {unit(m) for m, _ in modules()} - set(RANK)


def test_imports_point_left_or_within():
    bad = []
    for module, path in modules():
        for target, line in imports(path):
            if unit(target) not in RANK:
                bad.append(f"{path}:{line} imports {target}, which is in no layer")
            elif unit(target) != unit(module) and RANK[unit(target)] >= RANK[unit(module)]:
                bad.append(f"{path}:{line}: {module} ({unit(module)}) imports {target} ({unit(target)})")
    assert not bad, "\n".join(bad)


def import_graph() -> dict[str, set[str]]:
    """gattn module -> the gattn modules it imports, function-local imports included: a local import
    only defers the import to the first call, and the two modules still depend on each other's names
    (today's one circle hid that way). `from gattn.interop import qwen3_5` names the module
    gattn.interop.qwen3_5; `from gattn.config import ConfigError` names gattn.config."""
    paths = dict(modules())
    graph = {}
    for module, path in paths.items():
        graph[module] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                graph[module] |= {a.name for a in node.names if a.name in paths}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for a in node.names:
                    name = f"{node.module}.{a.name}"
                    target = name if name in paths else node.module
                    if target in paths:
                        graph[module].add(target)
        graph[module].discard(module)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index, low, stack, found = {}, {}, [], []

    def visit(m):
        index[m] = low[m] = len(index)
        stack.append(m)
        for t in graph.get(m, ()):
            if t not in index:
                visit(t)
                low[m] = min(low[m], low[t])
            elif t in stack:
                low[m] = min(low[m], index[t])
        if low[m] == index[m]:
            component = stack[stack.index(m):]
            del stack[stack.index(m):]
            if len(component) > 1:
                found.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return found


def test_no_import_cycles_between_modules():
    """No two modules import each other, directly or through others (any import, anywhere in the file)."""
    found = circles(import_graph())
    assert not found, "modules that import each other: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_circle_rule_sees_through_packages_and_chains():
    """The checker itself: a circle through three modules is one component; a package import and a
    module beside it are told apart."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    graph = import_graph()
    assert "gattn.interop.convert" in graph["gattn.interop.runs"]  # (`from gattn.interop import convert`, in a function)
    assert "gattn.interop" not in graph["gattn.interop.runs"]
    assert "gattn.variants" in graph["gattn.cli"]  # (`from gattn import variants`: a module of the top package)


def test_the_rule_catches_an_upward_import(tmp_path):
    """The checker itself: a model module importing the trainer is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from gattn.train import trainer\n")
    assert [(t, line) for t, line in imports(bad)] == [("gattn.train", 2)]
    assert RANK[unit("gattn.train")] > RANK[unit("gattn.model.attention")]
