"""The generated protobuf and gRPC modules, imported in one place.

They are built from proto/retrace/v1/retrace.proto when the package is installed (setup.py);
a checkout that was never installed has none, and says so here instead of with a bare
ModuleNotFoundError deep in an import chain.
"""

try:
    from ._pb.retrace.v1 import retrace_pb2 as pb
    from ._pb.retrace.v1 import retrace_pb2_grpc as pb_grpc
except ImportError as e:  # pragma: no cover - only in an uninstalled checkout
    raise ImportError(
        "retrace_client's generated modules are missing; install the package "
        "(pip install ./clients/python, or pip install -e ./clients/python) so setup.py "
        f"generates them from proto/ ({e})"
    ) from e

SERVICE = "retrace.v1.Evaluator"


def health_service(evaluator: str | None = None) -> str:
    """The grpc.health.v1 service name: the Evaluator service (SERVING while every evaluator is
    ready), or one evaluator's, `retrace.v1.Evaluator/<name>`."""
    return f"{SERVICE}/{evaluator}" if evaluator else SERVICE


__all__ = ["pb", "pb_grpc", "SERVICE", "health_service"]
