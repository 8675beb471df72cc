"""Sizing a plan from pool curves (paasbench/plan/sizing.py, alternatives.py, price.py, curves.py, traffic.py): the
fewest instances that hold the SLO, their capacity, machines and cost, on curves written by hand so every figure can
be worked out here."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from paas_common.errors import InputError
from paasbench.cost.table import CostInputs
from paasbench.metrics.slo import parse_gates
from paasbench.plan.alternatives import size_mixed
from paasbench.plan.curves import Curves, DecodePoint, Instance, PoolCurve, PrefillPoint, load, save
from paasbench.plan.price import deployment_cost, parse_prices
from paasbench.plan.queueing import erlang_c
from paasbench.plan.sizing import plan_slo, prefill_capacity, prefill_work, size_decode, size_disaggregated
from paasbench.plan.traffic import Request, Traffic, parse_traffic

INST = Instance("card-x", cards_per_instance=4, cards_per_machine=8, kv_tokens=1_000_000, chunk_tokens=512)


def curves() -> tuple[PoolCurve, PoolCurve]:
    """One prefill point: 1,000 uncached tokens after 9,000 cached take 0.1 s (1e-4 s a token at position 9,500),
    0.02 s more to the first token; one decode point: 16 streams at 10,000 tokens, 20 ms TPOT (8 streams: 12 ms)."""
    pre = PoolCurve(INST, prefill=[PrefillPoint(10_000, 0.9, 1_000.0, 0.1, [0.12] * 4)])
    dec = PoolCurve(INST, decode=[DecodePoint(10_000, 100, 16.0, 0.02, "tpot", [(1.0, 0.005), (8.0, 0.012), (16.0, 0.02)])])
    return pre, dec


def traffic(rps: float) -> Traffic:
    return Traffic("hand", tuple([Request(9_949, 8_949, 101)] * 10), rps, f"{rps} req/s")   # decodes at 10,000 - 0.5


def test_parse_traffic_forms_and_errors():
    assert parse_traffic("5.8M") == (5.8e6, "tpm") and parse_traffic("5.8M TPM") == (5.8e6, "tpm")
    assert parse_traffic("2 req/s") == (2.0, "rps") and parse_traffic("0.5rps") == (0.5, "rps")
    for bad in ("fast", "5 apples", "0", "-1 req/s"):
        with pytest.raises(InputError, match="--traffic"):
            parse_traffic(bad)


def test_prefill_pool_is_the_fewest_instances_whose_ttft_percentile_holds():
    pre, dec = curves()
    slo = plan_slo(parse_gates(["p90(ttft) <= 300ms"]))
    t = traffic(25.0)                    # offered load a = 25 x 0.1 = 2.5 instances of prefill work
    plan = size_disaggregated(t, pre, dec, slo)
    p = plan.pool("prefill")
    # 3 instances by hand: C(3, 2.5) = 0.702, and those who wait wait Exp(mean (1 + 0)/2 x 0.1 / (3 x (1 - 2.5/3)))
    # = 0.1 s, so P(TTFT > t) = 0.702 exp(-(t - 0.12) / 0.1): p90 = 0.12 + 0.1 ln(7.02) = 0.315 s > 0.3 s
    c, a = 3, 2.5
    pw, mean = erlang_c(c, a), 0.5 * 0.1 / (c * (1 - a / c))
    p90_3 = 0.12 + mean * math.log(pw / 0.1)
    assert pw == pytest.approx(0.7022, abs=1e-4) and p90_3 == pytest.approx(0.315, abs=1e-3)
    assert p.instances_needed == 4
    assert p.predicted["ttft_s"] <= 0.3 and p.machines == 2 and p.cards == 16   # 4 x 4 cards on 8-card machines
    cap = p.capacity_rps
    work = prefill_work(t, pre)
    assert cap > 25 and prefill_capacity(work, 4, slo) == pytest.approx(cap)
    assert size_disaggregated(traffic(cap * 0.999), pre, dec, slo).pool("prefill").instances_needed == 4
    assert size_disaggregated(traffic(cap * 1.01), pre, dec, slo).pool("prefill").instances_needed == 5


def test_decode_pool_holds_the_streams_at_the_slo_quantile():
    pre, dec = curves()
    slo = plan_slo(parse_gates(["p50(ttft) <= 2s", "p90(tpot) <= 20ms"]))
    t = traffic(30.0)
    d = size_decode(t, dec, slo)
    # each stream: 100 tokens after its first at 20 ms = 2 s, holding 1/16 of an instance
    mean = 30.0 * 2.0 / 16
    sd = math.sqrt(30.0 * (2.0 / 16) ** 2)
    assert d.predicted["occupancy_mean"] == pytest.approx(mean)
    assert d.predicted["occupancy_at_q"] == pytest.approx(mean + 1.2815516 * sd, rel=1e-6)
    assert d.instances_needed == math.ceil(mean + 1.2815516 * sd) == 5
    # 5 instances of 4 cards need 3 8-card machines, which hold 6: the capacity is 6's, lambda/8 + 1.28 sqrt(lambda/64)
    # = 6 -> sqrt(lambda) = (-0.1602 + sqrt(0.1602^2 + 3)) / 0.25
    assert (d.machines, d.instances) == (3, 6)
    assert d.capacity_rps == pytest.approx(((-0.16019 + math.sqrt(0.16019 ** 2 + 3)) / 0.25) ** 2, rel=1e-3)


def test_a_tighter_tpot_reads_fewer_streams_off_the_curve_for_a_mixed_pool():
    pre, dec = curves()
    assert dec.max_active(np.array([10_000.0]), 0.012)[0] == pytest.approx(8.0)
    assert dec.max_active(np.array([10_000.0]), 0.016)[0] == pytest.approx(12.0)
    assert dec.max_active(np.array([20_000.0]))[0] == pytest.approx(8.0)          # past the longest: KV-scaled
    mixed = PoolCurve(INST, prefill=pre.prefill, decode=dec.decode)
    slo = plan_slo(parse_gates(["p90(ttft) <= 400ms", "p50(tpot) <= 40ms"]))
    colo = size_mixed(traffic(25.0), mixed, mixed, slo, "colocated")
    chunk = size_mixed(traffic(25.0), mixed, mixed, slo, "chunked")
    assert colo.pool("mixed").instances >= 4 and chunk.pool("mixed").instances >= colo.pool("mixed").instances
    assert colo.pool("mixed").predicted["tpot_s"] <= 0.04


def test_an_slo_nothing_meets_is_an_input_error():
    pre, dec = curves()
    with pytest.raises(InputError, match="no prefill pool meets the TTFT SLO"):
        size_disaggregated(traffic(1.0), pre, dec, plan_slo(parse_gates(["p50(ttft) <= 50ms"])))
    with pytest.raises(InputError, match="percentile"):
        plan_slo(parse_gates(["mean(ttft) <= 1s"]))
    with pytest.raises(InputError, match="neither TTFT nor TPOT"):
        plan_slo(parse_gates(["error_rate <= 1%"]))


def test_cost_adds_each_machine_type_and_earns_once():
    inputs = CostInputs()
    cost = deployment_cost(5.8e6, 0.9, 0.0, [("prefill", "mtt-s5000", 2, 16), ("decode", "h200", 1, 8)], inputs,
                           parse_prices(["h200=3000000"], "--machine-price"), {})
    s5000, h200 = cost["pools"]
    assert s5000["price_source"].startswith("assumed") and h200["price_source"] == "given"
    assert s5000["hardware_per_day"] == pytest.approx(2 * 1.2e6 / (5 * 365))
    assert h200["hardware_per_day"] == pytest.approx(3e6 / (5 * 365))
    assert cost["cost_per_day"] == pytest.approx(s5000["cost_per_day"] + h200["cost_per_day"])
    assert cost["revenue_per_day"] == pytest.approx(5.8 * 2.6 * 1440)          # docs/cost.md's white-paper row
    assert cost["cost_per_m_input_tokens"] == pytest.approx(cost["cost_per_day"] / (5.8 * 1440))
    with pytest.raises(InputError, match="--machine-price"):
        parse_prices(["h200"], "--machine-price")


def test_curves_file_round_trips_and_bad_files_name_the_field(tmp_path):
    pre, dec = curves()
    path = save(Curves({"mode": "hand"}, ["p90(ttft) <= 400ms"], {"prefill": pre, "decode": dec}), tmp_path / "c.json")
    back = load(path)
    assert back.pools["prefill"].prefill[0].service_s == 0.1 and back.pools["decode"].decode[0].table[1] == (8.0, 0.012)
    data = json.loads(path.read_text())
    data["pools"]["prefill"]["prefill"][0]["service_s"] = 0
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(InputError, match="pools.prefill.prefill") as exc:
        load(tmp_path / "bad.json")
    assert exc.value.exit_code == 2
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(InputError, match="schema"):
        load(tmp_path / "other.json")
    with pytest.raises(InputError, match="no mixed pool"):
        back.pool("mixed")


def test_docs_worked_example_states_these_figures():
    """docs/plan.md's worked example is the two tests above: the figures it prints are the ones they recompute."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "plan.md").read_text()
    example = doc.split("## Worked example", 1)[1].split("\n## ", 1)[0]
    pw, p90 = erlang_c(3, 2.5), 0.12 + 0.1 * math.log(erlang_c(3, 2.5) / 0.1)
    mean, sd = 30 * 2.0 / 16, math.sqrt(30 * (2.0 / 16) ** 2)
    cap6 = ((-1.2815516 * math.sqrt(1 / 64) + math.sqrt(1.2815516 ** 2 / 64 + 4 * 6 / 8)) / (2 / 8)) ** 2
    for figure in (f"{pw:.3f}", f"{p90:.3f} s", "P = 4", f"{mean:.2f}", f"{sd:.3f}", f"{mean + 1.2816 * sd:.2f}",
                   "D = 5", f"{cap6:.1f} req/s"):
        assert figure in example, figure
