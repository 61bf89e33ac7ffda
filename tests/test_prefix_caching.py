"""§5.1 (prefix_caching.py): prefix caching against full reuse and CacheBlend as the retrieved chunks grow,
on the time model and measured; prefix caching's reuse is exact."""
import pytest
import torch

from lecture27 import blend_rules as rules
from lecture27 import blend_world as bw
from lecture27.blend import mask_pitfall as mp
from lecture27.blend import prefix_caching as pc
from common import timemodel as tm

P = bw.PREFIX
DEVICES = {"CPU RAM": ("per_gpu", tm.GPUS["A40"].pcie_bw), "NVMe SSD": ("shared", 4.2e9)}
SYSTEMS = [("llama-2-7b", 1), ("llama-3.1-70b", 2)]


@pytest.fixture(scope="module")
def study():
    return pc.time_model(SYSTEMS, "A40", DEVICES, range(1, 11), 512, 32, 0.15)


def test_the_more_chunks_the_less_prefix_caching_saves(study):
    for s in study.systems.values():
        p, b, r = s.prefix_saved_share, s.blend_saved_share, s.reuse_saved_share
        assert all(x > y for x, y in zip(p, p[1:]))             # falls with every chunk
        assert p[0] == pytest.approx(r[0]) and p[-1] < 0.15     # one chunk: all of it is a prefix
        assert all(0.75 < x < 0.85 for x in b)                  # CacheBlend: about 1 - 15%, whatever k
        assert all(x >= y for x, y in zip(b[1:], b))            # and not falling
        assert all(x < y < z for x, y, z in zip(p[1:], b[1:], r[1:]))
        assert all(x < y for x, y in zip(s.full_ttft_s, s.full_ttft_s[1:]))


def test_prefix_caching_of_one_chunk_is_full_reuse(study):
    for s in study.systems.values():
        for d in study.devices:
            assert s.prefix_ttft_s[d][0] == pytest.approx(s.reuse_ttft_s[d][0])
            # the TTFT of every reuse is below the full prefill's from CPU memory
            assert all(x < f for x, f in zip(s.blend_ttft_s["CPU RAM"], s.full_ttft_s))


def test_the_time_model_parts_add_up():
    """k = 3 on LLaMA-3.1-70B, by hand from the time model and the controller's pipeline."""
    from lecture27 import loading_controller as lc

    st = pc.time_model([("llama-3.1-70b", 2)], "A40", DEVICES, [3], 512, 32, 0.15).systems["llama-3.1-70b"]
    L, q = 80, tm.prefill_time("llama-3.1-70b", "A40", 32, 1536, 2)
    rest = tm.prefill_layer_time("llama-3.1-70b", "A40", 1024, 512, 2)
    load1 = lc.load_time("llama-3.1-70b", 512, "NVMe SSD", 2, DEVICES)
    assert st.prefix_ttft_s["NVMe SSD"][0] == pytest.approx(L * max(load1, rest) + q)
    load3 = lc.load_time("llama-3.1-70b", 1536, "NVMe SSD", 2, DEVICES)
    blend = tm.recompute_time("llama-3.1-70b", "A40", 1536, 0.15, 2)
    assert st.blend_ttft_s["NVMe SSD"][0] == pytest.approx(L * max(load3, blend / L) + q)
    full = tm.prefill_time("llama-3.1-70b", "A40", 1568, 0, 2)
    assert st.blend_saved_share[0] == pytest.approx(1 - (blend + q) / full)
    assert st.prefix_saved_share[0] == pytest.approx(1 - (L * rest + q) / full)


def test_key_chunks():
    assert pc.key_chunks(2) == (0, 1)
    assert pc.key_chunks(4) == (1, 2) and pc.key_chunks(6) == (1, 4)
    assert all(len(set(pc.key_chunks(k))) == 2 and max(pc.key_chunks(k)) < k for k in range(2, 12))


def tiny_doc(seed=0):
    from common.llama import Llama, LlamaConfig

    torch.manual_seed(seed)
    model = Llama(LlamaConfig(vocab_size=50)).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    doc = torch.randint(0, 50, (1, 2 + 6 + 5 + 7))
    ids = torch.tensor([P, P] + [0] * 6 + [1] * 5 + [2] * 7)
    return model, bw.RagDoc(doc, torch.randint(0, 50, (1, 4)), ids, None)


@torch.no_grad()
def test_prefix_caching_is_exact_and_full_reuse_is_not(kl_rounding):
    model, rd = tiny_doc()
    head, n = pc.first_chunk(bw.precompute_chunks(model, rd.doc, rd.chunks), rd)
    assert n == 8 and len(head) == 8
    _, full = model(rd.doc[:, :n])
    for i in range(model.cfg.n_layers):             # the stored first chunk is the full prefill's
        assert (head.k[i] - full.k[i]).abs().max() < 1e-5 and (head.v[i] - full.v[i]).abs().max() < 1e-5
    run = pc.measure_one(model, rd, rules.RULES["flat"], 0.3, mp.MASKS)
    tol = kl_rounding(model(rd.tokens, last=True)[0][0, -1])  # zero up to float32 rounding
    assert abs(run["kl"]["prefix"]) < tol and run["kl"]["reuse"] > 100 * tol
    assert set(run["ttft"]) == {"full", "prefix", "reuse", "blend"} and min(run["ttft"].values()) >= 0
    assert run["kl"]["blend position"] != run["kl"]["blend bottom-right"]


@torch.no_grad()
def test_prefix_caching_on_smollm2_is_exact(smollm2, kl_rounding):
    """SmolLM2, 3 chunks x 64 tokens: prefix caching's first-token KL is zero up to float32 rounding
    (conftest.rounding_kl), full reuse's is not."""
    from common.english import RAG_ITEMS, rag_chunks

    model, tok, _ = smollm2
    rd = bw.rag_doc(rag_chunks(RAG_ITEMS[0], tok, n_chunks=3, chunk_tokens=64, key_chunks=pc.key_chunks(3)))
    run = pc.measure_one(model, rd, rules.RULES["flat"], 0.15, {"position": bw.position_mask})
    tol = kl_rounding(model(rd.tokens, last=True)[0][0, -1])  # zero up to float32 rounding
    assert abs(run["kl"]["prefix"]) < tol and run["kl"]["reuse"] > 100 * tol
