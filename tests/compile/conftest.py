"""Fixtures of the compile tests. Inductor compiles take seconds each on the CPU, so the compiled
runners are built once per session, and every compiled runner shares one compile-cache root: a
later runner with the same configuration starts warm."""

import os

import pytest

from compile_helpers import build_tiny, make_runner


@pytest.fixture(scope="session")
def tiny_dense(tmp_path_factory):
    return build_tiny(tmp_path_factory.getbasetemp(), "tiny-qwen3")


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory):
    return build_tiny(tmp_path_factory.getbasetemp(), "tiny-qwen3-moe")


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile_cache")
    os.chmod(root, 0o700)
    return root / "cache"


@pytest.fixture(scope="session")
def dense_eager(tiny_dense):
    return make_runner(tiny_dense, "eager")


@pytest.fixture(scope="session")
def dense_piecewise(tiny_dense, cache_root):
    # max_capture_tokens=32: buckets 2..32, so a 35-token step runs compiled but unpadded.
    return make_runner(tiny_dense, "piecewise", max_capture_tokens=32, compile_cache_dir=str(cache_root))


@pytest.fixture(scope="session")
def dense_compile(tiny_dense, cache_root):
    return make_runner(tiny_dense, "compile", compile_cache_dir=str(cache_root))
