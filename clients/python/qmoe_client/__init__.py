"""Client for qmoed, the MoE expert-residency daemon.

Speaks PROTOCOL.md: JSON-RPC 2.0, one JSON text per line, over an AF_UNIX
stream socket. Standard library only; numpy, when installed, is used for
tensors in and out.
"""

from ._client import (
    Client,
    DaemonNotRunning,
    InferResult,
    MappedTensor,
    QmoeError,
    SharedMap,
    Tensor,
    decode_tensor,
    default_socket_path,
    encode_tensor,
)

__all__ = [
    "Client",
    "DaemonNotRunning",
    "InferResult",
    "MappedTensor",
    "QmoeError",
    "SharedMap",
    "Tensor",
    "decode_tensor",
    "default_socket_path",
    "encode_tensor",
]
__version__ = "0.1.0"
