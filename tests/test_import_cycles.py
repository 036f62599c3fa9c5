"""No import cycle among attnres's modules, counting the imports inside functions too (a cycle that only a lazy import
breaks still ties the two modules together)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "attnres"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The attnres modules `path` names in any import statement (`from pkg import sub` counts `pkg.sub` alone)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
    return found & modules


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done, stack = set(), []

    def visit(name: str) -> list[str] | None:
        if name in stack:
            return stack[stack.index(name):] + [name]
        if name in done:
            return None
        stack.append(name)
        for target in sorted(graph[name]):
            cycle = visit(target)
            if cycle:
                return cycle
        stack.pop()
        done.add(name)
        return None

    for name in sorted(graph):
        cycle = visit(name)
        if cycle:
            return cycle
    return None


def test_no_module_imports_itself_through_others():
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: imports_of(path, set(paths)) - {name} for name, path in paths.items()}
    assert find_cycle(graph) is None


def test_the_check_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
