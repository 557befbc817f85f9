#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# `cmake --install` gives a usable package: a consumer finds it with find_package(libmoe) and
# with pkg-config, links and runs. Usage: test_install.sh BUILD_DIR
set -euo pipefail
build=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
mkdir -p "$tmp/consumer"
cat >"$tmp/consumer/main.c" <<'C'
#include <moe/moe.h>
#include <stdio.h>
#include <string.h>
int main(void)
{
    int a, b, c;
    moe_version(&a, &b, &c);
    printf("libmoe %d.%d.%d\n", a, b, c);
    return strcmp(moe_status_string(MOE_STATUS_TIMEOUT), "MOE_STATUS_TIMEOUT") != 0;
}
C
cat >"$tmp/consumer/CMakeLists.txt" <<'C'
cmake_minimum_required(VERSION 3.24)
project(consumer C)
find_package(libmoe REQUIRED)
add_executable(consumer main.c)
target_link_libraries(consumer PRIVATE libmoe::moe)
C
cmake -S "$tmp/consumer" -B "$tmp/consumer/b" -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null
cmake --build "$tmp/consumer/b" >/dev/null
LD_LIBRARY_PATH="$tmp/prefix/lib:${LD_LIBRARY_PATH:-}" "$tmp/consumer/b/consumer"
# pkg-config, from the relocated prefix
cc "$tmp/consumer/main.c" $(PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig" pkg-config --cflags --libs libmoe) \
    -o "$tmp/consumer/pc"
LD_LIBRARY_PATH="$tmp/prefix/lib:${LD_LIBRARY_PATH:-}" "$tmp/consumer/pc"
echo "install: find_package and pkg-config consumers built and ran"
