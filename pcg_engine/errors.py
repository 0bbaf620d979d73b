"""Errors a user can act on. Each names the field at fault and what it may hold."""


class PcgError(Exception):
    """Base class of the engine's own errors."""


class InvalidRequestError(PcgError, ValueError):
    """A request (prompt or sampling parameter) the engine refuses; the batch keeps running."""

    prompt_index: int | None = None     # LLM.generate: which of its prompts was refused

    def __init__(self, field: str, message: str):
        self.field, self.message = field, message
        super().__init__(f"{field}: {message}")


class CheckpointError(PcgError, ValueError):
    """A checkpoint directory that cannot be loaded; names the file and the tensor or field."""


class ConfigError(PcgError, ValueError):
    """An EngineConfig field outside its allowed range."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class EngineClosedError(PcgError, RuntimeError):
    """A call on an engine after its close(): it holds no model or cache any more."""

    def __init__(self, what: str):
        super().__init__(f"{what}: the engine is closed (LLM.close() or LLMEngine.close() was called); "
                         "build a new LLM to go on")
