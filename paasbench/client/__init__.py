"""Async OpenAI-compatible streaming client: one shared aiohttp session, one record per request."""

from paasbench.client.config import ClientConfig
from paasbench.client.request import Client, build_body, clock, make_session

__all__ = ["Client", "ClientConfig", "build_body", "clock", "make_session"]
