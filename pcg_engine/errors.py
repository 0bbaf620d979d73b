"""Errors a user can act on. Each names the field at fault and what it may hold."""


class PcgError(Exception):
    """Base class of the engine's own errors."""


class InvalidRequestError(PcgError, ValueError):
    """A request (prompt or sampling parameter) the engine refuses; the batch keeps running."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class CheckpointError(PcgError, ValueError):
    """A checkpoint directory that cannot be loaded; names the file and the tensor or field."""


class ConfigError(PcgError, ValueError):
    """An EngineConfig field outside its allowed range."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")
