"""The package's layering, checked from the source: imports point down the layer list and no
import cycle exists (function-level imports included, so a lazy import cannot hide a cycle)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import fp8track

ROOT = Path(fp8track.__file__).parent

# Lower number = lower layer. A module may import its own subpackage and any lower layer;
# trackers sit below analysis: the analysis reads runs back through the trackers' readers
# (beside their writers), the trackers never import the analysis.
LAYERS = {
    "errors": 0,
    "optional": 0,
    "numerics": 10,
    "execution": 20,
    "monitoring": 30,
    "analysis": 40,
    "trackers": 35,
    "dumps": 45,  # public reader of tensor dumps (re-exports monitoring.dumps)
    "report": 50,  # the HTML report: reads records and analysis
    "inference": 55,  # the inference-chain check: runs models, reads analysis
    "config": 65,  # frontend-level configuration (capture + analysis thresholds)
    "frontend": 70,
    "trial": 75,  # a sweep trial's settings and shared caches: below the sweep program and the executor
    "lightning": 80,
    "hf": 80,  # the Hugging Face Trainer callback (a sibling of the Lightning one)
    "examples": 82,  # example programs; the sweep program uses the Lightning callback
    "sweep": 85,  # drives Lightning training runs
    "demo": 90,
    "cli": 100,
    "__init__": 110,
    "__main__": 110,
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        mod = _module_name(path)
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fp8track"):
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("fp8track"))
        graph[mod] = deps
    known = set(graph)
    return {m: {d for d in deps if d in known and d != m} for m, deps in graph.items()}


def _layer(mod: str) -> tuple[str, int]:
    parts = mod.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    assert top in LAYERS, f"{mod}: top-level module {top!r} has no layer; add it to LAYERS"
    return top, LAYERS[top]


def test_imports_point_down_the_layers() -> None:
    bad = []
    for mod, deps in _imports().items():
        top, layer = _layer(mod)
        for dep in deps:
            dtop, dlayer = _layer(dep)
            if dtop == top:
                continue
            if dlayer >= layer:
                bad.append(f"{mod} -> {dep}")
    assert not bad, "imports that point up or sideways:\n" + "\n".join(sorted(bad))


def test_no_import_cycles() -> None:
    graph = _imports()
    # Package __init__ files re-export their children; a child importing a sibling through the
    # package is the usual Python idiom, so edges *into* a package's own __init__ from inside it
    # are not counted as cycles.
    def edges(mod: str) -> set[str]:
        return {d for d in graph[mod] if not mod.startswith(d + ".")}

    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(edges(m)):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d) :] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_each_subpackage_states_its_job() -> None:
    for pkg in ("numerics", "execution", "monitoring", "analysis", "trackers", "cli"):
        doc = ast.get_docstring(ast.parse((ROOT / pkg / "__init__.py").read_text()))
        assert doc and len(doc.split()) >= 10, f"fp8track/{pkg}/__init__.py needs a docstring saying its job"


def test_readme_imports_keep_working() -> None:
    from fp8track import FP8Monitor, Monitor, apply_fp8
    from fp8track.lightning import FP8Monitor as LightningFP8Monitor

    assert FP8Monitor is LightningFP8Monitor
    assert callable(apply_fp8) and isinstance(Monitor, type)


def _named_in(rel: str, text: str) -> bool:
    """``rel`` (a path under fp8track/) is named in ``text``: itself, or a folder holding it, named
    whole in backquotes (``cli/``, ``te_features/<namespace>/``)."""
    if rel in text:
        return True
    parts = rel.split("/")[:-1]
    folders = ("/".join(parts[i:k]) + "/" for k in range(1, len(parts) + 1) for i in range(k))
    return any(re.search(f"`{re.escape(folder)}(<[^>]*>/)*`", text) for folder in folders)


def test_every_module_has_a_row_in_the_architecture_doc() -> None:
    text = (ROOT.parent / "docs" / "ARCHITECTURE.md").read_text()
    assert _named_in("cli/sync.py", text) and not _named_in("monitoring/no_such_module.py", text)
    missing = sorted(
        rel
        for p in ROOT.rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
        and not _named_in(rel := p.relative_to(ROOT).as_posix(), text)
    )
    assert not missing, "modules docs/ARCHITECTURE.md does not name: " + ", ".join(missing)
