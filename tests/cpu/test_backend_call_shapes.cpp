// The cpu backend's call shapes: every overload of cpu/backend.hpp instantiated once.
#include "kvsift/cpu/backend.hpp"

namespace kvsift::cpu {
#include "backend_call_shapes.inc"
}  // namespace kvsift::cpu
