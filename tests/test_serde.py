"""The engine's shared tiers in CacheGen's bitstream (serve.py --serde cachegen, LMCache's remote_serde): the records
on disk (and Redis) are the codec's, RAM keeps FP16; a record reads back as the codec decodes it, a request's records
decoded together; an engine of the other format never reads them; a corrupted one is a miss, never KV. No model:
a codec fitted on random-walk KV of a small shape (test_coder_parallel's)."""
import numpy as np
import pytest

from lecture27 import kvcache as kv
from lecture27 import kvrecord
from lecture27 import kvstore as ks
from lecture27.engine.connector import SERDE_LAYOUT, SERDE_SMALL, Tiers

L, C = 3, 16


def walk_kv(seed: int, n: int, T: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    walk = np.cumsum(0.3 * rng.standard_normal((n, T, L, 2, C)), 1)
    return (walk + rng.standard_normal((n, 1, L, 2, C))).astype(np.float32)


@pytest.fixture(scope="module")
def spec():
    Xc = walk_kv(0, 40, 30)
    return kv.fit_codec(Xc, np.sqrt((Xc ** 2).mean(axis=(0, 1, 4))) / 8, True)


def tiers(tmp_path, serde: str, spec=None, ram: bool = True) -> Tiers:
    """RAM (when asked) and a disk tier in tmp_path/disk, the shared one: a second Tiers on the same folder is a
    second engine on the same disk."""
    return Tiers(([ks.RamTier(1 << 26)] if ram else []) + [ks.DiskTier(tmp_path / "disk", 1 << 26)], (L, 2, C),
                 serde, spec)


def key(i: int) -> ks.ChunkKey:
    return ks.ChunkKey("m", tuple(range(i, i + 37)), (1, 2))


def test_the_shared_tier_keeps_the_codecs_records_and_ram_keeps_fp16(tmp_path, spec):
    X = walk_kv(5, 1, 37)[0]
    t = tiers(tmp_path, "cachegen", spec)
    t.put(key(0), X)
    ram, disk = t.stores
    assert (ram.fmt, disk.fmt) == ("fp16", "cachegen") and disk.name(key(0)).endswith("-cachegen0")
    record = disk.tier.get(disk.name(key(0)))
    assert kv.codec_header(bytes(kvrecord_payload(record)))["layout"] == SERDE_SMALL[0]   # 37 tokens: a small record
    got, where = t.get(key(0))
    assert where == "ram" and np.abs(got - X).max() <= np.abs(X).max() / 1000   # FP16's rounding
    shared, where = tiers(tmp_path, "cachegen", spec, ram=False).get(key(0))   # another engine, the same disk
    assert where == "disk" and np.array_equal(shared, kv.dequantize(kv.quantize(X[None], spec), spec)[0])


def kvrecord_payload(record: bytes):
    return kvrecord.check(record, key(0).digest, 37, (L, 2, C), kvrecord.signing_key() or None)[2]


def test_a_requests_records_decode_together_as_each_alone(tmp_path, spec):
    """get_many reads every chunk a tier holds at once (the parallel decoder over all their streams), a miss left to
    the tier below, the order kept."""
    Xs = walk_kv(6, 3, 37)
    writer = tiers(tmp_path, "cachegen", spec, ram=False)
    for i in (0, 2):
        writer.put(key(i), Xs[i])
    reader = tiers(tmp_path, "cachegen", spec)
    got = reader.get_many([key(0), key(1), key(2)])
    assert [where for _, where in got] == ["disk", None, "disk"]
    for i in (0, 2):
        assert np.array_equal(got[i][0], kv.dequantize(kv.quantize(Xs[i][None], spec), spec)[0])
    assert [where for _, where in reader.get_many([key(0), key(2)])] == ["ram", "ram"]   # copied up


def test_an_engine_of_the_other_serde_never_reads_the_records(tmp_path, spec):
    X = walk_kv(7, 1, 37)[0]
    tiers(tmp_path, "cachegen", spec, ram=False).put(key(0), X)
    assert tiers(tmp_path, "fp16", ram=False).get(key(0)) == (None, None)
    tiers(tmp_path, "fp16", ram=False).put(key(1), X)
    assert tiers(tmp_path, "cachegen", spec, ram=False).get(key(1)) == (None, None)


def test_a_corrupted_cachegen_record_is_a_miss(tmp_path, spec):
    X = walk_kv(8, 1, 37)[0]
    t = tiers(tmp_path, "cachegen", spec, ram=False)
    t.put(key(0), X)
    disk = t.stores[0]
    name = disk.name(key(0))
    record = bytearray(disk.tier.get(name))
    record[len(record) // 2] ^= 0x40   # a bit of the bitstream
    disk.tier.path(name).write_bytes(bytes(record))
    assert t.get(key(0)) == (None, None) and disk.corrupt == 1 and disk.tier.get(name) is None


def test_cachegen_records_are_smaller_by_the_codecs_bits(tmp_path, spec):
    """A record's bytes: FP16's 16 bits a value against the codec's (its header and the streams' ends aside)."""
    X = walk_kv(9, 1, 300)[0]
    fp16, cachegen = tiers(tmp_path / "a", "fp16", ram=False), tiers(tmp_path / "b", "cachegen", spec, ram=False)
    for t in (fp16, cachegen):
        t.put(key(0), X)
    size = [len(t.stores[0].tier.get(t.stores[0].name(key(0)))) for t in (fp16, cachegen)]
    record = cachegen.stores[0].tier.get(cachegen.stores[0].name(key(0)))
    assert kv.codec_header(bytes(record[kvrecord.HEAD.size:]), lengths=False)["layout"] == SERDE_LAYOUT   # 300
    bits = kv.codec_bits(spec, X[None]) / X.size
    assert size[0] / size[1] == pytest.approx(16 / bits, rel=0.1)


def test_a_bad_serde_is_refused():
    with pytest.raises(ValueError):
        Tiers([], (L, 2, C), "cachegen")   # no codec
    with pytest.raises(ValueError):
        Tiers([], (L, 2, C), "zip")


def test_each_tier_says_what_it_holds_and_what_its_reads_cost(tmp_path, spec):
    """Tiers.stats (the engine's /metrics l27_tier_*): records and bytes held, and for reads the records, tokens and
    payload bytes read with the seconds reading and decoding."""
    tiers(tmp_path, "cachegen", spec, ram=False).put(key(0), walk_kv(10, 1, 37)[0])
    reader = tiers(tmp_path, "cachegen", spec)
    reader.get_many([key(0), key(1)])   # a hit on disk (then copied up to RAM) and a miss
    ram, disk = reader.stats()
    assert ram[:4] == ("ram", "fp16", 1, ram[3]) and ram[3] > 37 * L * 2 * C * 2 and ram[4] == 0
    name, fmt, held, nbytes, records, tokens, read_bytes, read_s, decode_s = disk
    assert (name, fmt, held, records, tokens) == ("disk", "cachegen", 1, 1, 37)
    assert 0 < read_bytes < nbytes and read_s >= 0 and decode_s > 0


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2s_records_are_smaller_by_the_ratio_02_reports(tmp_path, smollm2):
    """SmolLM2's KV of a paragraph (300 tokens) in the shared tier: the CacheGen record at level 0 is FP16's over
    16 / (level 0's bits a value, as 02 reports them), within 10% (the record's layout adds its streams' ends; 02's
    figure is measured on other paragraphs)."""
    import torch
    from common import english
    from common.llama import kv_to_array
    from lecture27.codec import smollm2 as real
    model, tok, _ = smollm2
    ids = tok.encode(" ".join(english.EVALUATION))
    with torch.no_grad():
        X = kv_to_array(model(torch.tensor([ids.ids[:300]]))[1])[0]
    shape, bits = X.shape[1:], real.real_codec_levels()[0]["bits_per_value"]
    spec, k = real.real_codec_specs()[0], ks.ChunkKey("m", tuple(ids.ids[:300]))
    size = {}
    for serde in ("fp16", "cachegen"):
        t = Tiers([ks.DiskTier(tmp_path / serde, 1 << 30)], shape, serde, spec if serde == "cachegen" else None)
        t.put(k, X)
        size[serde] = len(t.stores[0].tier.get(t.stores[0].name(k)))
        assert t.get(k)[1] == "disk"   # it reads back
    assert size["fp16"] / size["cachegen"] == pytest.approx(16 / bits, rel=0.1), (size, bits)


def serde_run(name: str, ttfts: list, *, bytes_per_token: float, decode_s: float, held: list, kl: float):
    """A SerdeRun made here (no server): 100 tokens read, their decode taking decode_s."""
    from lecture27.serving import bench, serde
    samples = [bench.Sample("rag", 0, i, t, t + 1, 100, 80, 8, f"answer {i}") for i, t in enumerate(ttfts)]
    reads = {"read_records": 4, "read_tokens": 100, "read_bytes": 100 * bytes_per_token, "read_seconds": 0.1,
             "decode_seconds": decode_s}
    return serde.SerdeRun(serde=name, run=bench.Run(name, "rag", 1, samples, 5.0, [kl]), records=7,
                          bytes=3e6, held=held, docs=4, reads=reads, requests=5)


def test_the_serde_table_sets_cachegen_beside_fp16_with_its_break_even_link():
    """serde.table's rows and keys from made-up runs: documents held of those sent, the read and decode time a
    request, the answers equal to no_store's, and the link speed below which CacheGen's bytes and decode beat FP16's:
    8 (23,040 - 6,000) bits / (0.5 - 0.01) s a token's ... here per 100 tokens."""
    from lecture27.serving import bench, serde
    runs = {"fp16": serde_run("fp16", [1.0, 3.0], bytes_per_token=23040, decode_s=0.01, held=[1, 0], kl=0.0),
            "cachegen": serde_run("cachegen", [2.0, 4.0], bytes_per_token=6000, decode_s=0.5, held=[4, 4], kl=0.02)}
    plain = [bench.Sample("rag", 0, 0, 2, 3, 100, 0, 8, "answer 0"), bench.Sample("rag", 0, 1, 2, 3, 100, 0, 8, "x")]
    j = serde.json_keys(runs, plain, 0.01)
    assert j["serve_serde_breakeven_gbps"] == pytest.approx(8 * (23040 - 6000) / (0.49 / 100) / 1e9)
    assert j["serve_serde"]["cachegen"]["documents_held"] == 8 and j["serve_serde"]["fp16"]["documents_held"] == 1
    assert j["serve_serde"]["fp16"]["same_as_no_store"] == 0.5 and j["serve_serde"]["cachegen"]["kl"] == 0.02
    assert j["serve_serde"]["cachegen"]["read_decode_s"] == pytest.approx((0.1 + 0.5) / 5)
    t = serde.table(runs, plain, "t", serde.SHORT)
    assert [c.header for c in t.cols] == list(serde.SHORT)
    assert [r.cells[:4] for r in t.rows] == [["fp16", 3.0, "1/8", "80%"], ["cachegen", 3.0, "8/8", "80%"]]
    assert "23,040 bytes in FP16, 6,000 in CacheGen's records (3.84x fewer)" in " ".join(t.notes)
    runs["cachegen"] = serde_run("cachegen", [2.0], bytes_per_token=6000, decode_s=0.001, held=[4], kl=0.0)
    assert serde.breakeven_gbps(runs["fp16"], runs["cachegen"]) is None   # a decode no slower than FP16's: no link
    assert "no slower than FP16's" in " ".join(serde.table(runs, plain, "t").notes)
