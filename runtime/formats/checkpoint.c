/* SPDX-License-Identifier: Apache-2.0 */
/* Checkpoints: config.json to a layer config, sharded safetensors through the index, and
 * loading one rank's shard of a layer through the public weight API. */
#define _POSIX_C_SOURCE 200809L
#include "moe/moe_checkpoint.h"

#include <errno.h>
#include <float.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/numeric.h"
#include "base/diag.h"
#include "base/json.h"
#include "runtime/formats/checkpoint.h"
#include "runtime/formats/safetensors.h"
#include "runtime/weights.h"

/* config.json and the index are small; anything larger is not one. */
#define MAX_CONFIG_BYTES (16u << 20)
#define MAX_INDEX_BYTES (256u << 20)
/* Shard files one index may name (published checkpoints have at most a few hundred; each
 * opened shard holds a file descriptor). */
#define MAX_SHARDS 16384
#define FP8_BLOCK 128

typedef struct ckpt_file {
    char *name; /* file name inside dir */
    moe_st_file_t *st;
} ckpt_file_t;

typedef struct ckpt_name {
    const char *name;
    int file;
} ckpt_name_t;

struct moe_checkpoint {
    char *dir;
    moe_json_doc_t *config_doc; /* NULL without config.json */
    const moe_json_t *config;
    moe_json_doc_t *index_doc;
    ckpt_file_t *files;
    int num_files;
    ckpt_name_t *names; /* sorted by name */
    size_t num_names;
    moe_model_family_t family;
};

/* ------------------------------------------------------------------------------------------ */
/* Opening                                                                                     */
/* ------------------------------------------------------------------------------------------ */

static char *join(const char *dir, const char *name)
{
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p)
        snprintf(p, n, "%s/%s", dir, name);
    return p;
}

/* JSON text whose top level must be an object; `what` names it in messages. */
static moe_status_t parse_json_object(const char *text, size_t len, const char *what,
                                      moe_json_doc_t **doc)
{
    moe_status_t st = moe_json_parse(text, len, 0, what, doc);
    if (st == MOE_STATUS_SUCCESS && moe_json_root(*doc)->type != MOE_JSON_OBJECT) {
        st = moe_error(MOE_STATUS_FORMAT_ERROR, "%s: top level is a %s, expected an object", what,
                       moe_json_type_name(moe_json_root(*doc)->type));
        moe_json_free(*doc);
        *doc = NULL;
    }
    return st;
}

static moe_status_t parse_json_file(const char *path, size_t cap, moe_json_doc_t **doc,
                                    int *missing)
{
    char *text = NULL;
    size_t len = 0;
    moe_status_t st;

    *doc = NULL;
    MOE_CHECK(moe_read_regular(path, cap, &text, &len, missing));
    if (*missing)
        return MOE_STATUS_SUCCESS;
    st = parse_json_object(text, len, path, doc);
    free(text);
    return st;
}

static int cmp_names(const void *a, const void *b)
{
    return strcmp(((const ckpt_name_t *)a)->name, ((const ckpt_name_t *)b)->name);
}

/* A shard file name from the index must be a plain name inside the checkpoint folder. */
static int safe_file_name(const char *s)
{
    return s[0] && strlen(s) < 256 && !strchr(s, '/') && strcmp(s, ".") && strcmp(s, "..");
}

/* The one file a caller named. */
static moe_status_t add_single_file(moe_checkpoint_t *c, const char *name)
{
    c->files = calloc(1, sizeof(*c->files));
    if (!c->files || !(c->files[0].name = strdup(name)))
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "checkpoint: out of memory");
    c->num_files = 1;
    return MOE_STATUS_SUCCESS;
}

/* A weight_map entry: its shard file name and its position in c->names. */
typedef struct shard_ref {
    const char *file;
    size_t entry;
} shard_ref_t;

static int cmp_shard_refs(const void *a, const void *b)
{
    return strcmp(((const shard_ref_t *)a)->file, ((const shard_ref_t *)b)->file);
}

/* Shard files get their ids from the sorted shard names (O(n log n), unlike a search of the
 * files so far per entry); the names are sorted for find_tensor's bsearch. *missing = 1 when
 * there is no index. */
static moe_status_t map_index(moe_checkpoint_t *c, const char *path);

static moe_status_t load_index(moe_checkpoint_t *c, const char *path, int *missing)
{

    MOE_CHECK(parse_json_file(path, MAX_INDEX_BYTES, &c->index_doc, missing));
    if (*missing)
        return MOE_STATUS_SUCCESS;
    return map_index(c, path);
}

/* c->names and c->files from the parsed index's weight_map. */
static moe_status_t map_index(moe_checkpoint_t *c, const char *path)
{
    const moe_json_t *wm;
    shard_ref_t *refs = NULL;
    size_t n = 0, nf = 0;
    moe_status_t st = MOE_STATUS_SUCCESS;

    wm = moe_json_get(moe_json_root(c->index_doc), "weight_map");
    if (!wm || wm->type != MOE_JSON_OBJECT)
        return moe_error(MOE_STATUS_FORMAT_ERROR, "%s: no \"weight_map\" object", path);
    c->names = calloc(wm->count ? wm->count : 1, sizeof(*c->names));
    refs = calloc(wm->count ? wm->count : 1, sizeof(*refs));
    if (!c->names || !refs) {
        st = moe_error(MOE_STATUS_OUT_OF_MEMORY, "%s: out of memory", path);
        goto out;
    }
    for (const moe_json_t *m = wm->child; m; m = m->next) {
        if (m->type != MOE_JSON_STRING || !safe_file_name(m->string)) {
            st = moe_error(MOE_STATUS_FORMAT_ERROR,
                           "%s: weight_map[\"%.200s\"] is not a plain file name in the "
                           "checkpoint folder",
                           path, m->key);
            goto out;
        }
        c->names[n].name = m->key;
        refs[n].file = m->string;
        refs[n].entry = n;
        n++;
    }
    qsort(refs, n, sizeof(*refs), cmp_shard_refs);
    for (size_t i = 0; i < n; i++)
        nf += i == 0 || strcmp(refs[i].file, refs[i - 1].file) != 0;
    if (nf > MAX_SHARDS) {
        st = moe_error(MOE_STATUS_FORMAT_ERROR,
                       "%s: the weight_map names %zu shard files, more than the limit of %d", path,
                       nf, MAX_SHARDS);
        goto out;
    }
    c->files = calloc(nf ? nf : 1, sizeof(*c->files));
    if (!c->files) {
        st = moe_error(MOE_STATUS_OUT_OF_MEMORY, "%s: out of memory", path);
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        if (i == 0 || strcmp(refs[i].file, refs[i - 1].file) != 0) {
            c->files[c->num_files].name = strdup(refs[i].file);
            if (!c->files[c->num_files].name) {
                st = moe_error(MOE_STATUS_OUT_OF_MEMORY, "%s: out of memory", path);
                goto out;
            }
            c->num_files++;
        }
        c->names[refs[i].entry].file = c->num_files - 1;
    }
    c->num_names = n;
    qsort(c->names, n, sizeof(*c->names), cmp_names);
out:
    free(refs);
    return st;
}

/* Unsharded: open the given files now and map every tensor of their headers. */
static moe_status_t map_open_files(moe_checkpoint_t *c)
{
    size_t total = 0, n = 0;

    for (int i = 0; i < c->num_files; i++) {
        char *p = join(c->dir, c->files[i].name);
        moe_status_t st;
        if (!p)
            return moe_error(MOE_STATUS_OUT_OF_MEMORY, "checkpoint: out of memory");
        st = moe_st_open(p, &c->files[i].st);
        free(p);
        MOE_CHECK(st);
        total += moe_st_file_header(c->files[i].st)->num_tensors;
    }
    c->names = calloc(total ? total : 1, sizeof(*c->names));
    if (!c->names)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "checkpoint: out of memory");
    for (int i = 0; i < c->num_files; i++) {
        const moe_st_header_t *h = moe_st_file_header(c->files[i].st);
        for (size_t j = 0; j < h->num_tensors; j++) {
            c->names[n].name = h->tensors[j].name;
            c->names[n].file = i;
            n++;
        }
    }
    c->num_names = n;
    qsort(c->names, n, sizeof(*c->names), cmp_names);
    for (size_t i = 1; i < n; i++)
        if (!strcmp(c->names[i].name, c->names[i - 1].name))
            return moe_error(MOE_STATUS_FORMAT_ERROR, "%s: tensor \"%.200s\" is in both %s and %s",
                             c->dir, c->names[i].name, c->files[c->names[i - 1].file].name,
                             c->files[c->names[i].file].name);
    return MOE_STATUS_SUCCESS;
}

static moe_model_family_t family_of(const char *model_type)
{
    if (!strcmp(model_type, "mixtral"))
        return MOE_FAMILY_MIXTRAL;
    if (!strcmp(model_type, "qwen2_moe"))
        return MOE_FAMILY_QWEN2_MOE;
    if (!strcmp(model_type, "qwen3_moe"))
        return MOE_FAMILY_QWEN3_MOE;
    if (!strcmp(model_type, "deepseek_v3"))
        return MOE_FAMILY_DEEPSEEK_V3;
    return MOE_FAMILY_UNKNOWN;
}

/* c->config and c->family from the parsed config.json (none: family unknown). */
static moe_status_t set_config(moe_checkpoint_t *c)
{
    const char *mt = NULL;
    int r;

    c->config = moe_json_root(c->config_doc);
    if (!c->config)
        return MOE_STATUS_SUCCESS;
    r = moe_json_member_string(c->config, "model_type", &mt);
    if (r < 0)
        return moe_error(MOE_STATUS_FORMAT_ERROR, "%s/config.json: \"model_type\" is not a string",
                         c->dir);
    c->family = r > 0 ? family_of(mt) : MOE_FAMILY_UNKNOWN;
    return MOE_STATUS_SUCCESS;
}

static moe_status_t open_impl(moe_checkpoint_t *c, const char *path)
{
    struct stat sb;
    char *p;
    int missing = 0;

    if (stat(path, &sb) != 0)
        return moe_error(MOE_STATUS_IO_ERROR, "%s: %s", path, strerror(errno));
    if (S_ISDIR(sb.st_mode)) {
        c->dir = strdup(path);
        if (!c->dir)
            return moe_error(MOE_STATUS_OUT_OF_MEMORY, "checkpoint: out of memory");
    } else {
        const char *slash = strrchr(path, '/');
        c->dir = slash ? strndup(path, (size_t)(slash - path) + (slash == path)) : strdup(".");
        if (!c->dir)
            return moe_error(MOE_STATUS_OUT_OF_MEMORY, "checkpoint: out of memory");
        MOE_CHECK(add_single_file(c, slash ? slash + 1 : path));
    }

    p = join(c->dir, "config.json");
    if (!p)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "checkpoint: out of memory");
    {
        moe_status_t st = parse_json_file(p, MAX_CONFIG_BYTES, &c->config_doc, &missing);
        free(p);
        MOE_CHECK(st);
    }
    MOE_CHECK(set_config(c));

    if (c->num_files) /* one file named by the caller */
        return map_open_files(c);
    /* transformers' rule: the index when there is one (only the shards it names), else
     * model.safetensors; other files in the folder (inputs, consolidated.safetensors) are not
     * part of the model. */
    p = join(c->dir, "model.safetensors.index.json");
    if (!p)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "checkpoint: out of memory");
    {
        moe_status_t st = load_index(c, p, &missing);
        free(p);
        if (st != MOE_STATUS_SUCCESS || !missing)
            return st;
    }
    p = join(c->dir, "model.safetensors");
    if (!p)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "checkpoint: out of memory");
    if (access(p, F_OK) != 0 && errno == ENOENT) {
        free(p);
        return moe_error(MOE_STATUS_IO_ERROR,
                         "%s: no model.safetensors.index.json or model.safetensors", c->dir);
    }
    free(p);
    MOE_CHECK(add_single_file(c, "model.safetensors"));
    return map_open_files(c);
}

moe_status_t moe_checkpoint_open(const char *path, moe_checkpoint_t **ckpt)
{
    moe_checkpoint_t *c;
    moe_status_t st;

    moe_error_clear();
    MOE_ARG_CHECK(path != NULL && ckpt != NULL, "checkpoint_open: path and ckpt must not be NULL");
    *ckpt = NULL;
    c = calloc(1, sizeof(*c));
    if (!c)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "checkpoint: out of memory");
    st = open_impl(c, path);
    if (st != MOE_STATUS_SUCCESS) {
        moe_checkpoint_close(c);
        return st;
    }
    *ckpt = c;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_checkpoint_close(moe_checkpoint_t *c)
{
    if (!c)
        return MOE_STATUS_SUCCESS;
    for (int i = 0; i < c->num_files; i++) {
        moe_st_close(c->files[i].st);
        free(c->files[i].name);
    }
    free(c->files);
    free(c->names);
    moe_json_free(c->index_doc);
    moe_json_free(c->config_doc);
    free(c->dir);
    free(c);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_checkpoint_get_info(const moe_checkpoint_t *c, moe_checkpoint_info_t *info)
{
    const char *mt = "";
    int64_t nl = 0;

    moe_error_clear();
    MOE_ARG_CHECK(c != NULL && info != NULL, "checkpoint_get_info: NULL argument");
    memset(info, 0, sizeof(*info));
    info->family = c->family;
    if (moe_json_member_string(c->config, "model_type", &mt) <= 0)
        mt = "";
    snprintf(info->model_type, sizeof(info->model_type), "%s", mt);
    if (moe_json_member_int(c->config, "num_hidden_layers", &nl) > 0 && nl > 0 && nl < INT_MAX)
        info->num_layers = (int)nl;
    info->num_files = c->num_files;
    info->num_tensors = (int64_t)c->num_names;
    return MOE_STATUS_SUCCESS;
}

/* Whether the checkpoint names tensor `name` (no error set). */
static int has_tensor(const moe_checkpoint_t *c, const char *name)
{
    ckpt_name_t key = {name, 0};
    return c->num_names && bsearch(&key, c->names, c->num_names, sizeof(key), cmp_names) != NULL;
}

/* The file and header entry of tensor `name`; FORMAT_ERROR naming it when absent. */
static moe_status_t find_tensor(moe_checkpoint_t *c, const char *name, moe_st_file_t **file,
                                const moe_st_tensor_t **t)
{
    ckpt_name_t key = {name, 0}, *hit;
    ckpt_file_t *f;

    hit = c->num_names ? bsearch(&key, c->names, c->num_names, sizeof(key), cmp_names) : NULL;
    if (!hit)
        return moe_error(MOE_STATUS_FORMAT_ERROR, "%s: tensor \"%s\" not found in the checkpoint",
                         c->dir, name);
    f = &c->files[hit->file];
    if (!f->st) {
        char *p = join(c->dir, f->name);
        moe_status_t st;
        if (!p)
            return moe_error(MOE_STATUS_OUT_OF_MEMORY, "checkpoint: out of memory");
        st = moe_st_open(p, &f->st);
        free(p);
        MOE_CHECK(st);
    }
    *t = moe_st_find(f->st, name);
    if (!*t)
        return moe_error(MOE_STATUS_FORMAT_ERROR,
                         "%s: the index maps tensor \"%s\" to %s, which has no such tensor", c->dir,
                         name, f->name);
    *file = f->st;
    return MOE_STATUS_SUCCESS;
}

/* ------------------------------------------------------------------------------------------ */
/* config.json                                                                                 */
/* ------------------------------------------------------------------------------------------ */

typedef struct cfg_reader {
    const moe_json_t *obj;
    const char *dir;
    const char *model_type;
} cfg_reader_t;

/* An integer in [lo, hi]; `dflt` when absent and not required. */
static moe_status_t cfg_int(const cfg_reader_t *r, const char *key, int required, int64_t dflt,
                            int64_t lo, int64_t hi, int64_t *out)
{
    int k = moe_json_member_int(r->obj, key, out);
    if (k < 0)
        return moe_error(MOE_STATUS_FORMAT_ERROR, "%s/config.json: \"%s\" is not an integer",
                         r->dir, key);
    if (k == 0) {
        if (required)
            return moe_error(MOE_STATUS_FORMAT_ERROR,
                             "%s/config.json: \"%s\" is missing (needed for model_type %s)", r->dir,
                             key, r->model_type);
        *out = dflt;
        return MOE_STATUS_SUCCESS;
    }
    if (*out < lo || *out > hi)
        return moe_error(MOE_STATUS_FORMAT_ERROR,
                         "%s/config.json: \"%s\" = %lld is outside [%lld, %lld]", r->dir, key,
                         (long long)*out, (long long)lo, (long long)hi);
    return MOE_STATUS_SUCCESS;
}

static moe_status_t cfg_bool(const cfg_reader_t *r, const char *key, int dflt, int *out)
{
    int k = moe_json_member_bool(r->obj, key, out);
    if (k < 0)
        return moe_error(MOE_STATUS_FORMAT_ERROR, "%s/config.json: \"%s\" is not true or false",
                         r->dir, key);
    if (k == 0)
        *out = dflt;
    return MOE_STATUS_SUCCESS;
}

static moe_status_t cfg_str(const cfg_reader_t *r, const char *key, const char *dflt,
                            const char **out)
{
    int k = moe_json_member_string(r->obj, key, out);
    if (k < 0)
        return moe_error(MOE_STATUS_FORMAT_ERROR, "%s/config.json: \"%s\" is not a string", r->dir,
                         key);
    if (k == 0)
        *out = dflt;
    return MOE_STATUS_SUCCESS;
}

/* Whether decoder layer L is MoE; `why` gets the config key that makes it dense. */
static moe_status_t layer_is_moe(const cfg_reader_t *r, moe_model_family_t fam, int64_t L,
                                 int *is_moe, char *why, size_t why_len)
{
    int64_t k, freq;
    const moe_json_t *mlp_only;

    *is_moe = 1;
    switch (fam) {
    case MOE_FAMILY_DEEPSEEK_V3:
        /* modeling_deepseek: MoE iff n_routed_experts and L >= first_k_dense_replace and
         * L % moe_layer_freq == 0. */
        MOE_CHECK(cfg_int(r, "first_k_dense_replace", 0, 0, 0, INT_MAX, &k));
        MOE_CHECK(cfg_int(r, "moe_layer_freq", 0, 1, 1, INT_MAX, &freq));
        if (L < k) {
            *is_moe = 0;
            snprintf(why, why_len, "first_k_dense_replace = %lld", (long long)k);
        } else if (L % freq) {
            *is_moe = 0;
            snprintf(why, why_len, "moe_layer_freq = %lld", (long long)freq);
        }
        return MOE_STATUS_SUCCESS;
    case MOE_FAMILY_QWEN2_MOE:
    case MOE_FAMILY_QWEN3_MOE:
        /* Qwen: dense iff L in mlp_only_layers or (L + 1) % decoder_sparse_step != 0. */
        MOE_CHECK(cfg_int(r, "decoder_sparse_step", 0, 1, 1, INT_MAX, &freq));
        mlp_only = moe_json_get(r->obj, "mlp_only_layers");
        if (mlp_only && mlp_only->type != MOE_JSON_ARRAY && mlp_only->type != MOE_JSON_NULL)
            return moe_error(MOE_STATUS_FORMAT_ERROR,
                             "%s/config.json: \"mlp_only_layers\" is not an array", r->dir);
        for (const moe_json_t *e = mlp_only ? mlp_only->child : NULL; e; e = e->next) {
            if (e->type != MOE_JSON_NUMBER || !e->is_int)
                return moe_error(MOE_STATUS_FORMAT_ERROR,
                                 "%s/config.json: \"mlp_only_layers\" holds a non-integer", r->dir);
            if (e->integer == L) {
                *is_moe = 0;
                snprintf(why, why_len, "it is listed in mlp_only_layers");
                return MOE_STATUS_SUCCESS;
            }
        }
        if ((L + 1) % freq) {
            *is_moe = 0;
            snprintf(why, why_len, "decoder_sparse_step = %lld", (long long)freq);
        }
        return MOE_STATUS_SUCCESS;
    default:
        return MOE_STATUS_SUCCESS; /* Mixtral: every layer */
    }
}

static moe_status_t config_reader(const moe_checkpoint_t *c, cfg_reader_t *r)
{
    if (!c->config)
        return moe_error(MOE_STATUS_FORMAT_ERROR,
                         "%s: no config.json (needed for the layer configuration)", c->dir);
    r->obj = c->config;
    r->dir = c->dir;
    MOE_CHECK(cfg_str(r, "model_type", "", &r->model_type));
    if (!*r->model_type) /* a malformed config, not an unsupported model */
        return moe_error(MOE_STATUS_FORMAT_ERROR,
                         "%s/config.json: no \"model_type\" (it names the model family: mixtral, "
                         "qwen2_moe, qwen3_moe, deepseek_v3)",
                         c->dir);
    if (c->family == MOE_FAMILY_UNKNOWN)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "%s/config.json: model_type \"%.40s\" is not supported (mixtral, "
                         "qwen2_moe, qwen3_moe, deepseek_v3)",
                         c->dir, r->model_type);
    return MOE_STATUS_SUCCESS;
}

static moe_status_t check_layer_index(const moe_checkpoint_t *c, const cfg_reader_t *r,
                                      int layer_index, int *is_moe, char *why, size_t why_len)
{
    int64_t nl;
    MOE_CHECK(cfg_int(r, "num_hidden_layers", 1, 0, 1, INT_MAX, &nl));
    MOE_ARG_CHECK(layer_index >= 0 && layer_index < nl,
                  "layer_index = %d: the checkpoint has layers 0..%lld", layer_index,
                  (long long)nl - 1);
    return layer_is_moe(r, c->family, layer_index, is_moe, why, why_len);
}

moe_status_t moe_checkpoint_layer_is_moe(const moe_checkpoint_t *c, int layer_index, int *is_moe)
{
    cfg_reader_t r;
    char why[96];

    moe_error_clear();
    MOE_ARG_CHECK(c != NULL && is_moe != NULL, "checkpoint_layer_is_moe: NULL argument");
    MOE_CHECK(config_reader(c, &r));
    return check_layer_index(c, &r, layer_index, is_moe, why, sizeof(why));
}

static moe_status_t config_dtype(const cfg_reader_t *r, moe_layer_config_t *cfg)
{
    const moe_json_t *q = moe_json_get(r->obj, "quantization_config");
    const char *td = NULL;

    if (q && q->type != MOE_JSON_NULL) {
        cfg_reader_t qr = {q, r->dir, r->model_type};
        const char *method = NULL, *act = NULL;
        const moe_json_t *bs = moe_json_get(q, "weight_block_size");
        if (q->type != MOE_JSON_OBJECT)
            return moe_error(MOE_STATUS_FORMAT_ERROR,
                             "%s/config.json: \"quantization_config\" is not an object", r->dir);
        MOE_CHECK(cfg_str(&qr, "quant_method", "", &method));
        MOE_CHECK(cfg_str(&qr, "activation_scheme", "dynamic", &act));
        if (strcmp(method, "fp8"))
            return moe_error(MOE_STATUS_NOT_SUPPORTED,
                             "%s/config.json: quantization_config.quant_method \"%.40s\" is not "
                             "supported (only \"fp8\": 128x128 blocks or one scale per matrix)",
                             r->dir, method);
        /* "static" (AutoFP8 and common exporters) adds an input_scale per matrix: read and
         * checked; W8A8 layers use it (W8A16 ones do not quantise activations; SEMANTICS.md). */
        if (strcmp(act, "dynamic") && strcmp(act, "static"))
            return moe_error(MOE_STATUS_NOT_SUPPORTED,
                             "%s/config.json: activation_scheme \"%.40s\" is not supported "
                             "(\"dynamic\" or \"static\")",
                             r->dir, act);
        if (!bs || bs->type == MOE_JSON_NULL) { /* one scale per matrix: weight_scale */
            cfg->weight_dtype = MOE_DTYPE_FP8_E4M3;
            cfg->scale_kind = MOE_SCALE_PER_TENSOR;
            return MOE_STATUS_SUCCESS;
        }
        if (bs->type != MOE_JSON_ARRAY || bs->count != 2 ||
            moe_json_at(bs, 0)->type != MOE_JSON_NUMBER ||
            moe_json_at(bs, 1)->type != MOE_JSON_NUMBER ||
            moe_json_at(bs, 0)->number != FP8_BLOCK || moe_json_at(bs, 1)->number != FP8_BLOCK)
            return moe_error(MOE_STATUS_NOT_SUPPORTED,
                             "%s/config.json: quantization_config.weight_block_size must be "
                             "[128, 128] (or absent: one scale per matrix)",
                             r->dir);
        cfg->weight_dtype = MOE_DTYPE_FP8_E4M3;
        cfg->scale_kind = MOE_SCALE_BLOCK_128;
        return MOE_STATUS_SUCCESS;
    }
    /* transformers 5 writes "dtype", earlier versions "torch_dtype". */
    MOE_CHECK(cfg_str(r, "dtype", NULL, &td));
    if (!td)
        MOE_CHECK(cfg_str(r, "torch_dtype", "bfloat16", &td));
    cfg->scale_kind = MOE_SCALE_NONE;
    if (!strcmp(td, "bfloat16"))
        cfg->weight_dtype = MOE_DTYPE_BF16;
    else if (!strcmp(td, "float32") || !strcmp(td, "float16"))
        cfg->weight_dtype = MOE_DTYPE_F32; /* f16 has no storage dtype of its own: keep f32 */
    else
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "%s/config.json: dtype \"%.40s\" is not supported (bfloat16, float16, "
                         "float32, or an fp8 quantization_config)",
                         r->dir, td);
    return MOE_STATUS_SUCCESS;
}

static moe_status_t config_activation(const cfg_reader_t *r, moe_layer_config_t *cfg)
{
    const char *act = NULL;
    MOE_CHECK(cfg_str(r, "hidden_act", "silu", &act));
    if (!strcmp(act, "silu") || !strcmp(act, "swish"))
        cfg->activation = MOE_ACTIVATION_SILU;
    else if (!strcmp(act, "gelu_pytorch_tanh") || !strcmp(act, "gelu_new"))
        cfg->activation = MOE_ACTIVATION_GELU;
    else
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "%s/config.json: hidden_act \"%.40s\" is not supported (silu, "
                         "gelu_pytorch_tanh)",
                         r->dir, act);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_checkpoint_layer_config(const moe_checkpoint_t *c, int layer_index,
                                         moe_layer_config_t *cfg)
{
    cfg_reader_t r;
    char why[96] = "";
    int is_moe = 0, b = 0;
    int64_t E, k, H, I, v;
    double d;

    moe_error_clear();
    MOE_ARG_CHECK(c != NULL && cfg != NULL, "checkpoint_layer_config: NULL argument");
    MOE_CHECK(config_reader(c, &r));
    MOE_CHECK(check_layer_index(c, &r, layer_index, &is_moe, why, sizeof(why)));
    if (!is_moe)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT,
                         "layer_index = %d: layer %d of this %s checkpoint is dense, not MoE "
                         "(%s)",
                         layer_index, layer_index, r.model_type, why);

    MOE_CHECK(cfg_int(&r, "hidden_size", 1, 0, 1, INT_MAX, &H));
    MOE_CHECK(cfg_int(&r, "num_experts_per_tok", 1, 0, 1, INT_MAX, &k));
    switch (c->family) {
    case MOE_FAMILY_MIXTRAL:
        MOE_CHECK(cfg_int(&r, "num_local_experts", 1, 0, 1, INT_MAX, &E));
        MOE_CHECK(cfg_int(&r, "intermediate_size", 1, 0, 1, INT_MAX, &I));
        break;
    case MOE_FAMILY_QWEN2_MOE:
    case MOE_FAMILY_QWEN3_MOE:
        /* transformers 5 may write num_local_experts instead of num_experts. */
        if (moe_json_get(r.obj, "num_experts"))
            MOE_CHECK(cfg_int(&r, "num_experts", 1, 0, 1, INT_MAX, &E));
        else
            MOE_CHECK(cfg_int(&r, "num_local_experts", 1, 0, 1, INT_MAX, &E));
        MOE_CHECK(cfg_int(&r, "moe_intermediate_size", 1, 0, 1, INT_MAX, &I));
        break;
    default: /* DeepSeek-V3 */
        MOE_CHECK(cfg_int(&r, "n_routed_experts", 1, 0, 1, INT_MAX, &E));
        MOE_CHECK(cfg_int(&r, "moe_intermediate_size", 1, 0, 1, INT_MAX, &I));
        break;
    }
    if (k > E)
        return moe_error(MOE_STATUS_FORMAT_ERROR,
                         "%s/config.json: num_experts_per_tok = %lld exceeds the %lld experts",
                         c->dir, (long long)k, (long long)E);
    cfg->num_experts = (int)E;
    cfg->top_k = (int)k;
    cfg->hidden = (int)H;
    cfg->intermediate = (int)I;
    cfg->num_shared_experts = 0;
    cfg->shared_intermediate = 0;
    cfg->shared_expert_gate = 0;
    cfg->scoring = MOE_SCORING_SOFTMAX;
    cfg->use_score_bias = 0;
    cfg->n_group = 0;
    cfg->topk_group = 0;
    cfg->routed_scaling_factor = 1.0f;
    MOE_CHECK(config_activation(&r, cfg));
    MOE_CHECK(config_dtype(&r, cfg));

    switch (c->family) {
    case MOE_FAMILY_MIXTRAL:
        cfg->renormalize = 1; /* Mixtral always renormalises the top-k */
        break;
    case MOE_FAMILY_QWEN2_MOE:
        MOE_CHECK(cfg_int(&r, "shared_expert_intermediate_size", 0, 0, 0, INT_MAX, &v));
        if (v > 0) {
            cfg->num_shared_experts = 1;
            cfg->shared_intermediate = (int)v;
            cfg->shared_expert_gate = 1;
        }
        /* fall through */
    case MOE_FAMILY_QWEN3_MOE:
        MOE_CHECK(cfg_bool(&r, "norm_topk_prob", 0, &b));
        cfg->renormalize = b;
        break;
    default: { /* DeepSeek-V3 */
        const char *scoring = NULL, *method = NULL;
        int64_t ng, tg, ns;
        MOE_CHECK(cfg_str(&r, "scoring_func", "sigmoid", &scoring));
        MOE_CHECK(cfg_str(&r, "topk_method", "noaux_tc", &method));
        if (!strcmp(scoring, "sigmoid"))
            cfg->scoring = MOE_SCORING_SIGMOID;
        else if (!strcmp(scoring, "softmax"))
            cfg->scoring = MOE_SCORING_SOFTMAX;
        else
            return moe_error(MOE_STATUS_NOT_SUPPORTED,
                             "%s/config.json: scoring_func \"%.40s\" is not supported", c->dir,
                             scoring);
        if (!strcmp(method, "noaux_tc"))
            cfg->use_score_bias = 1;
        else if (strcmp(method, "greedy"))
            return moe_error(MOE_STATUS_NOT_SUPPORTED,
                             "%s/config.json: topk_method \"%.40s\" is not supported (noaux_tc, "
                             "greedy)",
                             c->dir, method);
        if (cfg->use_score_bias && cfg->scoring != MOE_SCORING_SIGMOID)
            return moe_error(MOE_STATUS_NOT_SUPPORTED,
                             "%s/config.json: topk_method noaux_tc needs scoring_func sigmoid",
                             c->dir);
        MOE_CHECK(cfg_int(&r, "n_group", 0, 1, 1, E, &ng));
        MOE_CHECK(cfg_int(&r, "topk_group", 0, ng, 1, ng, &tg));
        if (ng > 1 && !strcmp(method, "noaux_tc")) {
            cfg->n_group = (int)ng;
            cfg->topk_group = (int)tg;
        }
        MOE_CHECK(cfg_bool(&r, "norm_topk_prob", 1, &b));
        cfg->renormalize = b;
        if (moe_json_member_number(r.obj, "routed_scaling_factor", &d) < 0)
            return moe_error(MOE_STATUS_FORMAT_ERROR,
                             "%s/config.json: \"routed_scaling_factor\" is not a number", c->dir);
        /* named as read: a value beyond f32 would otherwise reach the layer as inf */
        if (!isfinite(d) || d < 0 || d > FLT_MAX)
            return moe_error(MOE_STATUS_FORMAT_ERROR,
                             "%s/config.json: \"routed_scaling_factor\" is %g: expected a "
                             "non-negative number an f32 holds (at most %g)",
                             c->dir, d, (double)FLT_MAX);
        if (moe_json_member_number(r.obj, "routed_scaling_factor", &d) == 0)
            d = 2.5; /* DeepseekV3Config's default */
        cfg->routed_scaling_factor = (float)d;
        MOE_CHECK(cfg_int(&r, "n_shared_experts", 0, 0, 0, INT_MAX / I, &ns));
        if (ns > 0) {
            cfg->num_shared_experts = (int)ns;
            cfg->shared_intermediate = (int)(ns * I);
        }
        break;
    }
    }
    return MOE_STATUS_SUCCESS;
}

/* ------------------------------------------------------------------------------------------ */
/* Loading a layer                                                                             */
/* ------------------------------------------------------------------------------------------ */

/* Tensor names of one family, relative to the layer prefix. */
typedef struct name_map {
    const char *prefix;      /* printf format with the layer index */
    const char *router;      /* gate.weight */
    const char *bias;        /* e_score_correction_bias, or NULL */
    const char *expert[3];   /* gate, up, down: printf formats with the expert index */
    const char *shared[3];   /* gate, up, down, or NULL */
    const char *shared_gate; /* shared_expert_gate.weight, or NULL */
} name_map_t;

static const name_map_t name_maps[] = {
    [MOE_FAMILY_MIXTRAL] = {"model.layers.%d.block_sparse_moe",
                            "gate.weight",
                            NULL,
                            {"experts.%d.w1.weight", "experts.%d.w3.weight",
                             "experts.%d.w2.weight"},
                            {NULL, NULL, NULL},
                            NULL},
    [MOE_FAMILY_QWEN2_MOE] = {"model.layers.%d.mlp",
                              "gate.weight",
                              NULL,
                              {"experts.%d.gate_proj.weight", "experts.%d.up_proj.weight",
                               "experts.%d.down_proj.weight"},
                              {"shared_expert.gate_proj.weight", "shared_expert.up_proj.weight",
                               "shared_expert.down_proj.weight"},
                              "shared_expert_gate.weight"},
    [MOE_FAMILY_QWEN3_MOE] = {"model.layers.%d.mlp",
                              "gate.weight",
                              NULL,
                              {"experts.%d.gate_proj.weight", "experts.%d.up_proj.weight",
                               "experts.%d.down_proj.weight"},
                              {NULL, NULL, NULL},
                              NULL},
    [MOE_FAMILY_DEEPSEEK_V3] = {"model.layers.%d.mlp",
                                "gate.weight",
                                "gate.e_score_correction_bias",
                                {"experts.%d.gate_proj.weight", "experts.%d.up_proj.weight",
                                 "experts.%d.down_proj.weight"},
                                {"shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
                                 "shared_experts.down_proj.weight"},
                                NULL},
};

/* Growing buffers reused across the matrices of one load. */
typedef struct load_ctx {
    moe_checkpoint_t *c;
    moe_layer_t *layer;
    char prefix[96];
    moe_dtype_t ckpt_dtype;      /* weight_dtype config.json gives (FP8_E4M3 with quantization) */
    moe_scale_kind_t ckpt_scale; /* its FP8 scale kind: 128x128 blocks or one per matrix */
    void *data;
    size_t data_cap;
    float *scale;
    size_t scale_cap;
    float *deq;
    size_t deq_cap;
    uint64_t bytes0, reads0; /* read counters at the start (for the log line) */
} load_ctx_t;

/* Bytes and preads of tensor data so far over the opened files, their data size and count. */
static void ckpt_stats(const moe_checkpoint_t *c, uint64_t *bytes, uint64_t *reads,
                       uint64_t *data_bytes, int *open_files)
{
    *bytes = *reads = *data_bytes = 0;
    *open_files = 0;
    for (int i = 0; i < c->num_files; i++) {
        uint64_t b, r;
        if (!c->files[i].st)
            continue;
        moe_st_file_stats(c->files[i].st, &b, &r);
        *bytes += b;
        *reads += r;
        *data_bytes += moe_st_file_header(c->files[i].st)->data_bytes;
        (*open_files)++;
    }
}

static moe_status_t grow(void **buf, size_t *cap, size_t need)
{
    void *p;
    if (need <= *cap)
        return MOE_STATUS_SUCCESS;
    p = realloc(*buf, need);
    if (!p)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "checkpoint: out of memory for %zu bytes", need);
    *buf = p;
    *cap = need;
    return MOE_STATUS_SUCCESS;
}

/* F64 tensors (rare: some biases) become F32. */
static void f64_to_f32(const double *src, float *dst, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = (float)src[i];
}

/* The tensor's shape as a matrix: 1-D [n] is [1, n] (bias and gate vectors). */
static moe_status_t matrix_shape(const moe_st_tensor_t *t, const char *dir, int64_t *rows,
                                 int64_t *cols)
{
    if (t->ndim == 1) {
        *rows = 1;
        *cols = t->shape[0];
    } else if (t->ndim == 2) {
        *rows = t->shape[0];
        *cols = t->shape[1];
    } else {
        return moe_error(MOE_STATUS_FORMAT_ERROR,
                         "%s: tensor \"%s\" has %d dimensions, "
                         "expected a matrix",
                         dir, t->name, t->ndim);
    }
    return MOE_STATUS_SUCCESS;
}

/* The expert matrices must be stored as config.json says: F8_E4M3 (with scales) under an fp8
 * quantization_config, a float dtype otherwise. The router, its bias and the shared-expert
 * gate stay in a float dtype in both kinds of checkpoint. */
static moe_status_t check_file_dtype(const load_ctx_t *x, moe_weight_kind_t kind,
                                     const moe_st_file_t *f, const char *name,
                                     const moe_st_tensor_t *t)
{
    const int fp8_file = t->dtype == MOE_ST_F8_E4M3;
    const int fp8_config = x->ckpt_dtype == MOE_DTYPE_FP8_E4M3;

    if (kind == MOE_WEIGHT_ROUTER || kind == MOE_WEIGHT_ROUTER_BIAS ||
        kind == MOE_WEIGHT_SHARED_EXPERT_GATE) {
        if (fp8_file)
            return moe_error(MOE_STATUS_FORMAT_ERROR,
                             "%s: tensor \"%s\" has dtype F8_E4M3, expected a float dtype (it "
                             "is not quantised in published checkpoints)",
                             moe_st_file_path(f), name);
        return MOE_STATUS_SUCCESS;
    }
    if (fp8_config && !fp8_file)
        return moe_error(MOE_STATUS_FORMAT_ERROR,
                         "%s: tensor \"%s\" has dtype %s but config.json's quantization_config "
                         "says fp8 (F8_E4M3 weights with their scales)",
                         moe_st_file_path(f), name, moe_st_dtype_name(t->dtype));
    if (!fp8_config && fp8_file)
        return moe_error(MOE_STATUS_FORMAT_ERROR,
                         "%s: tensor \"%s\" has dtype F8_E4M3 but config.json has no fp8 "
                         "quantization_config",
                         moe_st_file_path(f), name);
    return MOE_STATUS_SUCCESS;
}

/* The one-value scale tensor of matrix `weight` ("<m>.weight"): which = "weight_scale" reads
 * "<m>.weight_scale" (required); "input_scale" reads "<m>.input_scale" when the file has it (a
 * static activation scale, used by W8A8 layers; *out stays 0 without it). Either must be finite
 * and > 0, else an error naming it. */
static moe_status_t load_tensor_scale(load_ctx_t *x, const char *weight, const char *which,
                                      int required, float *out)
{
    char sname[300];
    const size_t stem = strlen(weight) >= 6 && !strcmp(weight + strlen(weight) - 6, "weight")
                            ? strlen(weight) - 6
                            : strlen(weight);
    moe_st_file_t *sf;
    const moe_st_tensor_t *s;
    float v = 0.0f;
    snprintf(sname, sizeof(sname), "%.*s%s", (int)stem, weight, which);
    if (!required && !has_tensor(x->c, sname))
        return MOE_STATUS_SUCCESS;
    MOE_CHECK(find_tensor(x->c, sname, &sf, &s));
    if (s->dtype != MOE_ST_F32 || s->rows * s->cols != 1)
        return moe_error(MOE_STATUS_FORMAT_ERROR,
                         "%s: scale tensor \"%s\" is %s with %lld values, expected one F32 "
                         "(one scale per matrix)",
                         moe_st_file_path(sf), sname, moe_st_dtype_name(s->dtype),
                         (long long)(s->rows * s->cols));
    MOE_CHECK(moe_st_read_block(sf, s, 0, 1, 0, 1, &v));
    if (moe_layer_checks_weight_values(x->layer)) {
        char origin[512];
        snprintf(origin, sizeof(origin), "%s: tensor \"%s\"", moe_st_file_path(sf), sname);
        MOE_CHECK(moe_scales_check(&v, 1, 1, origin, 0, 0));
    }
    *out = v;
    return MOE_STATUS_SUCCESS;
}

/* Reads rows [r0, r1) x cols [c0, c1) of tensor `name` (full shape [R, C] expected) and sets
 * it as `kind` of `expert` (slice shape, or the full matrix when the slice is all of it). */
static moe_status_t load_matrix(load_ctx_t *x, const char *suffix, moe_weight_kind_t kind,
                                int expert, int64_t R, int64_t C, int64_t r0, int64_t r1,
                                int64_t c0, int64_t c1)
{
    char name[256], sname[272];
    moe_st_file_t *f, *sf;
    const moe_st_tensor_t *t, *s;
    int64_t tr = 0, tc = 0, rows = r1 - r0, cols = c1 - c0;
    moe_tensor_t mt = {0};
    float input_scale = 0.0f; /* <m>.input_scale of per-tensor FP8 files; 0: none */
    size_t n = (size_t)rows * (size_t)cols, es;
    moe_dtype_t dt;

    snprintf(name, sizeof(name), "%s.", x->prefix);
    snprintf(name + strlen(name), sizeof(name) - strlen(name), suffix, expert);
    MOE_CHECK(find_tensor(x->c, name, &f, &t));
    MOE_CHECK(matrix_shape(t, x->c->dir, &tr, &tc));
    if (tr != R || tc != C)
        return moe_error(MOE_STATUS_FORMAT_ERROR,
                         "%s: tensor \"%s\" has shape [%lld, %lld] but config.json gives "
                         "[%lld, %lld]",
                         moe_st_file_path(f), name, (long long)tr, (long long)tc, (long long)R,
                         (long long)C);
    dt = moe_st_to_moe_dtype(t->dtype);
    if (dt == MOE_DTYPE_INVALID && t->dtype != MOE_ST_F64)
        return moe_error(MOE_STATUS_FORMAT_ERROR,
                         "%s: tensor \"%s\" has dtype %s, expected F32, BF16, F16, F8_E4M3 or "
                         "F64",
                         moe_st_file_path(f), name, moe_st_dtype_name(t->dtype));
    MOE_CHECK(check_file_dtype(x, kind, f, name, t));
    es = moe_st_dtype_size(t->dtype);
    MOE_CHECK(grow(&x->data, &x->data_cap, n * es + 1));
    if (t->ndim == 1) /* [n] is one row; the file view is [n, 1] */
        MOE_CHECK(moe_st_read_block(f, t, c0, c1, 0, 1, x->data));
    else
        MOE_CHECK(moe_st_read_block(f, t, r0, r1, c0, c1, x->data));
    mt.dtype = dt;
    mt.rows = rows;
    mt.cols = cols;
    mt.data = x->data;
    if (t->dtype == MOE_ST_F64) {
        MOE_CHECK(grow((void **)&x->deq, &x->deq_cap, n * sizeof(float) + 1));
        f64_to_f32(x->data, x->deq, n);
        mt.dtype = MOE_DTYPE_F32;
        mt.data = x->deq;
    }

    if (dt == MOE_DTYPE_FP8_E4M3 && x->ckpt_scale == MOE_SCALE_PER_TENSOR) {
        MOE_CHECK(grow((void **)&x->scale, &x->scale_cap, 2 * sizeof(float)));
        MOE_CHECK(load_tensor_scale(x, name, "weight_scale", 1, &x->scale[0]));
        MOE_CHECK(load_tensor_scale(x, name, "input_scale", 0, &input_scale));
        mt.scale = x->scale;
        mt.scale_rows = 1;
        mt.scale_cols = 1;
    } else if (dt == MOE_DTYPE_FP8_E4M3) {
        int64_t sr0 = r0 / FP8_BLOCK, sr1 = (r1 + FP8_BLOCK - 1) / FP8_BLOCK;
        int64_t sc0 = c0 / FP8_BLOCK, sc1 = (c1 + FP8_BLOCK - 1) / FP8_BLOCK;
        int64_t str = 0, stc = 0;
        int aligned = r0 % FP8_BLOCK == 0 && c0 % FP8_BLOCK == 0;
        size_t sn = (size_t)(sr1 - sr0) * (size_t)(sc1 - sc0);

        snprintf(sname, sizeof(sname), "%s_scale_inv", name);
        MOE_CHECK(find_tensor(x->c, sname, &sf, &s));
        MOE_CHECK(matrix_shape(s, x->c->dir, &str, &stc));
        /* a 2-D grid only: a 1-D tensor of the right count is not a grid of blocks */
        if (s->dtype != MOE_ST_F32 || s->ndim != 2 || str != (R + FP8_BLOCK - 1) / FP8_BLOCK ||
            stc != (C + FP8_BLOCK - 1) / FP8_BLOCK) {
            char got[64];
            if (s->ndim == 1)
                snprintf(got, sizeof(got), "[%lld] (1-D)", (long long)stc);
            else
                snprintf(got, sizeof(got), "[%lld, %lld]", (long long)str, (long long)stc);
            return moe_error(
                MOE_STATUS_FORMAT_ERROR,
                "%s: scale tensor \"%s\" is %s %s, expected the F32 grid "
                "[%lld, %lld] (one scale per 128x128 block of the [%lld, %lld] weight)",
                moe_st_file_path(sf), sname, moe_st_dtype_name(s->dtype), got,
                (long long)((R + FP8_BLOCK - 1) / FP8_BLOCK),
                (long long)((C + FP8_BLOCK - 1) / FP8_BLOCK), (long long)R, (long long)C);
        }
        MOE_CHECK(grow((void **)&x->scale, &x->scale_cap, sn * sizeof(float) + 1));
        MOE_CHECK(moe_st_read_block(sf, s, sr0, sr1, sc0, sc1, x->scale));
        if (moe_layer_checks_weight_values(x->layer)) {
            /* Here, where the scale tensor can be named (and before a dequantisation that
             * would hide a negative scale). */
            char origin[512];
            snprintf(origin, sizeof(origin), "%s: tensor \"%s\"", moe_st_file_path(sf), sname);
            MOE_CHECK(moe_scales_check(x->scale, sr1 - sr0, sc1 - sc0, origin, sr0 * FP8_BLOCK,
                                       sc0 * FP8_BLOCK));
        }
        if (aligned) {
            mt.scale = x->scale;
            mt.scale_rows = sr1 - sr0;
            mt.scale_cols = sc1 - sc0;
        } else {
            /* The slice cuts through scale blocks: the layer cannot be block-scaled here (it
             * checks 128-aligned TP slices), so hand it the dequantised f32 slice. */
            const uint8_t *q = x->data;
            MOE_CHECK(grow((void **)&x->deq, &x->deq_cap, n * sizeof(float) + 1));
            for (int64_t i = 0; i < rows; i++)
                for (int64_t j = 0; j < cols; j++)
                    x->deq[i * cols + j] = moe_fp8e4m3_to_f32(q[i * cols + j]) *
                                           x->scale[((r0 + i) / FP8_BLOCK - sr0) * (sc1 - sc0) +
                                                    (c0 + j) / FP8_BLOCK - sc0];
            mt.dtype = MOE_DTYPE_F32;
            mt.data = x->deq;
        }
    }
    {
        char origin[512];
        snprintf(origin, sizeof(origin), "%s: tensor \"%s\"", moe_st_file_path(f), name);
        return moe_layer_set_weight_from(x->layer, kind, expert, &mt, input_scale, origin,
                                         t->ndim == 1 ? 0 : r0, c0);
    }
}

moe_status_t moe_layer_load(moe_layer_t *layer, moe_checkpoint_t *c, int layer_index)
{
    moe_layer_config_t cfg = MOE_LAYER_CONFIG_INIT;
    moe_layer_info_t info;
    load_ctx_t x;
    const name_map_t *nm;
    const moe_weight_kind_t ek[3] = {MOE_WEIGHT_GATE_PROJ, MOE_WEIGHT_UP_PROJ,
                                     MOE_WEIGHT_DOWN_PROJ};
    const moe_weight_kind_t sk[3] = {MOE_WEIGHT_SHARED_GATE_PROJ, MOE_WEIGHT_SHARED_UP_PROJ,
                                     MOE_WEIGHT_SHARED_DOWN_PROJ};
    int64_t E, H, I, S, i0, i1, s0, s1;
    moe_status_t st = MOE_STATUS_SUCCESS;

    moe_error_clear();
    MOE_ARG_CHECK(layer != NULL && c != NULL, "layer_load: layer and ckpt must not be NULL");
    MOE_CHECK(moe_checkpoint_layer_config(c, layer_index, &cfg));
    MOE_CHECK(moe_layer_get_info(layer, &info));
    nm = &name_maps[c->family];
    E = cfg.num_experts;
    H = cfg.hidden;
    I = cfg.intermediate;
    S = cfg.num_shared_experts > 0 ? cfg.shared_intermediate : 0;
    i0 = info.intermediate_begin;
    i1 = info.intermediate_end;
    s0 = info.shared_begin;
    s1 = info.shared_end;
    MOE_ARG_CHECK(moe_layer_num_experts(layer) == E && i0 >= 0 && i0 <= i1 && i1 <= I &&
                      (S == 0 || (s0 >= 0 && s0 <= s1 && s1 <= S)),
                  "layer_load: the layer (experts %d..%d, intermediate [%lld, %lld)) does not "
                  "match layer %d of the checkpoint (%lld experts, intermediate %lld); create "
                  "it from moe_checkpoint_layer_config",
                  info.first_local_expert, info.first_local_expert + info.num_local_experts - 1,
                  (long long)i0, (long long)i1, layer_index, (long long)E, (long long)I);

    memset(&x, 0, sizeof(x));
    x.c = c;
    x.layer = layer;
    x.ckpt_dtype = cfg.weight_dtype;
    x.ckpt_scale = cfg.scale_kind;
    snprintf(x.prefix, sizeof(x.prefix), nm->prefix, layer_index);
    {
        uint64_t d;
        int nf;
        ckpt_stats(c, &x.bytes0, &x.reads0, &d, &nf);
    }

    MOE_CHECK_GOTO(load_matrix(&x, nm->router, MOE_WEIGHT_ROUTER, -1, E, H, 0, E, 0, H), st, out);
    if (nm->bias && cfg.use_score_bias)
        MOE_CHECK_GOTO(load_matrix(&x, nm->bias, MOE_WEIGHT_ROUTER_BIAS, -1, 1, E, 0, 1, 0, E), st,
                       out);
    /* the logical experts of this rank's slots, each once (set_weight fills its replicas) */
    for (int slot = 0; slot < info.num_local_experts; slot++) {
        const int e = moe_layer_slot_expert(layer, slot);
        int again = 0;
        for (int j = 0; j < slot; j++)
            again |= moe_layer_slot_expert(layer, j) == e;
        if (again)
            continue;
        /* gate/up [I, H]: rows of this rank's slice; down [H, I]: its columns. */
        MOE_CHECK_GOTO(load_matrix(&x, nm->expert[0], ek[0], e, I, H, i0, i1, 0, H), st, out);
        MOE_CHECK_GOTO(load_matrix(&x, nm->expert[1], ek[1], e, I, H, i0, i1, 0, H), st, out);
        MOE_CHECK_GOTO(load_matrix(&x, nm->expert[2], ek[2], e, H, I, 0, H, i0, i1), st, out);
    }
    if (S > 0 && nm->shared[0] && s1 > s0) {
        MOE_CHECK_GOTO(load_matrix(&x, nm->shared[0], sk[0], -1, S, H, s0, s1, 0, H), st, out);
        MOE_CHECK_GOTO(load_matrix(&x, nm->shared[1], sk[1], -1, S, H, s0, s1, 0, H), st, out);
        MOE_CHECK_GOTO(load_matrix(&x, nm->shared[2], sk[2], -1, H, S, 0, H, s0, s1), st, out);
    }
    if (cfg.shared_expert_gate && nm->shared_gate)
        MOE_CHECK_GOTO(
            load_matrix(&x, nm->shared_gate, MOE_WEIGHT_SHARED_EXPERT_GATE, -1, 1, H, 0, 1, 0, H),
            st, out);
out:
    if (st == MOE_STATUS_SUCCESS) {
        uint64_t bytes, reads, total_bytes = 0, total_reads = 0, data = 0;
        int files = 0;
        ckpt_stats(c, &total_bytes, &total_reads, &data, &files);
        bytes = total_bytes - x.bytes0;
        reads = total_reads - x.reads0;
        MOE_LOG_INFO("CKPT",
                     "layer %d: experts %d..%d, intermediate [%lld, %lld): read %llu bytes in "
                     "%llu preads from %d of %d files (%llu bytes of tensor data open)",
                     layer_index, info.first_local_expert,
                     info.first_local_expert + info.num_local_experts - 1, (long long)i0,
                     (long long)i1, (unsigned long long)bytes, (unsigned long long)reads, files,
                     c->num_files, (unsigned long long)data);
    }
    free(x.data);
    free(x.scale);
    free(x.deq);
    return st;
}

/* ------------------------------------------------------------------------------------------ */
/* In-memory entry points (fuzz targets)                                                       */
/* ------------------------------------------------------------------------------------------ */

moe_status_t moe_checkpoint_from_memory(const char *config, size_t config_len, const char *index,
                                        size_t index_len, moe_checkpoint_t **ckpt)
{
    moe_checkpoint_t *c;
    moe_status_t st = MOE_STATUS_SUCCESS;

    *ckpt = NULL;
    c = calloc(1, sizeof(*c));
    if (!c || !(c->dir = strdup("<memory>"))) {
        free(c);
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "checkpoint: out of memory");
    }
    if (config)
        MOE_CHECK_GOTO(
            parse_json_object(config, config_len, "<memory>/config.json", &c->config_doc), st,
            fail);
    MOE_CHECK_GOTO(set_config(c), st, fail);
    if (index) {
        MOE_CHECK_GOTO(parse_json_object(index, index_len, "<memory>/index.json", &c->index_doc),
                       st, fail);
        MOE_CHECK_GOTO(map_index(c, "<memory>/index.json"), st, fail);
    }
    *ckpt = c;
    return MOE_STATUS_SUCCESS;
fail:
    moe_checkpoint_close(c);
    return st;
}

const char *moe_checkpoint_tensor_file(const moe_checkpoint_t *c, const char *name)
{
    ckpt_name_t key = {name, 0}, *hit;

    if (!c || !name || !c->num_names)
        return NULL;
    hit = bsearch(&key, c->names, c->num_names, sizeof(key), cmp_names);
    return hit ? c->files[hit->file].name : NULL;
}

moe_status_t moe_checkpoint_tensor_name(const moe_checkpoint_t *c, int layer_index,
                                        moe_weight_kind_t kind, int expert, char *out, size_t n)
{
    const name_map_t *nm;
    const char *suffix = NULL;
    char prefix[96];
    int len;

    MOE_ARG_CHECK(c != NULL && out != NULL && n > 0, "checkpoint_tensor_name: NULL argument");
    MOE_ARG_CHECK(c->family != MOE_FAMILY_UNKNOWN, "%s: unknown model family", c->dir);
    nm = &name_maps[c->family];
    switch (kind) {
    case MOE_WEIGHT_ROUTER:
        suffix = nm->router;
        break;
    case MOE_WEIGHT_ROUTER_BIAS:
        suffix = nm->bias;
        break;
    case MOE_WEIGHT_GATE_PROJ:
    case MOE_WEIGHT_UP_PROJ:
    case MOE_WEIGHT_DOWN_PROJ:
        suffix = nm->expert[kind - MOE_WEIGHT_GATE_PROJ];
        break;
    case MOE_WEIGHT_SHARED_GATE_PROJ:
    case MOE_WEIGHT_SHARED_UP_PROJ:
    case MOE_WEIGHT_SHARED_DOWN_PROJ:
        suffix = nm->shared[kind - MOE_WEIGHT_SHARED_GATE_PROJ];
        break;
    case MOE_WEIGHT_SHARED_EXPERT_GATE:
        suffix = nm->shared_gate;
        break;
    default:
        break;
    }
    MOE_ARG_CHECK(suffix != NULL, "kind = %d: no tensor of that kind in this family", (int)kind);
    snprintf(prefix, sizeof(prefix), nm->prefix, layer_index);
    len = snprintf(out, n, "%s.", prefix);
    if (len < 0 || (size_t)len >= n)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT, "checkpoint_tensor_name: %zu bytes is short",
                         n);
    len = snprintf(out + len, n - (size_t)len, suffix, expert);
    if (len < 0 || (size_t)len >= n - strlen(prefix) - 1)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT, "checkpoint_tensor_name: %zu bytes is short",
                         n);
    return MOE_STATUS_SUCCESS;
}

/* ------------------------------------------------------------------------------------------ */
/* Single tensors                                                                              */
/* ------------------------------------------------------------------------------------------ */

static moe_status_t open_tensor(const char *path, const char *name, moe_st_file_t **f,
                                const moe_st_tensor_t **t)
{
    MOE_ARG_CHECK(path != NULL && name != NULL, "safetensors: path and name must not be NULL");
    MOE_CHECK(moe_st_open(path, f));
    *t = moe_st_find(*f, name);
    if (!*t) {
        moe_st_close(*f);
        *f = NULL;
        return moe_error(MOE_STATUS_FORMAT_ERROR, "%s: no tensor \"%s\"", path, name);
    }
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_safetensors_tensor_info(const char *path, const char *name, moe_dtype_t *dtype,
                                         int64_t *rows, int64_t *cols)
{
    moe_st_file_t *f = NULL;
    const moe_st_tensor_t *t;

    moe_error_clear();
    MOE_CHECK(open_tensor(path, name, &f, &t));
    if (dtype)
        *dtype = t->dtype == MOE_ST_F64 ? MOE_DTYPE_F32 : moe_st_to_moe_dtype(t->dtype);
    if (rows)
        *rows = t->rows;
    if (cols)
        *cols = t->cols;
    moe_st_close(f);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_safetensors_read_rows(const char *path, const char *name, int64_t row_begin,
                                       int64_t row_end, moe_dtype_t dtype, void *dst)
{
    moe_st_file_t *f = NULL;
    const moe_st_tensor_t *t;
    moe_status_t st;
    void *raw = NULL;
    float *tmp = NULL;
    size_t n;

    moe_error_clear();
    MOE_ARG_CHECK(dtype == MOE_DTYPE_F32 || dtype == MOE_DTYPE_BF16,
                  "dtype = %d: read_rows converts to F32 or BF16", (int)dtype);
    MOE_CHECK(open_tensor(path, name, &f, &t));
    if (t->dtype != MOE_ST_F64 && t->dtype != MOE_ST_F32 && t->dtype != MOE_ST_BF16 &&
        t->dtype != MOE_ST_F16) {
        st = moe_error(MOE_STATUS_FORMAT_ERROR,
                       "%s: tensor \"%s\" has dtype %s, expected F64, F32, BF16 or F16", path, name,
                       moe_st_dtype_name(t->dtype));
        goto out;
    }
    if (row_begin < 0 || row_end < row_begin || row_end > t->rows) {
        st = moe_error(MOE_STATUS_INVALID_ARGUMENT,
                       "rows [%lld, %lld): tensor \"%s\" of %s has %lld rows", (long long)row_begin,
                       (long long)row_end, name, path, (long long)t->rows);
        goto out;
    }
    n = (size_t)(row_end - row_begin) * (size_t)t->cols;
    raw = malloc(n * moe_st_dtype_size(t->dtype) + 1);
    tmp = malloc(n * sizeof(float) + 1);
    if (!raw || !tmp) {
        st = moe_error(MOE_STATUS_OUT_OF_MEMORY, "%s: out of memory for %zu elements", path, n);
        goto out;
    }
    MOE_CHECK_GOTO(moe_st_read_block(f, t, row_begin, row_end, 0, t->cols, raw), st, out);
    if (t->dtype == MOE_ST_F64)
        f64_to_f32(raw, tmp, n);
    else
        moe_convert_to_f32(moe_st_to_moe_dtype(t->dtype), raw, tmp, n);
    moe_convert_from_f32(dtype, tmp, dst, n);
out:
    free(raw);
    free(tmp);
    moe_st_close(f);
    return st;
}

moe_status_t moe_safetensors_write(const char *path, int count, const char *const *names,
                                   const moe_tensor_t *tensors)
{
    moe_st_entry_t *e;
    char **snames;
    int n = 0;
    moe_status_t st;

    moe_error_clear();
    MOE_ARG_CHECK(path != NULL && count >= 0 && (count == 0 || (names && tensors)),
                  "safetensors_write: NULL argument or count = %d", count);
    e = calloc((size_t)count * 2 + 1, sizeof(*e));
    snames = calloc((size_t)count + 1, sizeof(*snames));
    if (!e || !snames) {
        free(e);
        free(snames);
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "%s: out of memory", path);
    }
    for (int i = 0; i < count; i++) {
        const moe_tensor_t *t = &tensors[i];
        e[n].name = names[i];
        e[n].dtype = moe_st_from_moe_dtype(t->dtype);
        e[n].ndim = 2;
        e[n].shape[0] = t->rows;
        e[n].shape[1] = t->cols;
        e[n].data = t->data;
        n++;
        if (t->dtype == MOE_DTYPE_FP8_E4M3 && t->scale) {
            size_t len = strlen(names[i]) + 11;
            snames[i] = malloc(len);
            if (!snames[i]) {
                st = moe_error(MOE_STATUS_OUT_OF_MEMORY, "%s: out of memory", path);
                goto out;
            }
            snprintf(snames[i], len, "%s_scale_inv", names[i]);
            e[n].name = snames[i];
            e[n].dtype = MOE_ST_F32;
            e[n].ndim = 2;
            e[n].shape[0] = t->scale_rows;
            e[n].shape[1] = t->scale_cols;
            e[n].data = t->scale;
            n++;
        }
    }
    st = moe_st_write(path, e, (size_t)n, NULL, 0);
out:
    for (int i = 0; i < count; i++)
        free(snames[i]);
    free(snames);
    free(e);
    return st;
}
