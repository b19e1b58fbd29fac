"""Fixtures for the service tests: tokenizer directories and a gateway app on a scripted engine."""

from __future__ import annotations

import httpx
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.text import TextModel
from .fakes import FakeEngineClient, Script, bytefallback_model_dir, bytelevel_model_dir, verifier_info


@pytest.fixture(scope="session")
def bytelevel_dir(tmp_path_factory):
    return bytelevel_model_dir(tmp_path_factory.mktemp("bytelevel"))


@pytest.fixture(scope="session")
def bytefallback_dir(tmp_path_factory):
    return bytefallback_model_dir(tmp_path_factory.mktemp("bytefallback"))


@pytest.fixture(params=["bytelevel", "bytefallback"])
def model_dir(request, bytelevel_dir, bytefallback_dir):
    return bytelevel_dir if request.param == "bytelevel" else bytefallback_dir


class GatewayHarness:
    """A gateway app on a :class:`FakeEngineClient`, driven through httpx's ASGI transport."""

    def __init__(self, model_dir, **config):
        self.text = TextModel(model_dir)
        self.script_text = "Hello world, 你好世界 😀 done."
        self.script = lambda gen: Script(self.text.encode(self.script_text, add_special_tokens=False))
        self.engine = FakeEngineClient(verifier_info(self.text.vocab_size), lambda gen: self.script(gen))
        cfg = dict(target=str(model_dir), served_model_name="tiny", default_temperature=0.0)
        cfg.update(config)
        self.config = GatewayConfig(**cfg)
        self.app = create_app(self.config, self.engine, self.text)
        self.gateway = self.app.state.gateway
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app, raise_app_exceptions=False), base_url="http://test")

    async def complete(self, **body) -> httpx.Response:
        return await self.client.post("/v1/completions", json={"model": "tiny", **body})

    async def chat(self, **body) -> httpx.Response:
        return await self.client.post("/v1/chat/completions", json={"model": "tiny", **body})


@pytest.fixture
def harness(model_dir):
    return GatewayHarness(model_dir)


@pytest.fixture
def bl_harness(bytelevel_dir):
    return GatewayHarness(bytelevel_dir)
