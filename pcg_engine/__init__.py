"""pcg-engine: a small, fast LLM inference engine built around piecewise CUDA graphs."""

from pcg_engine import _sources  # noqa: F401  (hashes the sources as imported: the compile cache's key)

__version__ = "0.1.0"
