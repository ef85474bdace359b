"""The package's layers, read from its source (every import, at module level or inside a function):
arrows run down only, and no two modules import each other through any loop.

    cli -> instrument -> engine -> hostmem -> the leaves (options, log, errors, versions, ...)
"""
import ast
import os

import bridge_fgo

PACKAGE = os.path.dirname(bridge_fgo.__file__)
# a layer may import only from the layers after it
LAYERS = ["cli", "instrument", "engine", "hostmem"]


def modules():
    """module name -> source path, for every module of bridge_fgo."""
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def imports(name, path, known):
    """The bridge_fgo modules `name` imports (relative and absolute, `from X import module` included)."""
    tree = ast.parse(open(path).read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bases = [a.name for a in node.names]
            names = []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                bases = [".".join(base + ([node.module] if node.module else []))]
            else:
                bases = [node.module or ""]
            names = [a.name for a in node.names]
        else:
            continue
        for base in bases:
            if not base.startswith("bridge_fgo"):
                continue
            subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in known]
            found.update(subs or [m for m in [base] if m in known])
    found.discard(name)
    return found


def graph():
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def layer(name):
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def test_the_reader_sees_the_package():
    g = graph()
    assert "bridge_fgo.engine.streamed.engine" in g and "bridge_fgo.instrument.generations.none" in g
    assert "bridge_fgo.engine" in g["bridge_fgo.instrument.generations.none"]


def test_arrows_run_down_only():
    wrong = []
    for name, targets in graph().items():
        here = layer(name)
        if here is None:
            if name.count(".") > 0 and name != "bridge_fgo.__main__":  # a leaf imports no layer
                wrong += [(name, t) for t in targets if layer(t) is not None]
            continue
        for t in targets:
            there = layer(t)
            if there is not None and LAYERS.index(there) < LAYERS.index(here):
                wrong.append((name, t))
    assert not wrong, "\n".join(f"{a} imports {b}" for a, b in wrong)


def test_no_import_loops():
    g = graph()
    loops, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for t in sorted(g[node]):
            if state.get(t) == "open":
                loops.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[node] = "done"

    for node in sorted(g):
        if node not in state:
            visit(node, [node])
    assert not loops, "\n".join(" -> ".join(loop) for loop in loops)


# -- sizes: a class that holds too much is split by what each part holds ----------------------------------------
MAX_CLASS_LINES = 300
MAX_SCRIPT_LINES = 500


def test_no_class_over_300_lines_and_no_script_over_500():
    root = os.path.dirname(PACKAGE)
    big = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                big.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    for folder, _, files in os.walk(os.path.join(root, "scripts")):
        for f in files:
            if f.endswith((".py", ".sh")):
                path = os.path.join(folder, f)
                n = sum(1 for _ in open(path))
                if n > MAX_SCRIPT_LINES:
                    big.append(f"{os.path.relpath(path, root)}: {n} lines")
    assert not big, "\n".join(big)
