"""No import cycle among the project's packages (``ea_fairseq``, ``ea_fairseq_cli``, ``ea_ops``):
an AST walk over their sources, as one graph (a circle through two packages is a circle too).

Edges follow Python's import semantics: ``import a.b.c`` or ``from a.b import c`` runs
``a.b``'s ``__init__`` and then ``a.b.c`` (a submodule named in ``from ... import``), so the
importer depends on each package on the way -- except its own enclosing packages, which
are always being imported already when it runs. Imports at module level (including those
under ``if``/``try`` at the top and those placed at the bottom of a file) are what runs
when a module is imported; imports inside functions run later, but a cycle through them
is the same tangle, only hidden. Both are collected and reported separately; neither may
close a cycle. ``TYPE_CHECKING`` blocks do not run and are skipped.
"""
import ast
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Set, Tuple

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = [REPO / name for name in ("ea_fairseq", "ea_fairseq_cli", "ea_ops")]

Edges = Dict[str, Dict[str, Tuple[str, int]]]  # importer -> imported -> (file, line)


def modules_of(root: Path) -> Dict[str, Path]:
    """Dotted module name -> source file, for every ``.py`` file under the package ``root``."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def is_package(name: str, modules: Dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def resolve(importer: str, level: int, module: str, modules: Dict[str, Path]) -> str:
    """The absolute name of ``from <level dots><module> import ...`` in ``importer``."""
    if level == 0:
        return module
    base = importer.split(".")
    if not is_package(importer, modules):
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imported_names(node: ast.AST, importer: str, modules: Dict[str, Path]) -> List[str]:
    """The package's modules an import statement runs, outermost first."""
    targets = []
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = resolve(importer, node.level, node.module or "", modules)
        targets = [base] + [f"{base}.{alias.name}" for alias in node.names
                            if f"{base}.{alias.name}" in modules]
    ran = []
    for target in targets:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name in modules and name not in ran:
                ran.append(name)
    ancestors = {".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 1)}
    if is_package(importer, modules):
        ancestors.add(importer)
    return [name for name in ran if name not in ancestors and name != importer]


class ImportCollector(ast.NodeVisitor):
    """Imports of one file, split into module level and function level."""

    def __init__(self):
        self.module_level: List[ast.AST] = []
        self.function_level: List[ast.AST] = []
        self.depth = 0

    def visit_FunctionDef(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_If(self, node):
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node):
        (self.function_level if self.depth else self.module_level).append(node)

    visit_ImportFrom = visit_Import


def import_graph(roots: List[Path]) -> Tuple[Edges, Edges]:
    """``(module-level edges, function-level edges)`` among the modules under the packages
    ``roots`` (folders of one parent)."""
    modules = {name: path for root in roots for name, path in modules_of(root).items()}
    root = roots[0]
    module_level: Edges = defaultdict(dict)
    function_level: Edges = defaultdict(dict)
    for name, path in modules.items():
        collector = ImportCollector()
        collector.visit(ast.parse(path.read_text(), str(path)))
        for nodes, edges in ((collector.module_level, module_level),
                             (collector.function_level, function_level)):
            for node in nodes:
                for target in imported_names(node, name, modules):
                    edges[name].setdefault(target, (str(path.relative_to(root.parent)), node.lineno))
    return module_level, function_level


def cycles(edges: Edges) -> List[List[str]]:
    """One cycle per strongly connected component with more than one module (or a module
    importing itself), each as ``[a, b, ..., a]``."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components: List[List[str]] = []
    nodes = sorted(set(edges) | {t for targets in edges.values() for t in targets})

    def connect(v):  # Tarjan's algorithm; the package is small, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, {})):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, {}):
                components.append(sorted(component))

    for v in nodes:
        if v not in index:
            connect(v)
    return [one_cycle(component, edges) for component in components]


def one_cycle(component: List[str], edges: Edges) -> List[str]:
    """A shortest cycle through the component's first module (breadth-first)."""
    members, start = set(component), component[0]
    parents = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(edges.get(v, {})):
            if w == start:
                path = [v]
                while parents[path[-1]] is not None:
                    path.append(parents[path[-1]])
                return list(reversed(path)) + [start]
            if w in members and w not in parents:
                parents[w] = v
                queue.append(w)
    raise AssertionError(f"no cycle through {start}")


def describe(cycle: List[str], edges: Edges) -> str:
    steps = [f"{a} -> {b} ({edges[a][b][0]}:{edges[a][b][1]})" for a, b in zip(cycle, cycle[1:])]
    return "; ".join(steps)


def merged(*graphs: Edges) -> Edges:
    out: Edges = defaultdict(dict)
    for graph in graphs:
        for a, targets in graph.items():
            for b, where in targets.items():
                out[a].setdefault(b, where)
    return out


def test_no_cycle_among_module_level_imports():
    module_level, _ = import_graph(PACKAGE_DIRS)
    assert sum(len(t) for t in module_level.values()) > 50  # the walk saw the package
    found = cycles(module_level)
    assert not found, "import cycles at module level: " + " | ".join(describe(c, module_level) for c in found)


def test_no_cycle_even_through_imports_inside_functions():
    module_level, function_level = import_graph(PACKAGE_DIRS)
    assert function_level  # the walk sees imports inside functions (the package has some)
    edges = merged(module_level, function_level)
    found = cycles(edges)
    assert not found, "import cycles through function-level imports: " + " | ".join(describe(c, edges) for c in found)


def reachable(edges: Edges, start: str) -> Set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in edges.get(todo.pop(), {}):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_eq4_package_has_no_cycle_and_imports_nothing_of_fairseq():
    """``ea_ops`` (EA Eq. 4: the operation, its backends and its dispatcher): no import
    cycle, and no import of fairseq or of the plugin, at any level (test_dispatch.py
    imports it in a fresh process)."""
    ops_dir = REPO / "ea_ops"
    module_level, function_level = import_graph([ops_dir])
    edges = merged(module_level, function_level)
    assert "ea_ops.cpu" in edges["ea_ops.dispatch"]  # the walk saw the package
    assert not cycles(edges), [describe(c, edges) for c in cycles(edges)]
    imported = set()
    for path in ops_dir.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
    assert "torch" in imported and not imported & {"fairseq", "ea_fairseq", "ea_fairseq_cli"}, imported


def write_package(root: Path, files: Dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root / sorted(files)[0].split("/")[0]


def test_the_walker_finds_a_cycle_hidden_by_a_bottom_import(tmp_path):
    """Negative control: the shape of a cycle this package once had (a module importing a
    subpackage at its bottom, the subpackage importing the module back) is found and named,
    at module level; a function-level one is found only with function-level edges."""
    root = write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/mods/__init__.py": "from .op import run\n",
        "pkg/mods/op.py": "import os\n\ndef run():\n    return 1\n\n\nfrom .. import backends  # noqa\n",
        "pkg/backends/__init__.py": "from . import cpu\n",
        "pkg/backends/cpu.py": "from ..mods.op import run\n",
        "pkg/lazy/__init__.py": "",
        "pkg/lazy/a.py": "from . import b\n",
        "pkg/lazy/b.py": "def f():\n    from .a import x\n",
        "pkg/typed.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                         "    from .typed2 import T\n"),
        "pkg/typed2.py": "from . import typed\n",
    })
    module_level, function_level = import_graph([root])
    found = cycles(module_level)
    assert len(found) == 1
    text = describe(found[0], module_level)
    assert "pkg.backends.cpu -> pkg.mods.op" in text and "pkg.mods.op -> pkg.backends" in text
    assert "pkg/mods/op.py:7" in text
    assert not any("pkg.lazy" in c for cycle in found for c in cycle)  # only through a function
    assert function_level == {"pkg.lazy.b": {"pkg.lazy.a": ("pkg/lazy/b.py", 2)}}
    everything = cycles(merged(module_level, function_level))
    assert sorted(c[0] for c in everything) == ["pkg.backends", "pkg.lazy.a"]
    # TYPE_CHECKING imports do not run: pkg.typed <-> pkg.typed2 is no cycle
    assert "pkg.typed2" not in module_level.get("pkg.typed", {})


def test_relative_imports_resolve_like_python(tmp_path):
    root = write_package(tmp_path, {
        "pkg/__init__.py": "from . import a\n",
        "pkg/a.py": "from .sub import leaf\nfrom .sub.leaf import x\nimport pkg.sub\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/leaf.py": "from .. import a\n",
    })
    module_level, _ = import_graph([root])
    assert set(module_level["pkg.a"]) == {"pkg.sub", "pkg.sub.leaf"}
    assert set(module_level["pkg.sub.leaf"]) == {"pkg.a"}  # its own packages are already running
    assert set(module_level["pkg"]) == {"pkg.a"}
    found = cycles(module_level)
    assert [describe(c, module_level) for c in found] == [
        "pkg.a -> pkg.sub.leaf (pkg/a.py:1); pkg.sub.leaf -> pkg.a (pkg/sub/leaf.py:1)"]
