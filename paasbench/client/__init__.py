"""Async OpenAI-compatible streaming client: one shared aiohttp session, one record per request."""

from paasbench.client.body import JsonText, build_body
from paasbench.client.config import ClientConfig
from paasbench.client.request import Client, clock, make_session

__all__ = ["Client", "ClientConfig", "JsonText", "build_body", "clock", "make_session"]
