"""``OUT/sweep.json``: the sweep's record of itself, rewritten after every step so a kill loses one step.

Crash safety: the file is written to a temp file in the same directory, fsynced, then ``os.replace``d
over the old one, so a reader (or ``--resume``) always sees either the previous or the new complete
file, never a torn one. A step enters ``steps`` only once its records and summary are on disk; a step
directory without an entry (killed mid-step) is wiped and rerun.

Steps are identified by a *key* (bucket, server parameter, load) rather than by position: on resume
the search replays, proposes the same loads, and each proposal whose key is already recorded is
answered from the file instead of being run again.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from paas_common.errors import InputError

SCHEMA = "paasbench.sweep/1"
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def step_key(load: float, *, bucket: int | None = None, param: tuple[str, Any] | None = None) -> str:
    parts = []
    if bucket is not None:
        parts.append(f"ctx={bucket}")
    if param is not None:
        parts.append(f"{param[0]}={param[1]}")
    parts.append(f"load={load:.6g}")
    return "|".join(parts)


def write_json_atomic(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)      # mkstemp makes 0600; results are for sharing
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=1, default=_jsonable)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if hasattr(obj, "item"):        # numpy scalars
        return obj.item()
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


class SweepState:
    def __init__(self, out: Path, data: dict[str, Any]) -> None:
        self.out = out
        self.data = data

    @property
    def path(self) -> Path:
        return self.out / "sweep.json"

    @classmethod
    def open(cls, out: str | os.PathLike[str], *, config: dict[str, Any], meta: dict[str, Any],
             slo: list[str], resume: bool) -> "SweepState":
        """Fresh state, or (``resume``) the one on disk after checking it was made with the same settings.

        Without ``--resume`` an existing sweep in OUT is replaced (its step directories removed): rerunning
        the quickstart command must just work.
        """
        out = Path(out)
        path = out / "sweep.json"
        if resume and path.exists():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise InputError(f"cannot resume: not valid JSON ({exc.msg})", file=str(path), line=exc.lineno) from None
            if data.get("schema") != SCHEMA:
                raise InputError(f"cannot resume: schema is {data.get('schema')!r}, expected {SCHEMA!r}",
                                 file=str(path), field="schema")
            old = data.get("meta", {}).get("config", {})
            for key, value in config.items():
                if key in old and old[key] != value:
                    raise InputError(f"cannot resume: this sweep was started with {key}={old[key]!r}, now "
                                     f"{value!r}; use the same settings or a new --out", file=str(path), field=key)
            data["meta"].update(meta)
            data["meta"]["config"] = config
            data["meta"].setdefault("resumed", 0)
            data["meta"]["resumed"] += 1
            return cls(out, data)
        if path.exists() or any(out.glob("step-[0-9][0-9][0-9]")):
            for d in out.glob("step-[0-9][0-9][0-9]"):
                shutil.rmtree(d, ignore_errors=True)
        data = {"schema": SCHEMA, "status": "running", "meta": {**meta, "config": config}, "slo": slo,
                "steps": [], "best": None, "buckets": [], "server_param": None, "cost": []}
        state = cls(out, data)
        state.save()
        return state

    # --------------------------------------------------------------------------------------- steps

    @property
    def steps(self) -> list[dict[str, Any]]:
        return self.data["steps"]

    def finished(self, key: str) -> dict[str, Any] | None:
        for step in self.steps:
            if step.get("key") == key:
                return step
        return None

    def new_step_dir(self) -> tuple[int, Path]:
        """Index and an empty directory for the next step; leftovers of a killed step are removed."""
        index = max((s["index"] for s in self.steps), default=-1) + 1
        return index, self.empty_dir(f"step-{index:03d}")

    def empty_dir(self, name: str) -> Path:
        """``OUT/name``, empty: what a killed run left there is removed."""
        d = self.out / name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        return d

    def add_step(self, step: dict[str, Any]) -> None:
        self.steps.append(step)
        self.save()

    def save(self) -> None:
        self.data["updated_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        write_json_atomic(self.path, self.data)
