// The command-line reading of the tools (tools/cli_list.hpp) and the strict number parser under it
// (eval/parse_number.hpp): junk, empty text, overflow and non-finite numbers are refused, naming the tool, the
// option (and the list item) and the text given; unknown options, options without their value and unknown names
// are refused too.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../../tools/cli_list.hpp"
#include "kvsift/eval/parse_number.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::expect_error;

TEST(ParseNumber, TakesOnlyTheWholeTextAsOneNumberOfTheType) {
  EXPECT_EQ(parse_number<std::int32_t>("42"), 42);
  EXPECT_EQ(parse_number<std::int32_t>("-7"), -7);
  EXPECT_EQ(parse_number<std::int32_t>("2147483647"), 2147483647);
  EXPECT_EQ(parse_number<std::uint64_t>("18446744073709551615"), 18446744073709551615ull);
  EXPECT_EQ(parse_number<double>("1e5"), 1e5);
  EXPECT_EQ(parse_number<double>("0.25"), 0.25);
  for (const char* junk : {"", "x", "12x", "1.5", " 3", "3 ", "+3", "0x10", "2147483648", "1e3"}) {
    EXPECT_EQ(parse_number<std::int32_t>(junk), std::nullopt) << "'" << junk << "'";
  }
  EXPECT_EQ(parse_number<std::uint64_t>("-1"), std::nullopt);
  for (const char* junk : {"", "abc", "1e5xyz", "0.5.", "1e999", ",5"}) {
    EXPECT_EQ(parse_number<double>(junk), std::nullopt) << "'" << junk << "'";
  }
}

TEST(CommandLine, IntegersAreRefusedUnlessWholeAndInRangeNamingTheOptionAndText) {
  EXPECT_EQ(bench::parse_integer<std::int32_t>("tool", "--codewords", "4096", 1), 4096);
  EXPECT_EQ(bench::parse_integer<std::int32_t>("tool", "--offset", "0", 0), 0);
  EXPECT_EQ(bench::parse_integer<std::uint64_t>("tool", "--seed", "18446744073709551615", 0),
            18446744073709551615ull);
  for (const char* text : {"0", "-3", "12x", "", "abc", "1.5", "2147483648"}) {
    expect_error([&] { bench::parse_integer<std::int32_t>("tool", "--codewords", text, 1); },
                 fmt::format("kvsift::tool: --codewords must be an integer in [1, 2147483647], got '{}'", text));
  }
  expect_error([] { bench::parse_integer<std::uint64_t>("tool", "--seed", "-1", 0); },
               "kvsift::tool: --seed must be an integer in [0, 18446744073709551615], got '-1'");
}

TEST(CommandLine, RealsAreRefusedUnlessWholeAndFinite) {
  EXPECT_EQ(bench::parse_real("tool", "--prefill", "0.5"), 0.5);
  for (const char* text : {"abc", "", "nan", "inf", "-inf", "1e999", "0.5x"}) {
    expect_error([&] { bench::parse_real("tool", "--prefill", text); },
                 fmt::format("kvsift::tool: --prefill must be a finite number, got '{}'", text));
  }
}

TEST(CommandLine, ListsRefuseTheFirstBadItemNamingIt) {
  EXPECT_EQ(bench::parse_integers<std::int32_t>("tool", "--layers", "3,15,0", 0),
            (std::vector<std::int32_t>{3, 15, 0}));
  EXPECT_EQ(bench::parse_reals("tool", "--budgets", "0.01,0.02"), (std::vector<double>{0.01, 0.02}));
  const struct {
    const char* list;
    int item;
    const char* text;
  } cases[] = {{"x", 1, "x"}, {"", 1, ""}, {"3,,15", 2, ""}, {"3x", 1, "3x"}, {"3,99999999999", 2, "99999999999"},
               {"3,-1", 2, "-1"}, {"3,15,", 3, ""}};
  for (const auto& c : cases) {
    expect_error([&] { bench::parse_integers<std::int32_t>("tool", "--layers", c.list, 0); },
                 fmt::format("kvsift::tool: --layers item {} of '{}' must be an integer in [0, 2147483647], got '{}'",
                             c.item, c.list, c.text));
  }
  expect_error([] { bench::parse_reals("tool", "--budgets", "0.01,abc"); },
               "kvsift::tool: --budgets item 2 of '0.01,abc' must be a finite number, got 'abc'");
  // --layers: "all" (empty) or layer numbers.
  EXPECT_EQ(bench::parse_layers("tool", "--layers", "all"), std::vector<std::int32_t>{});
  EXPECT_EQ(bench::parse_layers("tool", "--layers", "15,3"), (std::vector<std::int32_t>{15, 3}));
  expect_error([] { bench::parse_layers("tool", "--layers", "x"); },
               "kvsift::tool: --layers item 1 of 'x' must be an integer in [0, 2147483647], got 'x'");
}

TEST(CommandLine, UnknownNamesAreRefusedListingTheKnownOnes) {
  bench::check_names("tool", "--only", {"Quest", "OracleTopK"}, {"OracleTopK", "StreamingLLM", "Quest"});
  expect_error([] { bench::check_names("tool", "--only", {"Quest", "Nope"}, {"OracleTopK", "StreamingLLM", "Quest"}); },
               "kvsift::tool: --only: 'Nope' is not one of: OracleTopK, StreamingLLM, Quest");
}

/// Reads `argv` (after the tool's name) as a tool with --positions N, --budgets F,..., --plain and positional
/// captures does.
struct Parsed {
  std::int32_t positions = 64;
  std::vector<double> budgets;
  bool plain = false;
  std::vector<std::string> captures;
};
Parsed parse(std::vector<std::string> argv) {
  argv.insert(argv.begin(), "tool");
  std::vector<char*> pointers;
  for (std::string& a : argv) pointers.push_back(a.data());
  Parsed out;
  bench::Arguments args("tool", int(pointers.size()), pointers.data());
  while (args.next()) {
    if (args.is("--positions")) {
      out.positions = args.integer<std::int32_t>(1);
    } else if (args.is("--budgets")) {
      out.budgets = args.reals();
    } else if (args.is("--plain")) {
      out.plain = true;
    } else if (args.arg().starts_with("--")) {
      args.refuse();
    } else {
      out.captures.push_back(args.arg());
    }
  }
  return out;
}

TEST(CommandLine, ArgumentsReadValuesAndRefuseUnknownOptionsAndMissingValues) {
  const Parsed p = parse({"a.kvscap", "--positions", "128", "--plain", "--budgets", "0.01,0.05", "b.kvscap"});
  EXPECT_EQ(p.positions, 128);
  EXPECT_EQ(p.budgets, (std::vector<double>{0.01, 0.05}));
  EXPECT_TRUE(p.plain);
  EXPECT_EQ(p.captures, (std::vector<std::string>{"a.kvscap", "b.kvscap"}));
  EXPECT_EQ(parse({}).positions, 64);
  expect_error([] { parse({"--positions", "abc", "a.kvscap"}); },
               "kvsift::tool: --positions must be an integer in [1, 2147483647], got 'abc'");
  expect_error([] { parse({"a.kvscap", "--positions"}); }, "kvsift::tool: --positions needs a value");
  expect_error([] { parse({"--plian", "a.kvscap"}); }, "kvsift::tool: unknown option '--plian'");
  expect_error([] { parse({"--budgets", "0.01,", "a.kvscap"}); },
               "kvsift::tool: --budgets item 2 of '0.01,' must be a finite number, got ''");
}

}  // namespace
}  // namespace kvsift
