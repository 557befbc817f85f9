#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The CUDA build compiles nothing at run time: no NVRTC, nvJitLink or loading of code from
# memory in the library or the tools; SASS for sm_80 and sm_90a, so the GPUs libmoe targets
# (8.x, 9.0) never JIT; the only PTX is the sm_80 family's compute_80 (forward compatibility:
# on a GPU newer than 9.0 the driver compiles it once, at layer create, where
# moe_kernels_prepare loads every kernel -- never inside a step); every sm_80 kernel also in
# sm_90a.
#   test_no_jit.sh [--cuda-bin DIR] FILE...   (FILE: libmoe.so, libmoe.a, the tools)
# Fails on: a forbidden library in NEEDED/ldd, a forbidden undefined symbol or symbol name in
# the file; a file cuobjdump cannot read, or without an sm_80 and an sm_90a ELF, or without
# kernels in either; embedded PTX other than compute_80's; a kernel in an sm_80 ELF missing from
# the sm_90a ELF of the same source. The matchers run on built-in fake inputs first, so one that never matches
# fails too. Exit 77 (skip) only when cuobjdump is not found, after the linkage checks (they
# need no cuobjdump) have passed.
# cuobjdump: $MOE_CUOBJDUMP, PATH, --cuda-bin DIR, then pip's nvidia-cuda-cuobjdump.
set -u
cuda_bin=""
if [ "${1:-}" = "--cuda-bin" ]; then
    cuda_bin=$2
    shift 2
fi
[ $# -gt 0 ] || {
    echo "usage: $0 [--cuda-bin DIR] FILE..." >&2
    exit 2
}
# shellcheck source=../common/check.sh
. "$(dirname "$0")/../common/check.sh" # check WHAT CONDITION...: one verdict line; fail=1 on a miss

# ---- matchers (stdin -> stdout), exercised on fake inputs below ---------------------------
# Run-time compilers and loaders of code from memory: NVRTC, nvJitLink, cuModuleLoad*
# (cuModuleLoadData, ...Ex, ...FatBinary), cuLink*, cuLibraryLoad*, cudaLibraryLoad*.
FORBIDDEN='nvrtc|NVRTC|nvJitLink|nvjitlink|cuModuleLoad|cuLink(Create|Add|Complete)'
FORBIDDEN+='|cuLibraryLoad|cudaLibraryLoad'
forbidden() { grep -aE "$FORBIDDEN" | sort -u; }
NAMES='nvrtc*, nvJitLink*, cuModuleLoad*, cuLink*, cu(da)LibraryLoad*' # for the verdict lines
oneline() { tr -s ' \t\n' ' ' | sed 's/^ //; s/ $//'; } # for the verdict lines

# `cuobjdump --list-ptx` -> one line per embedded PTX.
ptx_entries() { grep -E '^PTX file' || true; }
# The PTX files of ptx_entries other than the sm_80 family's compute_80 forward-compatibility.
foreign_ptx() { ptx_entries | awk '{print $NF}' | grep -v '\.sm_80\.ptx$' || true; }

# `cuobjdump --list-elf` -> the sorted set of SASS architectures (sm_80, sm_90a, ...).
elf_archs() { sed -n 's/^ELF file .*\.\(sm_[0-9]*[a-z]*\)\.cubin$/\1/p' | sort -u; }

# `cuobjdump -symbols` -> "ARCH SOURCE KERNEL" for each kernel (STO_ENTRY) of each ELF.
kernels() {
    awk '/^Fatbin /{kind = $2; arch = "?"; src = "?"}
         /^arch = /{arch = $3}
         /^identifier = /{src = $3}
         kind == "elf" && ($3 == "STO_ENTRY" || $4 == "ENTRY") {print arch, src, $NF}'
}

# kernels' output -> "SOURCE KERNEL" in an sm_80 ELF but in no sm_90a ELF of that source.
missing_sm90a() {
    awk '$1 == "sm_80"{k80[$2 " " $3] = 1} $1 == "sm_90a"{k90[$2 " " $3] = 1}
         END{for (k in k80) if (!(k in k90)) print k}' | sort
}

# ---- the matchers on fake inputs: each must catch what it is for ---------------------------
fake_nm='                 U cudaLaunchKernel@libcudart.so.13
                 U nvrtcCreateProgram@libnvrtc.so.13
                 U cuModuleLoadDataEx
                 U cuLinkCreate_v2
                 U cudaLibraryLoadData@libcudart.so.13
                 U cudaGetDriverEntryPointByVersion@libcudart.so.13'
check "self-test: forbidden() catches nvrtc*, cuModuleLoadDataEx, cuLinkCreate, cudaLibraryLoad*" \
    test "$(forbidden <<<"$fake_nm" | wc -l)" -eq 4
check "self-test: forbidden() catches libnvJitLink.so in NEEDED" \
    test -n "$(forbidden <<<' 0x01 (NEEDED) Shared library: [libnvJitLink.so.13]')"
check "self-test: forbidden() passes libcudart, cudaLaunchKernel, cuTensorMapEncodeTiled" \
    test -z "$(forbidden <<<'[libcudart.so.13] cudaLaunchKernel cuTensorMapEncodeTiled')"
check "self-test: ptx_entries() counts embedded PTX" \
    test "$(ptx_entries <<<$'PTX file 1: r.sm_80.ptx\nELF file 1: r.sm_80.cubin' | wc -l)" -eq 1
check "self-test: foreign_ptx() flags sm_90a PTX, lets compute_80's through" \
    test "$(foreign_ptx <<<$'PTX file 1: r.sm_80.ptx\nPTX file 2: q.sm_90a.ptx' | oneline)" = "q.sm_90a.ptx"
fake_elf=$'ELF file 1: a.sm_90a.cubin\nELF file 2: a.sm_80.cubin\nELF file 3: l.1.sm_75.cubin'
check "self-test: elf_archs() reads the architectures" \
    test "$(elf_archs <<<"$fake_elf" | tr '\n' ' ')" = "sm_75 sm_80 sm_90a "
# shellcheck disable=SC2016 # the $ in the fake dump is literal
fake_symbols='
Fatbin elf code:
================
arch = sm_90a
identifier = /src/kernels/cuda/route.cu

symbols:
STT_FUNC         STB_GLOBAL STO_ENTRY      route_a
STT_FUNC         STB_WEAK   STV_DEFAULT    $__internal_0_$__cuda_sm20_div_s64

Fatbin ptx code:
================
arch = sm_80
identifier = /src/kernels/cuda/route.cu

Fatbin elf code:
================
arch = sm_80
identifier = /src/kernels/cuda/route.cu

symbols:
STT_FUNC         STB_GLOBAL STO_ENTRY      route_a
STT_FUNC         STB_GLOBAL STO_ENTRY      route_b'
check "self-test: kernels() lists the ELF kernels only" \
    test "$(kernels <<<"$fake_symbols" | wc -l)" -eq 3
# cuobjdump 13.5's layout of the same (13.2 writes the one above)
# shellcheck disable=SC2016 # the $ in the fake dump is literal
fake_symbols_135='
Fatbin elf code:
================
arch = sm_90a
identifier = /src/kernels/cuda/route.cu

symbols:
FUNC          LOCAL   DEFAULT    ENTRY                                route_a
NOTYPE        WEAK    DEFAULT    RESERVED_SHARED                      __nv_reservedSMEM_offset_0_alias
FUNC          WEAK    DEFAULT    -                                    $__internal_0_$__cuda_sm20_div_s64'
check "self-test: kernels() reads cuobjdump 13.5's symbol table too" \
    test "$(kernels <<<"$fake_symbols_135")" = "sm_90a /src/kernels/cuda/route.cu route_a"
check "self-test: missing_sm90a() finds a kernel with no sm_90a SASS" \
    test "$(kernels <<<"$fake_symbols" | missing_sm90a)" = "/src/kernels/cuda/route.cu route_b"

# ---- 1. linkage: no run-time compiler, no loading of code from memory ----------------------
for f in "$@"; do
    name=$(basename "$f")
    if [ ! -f "$f" ]; then
        check "$name exists" false
        continue
    fi
    case $f in
    *.a)
        syms=$(nm --undefined-only "$f" 2>/dev/null)
        check "$name: undefined symbols read (cudaLaunchKernel* among them)" \
            grep -q 'cudaLaunchKernel' <<<"$syms"
        bad=$(forbidden <<<"$syms" | oneline)
        check "$name: no undefined $NAMES${bad:+ (found: $bad)}" test -z "$bad"
        ;;
    *)
        needed=$(readelf -d "$f" | grep NEEDED)
        check "$name: NEEDED read (libcudart among them)" grep -q 'libcudart' <<<"$needed"
        bad=$(forbidden <<<"$needed" | oneline)
        check "$name: no NVRTC/nvJitLink in NEEDED${bad:+ (found: $bad)}" test -z "$bad"
        bad=$(ldd "$f" 2>/dev/null | forbidden | oneline)
        check "$name: no NVRTC/nvJitLink among all loaded libraries (ldd)${bad:+ (found: $bad)}" \
            test -z "$bad"
        syms=$(nm -D --undefined-only "$f" 2>/dev/null)
        check "$name: undefined dynamic symbols read (cudaLaunchKernel* among them)" \
            grep -q 'cudaLaunchKernel' <<<"$syms"
        bad=$(forbidden <<<"$syms" | oneline)
        check "$name: no undefined $NAMES${bad:+ (found: $bad)}" test -z "$bad"
        ;;
    esac
    # A name in the file's strings would be a driver entry point fetched by name
    # (cudaGetDriverEntryPoint, dlsym).
    bad=$(strings -a "$f" | forbidden | head -5 | oneline)
    check "$name: no such name among its strings${bad:+ (found: $bad)}" test -z "$bad"
done

# ---- 2. and 3. the embedded device code: SASS only, every kernel for sm_90a ----------------
# shellcheck source=../common/find_cuobjdump.sh
. "$(dirname "$0")/../common/find_cuobjdump.sh"
cuobjdump=$(find_cuobjdump "$cuda_bin")
if [ -z "$cuobjdump" ]; then
    if [ $fail -ne 0 ]; then
        echo "test_no_jit: FAILED (linkage); cuobjdump not found, device code not checked"
        exit 1
    fi
    echo "SKIP: cuobjdump not found (PATH, --cuda-bin '$cuda_bin', MOE_CUOBJDUMP, pip's" \
        "nvidia-cuda-cuobjdump): the linkage checks passed, the device code was not checked"
    exit 77
fi
echo "cuobjdump: $cuobjdump"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/moe-no-jit-XXXXXX")
trap 'rm -rf "$tmp"' EXIT
for f in "$@"; do
    [ -f "$f" ] || continue
    name=$(basename "$f")
    err=""
    for l in elf:--list-elf ptx:--list-ptx sym:-symbols; do
        "$cuobjdump" "${l#*:}" "$f" >"$tmp/${l%%:*}" 2>&1 ||
            err="${l#*:}: $(grep -m1 -E 'fatal|info|error' "$tmp/${l%%:*}")"
    done
    check "$name: cuobjdump reads its device code${err:+ ($err)}" test -z "$err"
    archs=$(elf_archs <"$tmp/elf" | oneline)
    echo "$name: SASS for: $archs"
    check "$name: has sm_80 SASS" grep -qw sm_80 <<<"$archs"
    check "$name: has sm_90a SASS" grep -qw sm_90a <<<"$archs"
    ptx=$(foreign_ptx <"$tmp/ptx" | oneline)
    check "$name: no PTX but compute_80's${ptx:+; found: $ptx}" test -z "$ptx"

    kernels <"$tmp/sym" >"$tmp/k"
    for a in sm_80 sm_90a; do
        n=$(awk -v a=$a '$1 == a' "$tmp/k" | wc -l)
        check "$name: $n kernels in $a SASS (more than none)" test "$n" -gt 0
    done
    other=$(awk '$1 != "sm_80" && $1 != "sm_90a"{print $1}' "$tmp/k" | sort | uniq -c |
        awk '{printf "%s%s %s", (NR > 1 ? ", " : ""), $2, $1}')
    [ -z "$other" ] || echo "note: $name: kernels for other architectures: $other"
    for a in $archs; do
        case $a in sm_80 | sm_90a) ;;
        *) grep -q "^$a " "$tmp/k" || echo "note: $name: its $a ELF holds no kernel" ;;
        esac
    done
    one=$(awk '$1 == "sm_90a" || $1 == "sm_80"{print $2, $3}' "$tmp/k" | sort | uniq -u |
        awk '{print $1}' | uniq -c |
        awk '{n = split($2, p, "/"); printf "%s%s %s", (NR > 1 ? ", " : ""), p[n], $1}')
    [ -z "$one" ] || echo "note: $name: kernels in one of sm_80/sm_90a only: $one"
    bad=$(missing_sm90a <"$tmp/k" | oneline)
    check "$name: every sm_80 kernel also has sm_90a SASS${bad:+; missing: $bad}" test -z "$bad"
done

if [ $fail -ne 0 ]; then
    echo "test_no_jit: FAILED"
    exit 1
fi
echo "test_no_jit: all checks passed"
