"""CacheBlend's loading controller (loading_controller.py): the ratio that hides the recompute behind the
read, and the fallback when reading a layer takes longer than prefilling it."""
import pytest

from lecture27 import loading_controller as lc
from common import timemodel as tm


def test_exercise8_on_the_handouts_numbers():
    c = lc.choose(32, 0.020, {"SSD": 0.010}, "SSD", 0.15)
    assert (c.choice, c.device, c.ratio) == (lc.BLEND, "SSD", 0.5)
    assert c.ttft_s == pytest.approx(0.320) and c.full_s == pytest.approx(0.640)


@pytest.mark.parametrize("read_ms", [30.0, 20.0])
def test_a_read_no_faster_than_the_prefill_falls_back_to_a_full_prefill(read_ms):
    c = lc.choose(32, 0.020, {"SSD": read_ms / 1e3}, "SSD", 0.15)
    assert (c.choice, c.device, c.ratio) == (lc.FULL_PREFILL, None, 1.0)
    assert c.ttft_s == c.full_s == pytest.approx(0.640)
    # the old controller's plan: 100% recompute still waiting for every read
    assert lc.pipelined_ttft(32, read_ms / 1e3, lc.controller_ratio(read_ms, 20.0, 0.15) * 0.020) >= c.ttft_s


def test_a_slow_device_points_to_the_fastest_device_that_pays():
    loads = {"CPU RAM": 0.001, "NVMe SSD": 0.008, "SATA SSD": 0.060}
    c = lc.choose(32, 0.020, loads, "SATA SSD", 0.15, extra_s=0.005)
    assert (c.choice, c.device, c.stored) == (lc.BLEND, "CPU RAM", "SATA SSD")
    assert c.ratio == 0.15 and c.ttft_s == pytest.approx(32 * 0.15 * 0.020 + 0.005)
    assert c.read_s == 0.060 and c.ttft_s < c.full_s
    # a device that pays is used as it is, even if a faster one exists
    assert lc.choose(32, 0.020, loads, "NVMe SSD", 0.15).device == "NVMe SSD"
    # nothing pays: a full prefill
    assert lc.choose(32, 0.020, {"a": 0.03, "b": 0.05}, "b", 0.15).choice == lc.FULL_PREFILL


def test_the_choice_never_costs_more_than_a_full_prefill():
    for read in (0.001, 0.005, 0.019, 0.02, 0.021, 0.1):
        for floor in (0.0, 0.15, 0.5, 1.0):
            c = lc.choose(40, 0.02, {"d": read}, "d", floor, extra_s=0.01)
            assert c.ttft_s <= c.full_s + 1e-12
            assert (c.choice == lc.BLEND) == (read < 0.02 and floor < 1)
            assert c.choice == lc.FULL_PREFILL or c.ratio < 1


def test_controller_ratio_floor_and_ceiling():
    assert lc.controller_ratio(1.0, 20.0, 0.15) == 0.15
    assert lc.controller_ratio(10.0, 20.0, 0.15) == 0.5
    assert lc.controller_ratio(50.0, 20.0, 0.15) == 1.0
    assert lc.pipelined_ttft(32, 10.0, 0.15 * 20.0) == 320.0


def test_load_time_shares_a_disk_and_splits_over_pcie_links():
    devices = {"CPU RAM": ("per_gpu", 32e9), "NVMe SSD": ("shared", 4.2e9)}
    m = tm.get_model("llama-3.1-70b")
    per_layer = tm.kv_bytes_per_token(m) / m.n_layers * 4096
    assert lc.load_time("llama-3.1-70b", 4096, "NVMe SSD", 2, devices) == pytest.approx(per_layer / 4.2e9)
    assert lc.load_time("llama-3.1-70b", 4096, "CPU RAM", 2, devices) == pytest.approx(per_layer / 64e9)
