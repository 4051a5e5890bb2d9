/*
 * GF(2^8) multiply-accumulate kernels for lightning_dlrover.parity (CPU).
 *
 * Two operations, both over raw byte buffers (and gather_xor, the row deltas parity commits send, and the undo
 * log of touched rows those deltas are taken against: undo_mark, undo_sorted):
 *   matmul:      dst[j] = (accumulate ? dst[j] : 0) ^ XOR_i c[j][i] * src[i]      (j < r, i < k)
 *   update_rows: parity[p][rows[t]] ^= c[p] * delta[t]                            (p < P, t < m)
 * where a "row" is row_bytes consecutive bytes and parity shards lie shard_stride bytes apart.
 *
 * The field comes from Python: init() receives gf256.MUL_TABLE (a * b for all bytes), and the
 * per-constant tables every kernel uses are derived from it here:
 *   - NIBBLES[c]: c * x for the 16 low nibbles x, then for the 16 high nibbles (x << 4). Since
 *     multiplication is linear over XOR, c * x = NIBBLES[c][x & 15] ^ NIBBLES[c][16 + (x >> 4)],
 *     two pshufb lookups per vector (the ISA-L method).
 *   - AFFINE[c]: multiplication by c as an 8x8 bit matrix for gf2p8affineqb. GFNI's gf2p8mulb
 *     is fixed to the AES polynomial 0x11b, so it cannot be used for 0x11d; the affine form
 *     works for any polynomial: output bit p of c * x is the parity of (x & row_p) where bit q
 *     of row_p is bit p of c * 2^q, and row_p goes in byte 7 - p of the matrix.
 *
 * Instruction sets are chosen at run time (one build runs on any x86-64): functions carry
 * __attribute__((target(...))) and set_isa()/the default pick among those the CPU supports
 * (__builtin_cpu_supports, which also checks that the OS saves the AVX/AVX-512 state).
 * Elsewhere only the portable scalar kernels are compiled.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GF_X86 1
#include <immintrin.h>
#endif

#define MAX_SHARDS 256
/* Outputs computed together per pass over the sources; their accumulators stay in registers. */
#define GROUP 4
/* When more than GROUP outputs need several passes, the sources are processed in column blocks
 * of about this many bytes in total, so that later passes read them from L2 rather than DRAM. */
#define L2_BLOCK_BYTES (256 * 1024)
/* update_rows prefetches the parity lines of rows about this many bytes ahead: rows are random,
 * so the hardware prefetcher cannot guess them, and enough misses must be in flight. It
 * prefetches into L2 (locality 2), which tracks more outstanding misses than L1: measured
 * 25-40% faster than into L1 with two parity shards. */
#define PREFETCH_BYTES 8192

static uint8_t MUL[256][256];
static uint8_t NIBBLES[256][32];
static uint64_t AFFINE[256];

static int all_ones(const uint8_t *coefs, size_t count) {
    for (size_t i = 0; i < count; i++)
        if (coefs[i] != 1) return 0;
    return 1;
}

static size_t block_bytes(int k, int r) {
    if (r <= GROUP) return SIZE_MAX; /* one pass: every source byte is read once anyway */
    size_t block = L2_BLOCK_BYTES / (size_t)(k + GROUP) / 64 * 64;
    return block < 1024 ? 1024 : block;
}

/* ---------------------------------------------------------------- scalar (any CPU) */

/* d[o] ^= c * s[o] for o < len. */
static void mul_xor_bytes(uint8_t *d, const uint8_t *s, uint8_t c, size_t len) {
    if (c == 0) return;
    if (c == 1) {
        for (size_t o = 0; o < len; o++) d[o] ^= s[o];
        return;
    }
    const uint8_t *t = MUL[c];
    for (size_t o = 0; o < len; o++) d[o] ^= t[s[o]];
}

/* matmul restricted to the byte range [off, off + len) of every buffer; coefs row stride k. */
static void scalar_range(uint8_t *const *dst, int r, const uint8_t *const *src, int k,
                         const uint8_t *coefs, size_t off, size_t len, int accumulate) {
    if (len == 0) return;
    for (int j = 0; j < r; j++) {
        if (!accumulate) memset(dst[j] + off, 0, len);
        for (int i = 0; i < k; i++)
            mul_xor_bytes(dst[j] + off, src[i] + off, coefs[(size_t)j * k + i], len);
    }
}

static void scalar_matmul(uint8_t *const *dst, int r, const uint8_t *const *src, int k,
                          const uint8_t *coefs, size_t n, int accumulate) {
    /* Small blocks keep dst in L1 while every source is folded into it. */
    const size_t block = 4096;
    for (size_t off = 0; off < n; off += block)
        scalar_range(dst, r, src, k, coefs, off, n - off < block ? n - off : block, accumulate);
}

static size_t prefetch_distance(size_t row_bytes, int P) {
    size_t rows = PREFETCH_BYTES / (row_bytes * (size_t)P);
    return rows < 4 ? 4 : rows > 64 ? 64 : rows;
}

/* Prefetches every cache line of one row in each of the P parity shards. */
static void prefetch_row(uint8_t *parity, size_t shard_stride, int P, size_t row_off,
                         size_t row_bytes) {
    for (int p = 0; p < P; p++) {
        const uintptr_t start = (uintptr_t)(parity + (size_t)p * shard_stride + row_off);
        for (uintptr_t line = start & ~(uintptr_t)63; line < start + row_bytes; line += 64)
            __builtin_prefetch((const void *)line, 1, 2);
    }
}

static void scalar_update_rows(uint8_t *parity, size_t shard_stride, int P, const uint8_t *coefs,
                               const int64_t *rows, size_t m, const uint8_t *delta,
                               size_t row_bytes) {
    const size_t ahead = prefetch_distance(row_bytes, P);
    for (size_t t = 0; t < m; t++) {
        if (t + ahead < m)
            prefetch_row(parity, shard_stride, P, (size_t)rows[t + ahead] * row_bytes, row_bytes);
        uint8_t *row = parity + (size_t)rows[t] * row_bytes;
        for (int p = 0; p < P; p++)
            mul_xor_bytes(row + (size_t)p * shard_stride, delta + t * row_bytes, coefs[p],
                          row_bytes);
    }
}

#ifdef GF_X86
/* ---------------------------------------------------------------- SIMD kernels
 *
 * Each instruction set defines, with the same suffix:
 *   V: a vector of W bytes, and load / store / xor / zero on it,
 *   S: a source vector prepared once for multiplication by several constants (prep),
 *   mul(S, c): c * x for every byte x of the vector.
 * DEFINE_SIMD_KERNELS then builds matmul and update_rows from those.
 */

#define AVX2 __attribute__((target("avx2")))
#define AVX512 __attribute__((target("avx2,avx512f,avx512bw")))
#define GFNI_AVX2 __attribute__((target("avx2,gfni")))
#define GFNI_AVX512 __attribute__((target("avx2,avx512f,avx512bw,gfni")))
#define INLINE static inline __attribute__((always_inline))

/* Split-nibble pshufb, 32 bytes. */
typedef struct { __m256i lo, hi; } avx2_src;
INLINE AVX2 __m256i avx2_load(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
INLINE AVX2 void avx2_store(uint8_t *p, __m256i v) { _mm256_storeu_si256((__m256i *)p, v); }
INLINE AVX2 __m256i avx2_xor(__m256i a, __m256i b) { return _mm256_xor_si256(a, b); }
INLINE AVX2 __m256i avx2_zero(void) { return _mm256_setzero_si256(); }
INLINE AVX2 avx2_src avx2_prep(__m256i x) {
    const __m256i mask = _mm256_set1_epi8(0x0f);
    avx2_src s = {_mm256_and_si256(x, mask), _mm256_and_si256(_mm256_srli_epi16(x, 4), mask)};
    return s;
}
INLINE AVX2 __m256i avx2_mul(avx2_src s, uint8_t c) {
    const __m256i lo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)NIBBLES[c]));
    const __m256i hi =
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(NIBBLES[c] + 16)));
    return _mm256_xor_si256(_mm256_shuffle_epi8(lo, s.lo), _mm256_shuffle_epi8(hi, s.hi));
}

/* Split-nibble pshufb, 64 bytes (AVX-512BW without GFNI, e.g. Skylake-SP/Cascade Lake). */
typedef struct { __m512i lo, hi; } avx512_src;
INLINE AVX512 __m512i avx512_load(const uint8_t *p) { return _mm512_loadu_si512(p); }
INLINE AVX512 void avx512_store(uint8_t *p, __m512i v) { _mm512_storeu_si512(p, v); }
INLINE AVX512 __m512i avx512_xor(__m512i a, __m512i b) { return _mm512_xor_si512(a, b); }
INLINE AVX512 __m512i avx512_zero(void) { return _mm512_setzero_si512(); }
INLINE AVX512 avx512_src avx512_prep(__m512i x) {
    const __m512i mask = _mm512_set1_epi8(0x0f);
    avx512_src s = {_mm512_and_si512(x, mask), _mm512_and_si512(_mm512_srli_epi16(x, 4), mask)};
    return s;
}
INLINE AVX512 __m512i avx512_mul(avx512_src s, uint8_t c) {
    const __m512i lo = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)NIBBLES[c]));
    const __m512i hi = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(NIBBLES[c] + 16)));
    return _mm512_xor_si512(_mm512_shuffle_epi8(lo, s.lo), _mm512_shuffle_epi8(hi, s.hi));
}

/* GFNI affine, 32 bytes (VEX encoding: GFNI without AVX-512, e.g. Alder Lake, Sierra Forest). */
INLINE GFNI_AVX2 __m256i gfni_avx2_prep(__m256i x) { return x; }
INLINE GFNI_AVX2 __m256i gfni_avx2_mul(__m256i x, uint8_t c) {
    return _mm256_gf2p8affine_epi64_epi8(x, _mm256_set1_epi64x((long long)AFFINE[c]), 0);
}
#define gfni_avx2_load avx2_load
#define gfni_avx2_store avx2_store
#define gfni_avx2_xor avx2_xor
#define gfni_avx2_zero avx2_zero

/* GFNI affine, 64 bytes. */
INLINE GFNI_AVX512 __m512i gfni_avx512_prep(__m512i x) { return x; }
INLINE GFNI_AVX512 __m512i gfni_avx512_mul(__m512i x, uint8_t c) {
    return _mm512_gf2p8affine_epi64_epi8(x, _mm512_set1_epi64((long long)AFFINE[c]), 0);
}
#define gfni_avx512_load avx512_load
#define gfni_avx512_store avx512_store
#define gfni_avx512_xor avx512_xor
#define gfni_avx512_zero avx512_zero

/*
 * ISA##_group: matmul for G <= GROUP outputs over the byte range [off, off + len). Every source
 * vector is loaded once and folded into all G accumulators. Inlined with constant G and
 * xor_only, so the accumulator array lives in registers and the branches vanish.
 */
#define DEFINE_SIMD_KERNELS(ISA, TARGET, V, W, S)                                                 \
    INLINE TARGET void ISA##_group(uint8_t *const *dst, const int G, const uint8_t *const *src,   \
                                   int k, const uint8_t *coefs, size_t off, size_t len,           \
                                   int accumulate, const int xor_only) {                          \
        const size_t end = off + len / W * W;                                                     \
        for (size_t o = off; o < end; o += W) {                                                   \
            V acc[GROUP];                                                                         \
            for (int g = 0; g < G; g++) acc[g] = accumulate ? ISA##_load(dst[g] + o) : ISA##_zero(); \
            for (int i = 0; i < k; i++) {                                                         \
                const V x = ISA##_load(src[i] + o);                                               \
                if (xor_only) {                                                                   \
                    acc[0] = ISA##_xor(acc[0], x);                                                \
                } else {                                                                          \
                    const S s = ISA##_prep(x);                                                    \
                    for (int g = 0; g < G; g++)                                                   \
                        acc[g] = ISA##_xor(acc[g], ISA##_mul(s, coefs[(size_t)g * k + i]));       \
                }                                                                                 \
            }                                                                                     \
            for (int g = 0; g < G; g++) ISA##_store(dst[g] + o, acc[g]);                          \
        }                                                                                         \
        scalar_range(dst, G, src, k, coefs, end, off + len - end, accumulate);                    \
    }                                                                                             \
                                                                                                  \
    static TARGET void ISA##_matmul(uint8_t *const *dst, int r, const uint8_t *const *src, int k, \
                                    const uint8_t *coefs, size_t n, int accumulate) {             \
        const int xor_only = r == 1 && all_ones(coefs, (size_t)k);                                \
        const size_t block = block_bytes(k, r);                                                   \
        for (size_t off = 0; off < n; off += block) {                                             \
            const size_t len = n - off < block ? n - off : block;                                 \
            for (int g0 = 0; g0 < r; g0 += GROUP) {                                               \
                uint8_t *const *d = dst + g0;                                                     \
                const uint8_t *c = coefs + (size_t)g0 * k;                                        \
                switch (r - g0 < GROUP ? r - g0 : GROUP) {                                        \
                case 1:                                                                           \
                    if (xor_only)                                                                 \
                        ISA##_group(d, 1, src, k, c, off, len, accumulate, 1);                    \
                    else                                                                          \
                        ISA##_group(d, 1, src, k, c, off, len, accumulate, 0);                    \
                    break;                                                                        \
                case 2: ISA##_group(d, 2, src, k, c, off, len, accumulate, 0); break;             \
                case 3: ISA##_group(d, 3, src, k, c, off, len, accumulate, 0); break;             \
                default: ISA##_group(d, 4, src, k, c, off, len, accumulate, 0); break;            \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    static TARGET void ISA##_update_rows(uint8_t *parity, size_t shard_stride, int P,             \
                                         const uint8_t *coefs, const int64_t *rows, size_t m,     \
                                         const uint8_t *delta, size_t row_bytes) {                \
        const int xor_only = all_ones(coefs, (size_t)P);                                          \
        const size_t end = row_bytes / W * W;                                                     \
        const size_t ahead = prefetch_distance(row_bytes, P);                                     \
        for (size_t t = 0; t < m; t++) {                                                          \
            if (t + ahead < m)                                                                    \
                prefetch_row(parity, shard_stride, P, (size_t)rows[t + ahead] * row_bytes,        \
                             row_bytes);                                                          \
            uint8_t *row = parity + (size_t)rows[t] * row_bytes;                                  \
            const uint8_t *s = delta + t * row_bytes;                                             \
            for (size_t o = 0; o < end; o += W) {                                                 \
                const V x = ISA##_load(s + o);                                                    \
                const S sx = ISA##_prep(x);                                                       \
                for (int p = 0; p < P; p++) {                                                     \
                    uint8_t *d = row + (size_t)p * shard_stride + o;                              \
                    const V y = xor_only ? x : ISA##_mul(sx, coefs[p]);                           \
                    ISA##_store(d, ISA##_xor(ISA##_load(d), y));                                  \
                }                                                                                 \
            }                                                                                     \
            for (int p = 0; p < P; p++)                                                           \
                mul_xor_bytes(row + (size_t)p * shard_stride + end, s + end, coefs[p],            \
                              row_bytes - end);                                                   \
        }                                                                                         \
    }

DEFINE_SIMD_KERNELS(avx2, AVX2, __m256i, 32, avx2_src)
DEFINE_SIMD_KERNELS(avx512, AVX512, __m512i, 64, avx512_src)
DEFINE_SIMD_KERNELS(gfni_avx2, GFNI_AVX2, __m256i, 32, __m256i)
DEFINE_SIMD_KERNELS(gfni_avx512, GFNI_AVX512, __m512i, 64, __m512i)

static int has_avx2(void) { return __builtin_cpu_supports("avx2"); }
static int has_avx512(void) {
    return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}
static int has_gfni_avx2(void) { return has_avx2() && __builtin_cpu_supports("gfni"); }
static int has_gfni_avx512(void) { return has_avx512() && __builtin_cpu_supports("gfni"); }
#endif /* GF_X86 */

/* ---------------------------------------------------------------- dispatch */

typedef void (*matmul_fn)(uint8_t *const *, int, const uint8_t *const *, int, const uint8_t *,
                          size_t, int);
typedef void (*update_rows_fn)(uint8_t *, size_t, int, const uint8_t *, const int64_t *, size_t,
                               const uint8_t *, size_t);
typedef struct {
    const char *name;
    int (*supported)(void);
    matmul_fn matmul;
    update_rows_fn update_rows;
} isa_t;

static int always(void) { return 1; }

/* Slowest first; the default is the last one the CPU supports. */
static const isa_t ISAS[] = {
    {"scalar", always, scalar_matmul, scalar_update_rows},
#ifdef GF_X86
    {"avx2", has_avx2, avx2_matmul, avx2_update_rows},
    {"avx512", has_avx512, avx512_matmul, avx512_update_rows},
    {"gfni-avx2", has_gfni_avx2, gfni_avx2_matmul, gfni_avx2_update_rows},
    {"gfni-avx512", has_gfni_avx512, gfni_avx512_matmul, gfni_avx512_update_rows},
#endif
};
#define NUM_ISAS ((int)(sizeof(ISAS) / sizeof(ISAS[0])))

static const isa_t *active = &ISAS[0];
static int initialized = 0;

/* ---------------------------------------------------------------- Python bindings */

static PyObject *py_init(PyObject *self, PyObject *args) {
    Py_buffer table;
    if (!PyArg_ParseTuple(args, "y*", &table)) return NULL;
    if (table.len != 256 * 256) {
        PyBuffer_Release(&table);
        PyErr_SetString(PyExc_ValueError, "init() expects the 65536-byte table MUL[a][b] = a * b");
        return NULL;
    }
    memcpy(MUL, table.buf, sizeof(MUL));
    PyBuffer_Release(&table);
    for (int c = 0; c < 256; c++) {
        for (int x = 0; x < 16; x++) {
            NIBBLES[c][x] = MUL[c][x];
            NIBBLES[c][16 + x] = MUL[c][x << 4];
        }
        uint64_t matrix = 0;
        for (int p = 0; p < 8; p++) {
            uint64_t row = 0;
            for (int q = 0; q < 8; q++) row |= (uint64_t)((MUL[c][1 << q] >> p) & 1) << q;
            matrix |= row << (8 * (7 - p));
        }
        AFFINE[c] = matrix;
    }
    initialized = 1;
    Py_RETURN_NONE;
}

static PyObject *py_isas(PyObject *self, PyObject *noargs) {
    PyObject *names = PyList_New(0);
    if (names == NULL) return NULL;
    for (int i = 0; i < NUM_ISAS; i++) {
        if (!ISAS[i].supported()) continue;
        PyObject *name = PyUnicode_FromString(ISAS[i].name);
        if (name == NULL || PyList_Append(names, name) < 0) {
            Py_XDECREF(name);
            Py_DECREF(names);
            return NULL;
        }
        Py_DECREF(name);
    }
    PyObject *result = PyList_AsTuple(names);
    Py_DECREF(names);
    return result;
}

static PyObject *py_get_isa(PyObject *self, PyObject *noargs) {
    return PyUnicode_FromString(active->name);
}

static PyObject *py_set_isa(PyObject *self, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    for (int i = 0; i < NUM_ISAS; i++) {
        if (strcmp(ISAS[i].name, name) != 0) continue;
        if (!ISAS[i].supported()) {
            PyErr_Format(PyExc_ValueError, "this CPU does not support the '%s' kernels", name);
            return NULL;
        }
        active = &ISAS[i];
        Py_RETURN_NONE;
    }
    PyErr_Format(PyExc_ValueError, "unknown instruction set '%s'", name);
    return NULL;
}

/* Fills out[0:count) from a sequence of int addresses; returns count or -1 with an error set. */
static Py_ssize_t parse_pointers(PyObject *seq, uint8_t **out, const char *what) {
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of buffer addresses");
    if (fast == NULL) return -1;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
    if (count < 1 || count > MAX_SHARDS) {
        PyErr_Format(PyExc_ValueError, "expected 1 to %d %s addresses, got %zd", MAX_SHARDS, what,
                     count);
        Py_DECREF(fast);
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        out[i] = (uint8_t *)PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(fast, i));
        if (out[i] == NULL && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    return count;
}

static int check_initialized(void) {
    if (!initialized) PyErr_SetString(PyExc_RuntimeError, "call init(MUL_TABLE) first");
    return initialized;
}

static PyObject *py_matmul(PyObject *self, PyObject *args) {
    PyObject *dst_seq, *src_seq;
    Py_buffer coefs;
    Py_ssize_t n;
    int accumulate;
    if (!check_initialized()) return NULL;
    if (!PyArg_ParseTuple(args, "OOy*np", &dst_seq, &src_seq, &coefs, &n, &accumulate))
        return NULL;
    uint8_t *dst[MAX_SHARDS], *src[MAX_SHARDS];
    Py_ssize_t r = parse_pointers(dst_seq, dst, "destination");
    Py_ssize_t k = r < 0 ? -1 : parse_pointers(src_seq, src, "source");
    if (k >= 0 && (coefs.len != r * k || n < 0)) {
        PyErr_Format(PyExc_ValueError, "expected %zd coefficients and n >= 0, got %zd and n=%zd",
                     r * k, coefs.len, n);
        k = -1;
    }
    if (k < 0) {
        PyBuffer_Release(&coefs);
        return NULL;
    }
    matmul_fn fn = active->matmul;
    Py_BEGIN_ALLOW_THREADS
    fn(dst, (int)r, (const uint8_t *const *)src, (int)k, (const uint8_t *)coefs.buf, (size_t)n,
       accumulate);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&coefs);
    Py_RETURN_NONE;
}

static PyObject *py_update_rows(PyObject *self, PyObject *args) {
    PyObject *parity_obj, *rows_obj, *delta_obj;
    Py_ssize_t shard_stride, m, num_rows, row_bytes;
    Py_buffer coefs;
    if (!check_initialized()) return NULL;
    if (!PyArg_ParseTuple(args, "Ony*OnnOn", &parity_obj, &shard_stride, &coefs, &rows_obj, &m,
                          &num_rows, &delta_obj, &row_bytes))
        return NULL;
    uint8_t *parity = (uint8_t *)PyLong_AsVoidPtr(parity_obj);
    const int64_t *rows = (const int64_t *)PyLong_AsVoidPtr(rows_obj);
    const uint8_t *delta = (const uint8_t *)PyLong_AsVoidPtr(delta_obj);
    if (PyErr_Occurred()) goto fail;
    if (coefs.len < 1 || coefs.len > MAX_SHARDS || m < 0 || num_rows < 0 || row_bytes < 1 ||
        shard_stride < 0) {
        PyErr_SetString(PyExc_ValueError, "update_rows: bad sizes");
        goto fail;
    }
    /* Checked before any write, so that a bad index leaves the parity untouched. */
    for (Py_ssize_t t = 0; t < m; t++) {
        if (rows[t] < 0 || rows[t] >= num_rows) {
            PyErr_Format(PyExc_ValueError,
                         "rows[%zd] = %lld is out of range: the parity has %zd rows of %zd bytes",
                         t, (long long)rows[t], num_rows, row_bytes);
            goto fail;
        }
    }
    update_rows_fn fn = active->update_rows;
    Py_BEGIN_ALLOW_THREADS
    fn(parity, (size_t)shard_stride, (int)coefs.len, (const uint8_t *)coefs.buf, rows, (size_t)m,
       delta, (size_t)row_bytes);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&coefs);
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&coefs);
    return NULL;
}

/* out[t] = table[rows[t]] ^ old[at ? at[t] : t] over rows of row_bytes bytes (t < m): one pass that gathers the
 * current bytes of updated rows and XORs in their previous bytes, writing each delta once. */
static void gather_xor(uint8_t *out, const uint8_t *table, const int64_t *rows, size_t m,
                       const uint8_t *old, const int64_t *at, size_t row_bytes) {
    const size_t ahead = 8;
    for (size_t t = 0; t < m; t++) {
        if (t + ahead < m) {  /* every line of the rows ahead: one prefetch per row leaves the rest to chance */
            const uint8_t *a = table + (size_t)rows[t + ahead] * row_bytes;
            const uint8_t *b = at ? old + (size_t)at[t + ahead] * row_bytes : NULL;
            for (size_t i = 0; i < row_bytes; i += 64) {
                __builtin_prefetch(a + i, 0, 1);
                if (b) __builtin_prefetch(b + i, 0, 1);
            }
        }
        const uint8_t *a = table + (size_t)rows[t] * row_bytes, *b = old + (at ? (size_t)at[t] : t) * row_bytes;
        uint8_t *d = out + t * row_bytes;
        size_t i = 0;
        for (; i + 8 <= row_bytes; i += 8) {
            uint64_t x, y;
            memcpy(&x, a + i, 8);
            memcpy(&y, b + i, 8);
            x ^= y;
            memcpy(d + i, &x, 8);
        }
        for (; i < row_bytes; i++) d[i] = a[i] ^ b[i];
    }
}

static int check_indices(const int64_t *index, Py_ssize_t m, Py_ssize_t bound, const char *what) {
    for (Py_ssize_t t = 0; t < m; t++) {
        if (index[t] < 0 || index[t] >= bound) {
            PyErr_Format(PyExc_ValueError, "%s[%zd] = %lld is out of range [0, %zd)", what, t, (long long)index[t],
                         bound);
            return 0;
        }
    }
    return 1;
}

static PyObject *py_gather_xor(PyObject *self, PyObject *args) {
    PyObject *out_obj, *table_obj, *rows_obj, *old_obj;
    Py_ssize_t m, num_rows, row_bytes;
    if (!PyArg_ParseTuple(args, "OOnOnOn", &out_obj, &table_obj, &num_rows, &rows_obj, &m, &old_obj,
                          &row_bytes))
        return NULL;
    uint8_t *out = (uint8_t *)PyLong_AsVoidPtr(out_obj);
    const uint8_t *table = (const uint8_t *)PyLong_AsVoidPtr(table_obj);
    const int64_t *rows = (const int64_t *)PyLong_AsVoidPtr(rows_obj);
    const uint8_t *old = (const uint8_t *)PyLong_AsVoidPtr(old_obj);
    if (PyErr_Occurred()) return NULL;
    if (m < 0 || num_rows < 0 || row_bytes < 1) {
        PyErr_SetString(PyExc_ValueError, "gather_xor: bad sizes");
        return NULL;
    }
    if (!check_indices(rows, m, num_rows, "rows")) return NULL;
    Py_BEGIN_ALLOW_THREADS
    gather_xor(out, table, rows, (size_t)m, old, NULL, (size_t)row_bytes);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_gather_xor_at(PyObject *self, PyObject *args) {
    PyObject *out_obj, *table_obj, *rows_obj, *old_obj, *at_obj;
    Py_ssize_t m, num_rows, old_rows, row_bytes;
    if (!PyArg_ParseTuple(args, "OOnOnOnOn", &out_obj, &table_obj, &num_rows, &rows_obj, &m, &old_obj, &old_rows,
                          &at_obj, &row_bytes))
        return NULL;
    uint8_t *out = (uint8_t *)PyLong_AsVoidPtr(out_obj);
    const uint8_t *table = (const uint8_t *)PyLong_AsVoidPtr(table_obj);
    const int64_t *rows = (const int64_t *)PyLong_AsVoidPtr(rows_obj);
    const uint8_t *old = (const uint8_t *)PyLong_AsVoidPtr(old_obj);
    const int64_t *at = (const int64_t *)PyLong_AsVoidPtr(at_obj);
    if (PyErr_Occurred()) return NULL;
    if (m < 0 || num_rows < 0 || old_rows < 0 || row_bytes < 1) {
        PyErr_SetString(PyExc_ValueError, "gather_xor_at: bad sizes");
        return NULL;
    }
    if (!check_indices(rows, m, num_rows, "rows") || !check_indices(at, m, old_rows, "at")) return NULL;
    Py_BEGIN_ALLOW_THREADS
    gather_xor(out, table, rows, (size_t)m, old, at, (size_t)row_bytes);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- undo log of touched rows
 * A table's undo log: pos[row] (int32) is the row's place in the log since the last commit, -1 if not logged;
 * log_rows (int64) lists the logged rows by the capture that first touched them, each capture's in increasing order. */

/* Sorts keys[0:m] (each < 2^(8 * bytes)) in place, least significant byte first; tmp holds m keys. */
static void radix_sort(int64_t *keys, int64_t *tmp, size_t m, int bytes) {
    int64_t *src = keys, *dst = tmp;
    for (int b = 0; b < bytes; b++) {
        size_t count[257] = {0};
        const int shift = 8 * b;
        for (size_t t = 0; t < m; t++) count[((uint64_t)src[t] >> shift & 255) + 1]++;
        for (int d = 0; d < 256; d++) count[d + 1] += count[d];
        for (size_t t = 0; t < m; t++) dst[count[(uint64_t)src[t] >> shift & 255]++] = src[t];
        int64_t *swap = src;
        src = dst;
        dst = swap;
    }
    if (src != keys) memcpy(keys, src, m * sizeof(int64_t));
}

static PyObject *py_undo_mark(PyObject *self, PyObject *args) {
    PyObject *ids_obj, *pos_obj, *log_obj;
    Py_ssize_t m, num_rows, n, cap;
    if (!PyArg_ParseTuple(args, "OnOnOnn", &ids_obj, &m, &pos_obj, &num_rows, &log_obj, &n, &cap)) return NULL;
    const int64_t *ids = (const int64_t *)PyLong_AsVoidPtr(ids_obj);
    int32_t *pos = (int32_t *)PyLong_AsVoidPtr(pos_obj);
    int64_t *log_rows = (int64_t *)PyLong_AsVoidPtr(log_obj);
    if (PyErr_Occurred()) return NULL;
    if (m < 0 || num_rows < 0 || num_rows > INT32_MAX || n < 0 || n > num_rows ||
        cap < (n + m < num_rows ? n + m : num_rows)) {
        PyErr_SetString(PyExc_ValueError, "undo_mark: bad sizes (the log needs room for min(num_rows, n + m) rows)");
        return NULL;
    }
    if (!check_indices(ids, m, num_rows, "ids")) return NULL;
    int64_t *tmp = (int64_t *)PyMem_RawMalloc((m ? (size_t)m : 1) * sizeof(int64_t));
    if (tmp == NULL) return PyErr_NoMemory();
    const Py_ssize_t first = n;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t t = 0; t < m; t++) {  /* each new id once: its place is claimed, numbered below */
        const int64_t id = ids[t];
        if (pos[id] < 0) {
            pos[id] = INT32_MAX;
            log_rows[n++] = id;
        }
    }
    int bytes = 0;
    for (uint64_t top = num_rows > 0 ? (uint64_t)(num_rows - 1) : 0; top; top >>= 8) bytes++;
    radix_sort(log_rows + first, tmp, (size_t)(n - first), bytes);
    for (Py_ssize_t i = first; i < n; i++) pos[log_rows[i]] = (int32_t)i;
    Py_END_ALLOW_THREADS
    PyMem_RawFree(tmp);
    return PyLong_FromSsize_t(n);
}

static PyObject *py_undo_sorted(PyObject *self, PyObject *args) {
    PyObject *pos_obj, *rows_obj, *at_obj;
    Py_ssize_t num_rows, n;
    if (!PyArg_ParseTuple(args, "OnOOn", &pos_obj, &num_rows, &rows_obj, &at_obj, &n)) return NULL;
    const int32_t *pos = (const int32_t *)PyLong_AsVoidPtr(pos_obj);
    int64_t *rows = (int64_t *)PyLong_AsVoidPtr(rows_obj);
    int64_t *at = (int64_t *)PyLong_AsVoidPtr(at_obj);
    if (PyErr_Occurred()) return NULL;
    if (num_rows < 0 || n < 0) {
        PyErr_SetString(PyExc_ValueError, "undo_sorted: bad sizes");
        return NULL;
    }
    Py_ssize_t count = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t row = 0; row < num_rows && count < n; row++) {  /* branch-free: the marks are dense and random */
        const int32_t p = pos[row];
        rows[count] = row;
        at[count] = p;
        count += p >= 0;
    }
    Py_END_ALLOW_THREADS
    if (count != n) {
        PyErr_Format(PyExc_ValueError, "undo_sorted: %zd rows logged but %zd expected", count, n);
        return NULL;
    }
    return PyLong_FromSsize_t(count);
}

static PyMethodDef methods[] = {
    {"gather_xor", py_gather_xor, METH_VARARGS,
     "gather_xor(out: int, table: int, num_rows: int, rows: int, m: int, old: int, row_bytes: int) -> None\n\n"
     "out[t] = table[rows[t]] ^ old[t] for t < m: rows of row_bytes bytes, rows int64 [m] in [0, num_rows);\n"
     "raises ValueError, writing nothing, if a row is out of range. Buffers are addresses."},
    {"gather_xor_at", py_gather_xor_at, METH_VARARGS,
     "gather_xor_at(out: int, table: int, num_rows: int, rows: int, m: int, old: int, old_rows: int, at: int,"
     " row_bytes: int) -> None\n\n"
     "out[t] = table[rows[t]] ^ old[at[t]] for t < m: rows int64 [m] in [0, num_rows), at int64 [m] in\n"
     "[0, old_rows); raises ValueError, writing nothing, if an index is out of range. Buffers are addresses."},
    {"undo_mark", py_undo_mark, METH_VARARGS,
     "undo_mark(ids: int, m: int, pos: int, num_rows: int, log_rows: int, n: int, cap: int) -> int\n\n"
     "Appends to log_rows (int64, n rows logged, room for cap) each of ids (int64 [m]) not logged yet\n"
     "(pos[id] < 0, pos int32 [num_rows]), once and in increasing order, setting pos[id] to its place;\n"
     "returns the new n. Raises\n"
     "ValueError, changing nothing, if an id is out of range or cap < min(num_rows, n + m)."},
    {"undo_sorted", py_undo_sorted, METH_VARARGS,
     "undo_sorted(pos: int, num_rows: int, rows: int, at: int, n: int) -> int\n\n"
     "Writes the n logged rows (pos[row] >= 0) in increasing order to rows and their places pos[row] to at\n"
     "(both int64 [n]); raises ValueError if the log does not hold n rows."},
    {"init", py_init, METH_VARARGS,
     "init(table: bytes) -> None\n\nSet the field: table[256 * a + b] = a * b (gf256.MUL_TABLE)."},
    {"isas", py_isas, METH_NOARGS,
     "isas() -> tuple[str, ...]\n\nInstruction sets this CPU runs, slowest first."},
    {"get_isa", py_get_isa, METH_NOARGS, "get_isa() -> str\n\nThe instruction set in use."},
    {"set_isa", py_set_isa, METH_VARARGS,
     "set_isa(name: str) -> None\n\nUse the named instruction set (one of isas())."},
    {"matmul", py_matmul, METH_VARARGS,
     "matmul(dst: Sequence[int], src: Sequence[int], coefs: bytes, n: int, accumulate: bool)"
     " -> None\n\n"
     "dst[j] = (dst[j] if accumulate else 0) ^ XOR_i coefs[j * k + i] * src[i] over n bytes;\n"
     "dst and src are buffer addresses (r and k of them), which must not overlap."},
    {"update_rows", py_update_rows, METH_VARARGS,
     "update_rows(parity: int, shard_stride: int, coefs: bytes, rows: int, m: int,"
     " num_rows: int, delta: int, row_bytes: int) -> None\n\n"
     "parity[p][rows[t]] ^= coefs[p] * delta[t] for p < len(coefs), t < m, where parity[p] is\n"
     "num_rows rows of row_bytes bytes at parity + p * shard_stride, rows is int64 [m] and delta\n"
     "is m rows of row_bytes bytes. Raises ValueError, changing nothing, if a row is out of range."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_gf256",
    "GF(2^8) multiply-accumulate kernels with run-time instruction set dispatch.", -1, methods,
};

PyMODINIT_FUNC PyInit__gf256(void) {
    for (int i = NUM_ISAS - 1; i >= 0; i--) {
        if (ISAS[i].supported()) {
            active = &ISAS[i];
            break;
        }
    }
    return PyModule_Create(&module);
}
