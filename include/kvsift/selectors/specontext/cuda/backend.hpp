#pragma once
/// SpeContext's reduction of score rows, CUDA overloads: what the selector, written once for both backends, calls
/// unqualified (argument-dependent lookup on cuda::Context). cuda/backend.hpp includes this file;
/// selectors/specontext/cpu/backend.hpp is the CPU twin. Each overload forwards to the primitive documented in its own
/// header.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cuda/backend.hpp"  // the shared overloads (which include this file at their end)
#include "kvsift/cuda/context.hpp"
#include "kvsift/selectors/specontext/cuda/score_rows.hpp"

namespace kvsift::cuda {

inline void max_score_rows(const MatrixView<const float>& scores, std::int32_t group, const std::int32_t* lengths,
                           const MatrixView<float>& out, const Context& ctx) {
  cuda::max_score_rows(scores, group, lengths, out, ctx.stream);
}

}  // namespace kvsift::cuda
