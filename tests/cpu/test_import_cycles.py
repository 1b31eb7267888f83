"""No import cycle in `torpor/`, counting every import: module level, `if TYPE_CHECKING:` blocks and the lazy
imports inside functions (the CLI defers torch that way; a lazy import that closes a cycle still hides one)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "torpor"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(tree: ast.Module, name: str, is_package: bool, modules: set[str], lazy: bool = True) -> set[str]:
    """The torpor modules `tree` imports: at module level, and with `lazy` inside functions too. `from package
    import module` names the module only: its package runs first whatever the form, so that edge is no choice
    of the importer."""
    found: set[str] = set()
    nodes = list(ast.walk(tree)) if lazy else list(tree.body)
    while nodes:
        node = nodes.pop()
        if not lazy and isinstance(node, ast.If | ast.Try):  # `if TYPE_CHECKING:`, `try: import x`
            nodes += node.body + node.orelse + getattr(node, "handlers", []) + getattr(node, "finalbody", [])
        elif not lazy and isinstance(node, ast.ExceptHandler):
            nodes += node.body
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            submodules = {f"{base}.{alias.name}" for alias in node.names} & modules
            found |= submodules
            if len(submodules) < len(node.names):  # names defined by `base` itself
                found.add(base)
    return {m for m in found if m in modules and m != name}


def import_graph(lazy: bool = True) -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    return {name: imports(ast.parse(path.read_text()), name, path.name == "__init__.py", modules, lazy)
            for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_imports():
    graph, eager = import_graph(), import_graph(lazy=False)
    assert "torpor.engine.scheduler" in eager["torpor.engine.llm_engine"]
    assert "torpor.engine.models.layers.fused" in eager["torpor.engine.models.layers.norm"]
    lazy_only = {(a, b) for a in graph for b in graph[a] - eager[a]}
    assert lazy_only, "the lazy imports inside functions are counted too"
    assert all(eager[a] <= graph[a] for a in graph)


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_a_cycle_is_found():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
