"""lightwire: client for the lightwire gradient-compression sidecar.

``lightwire.Client`` speaks the control API (docs/api.md); ``lightwire.emit_gradient``,
``lightwire.emit_layers`` and ``lightwire.report`` use a default client built from ``LIGHTWIRE_SOCKET``;
``lightwire.torch`` holds the DDP communication hook (imported on demand: it needs torch).
"""

from ._errors import LightwireError, SidecarUnavailable
from ._shm import ShmSegment
from .client import Client, LayoutHashes, default_client, emit_gradient, emit_layers, report

__version__ = "0.1.0"

__all__ = ["Client", "LayoutHashes", "LightwireError", "SidecarUnavailable", "ShmSegment",
           "default_client", "emit_gradient", "emit_layers", "report", "__version__"]
