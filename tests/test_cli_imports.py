"""Issue 19: the command line's modules import each other without a cycle, counting the imports inside functions,
which `tests/test_layout.py`'s fresh-interpreter check (module-level imports only) cannot see: `doctor` imported
`ray_probe` and `ray_probe`'s worker entry imported `doctor` back. Read from the source, like test_layout."""

from __future__ import annotations

from test_layout import imports_of, modules


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of `graph` as a path [a, b, ..., a], or [] when there is none."""
    state: dict[str, str] = {}

    def visit(node: str, stack: list[str]) -> list[str]:
        if state.get(node) == "open":
            return stack[stack.index(node):] + [node]
        if state.get(node) == "done":
            return []
        state[node] = "open"
        for child in sorted(graph.get(node, ())):
            found = visit(child, stack + [node])
            if found:
                return found
        state[node] = "done"
        return []

    for node in sorted(graph):
        found = visit(node, [])
        if found:
            return found
    return []


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import():
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle_among_the_commands_counting_imports_inside_functions():
    found = modules()
    commands = {name: path for name, path in found.items()
                if name.startswith("verl_dppo.cli.") and not name.startswith("verl_dppo.cli.demo")}
    graph = {name: {target for target in imports_of(name, path)[0] if target in commands}
             for name, path in commands.items()}
    assert not _cycle(graph), " -> ".join(_cycle(graph))
    assert "verl_dppo.cli.install_probe" in graph["verl_dppo.cli.ray_probe"]  # the worker's probe, not doctor's
