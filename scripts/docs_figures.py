#!/usr/bin/env python3
"""Every figure the docs state, beside the command that measures it (issue #19).

A figure is a number with a unit a reader takes as a measurement or a promise: ms, s, µs, ns, min, %, ×, tok/s,
req/s, MB/GB/GiB/MiB/KB, TPM, or a decimal with an M/K/G suffix (``1.81M``, ``657.8K``; ``64K``, a bucket's
name, is not one). Ranges count as one figure (``7.2–7.4 µs``). Code spans and fenced blocks are skipped: they
are commands and configuration, not claims. The docs read are ``docs/*.md``, ``README.md`` and
``reports/README.md``.

The registry, ``docs/figures.yaml``, maps each doc to its figures, each with its ``source``: the command that
measures it and where its output is kept, or ``setting: ...`` for a configured value, a threshold or a formula's
input (not a measurement). A figure's text registered once covers every place that doc states it.

    python scripts/docs_figures.py              # check: exit 1 naming doc:line and figure when a doc states a
                                                # figure the registry lacks, or a row's figure left its doc
    python scripts/docs_figures.py --list       # every figure: doc:line, figure, source
    python scripts/docs_figures.py --stub       # YAML rows for the unregistered figures, to paste under their
                                                # doc's key (one key per doc) and complete

A row may also name the committed file that keeps the figure, ``json: FILE#dotted.path`` (list items by index,
``steps.8.summary.ttft_ms.p50``) with an optional ``scale`` (100 for a ratio the doc states as %): the check then
reads that value and fails when it does not round to the figure as the doc writes it (to the figure's last digit,
after its K/M/G suffix), or, for a recorded sentence, when the sentence does not state the figure.

Rows whose source starts with ``unverified`` were stated before the registry existed and still wait for their
command; ``--strict`` fails on them too.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
REGISTRY = Path("docs/figures.yaml")
UNVERIFIED = "unverified"

_N = r"\d[\d,]*(?:\.\d+)?"
_UNIT = (r"(?:\s?(?:µs|us|ns|ms|s|min|%|×|tok/s|tokens/s|req/s|MB|GB|GiB|MiB|KiB|KB|TB|TPM)"
         r"|(?<=\.\d)\d*[MKG](?:\s?(?:input\s)?TPM)?)")
FIGURE = re.compile(rf"(?<![\w.\-/$])[-+±~≈]?{_N}(?:\s?(?:–|-|to)\s?[-+]?{_N})?{_UNIT}(?![\w/])")


@dataclass(frozen=True, slots=True)
class Figure:
    doc: str          # repository-relative path
    line: int
    text: str         # as the doc writes it, whitespace collapsed


@dataclass(frozen=True, slots=True)
class Row:
    source: str
    json: str | None = None   # FILE#dotted.path of the committed output that keeps the figure
    scale: float = 1.0


def docs(root: Path = ROOT) -> list[Path]:
    return [*sorted((root / "docs").glob("*.md")), root / "README.md", root / "reports" / "README.md"]


def _prose(text: str) -> str:
    """The text with fenced blocks and code spans blanked out, line numbers kept."""
    text = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", lambda m: " " * len(m.group(0)), text)


def figures(path: Path, root: Path = ROOT) -> list[Figure]:
    rel = path.relative_to(root).as_posix()
    out = []
    for no, line in enumerate(_prose(path.read_text(encoding="utf-8")).splitlines(), 1):
        out += [Figure(rel, no, " ".join(m.group(0).split())) for m in FIGURE.finditer(line)]
    return out


def load_registry(path: Path) -> dict[str, dict[str, Row]]:
    """``{doc: {figure text: Row}}``; a malformed registry names its file and the offending entry."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    seen: dict[str, int] = {}
    for no, line in enumerate(text.splitlines(), 1):       # YAML would keep only the last of two equal keys
        key = re.match(r"^([^\s#-][^:]*):\s*$", line)
        if key and key.group(1) in seen:
            raise SystemExit(f"{path}:{no}: '{key.group(1)}' is already a key at line {seen[key.group(1)]}: "
                             f"put all of a doc's rows under one key")
        if key:
            seen[key.group(1)] = no
    raw = yaml.safe_load(text) if text else {}
    if not isinstance(raw, dict):
        raise SystemExit(f"{path}: expected a mapping of doc -> list of {{figure, source}}")
    reg: dict[str, dict[str, Row]] = {}
    for doc, rows in raw.items():
        for i, row in enumerate(rows or []):
            if not isinstance(row, dict) or not row.get("figure") or not row.get("source"):
                raise SystemExit(f"{path}: {doc}[{i}]: each row needs 'figure' and 'source' ({row!r})")
            reg.setdefault(doc, {})[" ".join(str(row["figure"]).split())] = Row(
                str(row["source"]), row.get("json"), float(row.get("scale", 1)))
    return reg


_SUFFIX = {"K": 1e3, "M": 1e6, "G": 1e9}


def json_mismatch(root: Path, figure: str, row: Row) -> str | None:
    """Why the committed value at ``row.json`` does not round to ``figure``; None when it does."""
    file, _, dotted = (row.json or "").partition("#")
    try:
        value = json.loads((root / file).read_text(encoding="utf-8"))
        for key in dotted.split("."):
            value = value[int(key)] if isinstance(value, list) else value[key]
        if isinstance(value, str):      # a recorded sentence (a search's start, a reason): it states the figure
            return None if figure in value else f"{row.json} says {value!r}, which does not state {figure}"
        value = float(value) * row.scale
    except OSError as e:
        return f"cannot read {row.json}: {e.strerror}"
    except (ValueError, KeyError, IndexError, TypeError) as e:
        return f"cannot read {row.json}: {type(e).__name__}: {e}"
    m = re.search(r"([-+]?)(\d[\d,]*)(?:\.(\d+))?([KMG](?![A-Za-z]))?", figure)     # 743 GB: no suffix
    if m is None:
        return f"{figure!r} has no number to check against {row.json}"
    mult = _SUFFIX.get(m.group(4) or "", 1.0)
    stated = float(f"{m.group(1)}{m.group(2).replace(',', '')}.{m.group(3) or 0}") * mult
    half_digit = 0.5 * 10 ** -len(m.group(3) or "") * mult
    if abs(value - stated) > half_digit * (1 + 1e-9):
        return f"{row.json} holds {value:g}, which does not round to {figure}"
    return None


def check(root: Path = ROOT, registry: Path | None = None, strict: bool = False) -> list[str]:
    """Problems, one line each: an unregistered figure (doc:line), a row whose figure its doc no longer states,
    with ``strict`` a row still unverified."""
    reg = load_registry(registry or root / REGISTRY)
    found = {p.relative_to(root).as_posix(): figures(p, root) for p in docs(root) if p.exists()}
    problems = []
    for doc, figs in found.items():
        known = reg.get(doc, {})
        problems += [f"{f.doc}:{f.line}: figure '{f.text}' is not in {REGISTRY} (add it under {doc} with the "
                     f"command that measures it, or drop it)" for f in figs if f.text not in known]
    for doc, rows in reg.items():
        stated = {f.text for f in found.get(doc, [])}
        problems += [f"{REGISTRY}: {doc}: figure '{fig}' is no longer stated in {doc} (remove the row)"
                     for fig in rows if fig not in stated]
        problems += [f"{REGISTRY}: {doc}: figure '{fig}': {why}" for fig, row in rows.items() if row.json
                     and (why := json_mismatch(root, fig, row))]
        if strict:
            problems += [f"{REGISTRY}: {doc}: figure '{fig}' has no command yet ({row.source})"
                         for fig, row in rows.items() if row.source.startswith(UNVERIFIED) and fig in stated]
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    ap.add_argument("--registry", type=Path, help=f"registry file (default: ROOT/{REGISTRY})")
    ap.add_argument("--list", action="store_true", help="print every figure with its source")
    ap.add_argument("--stub", action="store_true", help="print YAML rows for the unregistered figures")
    ap.add_argument("--strict", action="store_true", help=f"also fail on rows whose source is still '{UNVERIFIED}'")
    a = ap.parse_args(argv)
    root = a.root.resolve()
    reg = load_registry(a.registry or root / REGISTRY)
    if a.list or a.stub:
        for p in docs(root):
            if not p.exists():
                continue
            doc = p.relative_to(root).as_posix()
            figs = figures(p, root)
            if a.list:
                for f in figs:
                    row = reg.get(doc, {}).get(f.text)
                    print(f"{f.doc}:{f.line}\t{f.text}\t{row.source if row else 'NOT REGISTERED'}"
                          + (f" [checked against {row.json}]" if row and row.json else ""))
            else:
                new = list(dict.fromkeys(f.text for f in figs if f.text not in reg.get(doc, {})))
                if new:
                    print(f"{doc}:")
                    for t in new:
                        print(f"  - {{figure: {yaml.safe_dump(t, default_style=chr(34)).strip()}, source: \"TODO: command\"}}")
        return 0
    problems = check(root, a.registry, a.strict)
    for line in problems:
        print(line, file=sys.stderr)
    total = sum(len(figures(p, root)) for p in docs(root) if p.exists())
    waiting = sum(row.source.startswith(UNVERIFIED) for rows in reg.values() for row in rows.values())
    print(f"docs figures: {total} stated, {sum(map(len, reg.values()))} registered ({waiting} still {UNVERIFIED}), "
          f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
