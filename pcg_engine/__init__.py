"""pcg-engine: a small, fast LLM inference engine built around piecewise CUDA graphs."""

__version__ = "0.1.0"
