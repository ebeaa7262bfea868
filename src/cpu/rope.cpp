// RoPE on the CPU (cpu/rope.hpp): the table and the rotations, on core/rope.hpp's shared math.
#include "kvsift/cpu/rope.hpp"

#include <cstdlib>

#include "kvsift/core/detail/rope_checks.hpp"
#include "kvsift/core/detail/rope_instances.hpp"
#include "kvsift/core/dtype.hpp"

namespace kvsift::cpu {
namespace {

/// Rotates one vector by `delta` positions (the inverse rotation with `inverse`), times `scale`.
template <class T>
void rotate_vector(T* v, const RopeTableView& table, std::int64_t delta, bool inverse, double scale) {
  const std::int32_t half = table.pairs();
  for (std::int32_t i = 0; i < half; ++i) {
    float c = 0.0f, s = 0.0f;
    rope_lookup(table, delta, inverse, i, c, s);  // the caller checked |delta|
    std::int32_t a = 0, b = 0;
    rope_pair(table.layout, i, half, a, b);
    float xa = to_float(v[a]), xb = to_float(v[b]);
    rope_rotate_pair(xa, xb, c, s, scale);
    v[a] = from_float<T>(xa);
    v[b] = from_float<T>(xb);
  }
}

/// Row r's position, positions[r] + offset, inside the table.
void check_positions(const char* where, const std::int32_t* positions, std::int32_t offset, std::int64_t count,
                     const RopeTableView& table) {
  for (std::int64_t r = 0; r < count; ++r) {
    const std::int64_t p = std::int64_t(positions[r]) + offset;
    KVSIFT_CHECK(p >= 0 && p < table.positions, where,
                 "positions[{}] + {} (= {}) is outside the table's positions [0, {})", r, offset, p, table.positions);
  }
}

/// Row r's rotation, amount(r), a delta the table holds.
template <class Amount>
void check_deltas(const char* where, const Amount& amount, std::int64_t count, const RopeTableView& table) {
  for (std::int64_t r = 0; r < count; ++r) {
    KVSIFT_CHECK(std::llabs(amount(r)) < table.positions, where,
                 "the rotation of row {} (= {} positions) is not below the table's positions (= {})", r, amount(r),
                 table.positions);
  }
}

/// Rotates the heads of batch row b by amount(b) (a position or a delta).
template <class T, class Amount>
void rotate_heads(const HeadsView<T>& x, const Amount& amount, const RopeTableView& table, bool inverse, double scale,
                  const Context& ctx) {
  parallel_for(ctx.pool, std::int64_t(x.batch) * x.heads, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t e = begin; e < end; ++e) {
      const std::int64_t b = e / x.heads, h = e % x.heads;
      rotate_vector(x.row(b, h), table, amount(b), inverse, scale);
    }
  });
}

double forward_scale(const RopeTableView& table, bool inverse) {
  return inverse ? 1.0 / double(table.attention_factor) : double(table.attention_factor);
}

}  // namespace

void build_rope_table(const RopeConfig& config, const RopeTableView& table, const Context& ctx) {
  constexpr const char* where = "cpu::build_rope_table";
  kvsift::detail::check_rope_table_build(where, config, table);
  // A pair's column at a time: its inverse frequency is evaluated once.
  const std::int32_t half = table.pairs();
  parallel_for(ctx.pool, half, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      const double inv_freq = config.inv_freq(std::int32_t(i), table.rotary_dim);
      for (std::int32_t p = 0; p < table.positions; ++p) {
        const std::int64_t e = std::int64_t(p) * half + i;
        rope_table_entry(inv_freq, p, table.cos[e], table.sin[e]);
      }
    }
  });
}

template <class T>
void apply_rope(const HeadsView<T>& x, const std::int32_t* positions, const RopeTableView& table, bool inverse,
                const Context& ctx) {
  apply_rope(x, positions, 0, table, inverse, ctx);
}

template <class T>
void apply_rope(const HeadsView<T>& x, const std::int32_t* positions, std::int32_t position_offset,
                const RopeTableView& table, bool inverse, const Context& ctx) {
  constexpr const char* where = "cpu::apply_rope";
  kvsift::detail::check_rope_rows(where, x, positions, table, "positions");
  check_positions(where, positions, position_offset, x.batch, table);
  const auto position = [&](std::int64_t b) { return std::int64_t(positions[b]) + position_offset; };
  rotate_heads(x, position, table, inverse, forward_scale(table, inverse), ctx.pool);
}

template <class T>
void apply_rope(const MatrixView<T>& rows, const std::int32_t* positions, const RopeTableView& table, bool inverse,
                const Context& ctx) {
  constexpr const char* where = "cpu::apply_rope";
  kvsift::detail::check_rope_rows(where, rows, positions, table, "positions");
  check_positions(where, positions, 0, rows.rows, table);
  const double scale = forward_scale(table, inverse);
  parallel_for(ctx.pool, rows.rows, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) rotate_vector(rows.row(r), table, positions[r], inverse, scale);
  });
}

template <class T>
void rotate_to_position(const HeadsView<T>& x, const std::int32_t* positions, std::int32_t position_offset,
                        std::int32_t target, const RopeTableView& table, const Context& ctx) {
  constexpr const char* where = "cpu::rotate_to_position";
  kvsift::detail::check_rope_rows(where, x, positions, table, "positions");
  kvsift::detail::check_rope_target(where, target);
  for (std::int64_t b = 0; b < x.batch; ++b) {
    KVSIFT_CHECK(std::int64_t(positions[b]) + position_offset >= 0, where,
                 "positions[{}] + {} (= {}) is a negative position", b, position_offset,
                 std::int64_t(positions[b]) + position_offset);
  }
  const auto delta = [&](std::int64_t b) { return std::int64_t(target) - (std::int64_t(positions[b]) + position_offset); };
  check_deltas(where, delta, x.batch, table);
  rotate_heads(x, delta, table, /*inverse=*/false, 1.0, ctx.pool);
}

KVSIFT_STORAGE_TYPES(KVSIFT_ROPE_INSTANCES)

}  // namespace kvsift::cpu
