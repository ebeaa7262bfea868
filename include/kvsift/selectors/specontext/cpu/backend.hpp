#pragma once
/// SpeContext's reduction of score rows, CPU overloads: what the selector, written once for both backends, calls
/// unqualified (argument-dependent lookup on cpu::Context). cpu/backend.hpp includes this file;
/// selectors/specontext/cuda/backend.hpp is the CUDA twin. Each overload forwards to the primitive documented in its
/// own header.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/backend.hpp"  // the shared overloads (which include this file at their end)
#include "kvsift/cpu/context.hpp"
#include "kvsift/selectors/specontext/cpu/score_rows.hpp"

namespace kvsift::cpu {

inline void max_score_rows(const MatrixView<const float>& scores, std::int32_t group, const std::int32_t* lengths,
                           const MatrixView<float>& out, const Context&) {
  cpu::max_score_rows(scores, group, lengths, out);
}

}  // namespace kvsift::cpu
