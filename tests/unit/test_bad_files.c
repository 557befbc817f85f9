/* SPDX-License-Identifier: Apache-2.0 */
/* Hostile files for the checkpoint, safetensors and JSON readers and the safetensors writer:
 * FIFOs, devices, sockets and folders where files belong, crafted and oversized JSON, bad
 * weight values, dtype mismatches and unsafe output paths. Every case checks the status and
 * the message; nothing may hang (ctest's TIMEOUT for this test is short, see CMakeLists.txt). */
#define _POSIX_C_SOURCE 200809L
#include "testutil.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <unistd.h>

#include "base/numeric.h"
#include "moe/moe_checkpoint.h"
#include "base/json.h"
#include "runtime/formats/safetensors.h"

static moe_runtime_t *rt;
static char g_root[256];
static int g_seq;
static char g_msg[1024];

#define EXPECT(call, status, needle)                                                               \
    do {                                                                                           \
        moe_status_t st_ = (call);                                                                 \
        snprintf(g_msg, sizeof(g_msg), "%s", moe_last_error());                                    \
        if (st_ != (status) || !strstr(g_msg, needle))                                             \
            fail_msg("line %d: got %s \"%s\", expected %s with \"%s\"", __LINE__,                  \
                     moe_status_string(st_), g_msg, moe_status_string(status), needle);            \
    } while (0)

/* ---- files and folders ----------------------------------------------------------------------- */

static void new_dir(char *out, size_t n)
{
    snprintf(out, n, "%s/d%d", g_root, g_seq++);
    assert_int_equal(mkdir(out, 0700), 0);
}

static void put_text(const char *dir, const char *name, const char *text, size_t len)
{
    char path[512];
    FILE *fp;
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    fp = fopen(path, "wb");
    assert_non_null(fp);
    assert_int_equal(fwrite(text, 1, len, fp), len);
    fclose(fp);
}

static void put_str(const char *dir, const char *name, const char *text)
{
    put_text(dir, name, text, strlen(text));
}

static void make_fifo(const char *dir, const char *name)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    assert_int_equal(mkfifo(path, 0600), 0);
}

static void make_subdir(const char *dir, const char *name)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    assert_int_equal(mkdir(path, 0700), 0);
}

/* ---- a small Mixtral checkpoint (E = 2, H = I = 16, one layer) ------------------------------- */

enum { E = 2, H = 16, I = 16 };

typedef struct ckpt_opts {
    int fp8_file;    /* expert matrices F8_E4M3 with [1, 1] weight_scale_inv */
    int fp8_config;  /* config.json has an fp8 quantization_config */
    int nan_expert;  /* experts.1.w1.weight[2, 3] = NaN */
    int inf_expert;  /* experts.0.w2.weight[5, 0] = -Inf (BF16) */
    int nan_router;  /* every router value NaN */
    float bad_scale; /* != 0: experts.0.w3.weight_scale_inv = this */
    int shards;      /* 0: model.safetensors; n: n shards and the index */
    int skip_check;  /* the layer gets skip_weight_check = 1 */
} ckpt_opts_t;

typedef struct st_buf {
    moe_st_entry_t e[16];
    char names[16][128];
    void *data[16];
    int n;
} st_buf_t;

static void *buf_add(st_buf_t *b, const char *name, moe_st_dtype_t dt, int64_t r, int64_t c)
{
    moe_st_entry_t *e = &b->e[b->n];
    snprintf(b->names[b->n], sizeof(b->names[0]), "%s", name);
    b->data[b->n] = calloc((size_t)(r * c), moe_st_dtype_size(dt));
    *e = (moe_st_entry_t){b->names[b->n], dt, 2, {r, c}, b->data[b->n]};
    return b->data[b->n++];
}

static void bf16_matrix(st_buf_t *b, const char *name, int64_t r, int64_t c, float nan_at_value,
                        int64_t at)
{
    uint16_t *d = buf_add(b, name, MOE_ST_BF16, r, c);
    for (int64_t i = 0; i < r * c; i++) {
        float v = (float)((i * 7) % 13 - 6) * 0.02f;
        if (i == at)
            v = nan_at_value;
        moe_convert_from_f32(MOE_DTYPE_BF16, &v, &d[i], 1);
    }
}

static void write_ckpt(const char *dir, const ckpt_opts_t *o)
{
    static const char *const w[3] = {"w1", "w3", "w2"};
    char cfg[1024], name[96], path[512];
    st_buf_t b = {0};

    snprintf(cfg, sizeof(cfg),
             "{\"model_type\": \"mixtral\", \"hidden_size\": %d, \"num_hidden_layers\": 1, "
             "\"num_experts_per_tok\": 1, \"num_local_experts\": %d, \"intermediate_size\": %d, "
             "\"torch_dtype\": \"bfloat16\"%s}",
             H, E, I,
             o->fp8_config ? ", \"quantization_config\": {\"quant_method\": \"fp8\", "
                             "\"activation_scheme\": \"dynamic\", \"weight_block_size\": [128, "
                             "128]}"
                           : "");
    put_str(dir, "config.json", cfg);

    if (o->nan_router) {
        uint16_t *d = buf_add(&b, "model.layers.0.block_sparse_moe.gate.weight", MOE_ST_BF16, E, H);
        for (int i = 0; i < E * H; i++)
            d[i] = 0x7FC0; /* BF16 NaN */
    } else {
        bf16_matrix(&b, "model.layers.0.block_sparse_moe.gate.weight", E, H, 0, -1);
    }
    for (int e = 0; e < E; e++)
        for (int j = 0; j < 3; j++) {
            snprintf(name, sizeof(name), "model.layers.0.block_sparse_moe.experts.%d.%s.weight", e,
                     w[j]);
            if (!o->fp8_file) {
                int nan_here = o->nan_expert && e == 1 && j == 0;
                int inf_here = o->inf_expert && e == 0 && j == 2;
                bf16_matrix(&b, name, j == 2 ? H : I, j == 2 ? I : H, nan_here ? NAN : -INFINITY,
                            nan_here   ? 2 * H + 3
                            : inf_here ? 5 * I + 0
                                       : -1);
            } else {
                uint8_t *q = buf_add(&b, name, MOE_ST_F8_E4M3, 16, 16);
                float *s;
                char sname[112];
                for (int i = 0; i < 256; i++)
                    q[i] = (uint8_t)((i * 37) & 0x3E); /* small values, never a NaN code */
                snprintf(sname, sizeof(sname), "%s_scale_inv", name);
                s = buf_add(&b, sname, MOE_ST_F32, 1, 1);
                s[0] = (o->bad_scale != 0 && e == 0 && j == 1) ? o->bad_scale : 0.01f;
            }
        }
    if (o->shards <= 1) {
        snprintf(path, sizeof(path), "%s/model.safetensors", dir);
        TU_OK(moe_st_write(path, b.e, (size_t)b.n, NULL, 0));
    } else {
        char index[8192];
        size_t off = (size_t)snprintf(index, sizeof(index), "{\"weight_map\": {");
        for (int s = 0; s < o->shards; s++) {
            moe_st_entry_t part[16];
            int m = 0;
            char fname[64];
            snprintf(fname, sizeof(fname), "model-%05d-of-%05d.safetensors", s + 1, o->shards);
            for (int i = s; i < b.n; i += o->shards) {
                part[m++] = b.e[i];
                off += (size_t)snprintf(index + off, sizeof(index) - off, "%s\"%s\": \"%s\"",
                                        i ? ", " : "", b.e[i].name, fname);
            }
            snprintf(path, sizeof(path), "%s/%s", dir, fname);
            TU_OK(moe_st_write(path, part, (size_t)m, NULL, 0));
        }
        snprintf(index + off, sizeof(index) - off, "}}");
        put_str(dir, "model.safetensors.index.json", index);
    }
    for (int i = 0; i < b.n; i++)
        free(b.data[i]);
}

/* Opens `dir`, reads layer 0's config, creates the layer and loads it: the first failure. */
static moe_status_t try_load(const char *dir, int skip_check)
{
    moe_checkpoint_t *ck = NULL;
    moe_layer_config_t cfg = MOE_LAYER_CONFIG_INIT;
    moe_layer_t *l = NULL;
    moe_status_t st;

    cfg.max_tokens_per_rank = 8;
    cfg.skip_weight_check = skip_check;
    st = moe_checkpoint_open(dir, &ck);
    if (st == MOE_STATUS_SUCCESS)
        st = moe_checkpoint_layer_config(ck, 0, &cfg);
    if (st == MOE_STATUS_SUCCESS) {
        TU_OK(moe_layer_create(rt, &cfg, &l));
        st = moe_layer_load(l, ck, 0);
    }
    snprintf(g_msg, sizeof(g_msg), "%s", moe_last_error());
    moe_layer_destroy(l);
    moe_checkpoint_close(ck);
    return st;
}

#define EXPECT_LOAD(dir, skip_check, status, needle)                                               \
    do {                                                                                           \
        moe_status_t st_ = try_load(dir, skip_check);                                              \
        if (st_ != (status) || !strstr(g_msg, needle))                                             \
            fail_msg("line %d: got %s \"%s\", expected %s with \"%s\"", __LINE__,                  \
                     moe_status_string(st_), g_msg, moe_status_string(status), needle);            \
    } while (0)

/* ---- FIFOs, folders, devices and sockets where files belong -----------------------------------
 */

static void test_fifo_files(void **state)
{
    const ckpt_opts_t plain = {0}, sharded = {.shards = 2};
    char dir[300], path[512];

    /* model.safetensors is a FIFO (no writer: a blocking open would wait forever) */
    new_dir(dir, sizeof(dir));
    put_str(dir, "config.json", "{\"model_type\": \"mixtral\"}");
    make_fifo(dir, "model.safetensors");
    EXPECT_LOAD(dir, 0, MOE_STATUS_IO_ERROR, "model.safetensors: is a FIFO");

    /* config.json is a FIFO */
    new_dir(dir, sizeof(dir));
    write_ckpt(dir, &plain);
    snprintf(path, sizeof(path), "%s/config.json", dir);
    assert_int_equal(unlink(path), 0);
    make_fifo(dir, "config.json");
    EXPECT_LOAD(dir, 0, MOE_STATUS_IO_ERROR, "config.json: is a FIFO");

    /* the index is a FIFO */
    new_dir(dir, sizeof(dir));
    write_ckpt(dir, &sharded);
    snprintf(path, sizeof(path), "%s/model.safetensors.index.json", dir);
    assert_int_equal(unlink(path), 0);
    make_fifo(dir, "model.safetensors.index.json");
    EXPECT_LOAD(dir, 0, MOE_STATUS_IO_ERROR, "model.safetensors.index.json: is a FIFO");

    /* one shard is a FIFO: found when the loader first opens it */
    new_dir(dir, sizeof(dir));
    write_ckpt(dir, &sharded);
    snprintf(path, sizeof(path), "%s/model-00002-of-00002.safetensors", dir);
    assert_int_equal(unlink(path), 0);
    make_fifo(dir, "model-00002-of-00002.safetensors");
    EXPECT_LOAD(dir, 0, MOE_STATUS_IO_ERROR, "model-00002-of-00002.safetensors: is a FIFO");

    /* a FIFO named as the checkpoint itself, and as an input file */
    make_fifo(dir, "input.safetensors");
    snprintf(path, sizeof(path), "%s/input.safetensors", dir);
    EXPECT_LOAD(path, 0, MOE_STATUS_IO_ERROR, "input.safetensors: is a FIFO");
    {
        float x[16];
        EXPECT(moe_safetensors_read_rows(path, "hidden_states", 0, 1, MOE_DTYPE_F32, x),
               MOE_STATUS_IO_ERROR, "input.safetensors: is a FIFO");
        EXPECT(moe_safetensors_tensor_info(path, "hidden_states", NULL, NULL, NULL),
               MOE_STATUS_IO_ERROR, "is a FIFO (named pipe), not a regular file");
    }
}

static void test_folders_devices_sockets(void **state)
{
    const ckpt_opts_t plain = {0};
    char dir[300], path[512];

    /* a folder named model.safetensors, then one named config.json */
    new_dir(dir, sizeof(dir));
    put_str(dir, "config.json", "{\"model_type\": \"mixtral\"}");
    make_subdir(dir, "model.safetensors");
    EXPECT_LOAD(dir, 0, MOE_STATUS_IO_ERROR, "model.safetensors: is a directory");
    new_dir(dir, sizeof(dir));
    write_ckpt(dir, &plain);
    snprintf(path, sizeof(path), "%s/config.json", dir);
    assert_int_equal(unlink(path), 0);
    make_subdir(dir, "config.json");
    EXPECT_LOAD(dir, 0, MOE_STATUS_IO_ERROR, "config.json: is a directory");

    /* a character device as an input file and as a checkpoint */
    EXPECT(moe_safetensors_tensor_info("/dev/null", "x", NULL, NULL, NULL), MOE_STATUS_IO_ERROR,
           "/dev/null: is a character device");
    EXPECT_LOAD("/dev/null", 0, MOE_STATUS_IO_ERROR, "/dev/null: is a character device");

    /* a socket where model.safetensors belongs */
    new_dir(dir, sizeof(dir));
    put_str(dir, "config.json", "{\"model_type\": \"mixtral\"}");
    {
        struct sockaddr_un a;
        int fd = socket(AF_UNIX, SOCK_STREAM, 0);
        assert_true(fd >= 0);
        memset(&a, 0, sizeof(a));
        a.sun_family = AF_UNIX;
        snprintf(path, sizeof(path), "%s/model.safetensors", dir);
        assert_true(strlen(path) < sizeof(a.sun_path));
        memcpy(a.sun_path, path, strlen(path) + 1);
        assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
        EXPECT_LOAD(dir, 0, MOE_STATUS_IO_ERROR, "model.safetensors: is a socket");
        close(fd);
    }
}

/* ---- crafted and oversized JSON ----------------------------------------------------------------
 */

#define FNV_OFFSET 1469598103934665603ull
#define FNV_PRIME 1099511628211ull
#define LOW_BITS 20
#define LOW_MASK ((1u << LOW_BITS) - 1)

static uint64_t fnv1a(const char *s, size_t n)
{
    uint64_t h = FNV_OFFSET;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)s[i]) * FNV_PRIME;
    return h;
}

static int key_char(int c)
{
    return c > 0x20 && c < 0x7F && c != '"' && c != '\\';
}

/* Writes `count` distinct keys whose unseeded FNV-1a hashes agree in their low 20 bits: every
 * key lands in one bucket of a 2^20-slot table, so linear probing costs count^2 / 2 probes
 * (2^37 for 2^19 keys: hours). Each key is 8 hex digits (unique) and 3 bytes that steer the
 * low bits to 0. The low bits of FNV-1a depend only on low bits (the prime is odd, so
 * multiplying by it is invertible mod 2^20): walk back from 0 over every 3-byte suffix and
 * keep, per state reachable after the prefix, one suffix that ends at 0. Returns the JSON
 * object text ({"key": 0, ...}) and its length. */
static char *colliding_object(size_t count, size_t *len, const char *extra_key)
{
    uint64_t inv = FNV_PRIME; /* Newton: inverse of the prime mod 2^64 */
    uint32_t *suffix = calloc((size_t)1 << LOW_BITS, sizeof(uint32_t));
    size_t cap = count * 24 + 64, o = 0, made = 0;
    char *text = malloc(cap);

    assert_non_null(suffix);
    assert_non_null(text);
    for (int i = 0; i < 6; i++)
        inv *= 2 - FNV_PRIME * inv;
    for (int b3 = 0; b3 < 128; b3++)
        for (int b2 = 0; b2 < 128; b2++)
            for (int b1 = 0; b1 < 128; b1++) {
                uint64_t s2, s1, s0;
                if (!key_char(b1) || !key_char(b2) || !key_char(b3))
                    continue;
                s2 = (uint64_t)b3; /* ((s2 ^ b3) * P) & mask == 0 */
                s1 = ((s2 * inv) ^ (uint64_t)b2) & LOW_MASK;
                s0 = ((s1 * inv) ^ (uint64_t)b1) & LOW_MASK;
                suffix[s0] =
                    (uint32_t)(1u << 24 | (unsigned)b1 << 16 | (unsigned)b2 << 8 | (unsigned)b3);
            }
    text[o++] = '{';
    for (uint32_t p = 0; made < count; p++) {
        char key[16];
        uint32_t sf;
        snprintf(key, sizeof(key), "%08x", p);
        sf = suffix[fnv1a(key, 8) & LOW_MASK];
        if (!sf)
            continue;
        key[8] = (char)(sf >> 16 & 0xFF);
        key[9] = (char)(sf >> 8 & 0xFF);
        key[10] = (char)(sf & 0xFF);
        key[11] = '\0';
        assert_int_equal(fnv1a(key, 11) & LOW_MASK, 0); /* the generator is right */
        o += (size_t)snprintf(text + o, cap - o, "%s\"%s\":0", made ? "," : "", key);
        made++;
    }
    if (extra_key)
        o += (size_t)snprintf(text + o, cap - o, ",\"%s\":1", extra_key);
    text[o++] = '}';
    text[o] = '\0';
    free(suffix);
    *len = o;
    return text;
}

static void test_colliding_keys(void **state)
{
    const size_t count = (size_t)1 << 19;
    moe_json_doc_t *doc = NULL;
    size_t len = 0;
    char *text = colliding_object(count, &len, NULL);
    char dir[300], first[16];
    moe_checkpoint_t *ck = NULL;
    moe_checkpoint_info_t info;

    /* In memory: accepted, every key found (binary search over the sorted members). */
    TU_OK(moe_json_parse(text, len, 0, "colliding", &doc));
    assert_int_equal(moe_json_root(doc)->count, count);
    memcpy(first, text + 2, 11);
    first[11] = '\0';
    assert_non_null(moe_json_get(moe_json_root(doc), first));
    assert_null(moe_json_get(moe_json_root(doc), "absent"));
    moe_json_free(doc);

    /* As config.json (8 MB, under its cap): the checkpoint opens. */
    new_dir(dir, sizeof(dir));
    put_text(dir, "config.json", text, len);
    {
        st_buf_t b = {0};
        char path[512];
        bf16_matrix(&b, "x", 1, 4, 0, -1);
        snprintf(path, sizeof(path), "%s/model.safetensors", dir);
        TU_OK(moe_st_write(path, b.e, 1, NULL, 0));
        free(b.data[0]);
    }
    TU_OK(moe_checkpoint_open(dir, &ck));
    TU_OK(moe_checkpoint_get_info(ck, &info));
    assert_int_equal(info.family, MOE_FAMILY_UNKNOWN);
    moe_checkpoint_close(ck);
    free(text);

    /* The same keys and one of them again: the duplicate is named. */
    text = colliding_object(count, &len, first);
    EXPECT(moe_json_parse(text, len, 0, "colliding", &doc), MOE_STATUS_FORMAT_ERROR,
           "duplicate key");
    assert_non_null(strstr(g_msg, first));
    assert_null(doc);
    free(text);
}

static void test_json_bounds(void **state)
{
    const size_t n = MOE_JSON_MAX_MEMBERS + 1;
    char dir[300];
    size_t cap = n * 16 + 16, o = 0;
    char *text = malloc(cap);

    assert_non_null(text);
    /* one member over the bound, as config.json: the message names the file and the limit */
    text[o++] = '{';
    for (size_t i = 0; i < n; i++)
        o += (size_t)snprintf(text + o, cap - o, "%s\"%zx\":0", i ? "," : "", i);
    text[o++] = '}';
    new_dir(dir, sizeof(dir));
    put_text(dir, "config.json", text, o);
    EXPECT_LOAD(dir, 0, MOE_STATUS_FORMAT_ERROR, "more members than the limit of 1048576");
    assert_non_null(strstr(g_msg, "config.json: line 1"));

    /* a key of 5000 bytes */
    o = (size_t)snprintf(text, cap, "{\"model_type\": \"mixtral\", \"");
    memset(text + o, 'k', 5000);
    o += 5000;
    o += (size_t)snprintf(text + o, cap - o, "\": 1}");
    new_dir(dir, sizeof(dir));
    put_text(dir, "config.json", text, o);
    EXPECT_LOAD(dir, 0, MOE_STATUS_FORMAT_ERROR, "key longer than the limit of 4096 bytes");
    assert_non_null(strstr(g_msg, "config.json"));
    free(text);
}

/* An index of `n` tensors, each in its own shard file (none of which exists). */
static void write_wide_index(const char *dir, size_t n)
{
    size_t cap = n * 64 + 64, o = 0;
    char *text = malloc(cap);
    assert_non_null(text);
    o += (size_t)snprintf(text, cap, "{\"metadata\": {}, \"weight_map\": {");
    for (size_t i = 0; i < n; i++)
        o += (size_t)snprintf(text + o, cap - o,
                              "%s\"model.layers.%zu.w\": \"model-%06zu-of-%06zu.safetensors\"",
                              i ? "," : "", i, i + 1, n);
    o += (size_t)snprintf(text + o, cap - o, "}}");
    put_text(dir, "model.safetensors.index.json", text, o);
    free(text);
}

static void test_wide_index(void **state)
{
    char dir[300];
    moe_checkpoint_t *ck = NULL;
    moe_checkpoint_info_t info;

    /* 100k shards: over the bound (a per-entry search of the shards would take a minute) */
    new_dir(dir, sizeof(dir));
    put_str(dir, "config.json", "{\"model_type\": \"mixtral\"}");
    write_wide_index(dir, 100000);
    EXPECT(moe_checkpoint_open(dir, &ck), MOE_STATUS_FORMAT_ERROR,
           "names 100000 shard files, more than the limit of 16384");
    assert_non_null(strstr(g_msg, "model.safetensors.index.json"));
    assert_null(ck);

    /* 16384 shards: at the bound, opened (shards are opened lazily) */
    new_dir(dir, sizeof(dir));
    put_str(dir, "config.json", "{\"model_type\": \"mixtral\"}");
    write_wide_index(dir, 16384);
    TU_OK(moe_checkpoint_open(dir, &ck));
    TU_OK(moe_checkpoint_get_info(ck, &info));
    assert_int_equal(info.num_files, 16384);
    assert_int_equal(info.num_tensors, 16384);
    moe_checkpoint_close(ck);
}

/* ---- weight values ------------------------------------------------------------------------------
 */

static moe_layer_t *small_layer(int skip_check)
{
    moe_layer_config_t c = MOE_LAYER_CONFIG_INIT;
    moe_layer_t *l = NULL;
    c.num_experts = E;
    c.top_k = 1;
    c.hidden = H;
    c.intermediate = I;
    c.max_tokens_per_rank = 8;
    c.skip_weight_check = skip_check;
    TU_OK(moe_layer_create(rt, &c, &l));
    return l;
}

static void test_bad_weight_values(void **state)
{
    moe_layer_t *l = small_layer(0), *quiet = small_layer(1);
    float r[E * H], s = 0.5f;
    uint16_t b[I * H];
    uint8_t q[I * H];
    moe_tensor_t t = {MOE_DTYPE_F32, E, H, r, NULL, 0, 0};

    for (int i = 0; i < E * H; i++)
        r[i] = 0.01f * (float)i;
    r[1 * H + 2] = NAN;
    EXPECT(moe_layer_set_weight(l, MOE_WEIGHT_ROUTER, -1, &t), MOE_STATUS_NUMERIC_ERROR,
           "ROUTER: element [1, 2] is NaN");
    for (int i = 0; i < E * H; i++)
        r[i] = NAN;
    EXPECT(moe_layer_set_weight(l, MOE_WEIGHT_ROUTER, -1, &t), MOE_STATUS_NUMERIC_ERROR,
           "ROUTER: element [0, 0] is NaN");
    /* skip_weight_check = 1: the same tensor is taken as given */
    TU_OK(moe_layer_set_weight(quiet, MOE_WEIGHT_ROUTER, -1, &t));

    /* BF16 -Inf and +Inf in an expert matrix */
    for (int i = 0; i < I * H; i++)
        b[i] = 0x3C00; /* 0.0078125 */
    b[3 * H + 7] = 0xFF80;
    t = (moe_tensor_t){MOE_DTYPE_BF16, I, H, b, NULL, 0, 0};
    EXPECT(moe_layer_set_weight(l, MOE_WEIGHT_UP_PROJ, 1, &t), MOE_STATUS_NUMERIC_ERROR,
           "UP_PROJ of expert 1: element [3, 7] is -Inf");
    b[3 * H + 7] = 0x3C00;
    b[0] = 0x7F80;
    EXPECT(moe_layer_set_weight(l, MOE_WEIGHT_GATE_PROJ, 0, &t), MOE_STATUS_NUMERIC_ERROR,
           "element [0, 0] is +Inf");

    /* FP8: a NaN code, then scales that are negative, zero, NaN */
    for (int i = 0; i < I * H; i++)
        q[i] = 0x30;
    q[9] = 0x7F;
    t = (moe_tensor_t){MOE_DTYPE_FP8_E4M3, I, H, q, &s, 1, 1};
    EXPECT(moe_layer_set_weight(l, MOE_WEIGHT_GATE_PROJ, 0, &t), MOE_STATUS_NUMERIC_ERROR,
           "GATE_PROJ of expert 0: element [0, 9] is NaN");
    q[9] = 0x30;
    s = -1.0f;
    EXPECT(moe_layer_set_weight(l, MOE_WEIGHT_GATE_PROJ, 0, &t), MOE_STATUS_NUMERIC_ERROR,
           "scale [0, 0] is -1 (FP8 scales must be finite and > 0)");
    s = 0.0f;
    EXPECT(moe_layer_set_weight(l, MOE_WEIGHT_GATE_PROJ, 0, &t), MOE_STATUS_NUMERIC_ERROR,
           "scale [0, 0] is 0");
    s = NAN;
    EXPECT(moe_layer_set_weight(l, MOE_WEIGHT_DOWN_PROJ, 0, &t), MOE_STATUS_NUMERIC_ERROR,
           "DOWN_PROJ of expert 0: scale [0, 0]");
    s = 0.5f;
    TU_OK(moe_layer_set_weight(l, MOE_WEIGHT_DOWN_PROJ, 0, &t));

    /* per-channel scales [rows, 1]: row 5's is negative, then all fine */
    {
        float *sc = malloc(sizeof(float) * (size_t)I);
        assert_non_null(sc);
        for (int i = 0; i < I; i++)
            sc[i] = 0.25f;
        sc[5] = -2.0f;
        t = (moe_tensor_t){MOE_DTYPE_FP8_E4M3, I, H, q, sc, I, 1};
        EXPECT(moe_layer_set_weight(l, MOE_WEIGHT_UP_PROJ, 0, &t), MOE_STATUS_NUMERIC_ERROR,
               "UP_PROJ of expert 0: scale [5, 0] is -2");
        sc[5] = 0.25f;
        TU_OK(moe_layer_set_weight(l, MOE_WEIGHT_UP_PROJ, 0, &t));
        free(sc);
    }

    moe_layer_destroy(l);
    moe_layer_destroy(quiet);
}

static void test_bad_checkpoint_values(void **state)
{
    char dir[300];
    ckpt_opts_t o;

    /* a NaN in an expert matrix: the file, the tensor and the element */
    memset(&o, 0, sizeof(o));
    o.nan_expert = 1;
    new_dir(dir, sizeof(dir));
    write_ckpt(dir, &o);
    EXPECT_LOAD(dir, 0, MOE_STATUS_NUMERIC_ERROR,
                "model.safetensors: tensor \"model.layers.0.block_sparse_moe.experts.1.w1.weight\" "
                "(GATE_PROJ of expert 1): element [2, 3] is NaN");
    EXPECT_LOAD(dir, 1, MOE_STATUS_SUCCESS, ""); /* skip_weight_check */

    /* -Inf in a down projection, sharded */
    memset(&o, 0, sizeof(o));
    o.inf_expert = 1;
    o.shards = 3;
    new_dir(dir, sizeof(dir));
    write_ckpt(dir, &o);
    EXPECT_LOAD(dir, 0, MOE_STATUS_NUMERIC_ERROR,
                "experts.0.w2.weight\" (DOWN_PROJ of expert 0): "
                "element [5, 0] is -Inf");

    /* an all-NaN router */
    memset(&o, 0, sizeof(o));
    o.nan_router = 1;
    new_dir(dir, sizeof(dir));
    write_ckpt(dir, &o);
    EXPECT_LOAD(dir, 0, MOE_STATUS_NUMERIC_ERROR, "gate.weight\" (ROUTER): element [0, 0] is NaN");

    /* FP8 checkpoint: negative, then NaN weight_scale_inv (named by its own tensor) */
    memset(&o, 0, sizeof(o));
    o.fp8_file = o.fp8_config = 1;
    new_dir(dir, sizeof(dir));
    write_ckpt(dir, &o);
    EXPECT_LOAD(dir, 0, MOE_STATUS_SUCCESS, ""); /* the good one loads */
    o.bad_scale = -0.5f;
    new_dir(dir, sizeof(dir));
    write_ckpt(dir, &o);
    EXPECT_LOAD(dir, 0, MOE_STATUS_NUMERIC_ERROR,
                "experts.0.w3.weight_scale_inv\": scale [0, 0] is -0.5");
    o.bad_scale = INFINITY;
    new_dir(dir, sizeof(dir));
    write_ckpt(dir, &o);
    EXPECT_LOAD(dir, 0, MOE_STATUS_NUMERIC_ERROR, "experts.0.w3.weight_scale_inv\": scale [0, 0]");
}

static void test_dtype_mismatch(void **state)
{
    char dir[300];
    ckpt_opts_t o;

    /* config says fp8, the file holds BF16 weights and no scales */
    memset(&o, 0, sizeof(o));
    o.fp8_config = 1;
    new_dir(dir, sizeof(dir));
    write_ckpt(dir, &o);
    EXPECT_LOAD(dir, 0, MOE_STATUS_FORMAT_ERROR,
                "experts.0.w1.weight\" has dtype BF16 but config.json's quantization_config says "
                "fp8");

    /* the reverse: FP8 weights with scales, no quantization_config */
    memset(&o, 0, sizeof(o));
    o.fp8_file = 1;
    new_dir(dir, sizeof(dir));
    write_ckpt(dir, &o);
    EXPECT_LOAD(dir, 0, MOE_STATUS_FORMAT_ERROR,
                "has dtype F8_E4M3 but config.json has no fp8 quantization_config");
}

/* ---- which files a model folder is ------------------------------------------------------------
 */

static void test_model_folder_rule(void **state)
{
    const ckpt_opts_t plain = {0}, sharded = {.shards = 2};
    char dir[300];
    moe_checkpoint_t *ck = NULL;
    moe_checkpoint_info_t info;

    /* model.safetensors plus an input file and junk *.safetensors: only the model is read */
    new_dir(dir, sizeof(dir));
    write_ckpt(dir, &plain);
    put_str(dir, "input.safetensors", "not a safetensors file");
    put_str(dir, "zz-extra.safetensors", "");
    make_fifo(dir, "pipe.safetensors");
    TU_OK(moe_checkpoint_open(dir, &ck));
    TU_OK(moe_checkpoint_get_info(ck, &info));
    assert_int_equal(info.num_files, 1);
    assert_int_equal(info.num_tensors, 1 + 3 * E);
    moe_checkpoint_close(ck);
    EXPECT_LOAD(dir, 0, MOE_STATUS_SUCCESS, "");

    /* consolidated.safetensors (and a stray model.safetensors) beside the sharded files and
     * the index: only the shards the index names are read */
    new_dir(dir, sizeof(dir));
    write_ckpt(dir, &sharded);
    put_str(dir, "consolidated.safetensors", "garbage");
    put_str(dir, "model.safetensors", "garbage");
    TU_OK(moe_checkpoint_open(dir, &ck));
    TU_OK(moe_checkpoint_get_info(ck, &info));
    assert_int_equal(info.num_files, 2);
    moe_checkpoint_close(ck);
    EXPECT_LOAD(dir, 0, MOE_STATUS_SUCCESS, "");

    /* shards without the index and without model.safetensors: not a model folder */
    new_dir(dir, sizeof(dir));
    write_ckpt(dir, &sharded);
    {
        char path[512];
        snprintf(path, sizeof(path), "%s/model.safetensors.index.json", dir);
        assert_int_equal(unlink(path), 0);
    }
    put_str(dir, "consolidated.safetensors", "garbage");
    EXPECT_LOAD(dir, 0, MOE_STATUS_IO_ERROR,
                "no model.safetensors.index.json or model.safetensors");
}

/* ---- output paths ---------------------------------------------------------------------------- */

static moe_status_t write_one(const char *path)
{
    static float v[4] = {1, 2, 3, 4};
    const char *name = "y";
    moe_tensor_t t = {MOE_DTYPE_F32, 2, 2, v, NULL, 0, 0};
    moe_status_t st = moe_safetensors_write(path, 1, &name, &t);
    snprintf(g_msg, sizeof(g_msg), "%s", moe_last_error());
    return st;
}

static void read_text(const char *path, char *out, size_t n)
{
    FILE *fp = fopen(path, "rb");
    size_t got;
    assert_non_null(fp);
    got = fread(out, 1, n - 1, fp);
    out[got] = '\0';
    fclose(fp);
}

/* Nothing named <out>.tmp.* is left in `dir` except `keep`. */
static int temp_files_left(const char *dir, const char *keep)
{
    char cmd[700];
    snprintf(cmd, sizeof(cmd), "ls '%s' | grep '\\.tmp\\.' | grep -v '^%s$' | grep -q .", dir,
             keep ? keep : "^$");
    return system(cmd) == 0;
}

static void test_output_paths(void **state)
{
    char dir[300], out[512], victim[512], link[600], got[64];
    struct stat sb;

    new_dir(dir, sizeof(dir));
    snprintf(victim, sizeof(victim), "%s/victim.txt", dir);
    put_str(dir, "victim.txt", "precious");

    /* the output path is a symbolic link: refused, its target untouched */
    snprintf(out, sizeof(out), "%s/out-link.safetensors", dir);
    assert_int_equal(symlink(victim, out), 0);
    EXPECT(write_one(out), MOE_STATUS_IO_ERROR, "is a symbolic link; refusing to replace it");
    read_text(victim, got, sizeof(got));
    assert_string_equal(got, "precious");
    assert_int_equal(lstat(out, &sb), 0);
    assert_true(S_ISLNK(sb.st_mode));

    /* a folder, a FIFO: refused and left as they are */
    snprintf(out, sizeof(out), "%s/out-dir.safetensors", dir);
    assert_int_equal(mkdir(out, 0700), 0);
    EXPECT(write_one(out), MOE_STATUS_IO_ERROR, "the output path is a directory; refusing");
    snprintf(out, sizeof(out), "%s/out-fifo.safetensors", dir);
    assert_int_equal(mkfifo(out, 0600), 0);
    EXPECT(write_one(out), MOE_STATUS_IO_ERROR, "the output path is a FIFO (named pipe)");
    assert_int_equal(lstat(out, &sb), 0);
    assert_true(S_ISFIFO(sb.st_mode));

    /* a character device: our own node where we may make one (root), else /dev/null, which
     * the check refuses before anything is created */
    snprintf(out, sizeof(out), "%s/out-null", dir);
    if (mknod(out, S_IFCHR | 0600, makedev(1, 3)) != 0)
        snprintf(out, sizeof(out), "/dev/null");
    EXPECT(write_one(out), MOE_STATUS_IO_ERROR, "the output path is a character device");
    assert_int_equal(lstat(out, &sb), 0);
    assert_true(S_ISCHR(sb.st_mode));

    /* a symbolic link planted where the temporary file would be: neither followed nor
     * removed; the write goes through another name and lands at the output path */
    snprintf(out, sizeof(out), "%s/out.safetensors", dir);
    snprintf(link, sizeof(link), "%s.tmp.%ld", out, (long)getpid());
    assert_int_equal(symlink(victim, link), 0);
    TU_OK(write_one(out));
    read_text(victim, got, sizeof(got));
    assert_string_equal(got, "precious");
    assert_int_equal(lstat(link, &sb), 0);
    assert_true(S_ISLNK(sb.st_mode));
    assert_int_equal(lstat(out, &sb), 0);
    assert_true(S_ISREG(sb.st_mode));
    {
        moe_dtype_t dt;
        int64_t r, c;
        TU_OK(moe_safetensors_tensor_info(out, "y", &dt, &r, &c));
        assert_int_equal(r, 2);
    }
    /* a regular file is replaced; no temporary file is left but the planted link */
    TU_OK(write_one(out));
    {
        char keep[128];
        snprintf(keep, sizeof(keep), "out.safetensors.tmp.%ld", (long)getpid());
        assert_false(temp_files_left(dir, keep));
    }

    /* a folder that does not exist: the error names the temporary path, nothing is left */
    snprintf(out, sizeof(out), "%s/missing/out.safetensors", dir);
    EXPECT(write_one(out), MOE_STATUS_IO_ERROR, "cannot create");
}

/* ---- setup ----------------------------------------------------------------------------------- */

static int setup(void **state)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(g_root, sizeof(g_root), "%s/moe_bad_XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(g_root))
        return -1;
    rt = tu_runtime_cpu();
    return rt ? 0 : -1;
}

static int teardown(void **state)
{
    char cmd[300];
    moe_runtime_destroy(rt);
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", g_root); /* our own mkdtemp folder only */
    return system(cmd) == 0 ? 0 : -1;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fifo_files),
        cmocka_unit_test(test_folders_devices_sockets),
        cmocka_unit_test(test_colliding_keys),
        cmocka_unit_test(test_json_bounds),
        cmocka_unit_test(test_wide_index),
        cmocka_unit_test(test_bad_weight_values),
        cmocka_unit_test(test_bad_checkpoint_values),
        cmocka_unit_test(test_dtype_mismatch),
        cmocka_unit_test(test_model_folder_rule),
        cmocka_unit_test(test_output_paths),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
