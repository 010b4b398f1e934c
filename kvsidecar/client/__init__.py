"""What an engine imports: memory export helpers, layout helpers and the sidecar clients."""

from kvsidecar.client.export import SharedMemoryExport, export_cuda_tensor, export_cupy_array

__all__ = ["SharedMemoryExport", "export_cuda_tensor", "export_cupy_array"]
