"""Least-squares fit of a device profile's effective rates to measured step times.

Parameters are fitted in log space (all positive, spanning decades) by Levenberg-Marquardt on the
*relative* residuals, so a 2 ms decode step counts as much as a 400 ms prefill. The predictions come
from :func:`reference_server.sim.roofline.step_cost` itself: what is fitted is exactly what the sim runs.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from reference_server.sim.profiles import DeviceProfile, ModelProfile
from reference_server.sim.roofline import step_cost

Shape = Sequence[tuple[int, int]]
# fitted knobs: linear FLOP/s, attention FLOP/s, weight bytes/s, KV bytes/s, per-step and per-sequence
# overhead (s), all in log space; the compute/memory overlap as a logit; log of (GEMM weight passes - 1)
INITIAL = np.array([*np.log([5e10, 1e10, 2e10, 5e9, 1e-3, 3e-4]), 0.0, 0.0])
# keep the search physical: rates 1 MFLOP/s..1 PFLOP/s (B/s), overheads 0.1 us..1 s, overlap logit +-12
LOWER = np.array([*np.log([1e6, 1e6, 1e6, 1e6, 1e-7, 1e-7]), -12.0, np.log(1e-3)])
UPPER = np.array([*np.log([1e15, 1e15, 1e15, 1e15, 1.0, 1.0]), 12.0, np.log(9.0)])


def device_from(theta: np.ndarray, base: DeviceProfile, dtype: str) -> DeviceProfile:
    lin, attn, bw, kv_bw, step_o, seq_o = np.exp(theta[:6])
    return dataclasses.replace(base, tflops={dtype: float(lin) / 1e12}, mfu=1.0, attn_mfu=float(attn / lin),
                               hbm_tbps=float(bw) / 1e12, mbu=1.0, kv_mbu=float(kv_bw / bw),
                               overlap=float(1 / (1 + np.exp(-theta[6]))), gemm_weight_passes=float(1 + np.exp(theta[7])),
                               step_overhead_s=float(step_o),
                               seq_overhead_s=float(seq_o))


def predict(model: ModelProfile, device: DeviceProfile, shapes: Sequence[Shape]) -> np.ndarray:
    return np.array([step_cost(model, device, s, tp=1).seconds for s in shapes])


# Damping floor. More knobs than a short calibration has shapes (8 against `calibrate --quick`'s reduced set in
# tests) leave J^T J singular, and only the damping makes a step solvable: a damping that shrank below ~1e-16 of
# it (1 + lam == 1) made the system exactly singular and the fit raised LinAlgError ("Singular matrix") on
# measured step times that happened to converge long enough.
LAM_MIN = 1e-9


def _lm(residual: Callable[[np.ndarray], np.ndarray], theta: np.ndarray, iters: int = 200) -> np.ndarray:
    def jacobian(theta: np.ndarray, r: np.ndarray, eps: float = 1e-4) -> np.ndarray:
        return np.stack([(residual(theta + eps * e) - r) / eps for e in np.eye(theta.size)], axis=1)

    lam, r = 1e-2, residual(theta)
    J = jacobian(theta, r)   # anew only when theta moves: a rejected step leaves it where it was
    for _ in range(iters):
        A, g = J.T @ J, J.T @ r
        try:
            step = np.linalg.solve(A + lam * np.diag(np.diag(A) + 1e-12), -g)
        except np.linalg.LinAlgError:     # singular even so: damp harder, as for a step that did not improve
            step = None
        if step is not None:
            cand = np.clip(theta + step, LOWER, UPPER)
            rc = residual(cand)
            if rc @ rc < r @ r:
                theta, r, lam = cand, rc, max(lam / 3, LAM_MIN)
                if np.abs(step).max() < 1e-6:
                    break
                J = jacobian(theta, r)
                continue
        lam *= 4
        if lam > 1e8:
            break
    return theta


def fit_device(model: ModelProfile, base: DeviceProfile, shapes: Sequence[Shape], seconds: Sequence[float],
               dtype: str = "fp32") -> DeviceProfile:
    """The device (``base`` with fitted rates and overheads) whose roofline best matches ``seconds``."""
    meas = np.asarray(seconds, float)

    def residual(theta: np.ndarray) -> np.ndarray:
        return predict(model, device_from(theta, base, dtype), shapes) / meas - 1.0

    best, best_cost = INITIAL, np.inf
    for shift in ([0] * 8, [1, 1, 1, 1, -1, -1, 2, 1], [-1, -1, -1, -1, 1, 1, -2, -1], [0, 1, -1, 1, 0, 1, 0, 0]):
        theta = _lm(residual, INITIAL + np.array(shift, float) * np.log(4))
        cost = float(residual(theta) @ residual(theta))
        if cost < best_cost:
            best, best_cost = theta, cost
    return device_from(best, base, dtype)
