#!/usr/bin/env bash
# Checks that what kvsift's build needs is there, the way its build will look for it, and installs what is
# missing where it can. Called by `make demo` and `make test` before every build: it prints nothing and takes
# well under a second when everything is present.
#
# Needed: cmake >= 3.25, Ninja (the presets' generator) and a C++20 compiler on PATH; fmt, GoogleTest and Google
# Benchmark found by CMake as CMakeLists.txt finds them (find_package(fmt CONFIG), find_package(GTest),
# find_package(benchmark)), which a throwaway CMake project in a temporary directory checks (CXX,
# CMAKE_PREFIX_PATH and the like in the environment count, as they do for the build). CUDA is optional
# (KVSIFT_CUDA=AUTO) and not checked here.
#
# When something is missing: with apt-get, as root or with password-less sudo, it installs the Debian packages
# for what is missing and checks again; otherwise it prints what is missing (Debian and other package names)
# and exits 1. Other systems can also skip this script and use the plain CMake commands (README, Install).
set -euo pipefail

readonly min_cmake=3.25

# What each requirement is called: Debian package | elsewhere.
declare -A debian=([cmake]=cmake [ninja]=ninja-build [cxx]=g++ [fmt]=libfmt-dev [gtest]=libgtest-dev
                   [benchmark]=libbenchmark-dev)
declare -A generic=(
  [cmake]="CMake >= $min_cmake (Fedora/Homebrew: cmake; or https://cmake.org/download)"
  [ninja]="Ninja (Fedora: ninja-build; Homebrew: ninja)"
  [cxx]="a C++20 compiler: GCC >= 12 or Clang >= 16 (Fedora: gcc-c++; or set CXX)"
  [fmt]="{fmt}, found by find_package(fmt CONFIG) (Fedora: fmt-devel; Homebrew, vcpkg, conda: fmt)"
  [gtest]="GoogleTest, found by find_package(GTest) (Fedora: gtest-devel; Homebrew: googletest; vcpkg: gtest)"
  [benchmark]="Google Benchmark, found by find_package(benchmark) (Fedora: google-benchmark-devel; Homebrew: google-benchmark; vcpkg, conda: benchmark)")
readonly order=(cmake ninja cxx fmt gtest benchmark)

workdir=$(mktemp -d "${TMPDIR:-/tmp}/kvsift-deps.XXXXXX")
trap 'rm -rf "$workdir"' EXIT

cmake_ok() {
  command -v cmake >/dev/null 2>&1 || return 1
  local version
  version=$(cmake --version 2>/dev/null | sed -n '1s/^cmake version \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p')
  [ -n "$version" ] && [ "$(printf '%s\n%s\n' "$min_cmake" "$version" | sort -V | head -n1)" = "$min_cmake" ]
}

cxx_ok() {
  if [ -n "${CXX:-}" ]; then
    command -v "${CXX%% *}" >/dev/null 2>&1
  else
    command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || command -v clang++ >/dev/null 2>&1
  fi
}

# Configures a throwaway project that asks for the libraries as kvsift's CMakeLists.txt does; prints the missing
# ones. Returns 1 (printing nothing) when the probe could not run at all (its log is in $workdir/probe.log).
probe_libraries() {
  mkdir -p "$workdir/probe"
  cat >"$workdir/probe/CMakeLists.txt" <<'EOF'
cmake_minimum_required(VERSION 3.25)
project(kvsift_deps_probe LANGUAGES CXX)
set(missing "")
if(NOT cxx_std_20 IN_LIST CMAKE_CXX_COMPILE_FEATURES)
  list(APPEND missing cxx)
endif()
find_package(fmt CONFIG QUIET)
if(NOT fmt_FOUND)
  list(APPEND missing fmt)
endif()
find_package(GTest QUIET)
if(NOT GTest_FOUND)
  list(APPEND missing gtest)
endif()
find_package(benchmark QUIET)
if(NOT benchmark_FOUND)
  list(APPEND missing benchmark)
endif()
list(JOIN missing " " missing)
file(WRITE "${CMAKE_BINARY_DIR}/missing.txt" "${missing}\n")
EOF
  rm -rf "$workdir/probe/build"
  local generator=Ninja
  command -v ninja >/dev/null 2>&1 || generator="Unix Makefiles"
  if cmake -S "$workdir/probe" -B "$workdir/probe/build" -G "$generator" >"$workdir/probe.log" 2>&1; then
    cat "$workdir/probe/build/missing.txt"
  else
    return 1
  fi
}

is_missing() { [[ " ${missing[*]} " == *" $1 "* ]]; }

# Fills `missing` with what is not there, and `unchecked` with the libraries it could not check (no CMake probe
# possible and no dpkg).
check() {
  missing=()
  unchecked=()
  cmake_ok || missing+=(cmake)
  command -v ninja >/dev/null 2>&1 || missing+=(ninja)
  cxx_ok || missing+=(cxx)
  local libraries
  if ! is_missing cmake && ! is_missing cxx \
     && { command -v ninja >/dev/null 2>&1 || command -v make >/dev/null 2>&1; }; then
    if libraries=$(probe_libraries); then
      # shellcheck disable=SC2206  # the probe prints space-separated names
      missing+=($libraries)
      return 0
    fi
    missing+=(cxx)  # the tools are there but CMake could not configure a C++ project: the compiler failed
  fi
  # No probe possible: fall back to the Debian packages where dpkg can tell; elsewhere the libraries go unchecked.
  local name
  for name in fmt gtest benchmark; do
    if ! command -v dpkg-query >/dev/null 2>&1; then
      unchecked+=("$name")
    elif ! dpkg-query -W -f='${Status}' "${debian[$name]}" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$name")
    fi
  done
}

report() {  # $1: what happened
  echo "kvsift: $1. Missing:" >&2
  local name packages=()
  for name in "${order[@]}"; do
    if is_missing "$name"; then
      printf '  %-17s %s\n' "${debian[$name]}" "${generic[$name]}" >&2
      packages+=("${debian[$name]}")
    fi
  done
  if [ ${#unchecked[@]} -gt 0 ]; then
    echo "kvsift: not checked until CMake and a compiler are there (install them too if missing):" >&2
    for name in "${order[@]}"; do
      if [[ " ${unchecked[*]} " == *" $name "* ]]; then
        printf '  %-17s %s\n' "${debian[$name]}" "${generic[$name]}" >&2
        packages+=("${debian[$name]}")
      fi
    done
  fi
  echo "kvsift: on Debian/Ubuntu, as root: apt-get update && apt-get install -y ${packages[*]}" >&2
  echo "kvsift: installed under a prefix CMake does not search? Export CMAKE_PREFIX_PATH=<prefix> and run again." >&2
  if [ -s "$workdir/probe.log" ] && ! grep -q '^-- Configuring done' "$workdir/probe.log"; then
    echo "kvsift: CMake failed to configure a C++ project:" >&2
    grep -v '^See also' "$workdir/probe.log" | grep -A 12 -m 1 'CMake Error' | sed 's/^/    /' >&2
  fi
}

check
[ ${#missing[@]} -eq 0 ] && exit 0

packages=()
for name in "${order[@]}"; do
  if is_missing "$name"; then packages+=("${debian[$name]}"); fi
done

if ! command -v apt-get >/dev/null 2>&1; then
  report "no apt-get here: install these with your package manager (or see README.md, Install)"
  exit 1
fi
if [ "$(id -u)" -eq 0 ]; then
  sudo=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  sudo=(sudo -n)
else
  report "cannot install with apt-get: not root and no password-less sudo"
  exit 1
fi

echo "kvsift: installing missing Debian packages: ${packages[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq || { report "apt-get update failed (no network?)"; exit 1; }
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${packages[@]}" \
  || { report "apt-get install ${packages[*]} failed"; exit 1; }

check
if [ ${#missing[@]} -ne 0 ]; then
  report "still missing after apt-get install ${packages[*]} (installed, yet not found: too old a version?)"
  exit 1
fi
