"""The package's import graph: no cycles between modules, no private names imported across modules.

Read statically from the source (``ast``), so the check sees every import, including the lazy ones inside
functions and the ``try: import`` of optional kernels, and needs no dependency to be installed.

- A cycle (``a`` imports ``b`` ... imports ``a``) makes import order matter and hides which module is the lower
  layer; each one found is reported with its path.
- A private cross-module import (``from megatron.x.y import _name``, ``from megatron.x import _module``, or
  ``y._name`` through an imported module ``y``) couples a module to another's internals: the name should be
  made public, or the code moved to where it belongs. Importing a private *module* of one's own package (``from megatron.core.fusions import
  _triton_fp8`` inside ``megatron/core/fusions/``) is the normal way a package uses its implementation
  files, and allowed; a private module reached from another package is not.

Every violation is listed in the failure message, not only the first.
"""

from __future__ import annotations

import ast
import os
from typing import Dict, List, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "megatron"

# Violations known to exist in code maintained elsewhere, each to be removed from this list once fixed there.
# An entry that no longer matches a violation fails the test too, so the list can only shrink.
KNOWN_VIOLATIONS: Set[str] = set()


def _module_files() -> Dict[str, str]:
    """``{dotted module name: path}`` for every ``.py`` file of the package."""
    modules = {}
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, PACKAGE)):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module named by ``from <node.module> import ...`` inside ``module``."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _package_of(module: str, modules: Dict[str, str]) -> str:
    """The package a module belongs to (itself for a package's ``__init__``)."""
    return module if modules[module].endswith("__init__.py") else module.rsplit(".", 1)[0]


def _scan(modules: Dict[str, str]) -> Tuple[Dict[str, Set[str]], List[str]]:
    """(import edges between package modules, private cross-module imports as messages)."""
    edges: Dict[str, Set[str]] = {m: set() for m in modules}
    private: List[str] = []
    for module, path in modules.items():
        is_package = path.endswith("__init__.py")
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        bound: Dict[str, str] = {}  # local name -> package module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = alias.name
                    while target and target not in modules:
                        target = target.rpartition(".")[0]
                    if target and target != module:
                        edges[module].add(target)
                    if alias.asname and alias.name in modules:
                        bound[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(module, is_package, node)
                if source not in modules:
                    continue
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    if submodule in modules:  # ``from package import module``
                        if submodule != module:
                            edges[module].add(submodule)
                        bound[alias.asname or alias.name] = submodule
                        if _is_private(alias.name) and _package_of(module, modules) != source:
                            private.append(f"private import: {module} imports private module {submodule}")
                        continue
                    if source != module:
                        edges[module].add(source)
                        if _is_private(alias.name):
                            private.append(f"private import: {module} imports {alias.name} from {source}")
        for node in ast.walk(tree):  # ``other._name`` through a module bound above
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _is_private(node.attr)
                    and node.value.id in bound and bound[node.value.id] != module
                    and f"{bound[node.value.id]}.{node.attr}" not in modules):
                private.append(f"private import: {module} uses {node.attr} from {bound[node.value.id]}")
    return edges, sorted(set(private))


def _cycles(edges: Dict[str, Set[str]]) -> List[str]:
    """One message per strongly connected component of more than one module (Tarjan), with one cycle in it."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
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
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    messages = []
    for component in components:
        messages.extend(_cycles_in(component, edges))
    return messages


def _cycles_in(component: List[str], edges: Dict[str, Set[str]]) -> List[str]:
    """For each module of a strongly connected component, the shortest cycle through it (deduplicated)."""
    members = set(component)
    found = {}
    for start in component:
        # breadth-first search back to ``start`` inside the component
        previous = {start: None}
        frontier = [start]
        path = None
        while frontier and path is None:
            next_frontier = []
            for v in frontier:
                for w in sorted(edges[v] & members):
                    if w == start:
                        path = [v]
                        while previous[path[-1]] is not None:
                            path.append(previous[path[-1]])
                        path.reverse()
                        break
                    if w not in previous:
                        previous[w] = v
                        next_frontier.append(w)
                if path is not None:
                    break
            frontier = next_frontier
        if path is None:
            continue
        first = path.index(min(path))  # rotate so the same cycle always reads the same
        path = path[first:] + path[:first]
        found[tuple(path)] = "cycle: " + " -> ".join(path + [path[0]])
    return sorted(found.values())


def _violations() -> List[str]:
    modules = _module_files()
    edges, private = _scan(modules)
    return sorted(set(_cycles(edges)) | set(private))


def test_no_import_cycles_or_private_cross_module_imports():
    violations = _violations()
    new = [v for v in violations if v not in KNOWN_VIOLATIONS]
    fixed = sorted(KNOWN_VIOLATIONS - set(violations))
    message = []
    if new:
        message.append("import-graph violations in megatron/:\n  " + "\n  ".join(new))
    if fixed:
        message.append("no longer violated, remove from KNOWN_VIOLATIONS:\n  " + "\n  ".join(fixed))
    assert not message, "\n".join(message)


def test_checker_finds_a_cycle_and_a_private_import(tmp_path, monkeypatch):
    """The checker itself, on a throw-away package with one cycle and one private cross-module import."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from megatron.b import thing\n")
    (pkg / "b.py").write_text("def thing():\n    from megatron import a\n")
    (pkg / "c.py").write_text("from megatron.sub.d import _helper\nfrom megatron.sub import _impl, d\nd._helper()\n")
    (pkg / "sub" / "d.py").write_text("from . import _impl\ndef _helper():\n    pass\n")
    (pkg / "sub" / "_impl.py").write_text("")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", str(tmp_path))
    assert _violations() == [
        "cycle: megatron.a -> megatron.b -> megatron.a",
        "private import: megatron.c imports _helper from megatron.sub.d",
        "private import: megatron.c imports private module megatron.sub._impl",
        "private import: megatron.c uses _helper from megatron.sub.d",
    ]


# (lower package, higher package): nothing in the lower one imports the higher one, directly or through others
LAYERING = [("megatron.core.tensor_parallel", "megatron.core.transformer")]


def _reachable(start: str, edges: Dict[str, Set[str]]) -> Set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in edges[todo.pop()]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def test_lower_packages_do_not_import_higher_ones():
    """The tensor-parallel layers take their own configuration and know nothing of the transformer."""
    modules = _module_files()
    edges, _ = _scan(modules)
    upward = []
    for lower, higher in LAYERING:
        for module in sorted(m for m in modules if m == lower or m.startswith(lower + ".")):
            reached = sorted(w for w in _reachable(module, edges) if w == higher or w.startswith(higher + "."))
            if reached:
                upward.append(f"{module} reaches {reached[0]}")
    assert not upward, "upward imports:\n  " + "\n  ".join(upward)
