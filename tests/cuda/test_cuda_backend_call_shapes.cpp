// The cuda backend's call shapes: every overload of cuda/backend.hpp instantiated once.
#include "kvsift/cuda/backend.hpp"

namespace kvsift::cuda {
#include "backend_call_shapes.inc"
}  // namespace kvsift::cuda
