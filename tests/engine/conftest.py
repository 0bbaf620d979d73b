"""Fixtures of the engine tests: tiny checkpoints built once per session, transformers references.

Everything runs on the CPU with one intra-op thread: the tiny models are far too small for threads to
help, and on a loaded 2-core machine OpenMP spin-waiting makes every matmul an order of magnitude
slower.
"""

import pytest

from engine_helpers import HFReference, build_tiny, make_eos_checkpoint


@pytest.fixture(scope="session")
def tiny_paths(tmp_path_factory) -> dict:
    """preset -> checkpoint directory, each built on first use."""
    base = tmp_path_factory.getbasetemp()

    class Paths(dict):
        def __missing__(self, preset):
            self[preset] = build_tiny(base, preset)
            return self[preset]
    return Paths()


@pytest.fixture(scope="session")
def dense_path(tiny_paths):
    return tiny_paths["tiny-qwen3"]


@pytest.fixture(scope="session")
def moe_path(tiny_paths):
    return tiny_paths["tiny-qwen3-moe"]


@pytest.fixture(scope="session")
def hf_refs(tiny_paths):
    """preset -> HFReference (loaded on first use, kept for the session)."""
    cache: dict = {}

    def get(preset: str) -> HFReference:
        if preset not in cache:
            cache[preset] = HFReference(tiny_paths[preset])
        return cache[preset]
    return get


@pytest.fixture(scope="session")
def eos_checkpoint(tiny_paths, tmp_path_factory):
    """token -> a copy of the tiny dense checkpoint (weights symlinked) whose generation config makes
    `token` an EOS id too, so a test can make EOS happen where it wants; transformers reads the same
    file, so its generate stops there as well."""
    cache: dict = {}

    def get(token: int):
        if token not in cache:
            cache[token] = make_eos_checkpoint(tiny_paths["tiny-qwen3"], tmp_path_factory.mktemp("eos"), token)
        return cache[token]
    return get
