"""What a deployment costs: its machines priced per machine type with the cost table's formulas (docs/cost.md).

A plan buys machines of one or two types (the white paper's S5000 prefill machines beside a decode pool of another
card), so each pool is priced as a row of :func:`paasbench.cost.table.cost_row` with its own machine price and
power, and the rows add up; revenue is the traffic's (its input TPM at its prefix hit, priced at the blended input
price, plus its output TPM at the output price), earned once by the whole deployment. A machine type without a
price given (``--machine-price TYPE=PRICE``) takes the table below: **assumptions**, not quotes (no list price is
published for these servers), in the cost inputs' currency only when it is CNY; otherwise the cost inputs' own
``machine_price`` and ``power_kw``, said as such.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from paas_common.errors import InputError
from paasbench.cost.table import CostInputs, cost_row

# machine type -> (price, wall power kW) per 8-card machine, CNY. ASSUMED (see the module docstring):
# mtt-s5000: docs/cost.md's placeholder; h100 / h200: HGX 8-GPU servers at roughly $250K / $330K, 10.2 kW peak.
ASSUMED_CNY: dict[str, tuple[float, float]] = {
    "mtt-s5000": (1_200_000.0, 8.0),
    "h100": (1_800_000.0, 10.2),
    "h200": (2_400_000.0, 10.2),
}


@dataclass(frozen=True, slots=True)
class MachinePrice:
    machine_type: str
    price: float
    power_kw: float
    source: str                  # "given" | "assumed (plan/price.py)" | "cost inputs"


def parse_prices(items: Sequence[str], option: str) -> dict[str, float]:
    """``TYPE=VALUE`` items (``--machine-price h200=2.4e6``) -> {type: value}."""
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if not sep or not name.strip() or not number >= 0:
            raise InputError(f"{item!r} is not TYPE=NUMBER (e.g. h200=2400000)", field=option)
        out[name.strip()] = number
    return out


def machine_price(machine_type: str, inputs: CostInputs, prices: Mapping[str, float],
                  powers: Mapping[str, float]) -> MachinePrice:
    assumed = ASSUMED_CNY.get(machine_type) if inputs.currency == "CNY" else None
    price = prices.get(machine_type)
    power = powers.get(machine_type)
    if price is not None:
        source = "given"
    elif assumed:
        price, source = assumed[0], "assumed (plan/price.py)"
    else:
        price, source = inputs.machine_price, "cost inputs (machine_price)"
    if power is None:
        power = assumed[1] if assumed else inputs.power_kw
    return MachinePrice(machine_type, price, power, source)


def deployment_cost(input_tpm: float, hit: float, output_tpm: float, pools: Sequence[tuple[str, str, int, int]],
                    inputs: CostInputs, prices: Mapping[str, float] | None = None,
                    powers: Mapping[str, float] | None = None) -> dict[str, Any]:
    """The deployment's cost and margin at a traffic. ``pools``: (role, machine type, machines, cards) each."""
    rows = []
    for role, mtype, machines, cards in pools:
        mp = machine_price(mtype, inputs, prices or {}, powers or {})
        row = cost_row(input_tpm, hit, output_tpm, inputs.with_overrides(machine_price=mp.price, power_kw=mp.power_kw),
                       label=role, cards=max(1, cards), machines=max(1, machines))
        rows.append({"role": role, "machine_type": mtype, "machines": machines, "cards": cards,
                     "machine_price": mp.price, "power_kw": mp.power_kw, "price_source": mp.source,
                     "hardware_per_day": row.hardware_per_day, "power_per_day": row.power_per_day,
                     "network_per_day": row.network_per_day, "cost_per_day": row.cost_per_day})
    revenue = cost_row(input_tpm, hit, output_tpm, inputs)
    cost = sum(r["cost_per_day"] for r in rows)
    tokens = revenue.input_tokens_per_day
    capex = sum(r["machines"] * r["machine_price"] for r in rows)
    running = sum(r["power_per_day"] + r["network_per_day"] for r in rows)
    cash = (revenue.revenue_per_day - running) * 365 / 12
    return {"currency": inputs.currency, "pools": rows, "cost_per_day": cost,
            "cost_per_m_input_tokens": cost / (tokens / 1e6) if tokens else None,
            "revenue_per_day": revenue.revenue_per_day, "blended_price_per_m": revenue.blended_price_per_m,
            "gross_margin": (revenue.revenue_per_day - cost) / revenue.revenue_per_day if revenue.revenue_per_day else None,
            "capex": capex, "payback_months": capex / cash if cash > 0 else None}
