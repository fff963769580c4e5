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


def test_no_import_cycles_between_modules():
    graph = {m: set() for m, _ in modules()}
    for module, path in modules():
        for target, _ in imports(path):
            # `from gattn.eval import analysis` names the module gattn.eval.analysis
            graph[module].add(target if target in graph else target.rsplit(".", 1)[0])
    seen, on_path = set(), []

    def visit(m):
        if m in on_path:
            raise AssertionError("import cycle: " + " -> ".join(on_path[on_path.index(m):] + [m]))
        if m in seen or m not in graph:
            return
        on_path.append(m)
        for t in graph[m]:
            visit(t)
        on_path.pop()
        seen.add(m)

    for m in graph:
        visit(m)


def test_the_rule_catches_an_upward_import(tmp_path):
    """The checker itself: a model module importing the trainer is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from gattn.train import trainer\n")
    assert [(t, line) for t, line in imports(bad)] == [("gattn.train", 2)]
    assert RANK[unit("gattn.train")] > RANK[unit("gattn.model.attention")]
