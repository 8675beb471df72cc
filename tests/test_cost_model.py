"""The cost model reproduces the white paper's headline and each documented formula."""

from __future__ import annotations

from pathlib import Path

import pytest

from paas_common.errors import InputError
from paasbench.cost.table import FORMULAS, CostInputs, cost_row, load_cost_inputs


def test_white_paper_headline_row():
    row = cost_row(5.8e6, 0.9, 0.0, CostInputs(), "64K", context_tokens=65536)
    assert row.blended_price_per_m == pytest.approx(2.6)
    assert row.revenue_per_minute == pytest.approx(15.08)
    assert row.revenue_per_day == pytest.approx(21715.2)
    assert row.revenue_per_year == pytest.approx(21715.2 * 365)
    assert row.input_tokens_per_day == pytest.approx(5.8e6 * 1440)
    assert row.currency == "CNY" and row.tpm_per_card == pytest.approx(5.8e6 / 8)


def test_cost_side_formulas():
    ci = CostInputs(machine_price=1_000_000, amortization_years=4, power_kw=10, electricity_per_kwh=0.5,
                    network_per_day=50, price_output_per_m=16)
    row = cost_row(1e6, 0.5, 2e5, ci)
    hardware = 1_000_000 / (4 * 365)
    power = 10 * 24 * 0.5
    assert row.hardware_per_day == pytest.approx(hardware)
    assert row.power_per_day == pytest.approx(power)
    assert row.cost_per_day == pytest.approx(hardware + power + 50)
    per_min = 1.0 * (0.5 * 2 + 0.5 * 8) + 0.2 * 16
    assert row.revenue_per_minute == pytest.approx(per_min)
    assert row.cost_per_m_tokens == pytest.approx((hardware + power + 50) / (1e6 * 1440 / 1e6))
    assert row.gross_margin == pytest.approx((per_min * 1440 - row.cost_per_day) / (per_min * 1440))
    assert row.payback_months == pytest.approx(1_000_000 / ((per_min * 1440 - power - 50) * 365 / 12))


def test_hours_per_day_and_unprofitable_rows():
    half = cost_row(5.8e6, 0.9, inputs=CostInputs(hours_per_day=12))
    assert half.revenue_per_day == pytest.approx(21715.2 / 2)
    tiny = cost_row(100.0, 0.9)  # revenue below running cost: never pays back
    assert tiny.payback_months is None and tiny.gross_margin < 0
    zero = cost_row(0.0, 0.9)
    assert zero.cost_per_m_tokens is None and zero.gross_margin is None


def test_bad_numbers_are_input_errors():
    with pytest.raises(InputError, match="hit_ratio"):
        cost_row(1e6, 90)
    with pytest.raises(InputError, match="max_input_tpm"):
        cost_row(-1, 0.9)
    with pytest.raises(InputError, match="amortization_years"):
        CostInputs(amortization_years=0)
    with pytest.raises(InputError, match="hours_per_day"):
        CostInputs(hours_per_day=25)


def test_formulas_documented():
    names = [n for n, _ in FORMULAS]
    assert {"blended price", "revenue / minute", "cost / M tokens", "gross margin", "payback months"} <= set(names)
    doc = (Path(__file__).parent.parent / "docs" / "cost.md").read_text()
    for name in names:
        assert name in doc, f"docs/cost.md does not explain '{name}'"


def test_yaml_inputs_with_located_errors(tmp_path: Path):
    f = tmp_path / "cost.yaml"
    f.write_text("currency: USD\nprice_input_per_m: 1.1\nmachine_price: 250000\n")
    ci = load_cost_inputs(f)
    assert (ci.currency, ci.price_input_per_m, ci.machine_price) == ("USD", 1.1, 250000)
    assert ci.price_cached_input_per_m == 2.0  # untouched defaults stay
    f.write_text("currency: CNY\n\nmachine_prise: 1\n")
    with pytest.raises(InputError) as err:
        load_cost_inputs(f)
    assert (err.value.line, err.value.field) == (3, "machine_prise")
    f.write_text("power_kw: lots\n")
    with pytest.raises(InputError) as err:
        load_cost_inputs(f)
    assert (err.value.line, err.value.field) == (1, "power_kw") and "number" in str(err.value)
    f.write_text("price_input_per_m: 8\nprice_input_per_m: 9\n")
    with pytest.raises(InputError, match="twice") as err:
        load_cost_inputs(f)
    assert (err.value.line, err.value.field) == (2, "price_input_per_m")
    f.write_text("- 1\n")
    with pytest.raises(InputError, match="mapping"):
        load_cost_inputs(f)
    assert load_cost_inputs(None) == CostInputs()


def test_row_is_charged_for_the_machines_used():
    """32 cards (GLM-5.2-FP8 1P+1D on 8-card S5000 machines) cost four machines, not one; TPM per card is /32."""
    ci = CostInputs(machine_price=1_000_000, amortization_years=4, power_kw=10, electricity_per_kwh=0.5,
                    network_per_day=50)
    one, four = cost_row(4e6, 0.9, inputs=ci), cost_row(4e6, 0.9, inputs=ci, cards=32, machines=4)
    assert (one.cards, one.machines, one.hardware_source) == (8, 1, "assumed")
    assert (four.cards, four.machines, four.hardware_source) == (32, 4, "server")
    assert four.hardware_per_day == pytest.approx(4 * 1_000_000 / (4 * 365))
    assert four.power_per_day == pytest.approx(4 * 10 * 24 * 0.5)
    assert four.network_per_day == pytest.approx(4 * 50)
    assert four.cost_per_day == pytest.approx(4 * one.cost_per_day)
    assert four.revenue_per_day == pytest.approx(one.revenue_per_day)      # revenue is the tokens', not the machines'
    assert four.tpm_per_card == pytest.approx(4e6 / 32) and four.tpm_per_machine == pytest.approx(1e6)
    cash = four.revenue_per_day - four.power_per_day - four.network_per_day
    assert four.payback_months == pytest.approx(4 * 1_000_000 / (cash * 365 / 12))
    # cards give the machines through cards_per_machine; a server of 3 cards still takes a whole machine
    assert cost_row(4e6, 0.9, inputs=ci, cards=20).machines == 3
    assert cost_row(4e6, 0.9, inputs=ci, cards=3).machines == 1


def test_a_server_without_cards_is_never_given_any():
    """The cpu engine is "one machine, no cards" (reference_server/hardware.py: meta.hardware cards None,
    machines 1). Before, its row was priced as 8 cards (machines x cards_per_machine), source "server", with no
    "(assumed)" mark: cards nobody counted, and a TPM per card of a server that has none."""
    from paasbench.report.tables import cost_tables

    row = cost_row(4e6, 0.9, cards=None, machines=1)
    assert (row.cards, row.tpm_per_card, row.machines, row.hardware_source) == (None, None, 1, "server")
    assert row.note.startswith("no cards: the server's processes on 1 machine")
    cells = dict(zip(cost_tables([row], CostInputs())["rows"].headers, cost_tables([row], CostInputs())["rows"].rows[0]))
    assert (cells["cards"], cells["TPM / card"], cells["machines"]) == ("no cards", "—", "1")


def test_a_row_of_unknown_size_says_what_its_cost_figures_are_worth():
    """A --target that reports no hardware and no target_cards: one machine of 8 cards, assumed. Before, the row
    printed a 53-month payback beside a small "(assumed)" and nothing said those figures rest on a guess; the
    row says so now, and its margin is not coloured as a verdict."""
    from paasbench.report.tables import cost_tables

    row = cost_row(1e6, 0.9)
    table = cost_tables([row], CostInputs())["rows"]
    cells = dict(zip(table.headers, table.rows[0]))
    assert cells["cards"] == "8 (assumed)" and cells["machines"] == "1 (assumed)"
    assert "size unknown" in cells["size"] and "mean little until target_cards is set" in cells["size"]
    assert table.classes[0][table.headers.index("gross margin")] == ""
    counted = cost_tables([cost_row(1e6, 0.9, cards=8)], CostInputs())["rows"]
    assert dict(zip(counted.headers, counted.rows[0]))["size"] == "counted from the server"


def test_target_cards_price_an_external_server(tmp_path: Path):
    """A --target's size comes from the cost inputs (the sweep cannot count its cards): 24 cards = 3 machines."""
    f = tmp_path / "cost.yaml"
    f.write_text("target_cards: 24\n")
    row = cost_row(6e6, 0.9, inputs=load_cost_inputs(f))
    assert (row.cards, row.machines, row.hardware_source) == (24, 3, "cost inputs")
    assert row.tpm_per_card == pytest.approx(6e6 / 24)
    assert cost_row(6e6, 0.9, inputs=load_cost_inputs(f), cards=32, machines=4).machines == 4  # counted wins
