"""The package's shape: no import cycles, counting imports inside functions
too (a function-local import cannot hide one), and the XLA:CPU tuning is
imported only where the platform is CPU."""

import ast
import pathlib

SRC = pathlib.Path(__file__).parent.parent / "src"
# The one module that may import dpax.xla_cpu: it does so only for CPU devices.
XLA_CPU_GATE = "dpax.parallel.platform"


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted((SRC / "dpax").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The dpax modules `name` imports anywhere in its file (its parent package
    too: importing a submodule runs the package's __init__ first)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    # `if TYPE_CHECKING:` imports are read by type checkers, never run.
    unrun = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
             and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
             for child in node.body for n in ast.walk(child)}
    for node in ast.walk(tree):
        if id(node) in unrun:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            # `from pkg import mod` imports pkg.mod when that is a module.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import dpax.x.y` of a name in x
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    parent = name.rpartition(".")[0]
    if parent and parent in known:
        found.add(parent)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_even_through_function_local_imports():
    assert cycles(graph()) == []


def test_only_the_platform_gate_imports_the_xla_cpu_tuning():
    users = {name for name, targets in graph().items()
             if any(t == "dpax.xla_cpu" or t.startswith("dpax.xla_cpu.") for t in targets)
             and not name.startswith("dpax.xla_cpu")}
    assert users <= {XLA_CPU_GATE}, users
