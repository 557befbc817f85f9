#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The rooms' one dependency direction and no include cycles (docs/ARCHITECTURE.md, "Rooms and
# the one direction"). Reads every #include "..." of the C/CUDA sources under ROOT:
#   include/moe      includes only include/moe
#   base/            include/moe, base/
#   kernels/, comm/  include/moe, base/, their own room (never runtime/, never each other)
#   runtime/formats/ include/moe, base/, runtime/formats/, and runtime/weights.h (the one entry
#                    into a layer)
#   runtime/         the rooms above and runtime/; runtime/cuda/ headers only from runtime/cuda/
#                    and tests/; the CUDA backend's one-GPU half (runtime/cuda/ files not named
#                    ep* or backend.c) never includes the expert-parallel half (runtime/cuda/ep*)
#   launch/, bench/, tests/: anything
# and no cycle between modules (a module: the files of one path without extension, foo.c with
# foo.h). Usage: check_includes.sh [ROOT]  (default: the repository holding this script);
# check_includes.sh --self-test: a small tree with one wrong arrow and one cycle must fail.
set -euo pipefail

check() {
    local root=$1 fail=0 f inc dir target from to room
    cd "$root"
    local edges
    edges=$(mktemp)
    # shellcheck disable=SC2064
    trap "rm -f '$edges'" RETURN
    while IFS= read -r f; do
        dir=$(dirname "$f")
        room=$(room_of "$f")
        while IFS= read -r inc; do
            target=""
            for cand in "$dir/$inc" "$inc" "include/$inc" "tests/common/$inc"; do
                cand=${cand#./}
                if [ -f "$cand" ]; then
                    target=$cand
                    break
                fi
            done
            [ -n "$target" ] || continue # a system or generated header
            if ! allowed "$f" "$room" "$target"; then
                echo "check_includes: $f ($room) includes $target ($(room_of "$target"))" >&2
                fail=1
            fi
            from=${f%.*}
            to=${target%.*}
            [ "$from" = "$to" ] || echo "$from $to" >>"$edges"
        done < <(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' "$f")
    done < <(find . \( -path ./.git -o -path './build*' -o -path ./.device -o -path ./.whl \
        -o -path ./python/build \) -prune -o -type f \
        \( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.inc' \) \
        -print | sed 's|^\./||' | sort)
    # tsort reports every loop it meets on stderr and fails
    if ! sort -u "$edges" | tsort >/dev/null 2>"$edges.loops"; then
        echo "check_includes: include cycle between modules:" >&2
        sed 's/^tsort: //' "$edges.loops" >&2
        fail=1
    fi
    rm -f "$edges.loops"
    return $fail
}

room_of() {
    case $1 in
    include/*) echo include ;;
    base/*) echo base ;;
    kernels/*) echo kernels ;;
    comm/*) echo comm ;;
    runtime/formats/*) echo formats ;;
    runtime/*) echo runtime ;;
    *) echo top ;;
    esac
}

# allowed FILE ROOM TARGET
allowed() {
    local f=$1 room=$2 t=$3 troom
    troom=$(room_of "$t")
    case $t in
    runtime/cuda/*)
        case $f in
        runtime/cuda/* | tests/*) ;;
        *) return 1 ;;
        esac
        case $f:$(basename "$t") in
        runtime/cuda/ep*:* | runtime/cuda/backend.c:* | tests/*:*) ;;
        runtime/cuda/*:ep*) return 1 ;; # the one-GPU half never uses the EP half
        esac
        ;;
    esac
    case $room in
    include) [ "$troom" = include ] ;;
    base) [ "$troom" = include ] || [ "$troom" = base ] ;;
    kernels | comm) [ "$troom" = include ] || [ "$troom" = base ] || [ "$troom" = "$room" ] ;;
    formats)
        [ "$troom" = include ] || [ "$troom" = base ] || [ "$troom" = formats ] ||
            [ "$t" = runtime/weights.h ]
        ;;
    runtime) [ "$troom" != top ] ;;
    *) return 0 ;;
    esac
}

self_test() {
    local t
    t=$(mktemp -d)
    # shellcheck disable=SC2064
    trap "rm -rf '$t'" EXIT
    mkdir -p "$t/base" "$t/kernels" "$t/runtime" "$t/include/moe"
    printf '#include "moe/moe.h"\n' >"$t/base/diag.h"
    : >"$t/include/moe/moe.h"
    printf '#include "base/diag.h"\n' >"$t/kernels/a.c"
    printf '#include "kernels/a.h"\n' >"$t/runtime/r.c"
    : >"$t/kernels/a.h"
    (check "$t") || {
        echo "self-test: a clean tree failed" >&2
        return 1
    }
    printf '#include "runtime/r.h"\n' >>"$t/kernels/a.c" # an arrow back up
    : >"$t/runtime/r.h"
    if (check "$t" 2>/dev/null); then
        echo "self-test: kernels/ including runtime/ passed" >&2
        return 1
    fi
    printf '' >"$t/kernels/a.c"
    printf '#include "kernels/b.h"\n' >"$t/kernels/a.h" # a -> b -> a
    printf '#include "kernels/a.h"\n' >"$t/kernels/b.h"
    if (check "$t" 2>/dev/null); then
        echo "self-test: a cycle a -> b -> a passed" >&2
        return 1
    fi
    echo "check_includes: self-test passed"
}

if [ "${1:-}" = --self-test ]; then
    self_test
    exit
fi
root=${1:-$(cd "$(dirname "$0")/../.." && pwd)}
if check "$root"; then
    echo "check_includes: every include runs one way, no cycles"
else
    exit 1
fi
