"""Exceptions raised by the lightwire client."""


class LightwireError(Exception):
    """An error reply from the sidecar: ``status`` (HTTP status), ``error`` (the
    JSON ``error`` code, e.g. ``"invalid_argument"``) and ``message``."""

    def __init__(self, status, error, message):
        self.status = status
        self.error = error
        self.message = message
        super().__init__(status, error, message)

    def __str__(self):
        if self.status is None:
            return "%s: %s" % (self.error, self.message)
        return "%s %s: %s" % (self.status, self.error, self.message)


class SidecarUnavailable(LightwireError):
    """The sidecar could not be reached: no socket, connection refused or
    reset, or a connect/read timeout. ``status`` is None."""

    def __init__(self, message, error="unavailable"):
        super().__init__(None, error, message)
