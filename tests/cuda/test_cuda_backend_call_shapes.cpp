// The cuda backend's call shapes: every overload of cuda/backend.hpp, and every call written
// once over the context, instantiated for cuda::Context.
#include "kvsift/cuda/backend.hpp"

namespace kvsift {
namespace backend = cuda;
#include "backend_call_shapes.inc"
}  // namespace kvsift
