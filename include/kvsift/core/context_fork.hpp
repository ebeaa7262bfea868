#pragma once
/// Whether a context runs work beside its own stream, and with what: a CUDA context's Fork (cuda::StreamFork, a
/// second stream and two events: fork(stream), join(stream)); a CPU context has none, and code written once for both
/// backends runs that work in line there.

#include <utility>
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

/// work(); where it throws, join() first (work forked beside must not outlive the call that failed), then the
/// exception goes on: the first failure is the one reported, a failure of join() is dropped.
template <class Work, class Join>
void joined_on_failure(Work&& work, Join&& join) {
  try {
    work();
  } catch (...) {
    try {
      join();
    } catch (...) {  // the first failure is the one reported
    }
    throw;
  }
}

/// beside(a copy of ctx on the fork's second stream), forked off ctx's stream and left running: the caller joins it
/// (join_beside) before that stream needs its results. An exception from beside still joins and goes on.
template <ForksWork Context, class Beside>
void fork_beside(typename Context::Fork& fork, const Context& ctx, Beside&& beside) {
  Context on_side = ctx;
  on_side.stream = fork.fork(ctx.stream);
  joined_on_failure([&] { beside(std::as_const(on_side)); }, [&] { fork.join(ctx.stream); });
}

/// ctx's stream waits for everything forked beside it so far (fork_beside).
template <ForksWork Context>
void join_beside(typename Context::Fork& fork, const Context& ctx) {
  fork.join(ctx.stream);
}

/// beside(a copy of ctx on the fork's second stream) beside on_main() on ctx's own stream, joined before it returns
/// (Fork::run_beside: an exception still joins).
template <ForksWork Context, class Beside, class OnMain>
void run_beside(typename Context::Fork& fork, const Context& ctx, Beside&& beside, OnMain&& on_main) {
  fork.run_beside(
      ctx.stream,
      [&](auto side) {
        Context on_side = ctx;
        on_side.stream = side;
        beside(std::as_const(on_side));
      },
      on_main);
}

}  // namespace kvsift::detail
