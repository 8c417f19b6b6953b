"""The package's import graph has no circles (issue 34), counting imports inside functions too.

A lazy import hides a circle from Python's import machinery but not from a reader: two modules that need each
other are one module in two files. The graph is read from the source (ast), so it needs no import to run.
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "memkernels")


def _modules():
    """{dotted name: path} of every module of the package."""
    modules = {}
    for directory, _, files in os.walk(PACKAGE):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(directory, file)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                modules[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return modules


def import_graph():
    """{module: {modules of the package it imports anywhere in its source}}; a package's ``__init__`` only
    through the names its importers take from it."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        with open(path) as source:
            tree = ast.parse(source.read())
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets.update(f"{base}.{alias.name}" for alias in node.names)
                targets.add(base)
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_circles():
    graph = import_graph()
    assert "memkernels.tools.plan_apply" in graph["memkernels.tools.placement"]  # the walk sees imports
    assert "memkernels.patch" in graph["memkernels.tools.plan_apply"]  # ... inside functions too
    assert cycles(graph) == []


def test_the_walk_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_patching_does_not_import_the_planner_and_the_allocator_no_tool():
    """memkernels.apply(model, plan) is planning's entry (tools/plan_apply.py); the runtime (allocator, offload,
    meters, device) imports no tool."""
    graph = import_graph()
    helpers = {"memkernels.tools.sizes"}  # parsing and printing byte sizes: a helper, not a tool
    assert {name for name in graph["memkernels.patch"] if name.startswith("memkernels.tools.")} - helpers == {
        "memkernels.tools.profile"}  # the activation ledger apply(measure=True) reads
    for runtime in ("memkernels.allocator", "memkernels.offload", "memkernels.meters", "memkernels.device"):
        assert {name for name in graph[runtime] if name.startswith("memkernels.tools")} - helpers == set(), runtime
