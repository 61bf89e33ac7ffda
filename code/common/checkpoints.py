"""Train once, then load: the one cache (trained models, computed results, dequantized weights). The one
training loop every small model uses is trainer.py's.

cached(name, inputs, compute) loads a result or computes and saves it. Its key has two parts:
  inputs  what the caller names (configs, settings, the model file's size), as JSON;
  code    what computes the result: the syntax tree of `compute`, of the function it is written in, and
          of every function and class of code/ they name, followed through module attributes
          (kv.fit_codec), imports inside functions and the functions a closure holds; with the values of
          the module constants they read, and the keys of the cached models a closure holds.
The file is code/checkpoints/<name>-<hash of inputs>-<hash of code>.pt. A syntax tree has no comments,
no formatting; docstrings, type hints and bare print()/tqdm.write() calls are left out, and presentation
code is never reached from a computation: editing those computes nothing again. Editing the trainer or a
study does, with one line that names what changed (read from the file the same inputs were computed into
before); no version number to bump. A file that fails to load or holds another key is computed again
with a message, never used silently. Files are written to a temporary name and renamed, so a killed run
never leaves half a file; of two runs that need one result at once, one computes it while the other
waits for it (an flock beside the file). The folder is code/checkpoints/, or $L27_CHECKPOINTS; one that
is a file or cannot be written ends the run with one line (exit code 2).
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import numpy as np
import torch

try:
    import fcntl  # the lock that lets one of two runs compute a result while the other waits
except ImportError:  # not Unix
    fcntl = None

from .llama import Llama, LlamaConfig
from .present import CACHE_EVENTS, shown
from .render import plain, wrap

CODE_DIR = Path(__file__).resolve().parents[1]  # code/: its modules' functions and constants key the cache

# what this process loaded from the cache and what it computed: {"name", "loaded", "seconds"}; the list a
# page's record keeps (present.CACHE_EVENTS), so the report says which results came from code/checkpoints/
EVENTS: list[dict] = CACHE_EVENTS



class TrainingFailed(RuntimeError):
    """Raised by a train_fn whose model is not good enough to cache."""


# ------------------------------------------------------------------------------------ the folder
_CHECKED: set[Path] = set()


def checkpoint_dir() -> Path:
    """The cache's folder, created if missing. A path that is a file, or a folder that cannot be created
    or written, ends the run with one line on stderr naming L27_CHECKPOINTS (exit code 2)."""
    env = os.environ.get("L27_CHECKPOINTS")
    d = Path(env) if env else CODE_DIR / "checkpoints"
    if d in _CHECKED:
        return d
    try:
        d.mkdir(parents=True, exist_ok=True)
        why = None
    except FileExistsError:
        why = "it is a file, not a folder"
    except OSError as e:
        why = f"cannot create the folder ({e.strerror or e})"
    if why is None:
        try:
            with tempfile.TemporaryFile(dir=d):
                pass
        except OSError as e:
            why = f"cannot write in it ({e.strerror or e})"
    if why:
        where = f"L27_CHECKPOINTS={env}" if env else f"{d} (the checkpoint folder; L27_CHECKPOINTS moves it)"
        print(f"error: {where}: {why}", file=sys.stderr)
        raise SystemExit(2)
    _CHECKED.add(d)
    return d


def atomic_save(obj, path: Path) -> None:
    """torch.save to a temporary file in the same folder, then rename over `path`."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# ------------------------------------------------------------------------------------ the cache
_VERBS = {"compute": ("computing", "computed", "computes"), "train": ("training", "trained", "trains"),
          "read": ("reading", "read", "reads")}


def cached(name: str, inputs: dict, compute: Callable[[], dict], redo: bool = False, *, use=None,
           tag: str = "cache", verb: str = "compute", flag: str | None = None, mmap: bool = False,
           keep_one: bool = False, store: bool = True):
    """The result of compute() for these inputs and this code: loaded from its file, or computed (then
    saved). compute() returns what torch.save can store with weights_only (tensors, plain data).
    Returns use(result, entry) (default: the result); entry = {"key": the file's stem, "loaded",
    "seconds": compute's time}. A `use` that fails on a loaded result makes the file unusable.
    redo: compute even if a file exists; flag: the script option that does it (said when loading;
    without a flag a load is silent); keep_one: delete this name's other files (large ones);
    store=False: compute, no file. Every load and compute is recorded in EVENTS."""
    doing, done, does = _VERBS[verb]
    use = use or (lambda result, entry: result)
    inputs = json.loads(json.dumps(inputs, sort_keys=True, default=str))
    key = {"inputs": inputs, **code_identity(compute)}
    inputs_hash = _digest(inputs)
    stem = f"{name}-{inputs_hash}-{_digest([key['code'], key['values']])}"
    path = checkpoint_dir() / f"{stem}.pt" if store else None
    with _one_computes(path, f"[{tag}] {name}", doing):
        if store and path.exists() and not redo:
            try:
                blob = torch.load(path, weights_only=True, mmap=mmap)
                if blob["key"] != key:
                    raise ValueError("the stored key differs")
                out = use(blob["result"], {"key": stem, "loaded": True, "seconds": blob["seconds"]})
                if flag:
                    print(wrap(f"[{tag}] {name}: loaded from {path.name} ({done} in {blob['seconds']:.0f} s; "
                               f"{flag} {does} it again)"))
                EVENTS.append({"name": name, "loaded": True, "seconds": blob["seconds"]})
                return out
            except Exception as e:  # a broken or foreign file is never used silently
                print(wrap(f"[{tag}] {path.name} is unusable ({type(e).__name__}: {e}); {doing} it again"))
        elif store and not redo:
            why = _what_changed(path.parent.glob(f"{name}-{inputs_hash}-*.pt"), key)
            if why:
                print(wrap(f"[{tag}] {name}: {why}; {doing} it again"))
        t0 = time.time()
        result = compute()
        seconds = time.time() - t0
        if store:
            for old in path.parent.glob(f"{name}-*.pt") if keep_one else ():
                old.unlink(missing_ok=True)
            atomic_save({"key": key, "seconds": seconds, "result": result}, path)
            print(wrap(f"[{tag}] {done} {name} in {seconds:.1f} s -> {path.name} in {shown(path.parent)}"))
    EVENTS.append({"name": name, "loaded": False, "seconds": seconds})
    return use(result, {"key": stem, "loaded": False, "seconds": seconds})


@contextmanager
def _one_computes(path: Path | None, label: str, doing: str):
    """Hold the lock of the result file `path` for the block: of two runs that need the same result at once
    (run_all runs two scripts side by side, one per core), one computes it and the other waits, says so, and
    then loads it. The lock is an flock on the file `path` + ".lock", released by the system if a run is
    killed, and deleted by the run that holds it when it is done (a waiting run then finds the result). No
    lock where there is no file (store=False) or no flock (not Unix)."""
    if path is None or fcntl is None:
        yield
        return
    lock = path.with_name(path.name + ".lock")
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"{label}: another run is {doing} it; waiting for it", flush=True)
            t0 = time.time()
            fcntl.flock(f, fcntl.LOCK_EX)
            print(f"{label}: ready after {time.time() - t0:.0f} s of waiting", flush=True)
        try:
            yield
        finally:
            lock.unlink(missing_ok=True)
            fcntl.flock(f, fcntl.LOCK_UN)


def _digest(x) -> str:
    return hashlib.sha256(json.dumps(x, sort_keys=True).encode()).hexdigest()[:8]


def _what_changed(files, key: dict) -> str | None:
    """What differs between `key` and the key of the newest of `files` (earlier results for the same
    inputs): "code of X changed", "value of Y changed"; None when there is no such file."""
    files = sorted(files, key=lambda p: p.stat().st_mtime)
    if not files:
        return None
    try:
        was = torch.load(files[-1], weights_only=True, mmap=True)["key"]
    except Exception:
        return "the code that computes it changed"
    said = []
    for part, what in (("code", "code of"), ("values", "value of")):
        a, b = was.get(part, {}), key[part]
        # a closure's value is named by its function ("study.<locals>.<lambda>:model" -> "study:model")
        changed = sorted(k.replace(".<locals>.<lambda>:", ":") for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        named = [k for i, k in enumerate(changed) if i == 0 or len(", ".join(changed[:i + 1])) <= 60]
        if changed:
            more = f" and {len(changed) - len(named)} more" if len(changed) > len(named) else ""
            said.append(f"{what} {', '.join(named)}{more} changed")
    return "; ".join(said) or "the code that computes it changed"


def cached_result(name: str, ident: dict, compute: Callable[[], dict], refit: bool = False,
                  tag: str = "cache", flag: str = "--refit") -> dict:
    """A computed result (a dict of plain data, with its "compute_seconds") cached by `cached` under
    `ident` and the code of compute; a loaded one says so in one line, with the script flag (`flag`)
    that computes it again."""
    return cached(name, ident, lambda: plain(compute()), refit, tag=tag, flag=flag,
                  use=lambda result, entry: dict(result, compute_seconds=entry["seconds"]))


def cached_model(name: str, model_cfg: LlamaConfig, train_cfg: dict, train_fn: Callable[[Llama], dict],
                 retrain: bool = False, seed: int = 0) -> tuple[Llama, dict]:
    """Load the trained model `name` for these configs and this trainer's code, or build and train it
    (`cached`). train_fn(model) trains in place and returns JSON-able final metrics (or raises
    TrainingFailed). Returns (model in eval mode, meta); meta holds the ident (configs, seed and "code":
    the checkpoint's key), torch version, metrics and training time. model.cache_key is that key."""
    ident = json.loads(json.dumps({"name": name, "model": model_cfg.to_dict(), "train": train_cfg, "seed": seed}))
    trained = []  # the model trained in this call, returned as it is

    def use(blob, entry):
        if trained:
            model = trained[0]
        else:
            model = Llama(model_cfg)
            model.load_state_dict(blob["state_dict"])
        model.cache_key = entry["key"]
        return model.eval(), dict(blob["meta"], ident=dict(ident, code=entry["key"]), train_seconds=entry["seconds"])

    return cached(name, ident, lambda: _train(model_cfg, train_fn, seed, trained), retrain, use=use,
                  tag="checkpoints", verb="train")


def _train(model_cfg: LlamaConfig, train_fn, seed: int, out: list) -> dict:
    """A model of model_cfg initialised from torch's seed `seed`, trained by train_fn (appended to out)."""
    torch.manual_seed(seed)
    model = Llama(model_cfg)
    out.append(model)
    metrics = train_fn(model)
    return {"state_dict": model.state_dict(),
            "meta": {"metrics": metrics, "torch": str(torch.__version__), "n_params": model.n_params()}}


# ------------------------------------------------------------------------------------ the code key
# The functions above (and render.plain, which cached_result stores through) load and save; they compute
# nothing, so their own code is not part of any key.
_MACHINERY = {"checkpoint_dir", "atomic_save", "plain", "cached", "_one_computes", "_digest", "_what_changed",
              "cached_result", "cached_model", "code_identity", "_CodeWalk", "_tree", "_Strip", "_refs", "_own",
              "_canon", "_module_of", "_in_code", "_import", "_stem", "_qualified", "_under_code", "_is_code",
              "_machinery"}
_TREES: dict = {}  # file -> ({(name, first line): [def or lambda]}, {qualname: [class]}) or None
_OWN: dict = {}    # (code object or class, file) -> (hash of its syntax tree, names it reads, its imports)


def code_identity(compute) -> dict:
    """{"code": {module.qualname: hash of the syntax tree}, "values": {module.NAME: hash of the value}}
    of what compute() runs: see the module docstring. A function's own hash is computed once per
    process; the names it reads are looked up again each time (a test may replace one)."""
    walk = _CodeWalk()
    walk.run(compute)
    return {"code": dict(sorted(walk.code.items())), "values": dict(sorted(walk.values.items()))}


class _CodeWalk:
    def __init__(self):
        self.code, self.values, self.todo, self.seen = {}, {}, [], {}

    def run(self, root):
        self.todo.append((root, True))
        while self.todo:
            obj, is_root = self.todo.pop()
            try:
                obj = inspect.unwrap(obj) if callable(obj) else obj
            except ValueError:  # a loop of __wrapped__
                pass
            if id(obj) in self.seen:
                continue
            self.seen[id(obj)] = obj  # kept alive, so that no id is reused during the walk
            if isinstance(obj, functools.partial):
                self.push(obj.func)
                self.held([*obj.args, *obj.keywords.values()], "partial")
            elif inspect.ismethod(obj):
                self.push(obj.__func__)
                self.held(obj.__self__, "self")
            elif inspect.isfunction(obj):
                self.function(obj, is_root)
            elif inspect.isclass(obj):
                self.klass(obj)

    def push(self, obj):
        self.todo.append((obj, False))

    def function(self, f, is_root: bool):
        mod = _module_of(f)
        if mod is None:
            return
        top = f.__qualname__.split(".")[0]
        if not is_root and _machinery(f, mod, top):
            return
        label = f"{_stem(mod)}.{f.__qualname__}"
        self.code[label], chains, imports = _own(f.__code__, f.__code__.co_filename)
        if "." in f.__qualname__ and top in f.__globals__:  # the function (or class) it is written in
            enclosing = f.__globals__[top]
            if not _machinery(enclosing, mod, top):
                self.push(enclosing)
        cells = {}
        for name, cell in zip(f.__code__.co_freevars, f.__closure__ or ()):
            try:
                cells[name] = cell.cell_contents
            except ValueError:  # not yet assigned
                continue
            self.held(cells[name], f"{label}:{name}")
        self.names(chains - {c for c in chains if c[0] in cells}, imports, f.__globals__, mod)

    def klass(self, cls):
        mod = _module_of(cls)
        if mod is None or (mod.__name__ == __name__ and cls.__qualname__.split(".")[0] in _MACHINERY):
            return
        self.code[f"{_stem(mod)}.{cls.__qualname__}"], chains, imports = _own(cls, getattr(mod, "__file__", ""))
        self.names(chains, imports, vars(mod), mod)

    def names(self, chains, imports, space: dict, mod):
        """Resolve each name a function reads (through its own imports, then its module) and visit it."""
        local = {}
        for bound, module, attr, level in imports:
            if level:
                try:
                    module = importlib.util.resolve_name("." * level + (module or ""), space.get("__package__"))
                except (ImportError, ValueError):
                    continue
            m = _import(module)
            if m is not None:
                if attr is None:
                    local[bound] = (m, None, None)
                else:
                    local[bound] = (getattr(m, attr) if hasattr(m, attr) else _import(f"{module}.{attr}"), m, attr)
        for chain in chains:
            if chain[0] in local:
                obj, owner, name = local[chain[0]]
            elif chain[0] in space:
                obj, owner, name = space[chain[0]], mod, chain[0]
            else:
                continue  # a builtin or a local variable
            for attr in chain[1:]:  # kv.fit_codec: into the project's modules only
                if not (inspect.ismodule(obj) and _in_code(obj)) or not hasattr(obj, attr):
                    break
                obj, owner, name = getattr(obj, attr), obj, attr
            self.reference(obj, owner, name)

    def reference(self, obj, owner, name):
        if obj is None or inspect.ismodule(obj):
            return
        if _is_code(obj):
            self.push(obj)
        elif name and name.startswith("_") and name.islower():
            return   # a module's private state (redis_server's _spawner: a pid, a queue), not a constant it reads
        elif owner is not None and inspect.ismodule(owner) and _in_code(owner):
            self.values[f"{_stem(owner)}.{name}"] = hashlib.sha256(_canon(obj, self.push).encode()).hexdigest()[:16]

    def held(self, v, label: str, depth: int = 0):
        """A value a closure holds (or a dict, list or tuple of them): a function or class is visited, an
        object gives its class, a model loaded from the cache also its key (model.cache_key). Other data
        is the caller's input, named in `inputs`."""
        if depth > 4:
            return
        if _is_code(v):
            self.push(v)
        elif isinstance(v, dict):
            for k, x in list(v.items())[:1000]:
                self.held(x, f"{label}[{k}]", depth + 1)
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v[:1000]):
                self.held(x, f"{label}[{i}]", depth + 1)
        else:
            self.push(type(v))
            if isinstance(v, torch.nn.Module) and isinstance(getattr(v, "cache_key", None), str):
                self.values[label] = v.cache_key


def _machinery(f, mod, top: str) -> bool:
    """f (or the function `top` it is written in) loads and saves: one of this module's, or one it imports
    for that (render.plain, which turns a result into the plain data stored)."""
    return top in _MACHINERY and (mod.__name__ == __name__ or globals().get(top) is f)


def _is_code(obj) -> bool:
    return (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismethod(obj)
            or isinstance(obj, functools.partial))


def _stem(mod) -> str:
    """The module's qualified name under code/ (lecture27.codec.study), read from its file's path: the same
    whether its script runs as __main__ or is imported, and distinct for two files of one name in two folders."""
    return _qualified(Path(mod.__file__))


@functools.lru_cache(maxsize=None)
def _qualified(file: Path) -> str:
    path = file.resolve()
    if not path.is_relative_to(CODE_DIR):
        return path.stem
    parts = path.relative_to(CODE_DIR).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.lru_cache(maxsize=None)
def _under_code(file: str) -> bool:
    return Path(file).resolve().is_relative_to(CODE_DIR)


def _in_code(mod) -> bool:
    file = getattr(mod, "__file__", None)
    return bool(file) and _under_code(file)


def _module_of(obj):
    """The module of code/ that defines obj, or None (a library's, the tests')."""
    mod = sys.modules.get(getattr(obj, "__module__", None) or "")
    return mod if mod is not None and _in_code(mod) else None


def _import(name: str | None):
    """The module `name` if it is one of code/'s (imported now if it was not yet), else None."""
    if not name:
        return None
    if name in sys.modules:
        return sys.modules[name] if _in_code(sys.modules[name]) else None
    try:
        top = importlib.util.find_spec(name.split(".")[0])
        where = [top.origin, *(top.submodule_search_locations or [])] if top is not None else []
        if not any(_under_code(p) for p in where if p):
            return None
        return importlib.import_module(name)
    except (ImportError, ValueError):
        return None


class _Strip(ast.NodeTransformer):
    """What does not compute: docstrings (any bare string), print() and tqdm.write() calls, type hints."""

    def visit_Expr(self, node):
        v = node.value
        if isinstance(v, ast.Constant) and isinstance(v.value, str):
            return None
        if isinstance(v, ast.Call) and (isinstance(v.func, ast.Name) and v.func.id == "print" or
                                        isinstance(v.func, ast.Attribute) and v.func.attr == "write" and
                                        isinstance(v.func.value, ast.Name) and v.func.value.id == "tqdm"):
            return None
        return self.generic_visit(node)

    def visit_arg(self, node):
        node.annotation = None
        return node

    def visit_FunctionDef(self, node):
        node.returns = None
        return self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef


def _tree(file: str):
    """(defs and lambdas by (name, first line), classes by qualname) of a source file, stripped; None if
    it cannot be read. Read once per process, like the module itself."""
    if file in _TREES:
        return _TREES[file]
    try:
        tree = _Strip().visit(ast.parse(Path(file).read_text()))
    except (OSError, SyntaxError, ValueError):
        _TREES[file] = None
        return None
    defs, classes = {}, {}

    def index(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                defs.setdefault((child.name, first), []).append(child)
                index(child, f"{prefix}{child.name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                classes.setdefault(prefix + child.name, []).append(child)
                index(child, f"{prefix}{child.name}.")
            else:
                if isinstance(child, ast.Lambda):
                    defs.setdefault(("<lambda>", child.lineno), []).append(child)
                index(child, prefix)

    index(tree, "")
    _TREES[file] = defs, classes
    return defs, classes


def _refs(nodes) -> tuple[set, list]:
    """The dotted names read in these nodes (("kv", "fit_codec"), ("TRAIN",)) and the imports inside
    them [(bound name, module, attribute or None, level)]."""
    chains, imports, todo = set(), [], list(nodes)
    while todo:
        n = todo.pop()
        if isinstance(n, ast.Attribute):
            parts, base = [n.attr], n.value
            while isinstance(base, ast.Attribute):
                parts.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name):
                chains.add((base.id, *reversed(parts)))
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            chains.add((n.id,))
        elif isinstance(n, ast.Import):
            for a in n.names:  # `import a.b` binds a; `import a.b as c` binds c to a.b
                top = a.name.split(".")[0]
                imports.append((a.asname, a.name, None, 0) if a.asname else (top, top, None, 0))
        elif isinstance(n, ast.ImportFrom):
            imports += [(a.asname or a.name, n.module, a.name, n.level) for a in n.names if a.name != "*"]
        todo += ast.iter_child_nodes(n)
    return chains, imports


def _own(what, file: str) -> tuple[str, set, list]:
    """(hash of the syntax tree, names read, imports) of a function's code object or of a class,
    computed once. Without its source (compiled on the fly), the code object's bytes stand in."""
    if (what, file) in _OWN:
        return _OWN[what, file]
    found = _tree(file)
    if found is None:
        nodes = []
    elif inspect.isclass(what):
        nodes = found[1].get(what.__qualname__, [])
    else:  # the def at the code's first line, if its parameters are the code's (the file is the one run)
        params = list(what.co_varnames[:what.co_argcount + what.co_kwonlyargcount])
        nodes = [n for n in found[0].get((what.co_name, what.co_firstlineno), [])
                 if [a.arg for a in n.args.posonlyargs + n.args.args + n.args.kwonlyargs] == params]
    if nodes:
        text = "\n".join(ast.dump(n) for n in nodes)
        chains, imports = _refs(nodes)
    else:
        codes = [f.__code__ for f in vars(what).values() if inspect.isfunction(f)] if inspect.isclass(what) else [what]
        text = repr([(c.co_code, c.co_consts, c.co_names) for c in codes])
        chains, imports = {(n,) for c in codes for n in c.co_names}, []
    _OWN[what, file] = (hashlib.sha256(text.encode()).hexdigest()[:16], chains, imports)
    return _OWN[what, file]


def _where(v) -> str:
    """The name of the file that defines a function or class: the same whether its script runs as
    __main__ (python 02_cachegen_codec.py) or is imported (the tests)."""
    try:
        return _qualified(Path(inspect.getfile(v)))
    except TypeError:
        return getattr(v, "__module__", "")


def _canon(v, visit, depth: int = 0, active: frozenset = frozenset()) -> str:
    """A constant's value as text that changes when the value does (functions in it are visited)."""
    if depth > 12 or id(v) in active:
        return "..."
    inner = active | {id(v)}
    rec = lambda x: _canon(x, visit, depth + 1, inner)  # noqa: E731
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return f"{type(v).__name__}[{','.join(rec(x) for x in v)}]"
    if isinstance(v, (set, frozenset)):
        return f"set[{','.join(sorted(rec(x) for x in v))}]"
    if isinstance(v, dict):
        return "{" + ",".join(sorted(f"{rec(k)}:{rec(x)}" for k, x in v.items())) + "}"
    if isinstance(v, torch.Tensor):
        v = v.detach().cpu()
        v = v.float() if v.dtype == torch.bfloat16 else v
        return f"tensor{tuple(v.shape)}{v.dtype}:" + hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest()
    if isinstance(v, (np.ndarray, np.generic)):
        return f"array{v.shape}{v.dtype}:" + hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()
    if _is_code(v):
        visit(v)
        return f"{_where(v)}.{getattr(v, '__qualname__', repr(v))}"
    if inspect.ismodule(v):
        return f"module {v.__name__}"
    if dataclasses.is_dataclass(v):
        visit(type(v))
        return f"{type(v).__qualname__}({rec({f.name: getattr(v, f.name) for f in dataclasses.fields(v)})})"
    if _module_of(type(v)) is not None and hasattr(v, "__dict__"):
        visit(type(v))
        return f"{type(v).__qualname__}({rec(vars(v))})"
    r = repr(v)
    return f"{type(v).__module__}.{type(v).__qualname__}" if " at 0x" in r else r
