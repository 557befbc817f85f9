/* SPDX-License-Identifier: Apache-2.0 */
/* The knobs that change what ranks exchange, read once at layer create and agreed (knobs.h). */
#include "knobs.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/diag.h"
#include "runtime/formats/file.h"

static const struct {
    const char *name;
    int64_t dflt;
} int_knobs[MOE_KNOB_INT_COUNT] = {
    [MOE_KNOB_AG_MAX_TOKENS] = {"MOE_AG_MAX_TOKENS", 32},
    [MOE_KNOB_DETERMINISTIC] = {"MOE_DETERMINISTIC", 0},
    [MOE_KNOB_EP_LL] = {"MOE_EP_LL", 0},
    [MOE_KNOB_EP_MICROBATCH] = {"MOE_EP_MICROBATCH", 0},
    [MOE_KNOB_EP_P2P_HEADER] = {"MOE_EP_P2P_HEADER", 0},
    [MOE_KNOB_EP_LL_KERNELS] = {"MOE_EP_LL_KERNELS", 2},
    [MOE_KNOB_EP_CHUNK_TOKENS] = {"MOE_EP_CHUNK_TOKENS", 0},
    [MOE_KNOB_EP_LL_CTAS] = {"MOE_EP_LL_CTAS", 0},
    [MOE_KNOB_EP_FINISH_WAIT] = {"MOE_EP_FINISH_WAIT", 0},
    [MOE_KNOB_EP_SHARED_OVERLAP] = {"MOE_EP_SHARED_OVERLAP", 0},
    [MOE_KNOB_SCATTER_ROWS] = {"MOE_SCATTER_ROWS", 1},
    [MOE_KNOB_GEMM_SKIP_PAD] = {"MOE_GEMM_SKIP_PAD", 1},
};

static const char *const str_knobs[MOE_KNOB_STR_COUNT] = {
    [MOE_KNOB_FORCE_TRANSPORT] = "MOE_FORCE_TRANSPORT",
    [MOE_KNOB_EP_TRANSPORT] = "MOE_EP_TRANSPORT",
    [MOE_KNOB_FORCE_VARIANT] = "MOE_FORCE_VARIANT",
    [MOE_KNOB_GEMM_VARIANT] = "MOE_GEMM_VARIANT",
    [MOE_KNOB_TUNE_FILE] = "MOE_TUNE_FILE",
};

/* The largest tune file hashed (a larger one hashes as unreadable; the oracle reads at most
 * MOE_TUNE_MAX_BYTES: runtime/oracle.h). */
#define KNOB_FILE_MAX (4 << 20)

/* A word of the agreement: >= 0 (the agreement negates it for MIN), never a valid hash's 0. */
static int64_t word_of(uint64_t h)
{
    return (int64_t)(h >> 1);
}

/* MOE_TUNE_FILE's word: what the ranks read, not the path (hosts may keep copies at other
 * paths). A file that cannot be read hashes its error, so a rank that reads nothing differs
 * from one that reads a table. */
static int64_t tune_file_word(const char *path, char *why, size_t len)
{
    char *buf = NULL;
    size_t n = 0;
    uint64_t h;
    if (moe_read_regular(path, KNOB_FILE_MAX, &buf, &n, NULL) != MOE_STATUS_SUCCESS) {
        snprintf(why, len, "%s (unreadable: %s)", path, moe_last_error());
        moe_error_clear();
        return word_of(moe_fnv1a(MOE_FNV_BASIS ^ 1, "unreadable", 10));
    }
    h = moe_fnv1a(MOE_FNV_BASIS, buf, n);
    snprintf(why, len, "%s (%zu bytes, content hash %016" PRIx64 ")", path, n, h);
    free(buf);
    return word_of(h);
}

moe_status_t moe_knobs_read(moe_knobs_t *k)
{
    char why[64];
    int i;
    memset(k, 0, sizeof(*k));
    for (i = 0; i < MOE_KNOB_INT_COUNT; i++) {
        MOE_CHECK(moe_env_int_checked(int_knobs[i].name, int_knobs[i].dflt, &k->v[i]));
        k->word[i] = k->v[i] + (INT64_C(1) << 31); /* >= 0: every range is above -2^31 */
    }
    for (i = 0; i < MOE_KNOB_STR_COUNT; i++) {
        const char *v = moe_env_str(str_knobs[i], NULL);
        int64_t *w = &k->word[MOE_KNOB_INT_COUNT + i];
        if (!v)
            *w = 0;
        else if (i == MOE_KNOB_TUNE_FILE)
            *w = tune_file_word(v, why, sizeof(why));
        else
            *w = word_of(moe_fnv1a(MOE_FNV_BASIS, v, strlen(v))) | 1;
    }
    return MOE_STATUS_SUCCESS;
}

/* This rank's value of word i, as a message shows it. */
static void describe(const moe_knobs_t *k, int i, char *text, size_t len)
{
    const char *v;
    if (i < MOE_KNOB_INT_COUNT) {
        v = moe_env_str(int_knobs[i].name, NULL);
        snprintf(text, len, "%lld%s", (long long)k->v[i], v ? "" : " (unset: the default)");
        return;
    }
    i -= MOE_KNOB_INT_COUNT;
    v = moe_env_str(str_knobs[i], NULL);
    if (!v)
        snprintf(text, len, "(unset)");
    else if (i == MOE_KNOB_TUNE_FILE)
        tune_file_word(v, text, len);
    else
        snprintf(text, len, "%s", v);
}

static const char *knob_name(int i)
{
    return i < MOE_KNOB_INT_COUNT ? int_knobs[i].name : str_knobs[i - MOE_KNOB_INT_COUNT];
}

moe_status_t moe_knobs_mismatch(moe_comm_t *comm, const moe_knobs_t *k, const int64_t *max,
                                const int64_t *min)
{
    enum { TEXT = 240 };
    const int W = moe_comm_size(comm);
    char mine[TEXT], *all;
    int64_t *cnt;
    int i, r, other = -1;
    moe_status_t st;

    for (i = 0; i < MOE_KNOB_WORDS && max[i] == min[i]; i++)
        ;
    if (i == MOE_KNOB_WORDS)
        return MOE_STATUS_SUCCESS;
    /* every rank's value of the first differing knob, as text (one bounded all-gather) */
    all = malloc((size_t)TEXT * (size_t)W);
    cnt = malloc(sizeof(int64_t) * 2 * (size_t)W);
    if (!all || !cnt) {
        free(all);
        free(cnt);
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "knob agreement");
    }
    memset(mine, 0, sizeof(mine));
    describe(k, i, mine, sizeof(mine));
    mine[TEXT - 1] = '\0';
    for (r = 0; r < W; r++)
        cnt[r] = 1, cnt[W + r] = r;
    st = moe_comm_allgatherv(comm, mine, 1, all, cnt, cnt + W, TEXT);
    for (r = 1; r < W && st == MOE_STATUS_SUCCESS && other < 0; r++)
        if (strncmp(all, all + (size_t)r * TEXT, TEXT))
            other = r;
    if (st == MOE_STATUS_SUCCESS) {
        all[TEXT - 1] = all[(size_t)(other < 0 ? 0 : other) * TEXT + TEXT - 1] = '\0';
        /* other < 0: the words differ but the texts agree (a file changed between reads) */
        st = moe_error(MOE_STATUS_MISMATCH,
                       "%s differs among ranks: %s on rank 0, %s on rank %d (set it alike on "
                       "every rank)",
                       knob_name(i), all, all + (size_t)(other < 0 ? 0 : other) * TEXT,
                       other < 0 ? 0 : other);
    }
    free(all);
    free(cnt);
    return st;
}
