/* SPDX-License-Identifier: Apache-2.0 */
/* The oracle: which grouped-GEMM variant and which expert-parallel transport a layer runs,
 * from the built-in tables, a measured tune file (MOE_TUNE_FILE, written by moe-tune) or the
 * environment (MOE_FORCE_VARIANT, MOE_FORCE_TRANSPORT). CUDA-free; the file format is in
 * docs/KERNELS.md, "Tune file". */
#ifndef MOE_ORACLE_H
#define MOE_ORACLE_H

#include <stddef.h>
#include <stdint.h>
#include "kernels/expert_gemm.h"
#include "moe/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The tune file format this build reads and writes ("libmoe_tune": 1). */
#define MOE_TUNE_VERSION 1
/* Bounds on one tune file: bytes, tables, buckets per table, bytes of a name. Over any of them
 * the file is ignored (with a warning). */
#define MOE_TUNE_MAX_BYTES (1 << 20)
#define MOE_ORACLE_MAX_GROUPS 256
#define MOE_ORACLE_MAX_BUCKETS 16
#define MOE_ORACLE_NAME_LEN 48
/* The name the reference variant answers to (kernels/expert_gemm_simple.h): forcible, never in
 * a table. */
#define MOE_ORACLE_SIMT_REF "simt_ref"
/* The fused small-batch decode kernel (kernels/decode.h): MOE_FORCE_VARIANT=<this> runs it at
 * every step it can take; any other forced variant keeps the grouped path at every size. */
#define MOE_ORACLE_FUSED_DECODE "sm90_fused_decode"
/* A decode table's other path: route, permute, the grouped GEMMs, combine. */
#define MOE_ORACLE_GROUPED_PATH "grouped"
/* A built-in fast-accumulation table's bucket that defers to the promoted tables (whatever a
 * W8A8 layer runs there). Not a name a tune file may give. */
#define MOE_ORACLE_PROMOTED_PATH "promoted"

/* The accumulation a GEMM table's variants may use (moe_gemm_variant_t.fast_accum): a layer
 * with fp8_math W8A8_FAST and per-row scales asks the FAST tables first (tuned, then built in),
 * then, where none answers or one answers MOE_ORACLE_PROMOTED_PATH, the PROMOTED ones; every
 * other layer asks the PROMOTED ones alone, which never name a fast variant. */
enum { MOE_ORACLE_ACCUM_PROMOTED = 0, MOE_ORACLE_ACCUM_FAST = 1 };

/* Where a choice came from. */
typedef enum moe_oracle_source {
    MOE_ORACLE_DEFAULT = 0, /* the built-in table (or the backend's built-in rule) */
    MOE_ORACLE_TUNED = 1,   /* a tune file */
    MOE_ORACLE_FORCED = 2   /* an environment variable */
} moe_oracle_source_t;

typedef enum moe_oracle_kind {
    MOE_ORACLE_GEMM = 0,      /* buckets of rows per expert -> grouped-GEMM variant */
    MOE_ORACLE_TRANSPORT = 1, /* buckets of max tokens per rank -> allgather | lsa | p2p */
    MOE_ORACLE_DECODE = 2     /* buckets of tokens per step (one GPU) -> sm90_fused_decode |
                                 grouped; the fused buckets come first (one crossover) */
} moe_oracle_kind_t;
#define MOE_ORACLE_KINDS 3

/* The expert-parallel transports by name (runtime/cuda/ep_transport.c); a GEMM table's layout
 * key may name one, or MOE_ORACLE_ANY. A one-GPU layer queries with MOE_ORACLE_ANY. */
#define MOE_ORACLE_ANY (-1)
enum { MOE_ORACLE_ALLGATHER = 0, MOE_ORACLE_LSA = 1, MOE_ORACLE_P2P = 2 };
const char *moe_oracle_transport_name(int transport); /* "any" for MOE_ORACLE_ANY */
int moe_oracle_transport_by_name(const char *name);   /* -2: unknown; "any": MOE_ORACLE_ANY */

/* A layer's shape as the tune file keys it: the whole layer's hidden, one expert's full
 * intermediate (before any TP split), the routed experts and top_k. All 0: any shape. */
typedef struct moe_oracle_shape {
    int hidden, intermediate, experts, top_k;
} moe_oracle_shape_t;

typedef struct moe_oracle_bucket {
    /* Inclusive upper bound of the bucket (rows per expert, or max tokens per rank); the last
     * bucket of a table is open: HUGE_VAL. Bounds rise strictly. */
    double max;
    char name[MOE_ORACLE_NAME_LEN]; /* variant, or transport */
    double at;                      /* moe-tune: the value it was measured at (0: not given) */
    double time_us;                 /* moe-tune: the winner's median step there (0: not given) */
} moe_oracle_bucket_t;

/* One table: a key and its buckets. */
typedef struct moe_oracle_group {
    moe_oracle_kind_t kind;
    int arch; /* the device's compute capability (90); built-in sm_80 table: 80 and newer */
    moe_oracle_shape_t shape;
    moe_dtype_t dtype;      /* GEMM, DECODE: the operands, BF16 or FP8_E4M3 */
    moe_scale_kind_t scale; /* GEMM, DECODE: NONE (bf16), PER_CHANNEL (per-row), BLOCK_128 */
    int ep_size, tp_size;   /* 0: any layout */
    int transport;          /* GEMM: MOE_ORACLE_ANY or the transport it was measured with */
    int num_buckets;
    moe_oracle_bucket_t bucket[MOE_ORACLE_MAX_BUCKETS];
    int max_hidden; /* built-in GEMM tables: only layers whose hidden is at most this (0: any) */
    /* tuned GEMM tables: moe_oracle_builtin_id() of the library that measured them ("": not
     * recorded); another id at load gives a warning (the built-in choices they were compared
     * with have changed since) */
    char builtin[17];
    int accum; /* GEMM tables: MOE_ORACLE_ACCUM_*; a tune file's "accum" ("promoted" if absent) */
} moe_oracle_group_t;

/* What a tune file holds (moe_oracle_write / moe_oracle_parse). */
typedef struct moe_oracle_table {
    char gpu[256]; /* the device name, "NVIDIA H200" */
    int arch;
    int num_groups;
    moe_oracle_group_t *group; /* owned (moe_oracle_table_free) */
} moe_oracle_table_t;

/* A layer's oracle: the built-in tables plus the tune file's tables that fit its GPU and
 * shape. Zeroed (or moe_oracle_init): defaults only. */
typedef struct moe_oracle {
    moe_oracle_table_t tuned;
    char file[256];    /* where `tuned` came from ("" : no tune file) */
    char warning[512]; /* why a tune file was ignored, or that its GEMM tables are older than
                        * the built-in ones ("" : neither) */
} moe_oracle_t;

/* What the layer picking asks about. */
typedef struct moe_oracle_target {
    const char *gpu; /* device name */
    int arch;
    moe_oracle_shape_t shape;
} moe_oracle_target_t;

typedef struct moe_oracle_query {
    int arch;
    moe_dtype_t dtype;
    moe_scale_kind_t scale;
    int ep_size, tp_size, transport; /* one GPU: 1, 1, MOE_ORACLE_ANY */
    double value;                    /* rows per expert (GEMM), max tokens per rank (transport) */
    int hidden; /* the layer's hidden, GEMM 1's k (0: not known): built-in GEMM tables may be
                 * for short k only (max_hidden) */
    /* moe_oracle_decode_tokens: the expert weight bytes a one-token step reads (top_k experts'
     * three matrices; 0: not known) and whether the layer has a shared expert (the fused
     * decode kernel leaves it on the grouped path) */
    double token_bytes;
    int shared;
    int accum; /* GEMM: MOE_ORACLE_ACCUM_FAST for a W8A8_FAST layer with per-row scales */
} moe_oracle_query_t;

typedef struct moe_oracle_choice {
    const char *name; /* variant / transport; NULL: no table answers */
    moe_oracle_source_t source;
    double lo, hi;      /* the bucket: value in (lo, hi]; hi = HUGE_VAL for the last */
    const char *origin; /* TUNED: the file; FORCED: the variable; DEFAULT: NULL */
    int arch;           /* the device arch asked about */
    int max_hidden;     /* DEFAULT: the table's bound on the layer's hidden (0: any shape) */
} moe_oracle_choice_t;

void moe_oracle_init(moe_oracle_t *o);
/* Frees what o holds and leaves it at the defaults. NULL is fine. */
void moe_oracle_free(moe_oracle_t *o);
void moe_oracle_table_free(moe_oracle_table_t *t);

/* Reads tune file `path` for `target` into o (never an error status: a file that cannot be
 * used leaves the defaults, sets o->warning and logs it as one MOE_LOG_WARN). Returns the
 * number of tables taken (0: defaults only). */
int moe_oracle_load(moe_oracle_t *o, const char *path, const moe_oracle_target_t *target);
/* The same on `len` bytes of text; `what` names it in the warning. */
int moe_oracle_load_text(moe_oracle_t *o, const char *text, size_t len, const char *what,
                         const moe_oracle_target_t *target);
/* MOE_TUNE_FILE, if set (else defaults, no warning). */
int moe_oracle_load_env(moe_oracle_t *o, const moe_oracle_target_t *target);

/* Parses and checks a whole tune file (every table, any shape). MOE_STATUS_FORMAT_ERROR with a
 * message naming `what` and the offending value on malformed or stale input; *t is empty then. */
moe_status_t moe_oracle_parse(const char *text, size_t len, const char *what,
                              moe_oracle_table_t *t);
/* Writes `t` as a tune file to `path` (MOE_STATUS_IO_ERROR naming it on failure). */
moe_status_t moe_oracle_write(const char *path, const moe_oracle_table_t *t);
/* The text moe_oracle_write writes, into buf[len]; returns its length (like snprintf). */
size_t moe_oracle_format(const moe_oracle_table_t *t, char *buf, size_t len);

/* Buckets for g (its key set) from moe-tune's points: at[i] ascending, winner[i] the fastest
 * variant or transport there (NULL: none ran), best_us[i] its time (or NULL). A measured point
 * keeps its winner; between two points the winner only where both agree, else the built-in
 * table's choices there; below the first and above the last point the built-in table's (a
 * point's winner where it has none). So a tune file never replaces the built-in choice where
 * it was not measured to lose. Returns the number of buckets, -1 if more than
 * MOE_ORACLE_MAX_BUCKETS would be needed (g then unusable). */
int moe_oracle_buckets_from_points(moe_oracle_group_t *g, const double *at,
                                   const char *const *winner, const double *best_us, int n);

/* The variant for q (q->value: rows per expert): the first tuned table whose key fits, else
 * the built-in one. Returns 1 with *c filled, or 0 (c->name NULL) when no table has one. o may
 * be NULL (built-in tables only). */
int moe_oracle_pick_gemm(const moe_oracle_t *o, const moe_oracle_query_t *q,
                         moe_oracle_choice_t *c);
/* The transport for q (q->value: max tokens per rank; dtype/scale/transport ignored): a tuned
 * table's, or 0 (c->name NULL, source DEFAULT: the backend's built-in rule). */
int moe_oracle_pick_transport(const moe_oracle_t *o, const moe_oracle_query_t *q,
                              moe_oracle_choice_t *c);
/* "NAME (why)" for a choice at `value` ("rows/expert" or "tokens/rank" as `unit`): the table and
 * its bucket and whether built in, tuned from FILE, or forced by VAR. */
void moe_oracle_describe(const moe_oracle_choice_t *c, const char *unit, double value, char *text,
                         size_t len);

/* The forced variant: MOE_FORCE_VARIANT, else MOE_GEMM_VARIANT (the same meaning). *name = NULL
 * when neither is set; both set to different names: MOE_STATUS_INVALID_ARGUMENT naming both.
 * *env: the variable that set it. */
moe_status_t moe_oracle_forced_variant(const char **name, const char **env);
/* The forced transport: MOE_FORCE_TRANSPORT, else MOE_EP_TRANSPORT; "auto" or unset: *name =
 * NULL. Unknown names are left to the caller (it names the choices). */
moe_status_t moe_oracle_forced_transport(const char **name, const char **env);
/* Whether variant `name` (given by variable `env`) can run a layer's GEMMs of `dtype`/`scale`
 * on a device of `arch`: MOE_STATUS_INVALID_ARGUMENT for an unknown name, NOT_SUPPORTED for a
 * variant built for another arch or of another dtype or scale kind; the message names
 * ENV=NAME and the mismatch. simt_ref: bf16 layers, any arch. */
/* Whether the fused decode kernel runs a layer of this arch, dtype and scale kind by a table
 * (sm_90, bf16 or per-row fp8): the rule the tune file reader and moe-tune apply;
 * moe_oracle_check_variant also lets it be forced on fp8 with 128 x 128 blocks (one token a
 * step, not measured yet). */
int moe_oracle_fused_decode_runs(int arch, moe_dtype_t dtype, moe_scale_kind_t scale);
/* The crossover of the fused decode kernel: the most tokens per step (one GPU) at which it runs
 * instead of the grouped path (route, permute, GEMM 1, GEMM 2, combine) for a layer of this
 * arch, dtype and scale kind (q->value unused): the first tuned decode table whose key fits
 * (the bound of its leading sm90_fused_decode buckets; INT32_MAX when all of them are), else
 * the built-in one (sm_90, one GPU: bf16 at one token; fp8 never); 0: never. c (may be NULL) gets
 * the source (TUNED with the file, or DEFAULT), the path below the crossover and the bucket (0,
 * crossover]. o may be NULL. */
int moe_oracle_decode_tokens(const moe_oracle_t *o, const moe_oracle_query_t *q,
                             moe_oracle_choice_t *c);

moe_status_t moe_oracle_check_variant(const char *env, const char *name, int arch,
                                      moe_dtype_t dtype, moe_scale_kind_t scale);

/* Names of the tune file's words. */
const char *moe_oracle_dtype_name(moe_dtype_t dtype);      /* "bf16", "fp8_e4m3" */
const char *moe_oracle_scale_name(moe_scale_kind_t scale); /* "none", "per_channel", ... */

/* The built-in tables (the defaults), for moe-tune's buckets. */
const moe_oracle_group_t *moe_oracle_defaults(int *count);
/* 16 hex digits naming the built-in GEMM tables (a hash of their keys, bounds and variants):
 * moe-tune records it with each GEMM table it writes. */
const char *moe_oracle_builtin_id(void);

/* One line on what moe_gemm_select picks at `rows_per_expert` on `arch` for bf16, and why
 * (the built-in table's bucket; moe_oracle_pick_gemm has the tuned and forced choices). */
void moe_gemm_explain(int arch, double rows_per_expert, char *text, size_t len);

/* The default choice (the built-in table) for a device arch (e.g.
 * 90), dtype, scale kind and the expected rows per expert (host-known: num_tokens * top_k /
 * num_experts). Never NULL for bf16 on sm_80+. */
const moe_gemm_variant_t *moe_gemm_select(int arch, moe_dtype_t dtype, moe_scale_kind_t scale,
                                          double rows_per_expert);

#ifdef __cplusplus
}
#endif

#endif /* MOE_ORACLE_H */
