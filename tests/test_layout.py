"""Dependencies flow one way: code/common <- code/lecture27 library modules <- numbered scripts; no two
modules import each other (directly or around a circle); the codec needs only numpy."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "code"
MODULES = {p.stem: p for p in [*ROOT.glob("common/*.py"), *ROOT.glob("lecture27/*.py")] if p.stem != "__init__"}


def imports(source: str, folder: str, name: str = "") -> set[str]:
    """Every module of code/ that the module `name` of code/<folder>/ (its text: `source`) imports, at the top or
    inside a function: `import common.x`, `from common import x`, `from common.x import y`, and inside common/
    `from .x import y` and `from . import x`."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            package = ["common"] if node.level and folder == "common" else []
            module = ".".join(package + ([node.module] if node.module else []))
            names = [module] + [f"{module}.{a.name}" if module else a.name for a in node.names]
        else:
            continue
        for full in names:
            stem = full.removeprefix("common.")
            if stem in MODULES and (full.startswith("common.") == (MODULES[stem].parent.name == "common")):
                found.add(stem)
    return found - {name}


GRAPH = {name: imports(path.read_text(), path.parent.name, name) for name, path in MODULES.items()}


def circle(graph: dict) -> list[str] | None:
    """A circle of imports in `graph` (module -> the modules it imports), as the path that closes it, or None."""
    def visit(name, stack):
        if name in stack:
            return stack[stack.index(name):] + [name]
        for dep in sorted(graph[name]):
            found = visit(dep, stack + [name])
            if found:
                return found
        return None

    return next((c for c in map(lambda n: visit(n, []), sorted(graph)) if c), None)


def test_no_import_circle():
    """Among all modules of code/common and code/lecture27, scripts and library alike."""
    assert set(GRAPH) >= {"checkpoints", "present", "report", "gguf_llama", "blend_world", "04_cacheblend"}
    assert circle(GRAPH) is None, f"import circle: {' -> '.join(circle(GRAPH))}"


def test_a_circle_through_an_import_inside_a_function_is_caught():
    """checkpoints imports present at its top; present importing checkpoints back, even inside a method (as
    Page.finish did for checkpoints.EVENTS) or by name, closes a circle that the check must find."""
    assert "present" in GRAPH["checkpoints"] and "checkpoints" not in GRAPH["present"]
    for line in ("from . import checkpoints", "from .checkpoints import EVENTS", "import common.checkpoints",
                 "from common import checkpoints"):
        graph = dict(GRAPH, present=GRAPH["present"] | imports(f"def finish():\n    {line}\n", "common", "present"))
        found = circle(graph)
        assert found and found[0] == found[-1] and set(found) == {"checkpoints", "present"}, line


def test_dependencies_flow_one_way():
    for name, deps in GRAPH.items():
        layer = 0 if MODULES[name].parent.name == "common" else 2 if name[:2].isdigit() or name == "run_all" else 1
        for dep in deps:
            dep_layer = 0 if MODULES[dep].parent.name == "common" else 2 if dep[:2].isdigit() else 1
            assert dep_layer < layer or (dep_layer == layer == 1) or (dep_layer == layer == 0), (name, dep)
            assert dep_layer != 2, f"{name} imports the script {dep}"


def test_the_codec_needs_only_numpy():
    """The codec and its coder import no torch and nothing of code/ but one another: the serial coder
    nothing, the parallel coder the serial one, the throughput benchmark the coders, never the codec."""
    for name in ("coder", "coder_parallel", "coder_bench", "kvcache"):
        tree = ast.parse(MODULES[name].read_text())
        top = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        top |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert "torch" not in top, name
    assert GRAPH["coder"] == set() and GRAPH["coder_parallel"] == {"coder"}
    assert GRAPH["coder_bench"] == {"coder", "coder_parallel"}
    assert {"coder", "coder_parallel"} <= GRAPH["kvcache"] <= {"coder", "coder_parallel", "coder_bench"}


HANDOUT_READERS = {"01_kv_ledger": "01_kv_ledger", "02_cachegen_codec": "codec_page", "03_streaming": "streaming_page",
                   "04_cacheblend": "blend_page", "05_tiered_storage": "tiers_page"}   # script -> its page


def handout_reads(name: str) -> dict:
    """How module `name` reads the handout's table HANDOUT: calls of the table itself, its attributes
    (.figure, .refs), lookup helpers of its own, and calls of present.handout with the table."""
    tree = ast.parse(MODULES[name].read_text())
    nodes = list(ast.walk(tree))
    imported = {a.asname or a.name for n in nodes if isinstance(n, ast.ImportFrom) and n.module == "common.present"
                for a in n.names}
    return {"direct": [n.lineno for n in nodes if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "HANDOUT"],
            "attributes": [n.lineno for n in nodes if isinstance(n, ast.Attribute) and getattr(n.value, "id", "") ==
                           "HANDOUT"],
            "own": [n.name for n in nodes if isinstance(n, ast.FunctionDef) and n.name in ("said", "handout", "h",
                                                                                            "handout_figure")],
            "present": [n.lineno for n in nodes if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "handout"
                        and "handout" in imported and n.args and getattr(n.args[0], "id", "") == "HANDOUT"]}


def test_every_script_reads_the_handout_only_through_present_handout():
    """Every script, with its page module, takes every handout figure from common.present.handout (the one
    lookup, which blanks a figure whose inputs the run changed): never from the table directly."""
    for script, page in HANDOUT_READERS.items():
        for name in (script, page):
            reads = handout_reads(name)
            assert not reads["direct"] and not reads["attributes"] and not reads["own"], (name, reads)
        assert handout_reads(page)["present"], f"{page} shows no handout figure through present.handout"
