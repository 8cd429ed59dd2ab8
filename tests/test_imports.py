"""The import graph of ``src/syncbn`` has no cycle and flows one way (read with ``ast``, nothing imported).

Every ``import``/``from ... import`` statement counts, wherever it stands (module level or inside a
function): an import inside a function still makes a cycle, only a later one. The command line's
``importlib.import_module`` of its subcommands is not an import statement and is not counted.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
PACKAGE = "syncbn"

# Lower numbers sit lower: a module may import only modules of a strictly lower layer (or, within
# its own package, siblings of its layer). Modules not listed are checked for cycles only.
LAYERS: dict[str, int] = {
    # the shared arithmetic's leaves, the family math, configuration and transports' leaves
    "syncbn._config": 0,
    "syncbn._errors": 0,  # the channel-count error every check raises
    "syncbn.families._arith": 0,  # the arithmetic the families and the engine share (torch only)
    "syncbn.engine._double_backward": 0,
    "syncbn._shm": 0,
    "syncbn._threads": 0,
    "syncbn._accumulating": 0,  # the running-statistics hook of syncbn.accumulation
    "syncbn._cmbn": 2,  # the CmBN statistics hook (torch and the family protocol)
    "syncbn._fx": 0,  # how layers appear in torch.fx graphs (torch only)
    "syncbn._row": 0,  # the consistency check's row: its fields, codes and words (torch only)
    "syncbn.families": 1,  # a family is its math: torch and the shared arithmetic only
    "syncbn.engine._packing": 1,
    "syncbn.engine._math": 2,
    "syncbn.groups": 1,  # the communication seam
    "syncbn._checks": 2,
    "syncbn.engine._rules": 3,  # the engine's dtype rules and one-value error
    "syncbn.engine._function": 4,  # the engine: moments, framed sum, Join policy, eager autograd
    "syncbn.engine._ops": 5,  # the collective operator for torch.compile
    "syncbn.engine._compiled": 6,  # the traced engine around the operator
    "syncbn.functional": 7,
    "syncbn.parallel": 7,
    "syncbn._layer": 7,  # what every layer class shares (syncbn._layer.LayerMixin)
    "syncbn._abn_layer": 8,
    "syncbn.modules": 9,
    "syncbn.activated": 9,
    "syncbn.renorm": 10,
    "syncbn.convert": 10,
    "syncbn.fuse": 10,
    "syncbn.accumulate": 10,  # syncbn.accumulation (the module is not named after the class it exports)
    "syncbn.quantization": 11,  # torch.ao's fusion tables, above convert
}


def _modules() -> dict[str, str]:
    """Dotted module name -> file path, for every module of the package."""
    found = {}
    root = os.path.join(SRC, PACKAGE)
    for folder, _, files in os.walk(root):
        for name in files:
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(folder, name), SRC)[: -len(".py")].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            found[".".join(rel)] = os.path.join(folder, name)
    return found


def _imports(module: str, path: str, known: dict[str, str]) -> Iterator[str]:
    """The package's modules that ``module`` imports (explicitly; parent packages are not implied)."""
    is_package = path.endswith("__init__.py")
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                yield candidate if candidate in known else base


def _graph() -> dict[str, set[str]]:
    known = _modules()
    graph = {name: set() for name in known}
    for name, path in known.items():
        for target in _imports(name, path, known):
            assert target in known, f"{name} imports {target}, which is not a module of the package"
            if target != name:
                graph[name].add(target)
    return graph


def _layer(module: str) -> int | None:
    while module:
        if module in LAYERS:
            return LAYERS[module]
        module = module.rpartition(".")[0]
    return None


def test_the_graph_is_read() -> None:
    graph = _graph()
    assert "syncbn.engine._function" in graph["syncbn.functional"]
    assert "syncbn.modules" in graph["syncbn.convert"]
    assert "syncbn.parallel._joint" in graph["syncbn.parallel._replication"]


def test_no_import_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycle = path[path.index(target) :] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_imports_flow_down_the_layers() -> None:
    wrong = []
    for module, targets in _graph().items():
        mine = _layer(module)
        if mine is None:
            continue
        for target in targets:
            theirs = _layer(target)
            if theirs is not None and theirs >= mine and _top(target) != _top(module):
                wrong.append(f"{module} (layer {mine}) imports {target} (layer {theirs})")
    assert not wrong, "\n".join(wrong)


def test_no_frame_or_gc_introspection() -> None:
    """Library code learns nothing from stack frames or the garbage collector's object list."""
    banned = {"_getframe", "f_locals", "f_back", "currentframe", "get_objects", "get_referrers", "stack"}
    found = []
    for module, path in _modules().items():
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in banned:
                value = node.value
                owner = value.id if isinstance(value, ast.Name) else ""
                if node.attr != "stack" or owner == "inspect":
                    found.append(f"{module}:{node.lineno}: {owner}.{node.attr}")
    assert not found, "\n".join(found)


def _top(module: str) -> str:
    """The module's entry in LAYERS (``syncbn.parallel`` for ``syncbn.parallel._joint``)."""
    while module and module not in LAYERS:
        module = module.rpartition(".")[0]
    return module


def test_import_syncbn_leaves_dynamo_unimported_and_its_constant_mark_is_torchs() -> None:
    """``import syncbn`` does not import ``torch._dynamo`` (about 1.5 s of every process's start);
    the mark syncbn puts on its trace-time functions is the one torch's decorator puts."""
    import subprocess
    import sys

    code = "import sys, syncbn; print('torch._dynamo' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr

    import torch._dynamo

    from syncbn.engine import _ops, _rules

    def ours() -> None: ...

    def torchs() -> None: ...

    assert vars(_rules.constant_while_tracing(ours)) == vars(torch._dynamo.assume_constant_result(torchs))
    for fn in (_rules.warn_while_tracing, _ops.group_handle, _ops.tracing_a_checkpointed_region):
        assert vars(fn) == vars(torchs), fn
