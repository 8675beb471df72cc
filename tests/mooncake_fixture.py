"""Skip Mooncake tests, with the reason printed, only where the package (paasbench[mooncake]) or its Debian
libraries cannot be loaded; everywhere else they run."""

from __future__ import annotations

import pytest


def mooncake_or_skip() -> None:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:        # the wheel missing, or libibverbs1/librdmacm1/libnuma1 missing
        pytest.skip(f"Mooncake Store not importable ({exc}): pip install '.[mooncake]' and "
                    "apt-get install libibverbs1 librdmacm1 libnuma1", allow_module_level=True)
