"""The package's import graph has no circles (issue 34), counting imports inside functions too, and no module
reaches into another's private names.

A lazy import hides a circle from Python's import machinery but not from a reader: two modules that need each
other are one module in two files. A name with a leading underscore is a module's own business: another module
that needs it makes it part of an interface nobody declared. The source is read with ast, so nothing is imported.
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
    assert "memkernels.planning.apply_plan" in graph["memkernels.planning.placement"]  # the walk sees imports
    assert "memkernels.fusions.apply" in graph["memkernels.planning.apply_plan"]  # ... inside functions too
    assert cycles(graph) == []


def test_the_walk_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_runtime_and_the_fusions_import_no_planner_forensics_or_audit():
    """A training process loads the runtime (allocator, offload, device, meters, ledger) and the fusions; the
    tools that decide before a run, read a dead one, or count kernels on a CPU stay out of it.
    memkernels.apply(model, plan) is planning's entry (planning/apply_plan.py), so patching imports no planner."""
    graph = import_graph()
    tools = ("memkernels.planning", "memkernels.forensics", "memkernels.audit")
    loaded = [name for name in graph if name.startswith(("memkernels.runtime", "memkernels.fusions"))]
    assert {"memkernels.runtime.allocator", "memkernels.runtime.offload", "memkernels.runtime.ledger",
            "memkernels.fusions.apply", "memkernels.fusions.norm.rule"} <= set(loaded)
    for name in loaded:
        assert not {target for target in graph[name] if target.startswith(tools)}, name
    # the walk sees these imports: the rule is not vacuous
    assert "memkernels.runtime.ledger" in graph["memkernels.fusions.apply"]
    assert "memkernels.runtime.allocator" in graph["memkernels.forensics.monitor"]


def test_the_public_module_names_are_the_runtime_modules():
    """memkernels.allocator, .offload, .device and .meters (the README's spellings) are the runtime's modules
    themselves, not copies: a setting made through one is seen by the other."""
    import importlib

    for name in ("allocator", "offload", "device", "meters"):
        assert importlib.import_module(f"memkernels.{name}") is importlib.import_module(f"memkernels.runtime.{name}")


# The compiled C++ core is a module named by extension-module convention, not a private name of the package.
_EXTENSION_MODULES = {"_C"}


def _resolve(node, package):
    """The absolute module an ``ast.ImportFrom`` names."""
    base = node.module or ""
    if node.level:
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
    return base


def private_crossings(sources, packages):
    """{(importer, module): {private names}} for ``sources`` ({dotted name: source text}; ``packages``: the names
    that are packages, i.e. ``__init__``): names with one leading underscore that a module imports from another
    (``from m import _x``) or reads off an imported module (``m._x``)."""
    found = {}
    for name, text in sources.items():
        tree = ast.parse(text)
        package = name if name in packages else name.rpartition(".")[0]
        modules = {}  # local name -> the package module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _resolve(node, package)
                for alias in node.names:
                    if f"{base}.{alias.name}" in sources:
                        modules[alias.asname or alias.name] = f"{base}.{alias.name}"
                    elif (base in sources and base != name and alias.name.startswith("_")
                          and not alias.name.startswith("__") and alias.name not in _EXTENSION_MODULES):
                        found.setdefault((name, base), set()).add(alias.name)
            elif isinstance(node, ast.Import):
                modules.update({alias.asname or alias.name: alias.name for alias in node.names
                                if alias.name in sources})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and modules.get(node.value.id, name) != name
                    and node.attr not in _EXTENSION_MODULES):
                found.setdefault((name, modules[node.value.id]), set()).add(node.attr)
    return found


def test_no_module_reads_another_modules_private_names():
    modules = _modules()
    sources = {}
    for name, path in modules.items():
        with open(path) as source:
            sources[name] = source.read()
    packages = {name for name, path in modules.items() if path.endswith("__init__.py")}
    assert private_crossings(sources, packages) == {}


def test_the_private_name_walk_finds_planted_crossings():
    sources = {"pkg": "", "pkg.a": "def _helper(): pass\n_TABLE = {}\n",
               "pkg.b": "from pkg.a import _helper, public\n",
               "pkg.c": "from pkg import a\nx = a._TABLE\ny = a.__name__\n",
               "pkg.d": "from pkg import _C\nfrom . import a\nz = a._helper\n"}
    assert private_crossings(sources, {"pkg"}) == {("pkg.b", "pkg.a"): {"_helper"}, ("pkg.c", "pkg.a"): {"_TABLE"},
                                          ("pkg.d", "pkg.a"): {"_helper"}}


def test_nothing_outside_the_audit_registers_kernels_into_pytorchs_own_ops():
    """Importing memkernels and running its ops leaves PyTorch's aten ops as they were: only the GPU audit, inside
    its count(), gives the CPU aten's float32-result GEMM (memkernels/fusions/common/half_gemm.py). A source walk,
    and the one overload checked after a half-precision chunked loss, whose dW takes that GEMM, ran on the CPU."""
    import torch

    registering = []
    for path in _modules().values():
        with open(path) as f:
            source = f.read()
        if 'Library("aten"' in source and os.sep + "audit" + os.sep not in path:
            registering.append(os.path.relpath(path, ROOT))
    assert not registering
    native = torch._C._dispatch_has_kernel_for_dispatch_key("aten::addmm.dtype_out", "CPU")  # a later torch's own
    from memkernels.functional import linear_cross_entropy
    hidden = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(10, 16, dtype=torch.bfloat16, requires_grad=True)
    linear_cross_entropy(hidden, weight, torch.randint(0, 10, (8,)), strategy="chunked", chunk_size=4,
                         backend="torch").backward()
    assert weight.grad is not None
    assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::addmm.dtype_out", "CPU") == native
