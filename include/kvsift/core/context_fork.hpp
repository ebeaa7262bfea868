#pragma once
/// Whether a context runs work beside its own stream, and with what: a CUDA context's Fork (cuda::StreamFork, a
/// second stream and two events: fork(stream), join(stream)); a CPU context has none, and code written once for both
/// backends runs that work in line there.

#include <variant>

namespace kvsift::detail {

/// A context that runs work beside its own (Context::Fork).
template <class Context>
concept ForksWork = requires { typename Context::Fork; };

/// The context's Fork, or std::monostate for one without.
template <class Context>
struct ContextFork {
  using type = std::monostate;
};
template <ForksWork Context>
struct ContextFork<Context> {
  using type = typename Context::Fork;
};

}  // namespace kvsift::detail
