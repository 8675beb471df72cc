"""The revenue / cost table (article §6.3, the MTT S5000 white paper): from "max input TPM under the SLO" to money.

One row per measured capacity (a sweep's best step, or one context-length bucket), charged for the machines that
capacity used: the server's cards packed onto machines (a sweep records them from the embedded server; for a
``--target`` its ``target_cards`` from the cost inputs, else one machine of ``cards_per_machine`` cards, assumed). Prices default to the white
paper's (8 CNY per million input tokens, 2 for cache hits: 2.6 blended at a 90% hit); the hardware figures are
placeholders to be replaced with your own quote — they are assumptions, not published numbers. Every formula is in
:data:`FORMULAS`, which the report prints next to the table, and in ``docs/cost.md``.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml

from paas_common.errors import InputError

MINUTES_PER_HOUR = 60
DAYS_PER_YEAR = 365
MONTH_DAYS = DAYS_PER_YEAR / 12


@dataclass(frozen=True, slots=True)
class CostInputs:
    currency: str = "CNY"
    # Prices per million tokens (white paper). Output defaults to 0: a Prefill-as-a-Service machine sells
    # prefill; output tokens are generated, and billed, by the decode pool, whose cost is not in this row.
    price_input_per_m: float = 8.0
    price_cached_input_per_m: float = 2.0
    price_output_per_m: float = 0.0
    # Hardware, per machine. ASSUMED figures (no published price for an 8x MTT S5000 server) — override them.
    cards_per_machine: int = 8             # machine size when the target's hardware is unknown (--target)
    target_cards: int = 0                  # cards a --target uses (the sweep cannot count them); 0: one machine
    machine_price: float = 1_200_000.0     # purchase price of the whole machine, in `currency`
    amortization_years: float = 5.0        # straight-line depreciation period
    power_kw: float = 8.0                  # wall power at load, cards + host + cooling share
    electricity_per_kwh: float = 0.7       # in `currency`
    network_per_day: float = 100.0         # bandwidth / hosting share per day, in `currency`
    hours_per_day: float = 24.0            # hours a day the machine sells at max TPM

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "currency":
                if not isinstance(value, str) or not value:
                    raise InputError("must be a non-empty string", field="currency")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InputError(f"must be a number, got {value!r}", field=f.name)
            if value < 0:
                raise InputError(f"must be >= 0, got {value}", field=f.name)
        if self.amortization_years <= 0 or self.cards_per_machine <= 0:
            raise InputError("must be > 0", field="amortization_years" if self.amortization_years <= 0
                             else "cards_per_machine")
        if self.hours_per_day > 24:
            raise InputError(f"a day has 24 hours, got {self.hours_per_day}", field="hours_per_day")

    def blended_input_price(self, hit_ratio: float) -> float:
        return hit_ratio * self.price_cached_input_per_m + (1.0 - hit_ratio) * self.price_input_per_m

    def with_overrides(self, **overrides: Any) -> "CostInputs":
        unknown = sorted(set(overrides) - {f.name for f in fields(self)})
        if unknown:
            raise InputError(f"unknown cost input; known: {', '.join(f.name for f in fields(self))}",
                             field=unknown[0])
        return replace(self, **overrides)


@dataclass(frozen=True, slots=True)
class CostRow:
    label: str
    currency: str
    max_input_tpm: float            # input (prompt) tokens per minute the server sustains under the SLO
    hit_ratio: float                # prefix-cache hit ratio those tokens were served at
    output_tpm: float
    blended_price_per_m: float      # price of one million input tokens at that hit ratio
    input_tokens_per_day: float
    revenue_per_minute: float
    revenue_per_day: float
    revenue_per_year: float
    hardware_per_day: float         # amortization of every machine used
    power_per_day: float
    network_per_day: float
    cost_per_day: float
    cost_per_m_tokens: float | None  # what one million input tokens cost to serve
    gross_margin: float | None      # (revenue - cost) / revenue
    payback_months: float | None    # machines' price / monthly (revenue - running cost); None: never
    tpm_per_card: float | None      # None: a server with no cards (the cpu engine's processes on one host)
    context_tokens: int | None = None
    cards: int | None = None        # cards the capacity used (all workers' instances); None: the server has none
    machines: int = 1               # machines those cards occupy: what the row is charged for
    tpm_per_machine: float = 0.0
    hardware_source: str = "assumed"  # "server": counted from the server's config; "cost inputs": target_cards;
                                      # "assumed": one machine of cards_per_machine; "published": a claim's own

    @property
    def size_text(self) -> str:
        """Where the row's cards and machines come from, in words (the report's "size" column)."""
        return self.note or {"server": "counted from the server", "cost inputs": "target_cards of the cost inputs",
                             "published": "as published"}.get(self.hardware_source, self.hardware_source)

    @property
    def note(self) -> str:
        """What the row's size rests on, said in the row: an assumed size makes its cost figures placeholders."""
        if self.hardware_source == "assumed":
            return (f"size unknown: priced as {self.machines} machine of {self.cards} cards (assumed); its cost, "
                    "margin and payback mean little until target_cards is set in --cost-inputs")
        if self.cards is None:
            return (f"no cards: the server's processes on {self.machines} machine"
                    f"{'s' if self.machines != 1 else ''}, each charged the cost inputs' machine_price "
                    "(set it to this host's)")
        return ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# The formulas, in the words the report and docs/cost.md print. Keep in step with cost_row().
FORMULAS: list[tuple[str, str]] = [
    ("blended price", "hit · cached input price + (1 − hit) · input price   (per M tokens)"),
    ("revenue / minute", "max input TPM / 1e6 · blended price + output TPM / 1e6 · output price"),
    ("revenue / day", "revenue / minute · 60 · hours per day"),
    ("revenue / year", "revenue / day · 365"),
    ("input tokens / day", "max input TPM · 60 · hours per day"),
    ("machines", "⌈cards / cards per machine⌉   (cards = workers · cards per worker, from the server; a server "
                 "with no cards, the cpu engine: the machines it runs on)"),
    ("TPM / card, TPM / machine", "max input TPM / cards, max input TPM / machines"),
    ("hardware / day", "machines · machine price / (amortization years · 365)"),
    ("power / day", "machines · power kW · 24 h · electricity price per kWh   (on all day)"),
    ("cost / day", "hardware / day + power / day + machines · network / day"),
    ("cost / M tokens", "cost / day / (input tokens / day / 1e6)"),
    ("gross margin", "(revenue / day − cost / day) / revenue / day"),
    ("payback months", "machines · machine price / ((revenue / day − power / day − network / day) · 365 / 12)"),
]


def cost_row(max_input_tpm: float, hit_ratio: float, output_tpm: float = 0.0,
             inputs: CostInputs | None = None, label: str = "", *, context_tokens: int | None = None,
             cards: int | None = None, machines: int | None = None) -> CostRow:
    """One row of the table. See :data:`FORMULAS`. ``cards`` / ``machines``: what the server used. Cards alone
    give the machines through ``cards_per_machine``; machines with no cards are a server without cards (the cpu
    engine: its processes on one host, ``reference_server.hardware``), whose row has no cards and no TPM per
    card, never cards made up from ``cards_per_machine``. Neither: the size is unknown, and the row is one machine
    of ``cards_per_machine`` cards, marked assumed (:attr:`CostRow.note` says what that leaves)."""
    inputs = inputs or CostInputs()
    source = "assumed" if cards is None and machines is None else "server"
    if source == "assumed" and inputs.target_cards:
        cards, source = int(inputs.target_cards), "cost inputs"
    if source == "assumed":
        cards = inputs.cards_per_machine
    if machines is None:
        machines = max(1, math.ceil(cards / inputs.cards_per_machine))
    if machines < 1 or (cards is not None and cards < 1):
        raise InputError(f"cards and machines must be >= 1, got {cards} / {machines}", field="machines")
    for name, value in (("max_input_tpm", max_input_tpm), ("output_tpm", output_tpm)):
        if not math.isfinite(value) or value < 0:
            raise InputError(f"must be a finite number >= 0, got {value}", field=name)
    if not 0.0 <= hit_ratio <= 1.0:
        raise InputError(f"a hit ratio is a fraction in [0, 1], got {hit_ratio}", field="hit_ratio")
    blended = inputs.blended_input_price(hit_ratio)
    per_minute = max_input_tpm / 1e6 * blended + output_tpm / 1e6 * inputs.price_output_per_m
    minutes = MINUTES_PER_HOUR * inputs.hours_per_day
    per_day = per_minute * minutes
    tokens_per_day = max_input_tpm * minutes
    hardware = machines * inputs.machine_price / (inputs.amortization_years * DAYS_PER_YEAR)
    power = machines * inputs.power_kw * 24.0 * inputs.electricity_per_kwh
    network = machines * inputs.network_per_day
    cost = hardware + power + network
    cash_per_month = (per_day - power - network) * MONTH_DAYS
    return CostRow(
        label=label, currency=inputs.currency, max_input_tpm=max_input_tpm, hit_ratio=hit_ratio,
        output_tpm=output_tpm, blended_price_per_m=blended, input_tokens_per_day=tokens_per_day,
        revenue_per_minute=per_minute, revenue_per_day=per_day, revenue_per_year=per_day * DAYS_PER_YEAR,
        hardware_per_day=hardware, power_per_day=power, network_per_day=network,
        cost_per_day=cost, cost_per_m_tokens=cost / (tokens_per_day / 1e6) if tokens_per_day else None,
        gross_margin=(per_day - cost) / per_day if per_day else None,
        payback_months=machines * inputs.machine_price / cash_per_month if cash_per_month > 0 else None,
        tpm_per_card=max_input_tpm / cards if cards else None, context_tokens=context_tokens, cards=cards,
        machines=machines,
        tpm_per_machine=max_input_tpm / machines, hardware_source=source,
    )


def load_cost_inputs(path: str | os.PathLike[str] | None) -> CostInputs:
    """:class:`CostInputs` from a YAML mapping of field -> value; errors name the file, line and field."""
    if path is None:
        return CostInputs()
    path = Path(path)
    try:
        root = yaml.compose(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(f"cannot read cost inputs: {exc.strerror or exc}", file=str(path)) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise InputError(f"not valid YAML: {getattr(exc, 'problem', exc)}", file=str(path),
                         line=mark.line + 1 if mark else None) from None
    if root is None:
        return CostInputs()
    if not isinstance(root, yaml.MappingNode):
        raise InputError("expected a mapping of cost input -> value", file=str(path), line=root.start_mark.line + 1)
    known = {f.name: f for f in fields(CostInputs)}
    values: dict[str, Any] = {}
    for key_node, value_node in root.value:
        line, name = key_node.start_mark.line + 1, key_node.value
        if name not in known:
            raise InputError(f"unknown cost input; known: {', '.join(known)}", file=str(path), line=line, field=name)
        if name in values:  # YAML lets the last one win without a word: which price did the user mean?
            raise InputError("given twice", file=str(path), line=line, field=name)
        value = yaml.safe_load(yaml.serialize(value_node))
        try:
            CostInputs(**{name: value})  # validates this one field, so the error can carry its line
        except InputError as exc:
            raise InputError(exc.reason, file=str(path), line=line, field=name) from None
        values[name] = value
    return CostInputs(**values)
