"""The import graph of `hybridflow` has no cycles, between packages or between modules.

Every import is read with `ast`, top level and inside functions. The package graph also counts imports under
`if TYPE_CHECKING:` (a lower layer should not name a higher one's types); the module graph does not (they never run,
so they need no import hidden in a function). A cycle is usually kept alive by an import hidden inside a function,
so those are counted too and may only go down.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "hybridflow"

# Imports that still close a cycle, in code under active refactoring: (importing module, imported module) -> why.
# They are left out of both graphs; the test fails once one no longer closes a cycle, so this list only shrinks.
ALLOWED_BACK_EDGES: dict[tuple[str, str], str] = {
    ("hybridflow.checkpoint.manager", "hybridflow"): "reads __version__ from the API facade, which reaches the "
    "trainer through hybridflow.api; hybridflow.version ends it (checkpoint/ is being refactored)",
    ("hybridflow.rollout.decode_attention", "hybridflow.rollout.forward"): "apply_rope, imported in a function; "
    "it belongs below both (rollout/ is being refactored)",
    ("hybridflow.rollout.kv_store_kernel", "hybridflow.rollout.forward"): "apply_rope, as above",
}

# Imports of hybridflow modules inside function bodies still allowed; the number may only go down. Those left are
# lazy on purpose: the CLI imports every command module to build its parser, and commands/ (the trainers, rollout,
# models, data: torch, transformers, triton, pyarrow), config/ (algorithm registries, model shapes), preflight.py,
# trainer/run.py and api.py (`hybridflow.build_config`) stay free of torch for it; `import hybridflow` reaches the
# API only on first use; controller/backends loads the optional ray backend; planning/ reads model shapes through
# models/ (transformers) only when asked; rollout/engine loads the agent server only in that mode; checkpoint/ and
# rollout/ are being refactored.
MAX_FUNCTION_IMPORTS = 62


@dataclass(frozen=True)
class Import:
    source: str  # importing module, e.g. "hybridflow.config.loader"
    target: str  # imported module, e.g. "hybridflow.rewards.manager"
    line: int
    in_function: bool
    type_only: bool  # under `if TYPE_CHECKING:`


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _all_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, in_function: bool = False, type_only: bool = False) -> Iterator[tuple[ast.AST, bool, bool]]:
    for child in ast.iter_child_nodes(node):
        inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        typing = type_only or _is_type_checking(node) and child in node.body
        yield child, inside, typing
        yield from _walk(child, inside, typing)


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is a hybridflow module (or None for another project)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _imports_of(module: str, path: Path, modules: dict[str, Path]) -> Iterator[Import]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node, in_function, type_only in _walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != module:
                yield Import(module, target, node.lineno, in_function, type_only)


@functools.cache
def all_imports() -> tuple[Import, ...]:
    modules = _all_modules()
    return tuple(imp for module, path in modules.items() for imp in _imports_of(module, path, modules))


def package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def cycles(edges: set[tuple[str, str]]) -> list[frozenset[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def _describe(component: frozenset[str], imports: Sequence[Import], key: Callable[[str], str]) -> str:
    lines = [f"cycle among {sorted(component)}:"]
    for source, line, target, where in sorted({
        (i.source, i.line, i.target, "in a function" if i.in_function else "top level") for i in imports
        if key(i.source) != key(i.target) and key(i.source) in component and key(i.target) in component
    }):
        lines.append(f"  {source}:{line} -> {target} ({where})")
    return "\n".join(lines)


def _reaches(edges: set[tuple[str, str]], start: str, goal: str) -> bool:
    seen, todo = {start}, [start]
    while todo:
        node = todo.pop()
        for a, b in edges:
            if a == node and b not in seen:
                if b == goal:
                    return True
                seen.add(b)
                todo.append(b)
    return False


def _check(imports: Sequence[Import], key: Callable[[str], str]) -> None:
    kept = [i for i in imports if (i.source, i.target) not in ALLOWED_BACK_EDGES]
    found = cycles({(key(i.source), key(i.target)) for i in kept if key(i.source) != key(i.target)})
    assert not found, "import cycles (move the shared piece a layer down):\n" + "\n".join(
        _describe(c, kept, key) for c in found
    )


def test_no_package_cycles() -> None:
    _check(all_imports(), package_of)


def test_no_module_cycles() -> None:
    _check([i for i in all_imports() if not i.type_only], lambda m: m)


def test_allowed_back_edges_still_close_a_cycle() -> None:
    edges = {(i.source, i.target) for i in all_imports() if not i.type_only}
    gone = [edge for edge in ALLOWED_BACK_EDGES if edge not in edges or not _reaches(edges, edge[1], edge[0])]
    assert not gone, f"these imports no longer close a cycle; delete them from ALLOWED_BACK_EDGES: {gone}"


def test_function_level_imports_only_go_down() -> None:
    inside = sorted({(i.source, i.line, i.target) for i in all_imports() if i.in_function})
    listing = "\n".join(f"  {s}:{line} -> {t}" for s, line, t in inside)
    assert len(inside) <= MAX_FUNCTION_IMPORTS, (
        f"{len(inside)} imports of hybridflow modules inside functions (ceiling {MAX_FUNCTION_IMPORTS}); "
        f"move them to the top of the module:\n{listing}"
    )


def test_cycle_finder_sees_a_cycle_through_three_nodes() -> None:
    assert cycles({("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")}) == [frozenset({"a", "b", "c"})]
