"""Dependencies flow one way: code/common <- the lecture's mechanisms (code/lecture27/*.py) <- each section's
measuring and showing (code/lecture27/<section>/) <- the programs (the numbered scripts, run_all, shipped_settings);
no folder imports a sibling folder; no two modules import each other (directly or around a circle); the codec
needs only numpy; no module touches sys.path (the project is installed: pyproject.toml)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "code"
PROGRAMS = {"run_all", "shipped_settings", "serve", "bench_serve", "gpu_check"}   # with the numbered scripts: programs


def qualified(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


MODULES = {qualified(p): p for p in [*ROOT.glob("common/*.py"), *ROOT.glob("lecture27/*.py"),
                                     *ROOT.glob("lecture27/*/*.py")] if p.stem != "__init__"}


def imports(source: str, folder: str, name: str = "") -> set[str]:
    """Every module of code/ that the module `name` (its text: `source`; `folder`: its folder under code/, as
    "common" or "lecture27/codec") imports, at the top or inside a function: `import lecture27.x`,
    `from lecture27 import x`, `from lecture27.codec.study import y`, and inside common/ `from .x import y`
    and `from . import x`."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            package = folder.split("/") if node.level else []
            module = ".".join(package + ([node.module] if node.module else []))
            names = [module] + [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {full for full in names if full in MODULES}
    return found - {name}


GRAPH = {name: imports(path.read_text(), str(path.parent.relative_to(ROOT)), name) for name, path in MODULES.items()}


def layer(name: str) -> int:
    """0 common, 1 a mechanism, 2 a section's measuring and showing, 3 a program."""
    parts = name.split(".")
    if parts[0] == "common":
        return 0
    if len(parts) == 3:
        return 2
    return 3 if parts[1][:2].isdigit() or parts[1] in PROGRAMS else 1


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
    """Among all modules of code/common and code/lecture27, programs and library alike."""
    assert set(GRAPH) >= {"common.checkpoints", "common.present", "common.report", "common.gguf_llama",
                          "lecture27.blend_world", "lecture27.04_cacheblend", "lecture27.codec.study"}
    assert circle(GRAPH) is None, f"import circle: {' -> '.join(circle(GRAPH))}"


def test_a_circle_through_an_import_inside_a_function_is_caught():
    """checkpoints imports present at its top; present importing checkpoints back, even inside a method (as
    Page.finish did for checkpoints.EVENTS) or by name, closes a circle that the check must find."""
    cp, pr = "common.checkpoints", "common.present"
    assert pr in GRAPH[cp] and cp not in GRAPH[pr]
    for line in ("from . import checkpoints", "from .checkpoints import EVENTS", "import common.checkpoints",
                 "from common import checkpoints"):
        graph = dict(GRAPH, **{pr: GRAPH[pr] | imports(f"def finish():\n    {line}\n", "common", pr)})
        found = circle(graph)
        assert found and found[0] == found[-1] and set(found) == {cp, pr}, line


def test_dependencies_flow_one_way():
    """A module imports only from the layers below its own, or within its own layer: common from common, a
    mechanism from mechanisms, a section folder from its own folder; never a program."""
    for name, deps in GRAPH.items():
        for dep in deps:
            assert layer(dep) < 3, f"{name} imports the program {dep}"
            assert layer(dep) < layer(name) or (layer(dep) == layer(name) < 2) or \
                (layer(dep) == layer(name) == 2 and dep.split(".")[1] == name.split(".")[1]), (name, dep)


def test_a_sibling_folder_import_is_caught():
    """The stream folder reading the codec folder's module is refused, as a mechanism reading a section is."""
    graph = dict(GRAPH, **{"lecture27.stream.page": GRAPH["lecture27.stream.page"] | {"lecture27.codec.smollm2"}})
    name, dep = "lecture27.stream.page", "lecture27.codec.smollm2"
    assert dep in graph[name] and not (layer(dep) < layer(name) or layer(dep) == layer(name) < 2
                                       or dep.split(".")[1] == name.split(".")[1])
    assert layer("lecture27.kvcache") == 1 and layer("lecture27.codec.study") == 2 and layer("lecture27.run_all") == 3


def test_the_top_folder_holds_only_programs_and_mechanisms():
    """code/lecture27/ keeps the programs (the five scripts, run_all, shipped_settings, the engine's server and its
    benchmark, the GPU check) and the lecture's mechanisms, at most 25 files; every other module is in a section's
    folder."""
    top = sorted(p.stem for p in (ROOT / "lecture27").glob("*.py"))
    assert len(top) <= 25, top


def test_no_module_touches_sys_path():
    """`common` and `lecture27` import from the installed project (pip install -r requirements.txt installs it in
    editable mode), so no module, program or library, puts code/ on sys.path, and no import needs `noqa: E402`."""
    for name, path in MODULES.items():
        text = path.read_text()
        assert "sys.path" not in text and "noqa: E402" not in text, name


def test_the_codec_needs_only_numpy():
    """The codec and its coder import no torch and nothing of code/ but one another and the one timer
    (common/clock.py, the standard library only): the serial coder nothing, the parallel coder the serial one,
    the throughput benchmark the coders, never the codec."""
    coder, parallel, bench, codec = ("lecture27.coder", "lecture27.coder_parallel", "lecture27.codec.coder_bench",
                                     "lecture27.kvcache")
    for name in (coder, parallel, bench, codec):
        tree = ast.parse(MODULES[name].read_text())
        top = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        top |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert "torch" not in top, name
    timer = {"common.clock"}
    assert GRAPH["common.clock"] == set()
    assert GRAPH[coder] - timer == set() and GRAPH[parallel] - timer == {coder}
    assert GRAPH[bench] - timer == {coder, parallel}
    assert GRAPH[codec] - timer == {coder, parallel}


HANDOUT_READERS = {"lecture27.01_kv_ledger": "lecture27.01_kv_ledger",
                   "lecture27.02_cachegen_codec": "lecture27.codec.page",
                   "lecture27.03_streaming": "lecture27.stream.page", "lecture27.04_cacheblend": "lecture27.blend.page",
                   "lecture27.05_tiered_storage": "lecture27.store.tiers_page"}   # script -> its page


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


def test_every_table_names_the_function_that_computed_it():
    """A table's source ("codec.measures.coder_check": a module under code/lecture27/, then a function), as the
    report prints it beside the table, names a function that exists: a module moved or a function renamed is
    caught here. Read from the code: every source= string, and every string that reads like a source (a dotted
    name whose first part is a module or folder of code/lecture27/)."""
    import importlib
    import re
    tops = {p.stem for p in (ROOT / "lecture27").iterdir() if p.suffix == ".py" or p.is_dir()}
    sources = set()
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and re.fullmatch(r"[a-z_0-9]+(\.[a-z_0-9]+)+", node.value) and node.value.split(".")[0] in tops
                    and node.value.rsplit(".", 1)[1] not in ("py", "json", "png", "txt")):   # not a file
                sources.add(node.value)
            if isinstance(node, ast.keyword) and node.arg == "source" and isinstance(node.value, ast.Constant):
                sources.add(node.value.value)   # whatever it reads like
    sources.discard("")
    assert len(sources) > 40
    for source in sorted(sources):
        module, fn = source.rsplit(".", 1)
        assert callable(getattr(importlib.import_module(f"lecture27.{module}"), fn, None)), source
