"""The package's shape: no import cycles, between modules or between
packages, counting imports inside functions too (a function-local import
cannot hide one); every import between packages goes down the layers of
`LAYERS`; and the XLA:CPU tuning is imported only where the platform is CPU."""

import ast
import importlib
import pathlib

SRC = pathlib.Path(__file__).parent.parent / "src"
# The one module that may import dpax.xla_cpu: it does so only for CPU devices.
XLA_CPU_GATE = "dpax.parallel.platform"

# What `from dpax import Name` reaches: the module the root loads it from.
ROOT_EXPORTS: dict[str, str] = importlib.import_module("dpax")._EXPORTS

# dpax's packages (and top-level modules) from the top down. A package imports
# only from layers below its own: none from its own layer but itself, none
# from above. The batch's way reads up the table: `data` makes the batches,
# `models` compute on them, `parallel` runs them on the devices, `training`
# steps and loops, `cli` and `bench` drive it all.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("__main__",),  # `python -m dpax`: the command
    ("cli",),
    ("bench",),  # `dpax bench`: trains through the Trainer and the hand-written loops
    # The engine's two users: the Trainer, and jax.pmap's idioms (`dpax.pmap`).
    ("training", "pmap"),
    # What training is built on: the engine, the step's jaxpr analyses (JAX and
    # dpax.errors only); and the writers, where the CLI sends the loop's rows.
    ("analysis", "parallel", "writers"),
    ("models",),  # their layers read the step's batch context and sum over the devices
    ("data",),
    # Leaves: sums over a mesh axis (the engine's and SyncBatchNorm's), and the
    # XLA:CPU tuning, which `XLA_CPU_GATE` alone imports.
    ("collectives", "xla_cpu"),
    # What the leaves share with the rest: small pieces that import nothing
    # from dpax but dpax.errors.
    ("config", "dense_grads", "machine", "ratios"),
    ("errors",),
)
# The package root (its lazy exports) and the lazy-attribute helper that every
# package's __init__ uses: they import nothing at import time.
EXEMPT = {"dpax", "_submodules"}


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
            # `from pkg import mod` imports pkg.mod when that is a module; a
            # name the package root exports comes from the module that holds it.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known
                       else ROOT_EXPORTS.get(a.name, base) if base == "dpax" else base
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


def package(module: str) -> str:
    """`dpax.data.batches` -> `data`; `dpax.config` -> `config`; `dpax` -> `dpax`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for name, targets in edges.items():
        out.setdefault(package(name), set()).update(
            package(t) for t in targets if package(t) != package(name))
    return out


def upward(edges: dict[str, set[str]], layers=LAYERS, exempt=EXEMPT) -> list[str]:
    """Each module import that does not go down `layers`, as a sentence."""
    level = {p: i for i, layer in enumerate(layers) for p in layer}
    out = []
    for name in sorted(edges):
        for target in sorted(edges[name]):
            a, b = package(name), package(target)
            if a == b or a in exempt or b in exempt:
                continue
            if level[a] >= level[b]:
                where = "in the same layer as" if level[a] == level[b] else "above"
                out.append(f"{name} imports {target}, but `{b}` is {where} `{a}`")
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


def test_the_layer_check_finds_an_import_upwards_or_sideways():
    layers = (("top",), ("mid", "side"), ("low",))
    edges = {"dpax.top.a": {"dpax.mid.b", "dpax.low"}, "dpax.mid.b": {"dpax.top.a"},
             "dpax.side": {"dpax.mid.b", "dpax"}, "dpax.low": {"dpax._submodules"}}
    assert upward(edges, layers) == [
        "dpax.mid.b imports dpax.top.a, but `top` is above `mid`",
        "dpax.side imports dpax.mid.b, but `mid` is in the same layer as `side`"]


def test_every_package_has_a_layer():
    placed = {p for layer in LAYERS for p in layer}
    unplaced = {package(name) for name in modules()} - placed - EXEMPT
    assert not unplaced, f"add {sorted(unplaced)} to LAYERS in tests/test_structure.py"


def test_no_package_cycles():
    assert cycles(package_graph(graph())) == []


def test_imports_between_packages_go_down_the_layers():
    wrong = upward(graph())
    assert not wrong, "imports against LAYERS (tests/test_structure.py):\n" + "\n".join(wrong)
