// The cpu backend's call shapes: every overload of cpu/backend.hpp, and every call written
// once over the context, instantiated for cpu::Context.
#include "kvsift/cpu/backend.hpp"

namespace kvsift {
namespace backend = cpu;
#include "backend_call_shapes.inc"
}  // namespace kvsift
