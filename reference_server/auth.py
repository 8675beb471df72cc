"""Who is calling: API keys, and the tenant each key stands for.

The tenant is the namespace of the prefix cache, and ``cached_tokens`` in every response is an exact
oracle of what that namespace holds: whoever can choose their tenant can probe another tenant's
prompts block by block. So the tenant comes from the key alone:

* ``--api-keys-file PATH``: one ``KEY TENANT`` per line (``#`` comments, blank lines allowed): each key
  stands for its named tenant;
* one key (``--api-key-file PATH``, the ``PAASBENCH_API_KEY`` environment variable, or ``--api-key``,
  which ``ps`` shows to every local user): it stands for the tenant ``key:<sha256 prefix>``;
* no key: every caller is the tenant ``default``.

The ``x-tenant`` header is honoured only with ``--trust-tenant-header``: for a server behind a gateway
that authenticates callers and sets the header itself. Keys are never logged or echoed in errors.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from paas_common.errors import InputError


@dataclass(frozen=True)
class Auth:
    tenants: Mapping[str, str] = field(default_factory=dict, repr=False)   # key -> tenant
    trust_tenant_header: bool = False

    @property
    def required(self) -> bool:
        return bool(self.tenants)

    def check(self, bearer: str | None) -> str | None:
        """The tenant of a valid key, else None. Compares against every key in constant time each."""
        given = (bearer or "").encode()
        found = None
        for key, tenant in self.tenants.items():
            if hmac.compare_digest(given, key.encode()):
                found = tenant
        return found

    def tenant(self, bearer: str | None, header: str | None) -> str:
        """The caller's tenant (after the key was checked, when keys are required)."""
        if self.trust_tenant_header and header:
            return header
        return self.check(bearer) or "default"


def load_auth(api_key: str | None = None, api_key_file: str | None = None, api_keys_file: str | None = None,
              trust_tenant_header: bool = False) -> Auth:
    """Keys from every source given; a bad file is an :class:`InputError` naming file, line and field."""
    tenants: dict[str, str] = {}
    single = [k for k in (api_key, _read_key(api_key_file) if api_key_file else None) if k]
    for key in single:
        tenants[key] = "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]
    if api_keys_file:
        tenants.update(_read_keys(api_keys_file))
    return Auth(tenants, trust_tenant_header)


def _read_text(path: str, flag: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read: {type(exc).__name__}", file=path, field=flag) from None


def _read_key(path: str) -> str:
    key = _read_text(path, "--api-key-file").strip()
    if not key or any(c.isspace() for c in key):
        raise InputError("must hold one key (no spaces)", file=path, line=1, field="--api-key-file")
    return key


def _read_keys(path: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for n, raw in enumerate(_read_text(path, "--api-keys-file").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise InputError(f"expected 'KEY TENANT', got {len(parts)} field(s)", file=path, line=n,
                             field="--api-keys-file")
        key, tenant = parts
        if key in out and out[key] != tenant:
            raise InputError(f"a key listed earlier for tenant {out[key]!r} is listed again for {tenant!r}",
                             file=path, line=n, field="--api-keys-file")
        out[key] = tenant
    if not out:
        raise InputError("no keys", file=path, field="--api-keys-file")
    return out


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, auth: Auth) -> str | None:
    """What to warn about before serving on ``host``: a non-loopback address with no key."""
    if auth.required or is_loopback(host):
        return None
    return (f"serving on {host} with no API key: anyone who can reach this address can use the server "
            "(give --api-key-file, --api-keys-file or PAASBENCH_API_KEY)")
