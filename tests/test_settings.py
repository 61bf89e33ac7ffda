"""One name per setting. Each numbered script's UPPER_CASE constants are its settings: every one is read
(a constant nothing reads is a lie to the student who edits it), none is copied into a library module
(two names for one setting drift apart), no library function's default mirrors one (the script passes its
value), and the script builds one frozen Settings object that its computing functions take instead of the
argparse Namespace. Read from the source, so nothing is run."""
import ast
import dataclasses
import importlib
from pathlib import Path

import pytest

from common import cli

LECTURE = Path(__file__).resolve().parents[1] / "code" / "lecture27"
COMMON = LECTURE.parent / "common"
SCRIPTS = sorted(LECTURE.glob("0[1-5]_*.py"))
LIBRARY = {".".join(p.relative_to(LECTURE.parent).with_suffix("").parts): p
           for p in [*LECTURE.glob("*.py"), *LECTURE.glob("*/*.py"), *COMMON.glob("*.py")]
           if not p.name[:2].isdigit() and p.name not in ("run_all.py", "shipped_settings.py", "__init__.py")}


def tree(path):
    return ast.parse(path.read_text(), filename=str(path))


def constants(path) -> dict[str, ast.AST]:
    """UPPER_CASE names assigned at module level -> their value's node."""
    out = {}
    for node in tree(path).body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name) and n.id.isupper() and len(n.id) > 1:
                    out[n.id] = node.value
    return out


def settings_fields(path) -> set[str]:
    """The fields of the script's Settings: one per constant above the class (common.cli.settings), and those
    the class declares itself."""
    t = tree(path)
    cls = next(c for c in t.body if isinstance(c, ast.ClassDef) and c.name == "Settings")
    own = {a.target.id for a in cls.body if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)}
    return own | {n.lower() for n in cli.top_constants(path, "Settings")}


def literal(node):
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        return None


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_constant_is_read(script):
    """A constant is read by name, or it is a field of Settings (field `chunk_len` holds CHUNK_LEN) that the
    script or a library it imports reads (`s.chunk_len`)."""
    t = tree(script)
    loads = {n.id for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    attributes = {n.attr for path in [script, *imported_library(script)] for n in ast.walk(tree(path))
                  if isinstance(n, ast.Attribute)}
    loads |= {f.upper() for f in settings_fields(script) & attributes}
    unread = sorted(set(constants(script)) - loads)
    assert not unread, f"{script.name}: constants nothing reads: {unread}"


def imported_library(script) -> list[Path]:
    """The library modules a script imports (directly), by their qualified names."""
    names = set()
    for n in ast.walk(tree(script)):
        if isinstance(n, ast.Import):
            names |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module:
            names |= {n.module} | {f"{n.module}.{a.name}" for a in n.names}
    return [path for name, path in LIBRARY.items() if name in names]


def same_value(a, b) -> bool:
    va, vb = literal(a), literal(b)
    return va is not None and va == vb


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_no_library_copy_of_a_script_constant(script):
    """A constant of the script is not defined again, with the same value, in a library it imports (units
    such as GB or K aside)."""
    mine = constants(script)
    copies = [(lib.name, name) for lib in imported_library(script) for name, value in constants(lib).items()
              if name in mine and len(name) > 3 and same_value(value, mine[name])]
    assert not copies, f"{script.name}: these settings have a second name in the library: {copies}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_no_library_default_mirrors_a_script_constant(script):
    """A parameter of an imported library named like a script constant (chunk_len ~ CHUNK_LEN) does not
    default to that constant's value or name: the script passes it."""
    mine = {name.lower(): (name, value) for name, value in constants(script).items()}
    mirrored = []
    for lib in imported_library(script):
        for fn in ast.walk(tree(lib)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = fn.args.args + fn.args.kwonlyargs
            defaults = [None] * (len(fn.args.args) - len(fn.args.defaults)) + fn.args.defaults + fn.args.kw_defaults
            for arg, default in zip(args, defaults):
                if default is None or arg.arg not in mine:
                    continue
                name, value = mine[arg.arg]
                if same_value(default, value) or (isinstance(default, ast.Name) and default.id == name):
                    mirrored.append(f"{lib.name}:{fn.name}({arg.arg}=...) ~ {name}")
    assert not mirrored, f"{script.name}: library defaults mirror its constants: {mirrored}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_one_frozen_settings_object_instead_of_the_namespace(script):
    t = tree(script)
    frozen = [c for c in t.body if isinstance(c, ast.ClassDef) and c.name == "Settings" and any(
        isinstance(d, ast.Call) and getattr(d.func, "id",
                                            "") == "settings" and [ast.unparse(x) for x in d.args] == ["globals()"]
        for d in c.decorator_list)]
    assert frozen, f"{script.name}: no @settings(globals()) class Settings (common.cli: a frozen dataclass)"
    module = importlib.import_module(f"lecture27.{script.stem}")
    assert module.Settings.__dataclass_params__.frozen
    assert {f.name for f in dataclasses.fields(module.Settings)} == settings_fields(script)
    takes_namespace = [fn.name for fn in ast.walk(t) if isinstance(fn, ast.FunctionDef) and fn.name not in
                       ("main", "parse", "parse_args", "settings") and any(
                           a.arg in ("a", "args", "ns", "namespace") for a in fn.args.args)]
    assert not takes_namespace, f"{script.name}: functions take the argparse Namespace: {takes_namespace}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_run_is_compared_with_the_defaults_as_shipped(script):
    """The defaults a what-if is told from are cli.shipped_defaults(Settings, globals()), the shipped table:
    not Settings() nor the constants as they are now, which move with a student's edit."""
    t = tree(script)
    calls = [n for n in ast.walk(t) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "shipped_defaults"]
    assert calls and all([getattr(a, "id", None) for a in c.args[:1]] == ["Settings"]
                         and getattr(c.args[1].func, "id", "") == "globals" for c in calls), script.name
    pages = [n for n in ast.walk(t) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "Page"]
    bare = [n.lineno for p in pages for n in p.args[4:5]
            if isinstance(n, ast.Call) and getattr(n.func, "id", "") in ("Settings", "constants_of")]
    assert not bare, f"{script.name}: a Page compared with Settings() or the current constants, line {bare}"
