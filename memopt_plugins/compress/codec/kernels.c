/* Fused CPU kernels of the activation codec, called through ctypes by native.py.
 *
 * reference.py holds the specification, and with round-to-nearest these kernels write the same
 * bytes as its torch code (tests/test_native.py checks it). Quantizing makes one pass over memory
 * (group statistics, parameters, codes and packing while a block of groups is in cache) instead
 * of torch's dozen, decoding one; both work on a range of groups, so callers can split a tensor.
 * With AVX-512, float32 and bfloat16 groups are read in place, codes are packed in a register as
 * they are made with the noise hashed in registers, and 4- and 2-bit codes decode by table; the
 * AVX2 and plain C paths write the same bytes (tests/test_native.py builds them).
 *
 * Element types (dtype argument): 0 float32, 1 bfloat16, 2 float16. Codes are packed low bits
 * first, 8 / bits per byte, in the order of the flattened tensor: its index order, also for a
 * strided view, which is read (and a decode written) where it lies.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define MEMOPT_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define MEMOPT_AVX2 1
#endif
#if defined(MEMOPT_AVX512) || defined(MEMOPT_AVX2)
#include <immintrin.h>
#endif

enum { F32 = 0, BF16 = 1, F16 = 2 };

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even; finite input (decoded values always are). */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Elements [start, start + count) of x as float32 into buf. */
static void load(const void *x, int dtype, int64_t start, int64_t count, float *buf) {
    if (dtype == F32) {
        memcpy(buf, (const float *)x + start, (size_t)count * sizeof(float));
    } else if (dtype == BF16) {
        const uint16_t *p = (const uint16_t *)x + start;
        for (int64_t i = 0; i < count; i++) buf[i] = from_bf16(p[i]);
    } else {
        const _Float16 *p = (const _Float16 *)x + start;
        for (int64_t i = 0; i < count; i++) buf[i] = (float)p[i];
    }
}

/* A group's elements as float32: in place for a whole float32 group, else converted into buf
 * (group_size floats); the tensor's last group is padded by repeating its last element, as
 * reference.py's Groups does. */
static const float *load_group(const void *x, int dtype, int64_t numel, int64_t group_size,
                               int64_t g, float *buf) {
    int64_t start = g * group_size;
    int64_t count = numel - start < group_size ? numel - start : group_size;
    if (dtype == F32 && count == group_size) return (const float *)x + start;
    load(x, dtype, start, count, buf);
    for (int64_t i = count; i < group_size; i++) buf[i] = buf[count - 1];
    return buf;
}

/* A tensor that is not one contiguous run (a transpose, a permutation, a slice with gaps), read
 * and written in its index order (row-major over its sizes): sizes and strides in elements, with
 * size-1 dims dropped and dims that continue one another merged (strided_of). */
#define MAX_DIMS 16
typedef struct {
    int ndim;
    int64_t size[MAX_DIMS], stride[MAX_DIMS];
} strided_t;

/* The layout of ndim sizes and strides, simplified; NULL (contiguous) where ndim is 0. */
static const strided_t *strided_of(int ndim, const int64_t *size, const int64_t *stride,
                                   strided_t *out) {
    if (ndim <= 0) return NULL;
    out->ndim = 0;
    for (int d = 0; d < ndim && d < MAX_DIMS; d++) {
        if (size[d] == 1) continue;
        const int n = out->ndim;
        if (n > 0 && out->stride[n - 1] == stride[d] * size[d]) { /* one run with the last */
            out->size[n - 1] *= size[d];
            out->stride[n - 1] = stride[d];
            continue;
        }
        out->size[n] = size[d];
        out->stride[n] = stride[d];
        out->ndim = n + 1;
    }
    if (out->ndim == 0) { /* one element */
        out->ndim = 1;
        out->size[0] = 1;
        out->stride[0] = 1;
    }
    return out;
}

/* An element of a strided layout: its index along each dim and where it lies (in elements). */
typedef struct {
    int64_t index[MAX_DIMS];
    int64_t at;
} cursor_t;

/* The cursor of element `index` (in index order). */
static cursor_t cursor_at(const strided_t *s, int64_t index) {
    cursor_t c;
    c.at = 0;
    for (int d = s->ndim - 1; d >= 0; d--) {
        c.index[d] = index % s->size[d];
        c.at += c.index[d] * s->stride[d];
        index /= s->size[d];
    }
    return c;
}

/* The length of the run along the last dim that starts at c, at most `most` elements. */
static inline int64_t run_of(const strided_t *s, const cursor_t *c, int64_t most) {
    const int64_t run = s->size[s->ndim - 1] - c->index[s->ndim - 1];
    return run < most ? run : most;
}

/* Move c on by `run` elements of its run along the last dim, to the next run where it ends. */
static inline void advance(const strided_t *s, cursor_t *c, int64_t run) {
    int d = s->ndim - 1;
    c->index[d] += run;
    c->at += run * s->stride[d];
    for (; d > 0 && c->index[d] == s->size[d]; d--) { /* carry into the dim above */
        c->at += s->stride[d - 1] - s->size[d] * s->stride[d];
        c->index[d] = 0;
        c->index[d - 1] += 1;
    }
}

/* The `count` elements from cursor c on, in index order, as float32 into buf, a run at a time;
 * c moves past them (consecutive groups go on from where the last ended). */
static void gather(const void *x, int dtype, const strided_t *s, cursor_t *c, int64_t count,
                   float *buf) {
    const int64_t step = s->stride[s->ndim - 1];
    for (int64_t i = 0, run; i < count; i += run) {
        run = run_of(s, c, count - i);
        if (step == 1) {
            load(x, dtype, c->at, run, buf + i);
        } else {
            for (int64_t k = 0; k < run; k++) load(x, dtype, c->at + k * step, 1, buf + i + k);
        }
        advance(s, c, run);
    }
}

/* The `count` elements of `width` bytes at src written where the elements from cursor c on lie
 * in out, in index order, a run at a time; c moves past them. */
static void scatter(const char *src, size_t width, const strided_t *s, cursor_t *c, int64_t count,
                    char *out) {
    const int64_t step = s->stride[s->ndim - 1];
    for (int64_t i = 0, run; i < count; i += run) {
        run = run_of(s, c, count - i);
        if (step == 1) {
            memcpy(out + (size_t)c->at * width, src + (size_t)i * width, (size_t)run * width);
        } else {
            for (int64_t k = 0; k < run; k++)
                memcpy(out + (size_t)(c->at + k * step) * width, src + (size_t)(i + k) * width,
                       width);
        }
        advance(s, c, run);
    }
}

/* The float32 whose order key (below) is k: the key flips the magnitude bits of negative
 * floats, so that signed int32 order is the floats' order (NaN aside); flipping is its inverse. */
static inline float from_order_key(int32_t k) {
    int32_t i = k ^ ((k >> 31) & 0x7fffffff);
    float f;
    memcpy(&f, &i, sizeof f);
    return f;
}

/* The group's minimum and maximum from the order keys of its extremes, both NaN when a key lies
 * beyond +inf's (a NaN with the sign bit clear) or below -inf's (one with it set). */
static inline void extremes_of_keys(int32_t lo, int32_t hi, float *mn, float *mx) {
    const int nan = hi > 0x7f800000 || lo < -0x7f800001; /* key of -inf: 0x807fffff */
    *mn = nan ? __builtin_nanf("") : from_order_key(lo);
    *mx = nan ? __builtin_nanf("") : from_order_key(hi);
}

#if !defined(MEMOPT_AVX512) /* AVX-512 builds: minmax_f32 */
/* Minimum and maximum of the n floats at v, both NaN when one is NaN. Integer reductions over
 * order keys: they vectorize where float min/max (NaN rules) do not. */
static void minmax(const float *v, int64_t n, float *mn, float *mx) {
    int32_t lo = INT32_MAX, hi = INT32_MIN;
    for (int64_t i = 0; i < n; i++) {
        int32_t bits;
        memcpy(&bits, &v[i], sizeof bits);
        int32_t k = bits ^ ((bits >> 31) & 0x7fffffff);
        lo = k < lo ? k : lo;
        hi = k > hi ? k : hi;
    }
    extremes_of_keys(lo, hi, mn, mx);
}
#endif

#if defined(MEMOPT_AVX512)
/* Order keys of 16 float32 (or 32 bfloat16) bit patterns: the magnitude bits of negatives
 * flipped (ternary logic 0x78: a ^ (sign & magnitude)). */
static inline __m512i keys32(__m512i a) {
    return _mm512_ternarylogic_epi32(a, _mm512_srai_epi32(a, 31), _mm512_set1_epi32(0x7fffffff),
                                     0x78);
}
static inline __m512i keys16(__m512i a) {
    return _mm512_ternarylogic_epi32(a, _mm512_srai_epi16(a, 15), _mm512_set1_epi16(0x7fff),
                                     0x78);
}

/* minmax of a float32 group in AVX-512: two key vectors per step, masked tail. */
static void minmax_f32(const float *v, int64_t n, float *mn, float *mx) {
    __m512i lo0 = _mm512_set1_epi32(INT32_MAX), hi0 = _mm512_set1_epi32(INT32_MIN);
    __m512i lo1 = lo0, hi1 = hi0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m512i a = keys32(_mm512_loadu_si512(v + i));
        const __m512i b = keys32(_mm512_loadu_si512(v + i + 16));
        lo0 = _mm512_min_epi32(lo0, a);
        hi0 = _mm512_max_epi32(hi0, a);
        lo1 = _mm512_min_epi32(lo1, b);
        hi1 = _mm512_max_epi32(hi1, b);
    }
    for (; i < n; i += 16) {
        const __mmask16 lanes = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m512i a = keys32(_mm512_maskz_loadu_epi32(lanes, v + i));
        lo0 = _mm512_mask_min_epi32(lo0, lanes, lo0, a);
        hi0 = _mm512_mask_max_epi32(hi0, lanes, hi0, a);
    }
    extremes_of_keys(_mm512_reduce_min_epi32(_mm512_min_epi32(lo0, lo1)),
                     _mm512_reduce_max_epi32(_mm512_max_epi32(hi0, hi1)), mn, mx);
}

/* The 16-bit order key's float32 key: the bfloat16's float32 bits are its own shifted left by
 * 16, and a negative's flipped magnitude bits take the low 16 along. */
static inline int32_t key32_of_key16(int32_t k) {
    return (int32_t)((uint32_t)k << 16) | (k < 0 ? 0xffff : 0);
}

/* Reduce 32 signed 16-bit lanes to one, by halves: reduce_min_epi16 and reduce_max_epi16. */
#define MEMOPT_REDUCE_EPI16(OP)                                                                    \
    static inline int32_t reduce_##OP##_epi16(__m512i a) {                                         \
        __m256i h = _mm256_##OP##_epi16(_mm512_castsi512_si256(a),                                 \
                                        _mm512_extracti64x4_epi64(a, 1));                          \
        __m128i q = _mm_##OP##_epi16(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));   \
        q = _mm_##OP##_epi16(q, _mm_shuffle_epi32(q, 0x4e));                                       \
        q = _mm_##OP##_epi16(q, _mm_shuffle_epi32(q, 0xb1));                                       \
        q = _mm_##OP##_epi16(q, _mm_srli_epi32(q, 16));                                            \
        return (int16_t)_mm_cvtsi128_si32(q);                                                      \
    }
MEMOPT_REDUCE_EPI16(min)
MEMOPT_REDUCE_EPI16(max)
#undef MEMOPT_REDUCE_EPI16

/* minmax of a bfloat16 group on its 16-bit keys, 32 lanes a vector (the float32 keys of
 * bfloat16 values are ordered as their 16-bit keys). */
static void minmax_bf16(const uint16_t *v, int64_t n, float *mn, float *mx) {
    __m512i lo = _mm512_set1_epi16(INT16_MAX), hi = _mm512_set1_epi16(INT16_MIN);
    for (int64_t i = 0; i < n; i += 32) {
        const __mmask32 lanes = n - i >= 32 ? (__mmask32)0xffffffffu
                                            : (__mmask32)((1u << (n - i)) - 1);
        const __m512i a = keys16(_mm512_maskz_loadu_epi16(lanes, v + i));
        lo = _mm512_mask_min_epi16(lo, lanes, lo, a);
        hi = _mm512_mask_max_epi16(hi, lanes, hi, a);
    }
    extremes_of_keys(key32_of_key16(reduce_min_epi16(lo)), key32_of_key16(reduce_max_epi16(hi)),
                     mn, mx);
}
#endif

/* f (>= 0) as bfloat16 bits, rounded toward +inf so a step never shrinks:
 * codec._bf16_round_up. In 32 bits, so that loops over groups vectorize. */
static inline uint32_t bf16_round_up(float f) {
    const uint32_t y = to_bf16(f);
    return from_bf16((uint16_t)y) < f ? y + 1 : y;
}

enum { EXACT = 1, CONSTANT = 2, MAX_BLOCK = 16 };

/* Groups quantized as one block: as many as fit in 16 KiB of float32 (L1), 1 to MAX_BLOCK. The
 * statistics and parameters of a block are computed before its codes, so that the parameters'
 * divisions and branches of neighbouring groups overlap. */
static int64_t block_of(int64_t group_size) {
    const int64_t block = 4096 / group_size;
    return block < 1 ? 1 : block > MAX_BLOCK ? MAX_BLOCK : block;
}

/* Whether f (>= 0, not NaN) stays nonzero when rounded to nearest even in the element type:
 * above half of its smallest subnormal (float16: 2^-25; bfloat16: 2^-134, float32 bits 0x8000).
 * Comparisons, not conversions, so that loops over groups vectorize. */
static inline int nonzero_in(int dtype, float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return dtype == F32 ? f != 0.0f : dtype == BF16 ? u > 0x8000u : f > 0x1p-25f;
}

/* The step of a mixed-sign group with zero point zp: k codes reach (k - 1 + first) steps. */
static inline float mixed_step(float mn, float mx, float zp, float top, float first) {
    const float below = -mn / (zp - 1.0f + first), above = mx / (top - zp - 1.0f + first);
    return below >= above ? below : above;
}

/* A group's parameters from its minimum and maximum: codec._group_params, operation for
 * operation in float32, so both give the same bits. Every case is computed and one chosen, with
 * 32-bit fields: no branches, so that loops over groups vectorize. */
typedef struct {
    float inverse;    /* 1 / the step, 1 where the codes need none */
    float zero_point; /* integer-valued */
    uint32_t scale;   /* bfloat16 bits of the stored step; 0 for a group kept exactly */
    uint32_t flags;   /* EXACT: kept exactly; CONSTANT: its value goes in the side table */
} params_t;

static inline __attribute__((always_inline)) params_t
group_params(float mn, float mx, int bits, float first, int dtype, float dtype_max) {
    const float top = (float)((1 << bits) - 1);
    const int finite = __builtin_isfinite(mn) & __builtin_isfinite(mx);
    const int constant = mn == mx;
    mn = finite ? mn : 0.0f;
    mx = finite ? mx : 0.0f;
    /* Mixed signs: the better of the two zero points beside the balance point. */
    const float balance = (-mn / (mx - mn)) * (top - 2.0f + 2.0f * first) + (1.0f - first);
    float low_zp = __builtin_floorf(balance);
    low_zp = low_zp < 1.0f ? 1.0f : low_zp > top - 1.0f ? top - 1.0f : low_zp;
    const float high_zp = low_zp + 1.0f > top - 1.0f ? top - 1.0f : low_zp + 1.0f;
    const float low_step = mixed_step(mn, mx, low_zp, top, first);
    const float high_step = mixed_step(mn, mx, high_zp, top, first);
    const int higher = high_step < low_step;
    /* A constant v >= 0 or v < 0, and a group of one sign, are one-sided. */
    const float one_sided = top - 1.0f + first;
    const float zero_point = constant ? (mn >= 0.0f ? 0.0f : top)
                             : mn >= 0.0f ? 0.0f
                             : mx <= 0.0f ? top
                             : higher     ? high_zp
                                          : low_zp;
    const float scale = constant ? __builtin_fabsf(mx) / first
                        : mn >= 0.0f ? mx / one_sided
                        : mx <= 0.0f ? -mn / one_sided
                        : higher     ? high_step
                                     : low_step;
    const uint32_t stored = bf16_round_up(scale);
    const float step = from_bf16((uint16_t)stored);
    const float inverse = 1.0f / step;
    const int invertible = __builtin_isfinite(inverse);
    const float reach =
        ((zero_point > top - zero_point ? zero_point : top - zero_point) - 1.0f + first) * step;
    const int encodable = (!constant) & finite & invertible & nonzero_in(dtype, step * first) &
                          (reach <= dtype_max);
    const int const_by_codes = constant & finite & (step * first == __builtin_fabsf(mx));
    const int exact = !constant && !encodable;
    params_t p;
    p.inverse = invertible & (encodable | constant) ? inverse : 1.0f;
    p.zero_point = exact ? 0.0f : zero_point;
    p.scale = exact ? 0u : stored;
    p.flags = (exact ? (uint32_t)EXACT : 0u) |
              (constant & !const_by_codes ? (uint32_t)CONSTANT : 0u);
    return p;
}

/* A well-mixed 32-bit hash (Wellons' lowbias32): the noise of one element. */
static inline uint32_t mix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    h *= 0x846ca68bu;
    h ^= h >> 16;
    return h;
}

/* Rounding noise of elements [first, first + n) as 16-bit integers k, for u = (k + 1/2) / 2^16:
 * element e takes one half (the low half for even e) of a hash of e / 2 and the seed, so one hash
 * serves two elements and the noise depends only on the element's index, however a tensor is
 * split between threads. (The kernels are built for little-endian x86-64 and AArch64 only.) */
static void fill_noise(uint64_t first, uint64_t seed, int64_t n, uint16_t *k) {
    const uint32_t key = (uint32_t)seed ^ mix32((uint32_t)(first >> 33) ^ (uint32_t)(seed >> 32));
    int64_t i = 0;
    if (first & 1) { /* the second half of a pair the previous group started */
        k[0] = (uint16_t)(mix32((uint32_t)(first >> 1) ^ key) >> 16);
        i = 1;
    }
    const uint32_t pair0 = (uint32_t)((first + (uint64_t)i) >> 1);
    const int64_t pairs = (n - i) / 2;
    for (int64_t j = 0; j < pairs; j++) {
        const uint32_t h = mix32((pair0 + (uint32_t)j) ^ key);
        memcpy(k + i + 2 * j, &h, sizeof h); /* both halves at once (little-endian: low first) */
    }
    if (i + 2 * pairs < n) k[n - 1] = (uint16_t)mix32((pair0 + (uint32_t)pairs) ^ key);
}

/* One group's rounding: its elements, their place in the tensor (the noise's index), parameters
 * and noise. */
typedef struct {
    const void *v;          /* the elements: float32, or bfloat16 where bf16 */
    int bf16;
    int64_t ahead;          /* bytes from v on of the next block's group, prefetched; or 0 */
    int64_t n;              /* elements */
    uint64_t first_element; /* v[0]'s index in the tensor */
    uint64_t seed;          /* stochastic rounding's */
    const uint16_t *noise;  /* fill_noise's noise of the elements, where read from a buffer */
    float inverse, first;   /* 1 / step; the first level in steps */
    int32_t zp, top;        /* zero point; the top code */
} group_round_t;

#if defined(MEMOPT_AVX512)
/* 16 elements from lane i on as float32: float32 or bfloat16 (its bits shifted up), masked. */
static inline __m512 load_lanes(const void *v, int bf16, int64_t i, __mmask16 lanes) {
    if (!bf16) return _mm512_maskz_loadu_ps(lanes, (const float *)v + i);
    const __m256i h = _mm256_maskz_loadu_epi16(lanes, (const uint16_t *)v + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Store the codes (0..top, one per 32-bit lane) of `count` lanes packed `bits` wide, low bits
 * first, at out: 16 bytes, 8 (two codes a byte) or 4 (four). count is a multiple of 8 / bits. */
static inline void store_packed(__m512i code, int bits, int64_t count, uint8_t *out) {
    const __m128i bytes = _mm512_cvtepi32_epi8(code); /* narrowed in a register: faster than
                                                          the masked narrowing store */
    if (bits == 8) {
        if (count >= 16)
            _mm_storeu_si128((__m128i *)out, bytes);
        else
            _mm_mask_storeu_epi8(out, (__mmask16)((1u << count) - 1), bytes);
        return;
    }
    __m128i packed;
    if (bits == 4) { /* per 16-bit lane: b0 | b1 << 4 in the low byte */
        packed = _mm_cvtepi16_epi8(_mm_or_si128(bytes, _mm_srli_epi16(bytes, 4)));
    } else { /* per 32-bit lane: b0 | b1 << 2 | b2 << 4 | b3 << 6 in the low byte */
        __m128i t = _mm_or_si128(bytes, _mm_srli_epi32(bytes, 6));
        packed = _mm_cvtepi32_epi8(_mm_or_si128(t, _mm_srli_epi32(t, 12)));
    }
    const int64_t n_bytes = count * bits / 8;
    if (count >= 16) {
        if (bits == 4)
            _mm_storel_epi64((__m128i *)out, packed);
        else
            _mm_storeu_si32(out, packed);
    } else {
        _mm_mask_storeu_epi8(out, (__mmask16)((1u << n_bytes) - 1), packed);
    }
}

/* The constants of one group's rounding, in vectors. */
typedef struct {
    __m512 inv, first, zero, half, cap, fixed_one;
    __m512i zp, above, below, top, zero_i;
} rounding_t;

static inline rounding_t rounding_of(float inverse, float first, int32_t zp, int32_t top) {
    rounding_t r;
    r.inv = _mm512_set1_ps(inverse);
    r.first = _mm512_set1_ps(first);
    r.zero = _mm512_setzero_ps();
    r.half = _mm512_set1_ps(0.5f);
    r.cap = _mm512_set1_ps(1024.0f);
    r.fixed_one = _mm512_set1_ps(65536.0f);
    r.zp = _mm512_set1_epi32(zp);
    r.above = _mm512_set1_epi32(zp + 1);
    r.below = _mm512_set1_epi32(zp - 1);
    r.top = _mm512_set1_epi32(top);
    r.zero_i = _mm512_setzero_si512();
    return r;
}

/* The codes of 16 lanes from lane i on (round_group's, below): zp + 1 + m above zero and
 * zp - 1 - m below, m = floor(q + u), clamped to [0, top]. noise: the lanes' 16-bit noise k
 * where stochastic, else round-to-nearest. */
static inline __attribute__((always_inline)) __m512i
round_lanes(const rounding_t *r, const void *v, int bf16, const int stochastic, __m512i noise,
            int64_t i, __mmask16 lanes) {
    const __m512 e = load_lanes(v, bf16, i, lanes);
    /* max(|e * inverse|, first) - first == max(|e * inverse| - first, 0), one operation fewer
     * (vrangeps 0x0b: the larger magnitude, sign cleared); NaN stays NaN, and its lane's code
     * is zp whatever its magnitude */
    __m512 q = _mm512_sub_ps(_mm512_range_ps(_mm512_mul_ps(e, r->inv), r->first, 0x0b), r->first);
    __m512i mag;
    if (stochastic) {
        q = _mm512_min_ps(q, r->cap);
        const __m512i fixed = _mm512_cvttps_epi32(_mm512_fmadd_ps(q, r->fixed_one, r->half));
        mag = _mm512_srli_epi32(_mm512_add_epi32(fixed, noise), 16);
    } else {
        mag = _mm512_cvttps_epi32(_mm512_min_ps(_mm512_add_ps(q, r->half), r->cap));
    }
    const __mmask16 pos = _mm512_cmp_ps_mask(e, r->zero, _CMP_GT_OQ);
    const __mmask16 neg = _mm512_cmp_ps_mask(e, r->zero, _CMP_LT_OQ);
    __m512i code = _mm512_mask_add_epi32(r->zp, pos, r->above, mag);
    code = _mm512_mask_sub_epi32(code, neg, r->below, mag);
    return _mm512_min_epi32(_mm512_max_epi32(code, r->zero_i), r->top);
}

/* How a group's codes are rounded: to nearest; with noise from a buffer (fill_noise's); or with
 * noise hashed in the registers, for a group that starts on an even element. */
enum { NEAREST, NOISE_BUFFER, NOISE_HASHED };

/* mix32 in 8 lanes (fill_noise's hash). */
static inline __m256i mix32_lanes(__m256i h) {
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32(0x7feb352d));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 15));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32((int)0x846ca68bu));
    return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

/* round_packed with the element type, rounding and width fixed (constants once inlined).
 * NOISE_HASHED: fill_noise's noise of the group's elements (its first element even): lane pair j
 * of a vector takes the halves of one hash, low first, as fill_noise writes them. */
static inline __attribute__((always_inline)) void
round_packed_as(const group_round_t *g, const int bf16, const int rounding, const int bits,
                uint8_t *out) {
    const rounding_t r = rounding_of(g->inverse, g->first, g->zp, g->top);
    const uint32_t key = (uint32_t)g->seed ^ mix32((uint32_t)(g->first_element >> 33) ^
                                                   (uint32_t)(g->seed >> 32));
    const __m256i keys = _mm256_set1_epi32((int)key), eight = _mm256_set1_epi32(8);
    __m256i pairs = _mm256_add_epi32(_mm256_set1_epi32((int)(uint32_t)(g->first_element >> 1)),
                                     _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const int64_t n = g->n;
    const char *next_block = (const char *)g->v + g->ahead;
    for (int64_t i = 0;; i += 16, out += 2 * bits) {
        const int whole = i + 16 <= n;
        if (!whole && i >= n) break;
        const __mmask16 lanes = whole ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        /* the next block's elements stream in while this block's are rounded from the cache */
        _mm_prefetch(next_block + i * (bf16 ? 2 : 4), _MM_HINT_T0);
        __m512i noise = _mm512_setzero_si512();
        if (rounding == NOISE_HASHED) {
            noise = _mm512_cvtepu16_epi32(mix32_lanes(_mm256_xor_si256(pairs, keys)));
            pairs = _mm256_add_epi32(pairs, eight);
        } else if (rounding == NOISE_BUFFER) {
            noise = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, g->noise + i));
        }
        store_packed(round_lanes(&r, g->v, bf16, rounding != NEAREST, noise, i, lanes), bits,
                     whole ? 16 : n - i, out);
        if (!whole) break;
    }
}

/* round_group's codes (below) in AVX-512, 16 lanes at a time (gcc's own vectorization of the
 * plain loop packs the codes with long permute chains), from float32 or bfloat16 elements,
 * packed `bits` wide into out as they are made (n a multiple of 8 / bits; bits 8: a byte a
 * code). */
static void round_packed(const group_round_t *g, int rounding, int bits, uint8_t *out) {
#define MEMOPT_ROUND_BITS(BF16, MODE) \
    (bits == 8   ? round_packed_as(g, BF16, MODE, 8, out) \
     : bits == 4 ? round_packed_as(g, BF16, MODE, 4, out) \
                 : round_packed_as(g, BF16, MODE, 2, out))
#define MEMOPT_ROUND_MODE(BF16) \
    (rounding == NEAREST        ? MEMOPT_ROUND_BITS(BF16, NEAREST) \
     : rounding == NOISE_BUFFER ? MEMOPT_ROUND_BITS(BF16, NOISE_BUFFER) \
                                : MEMOPT_ROUND_BITS(BF16, NOISE_HASHED))
    g->bf16 ? MEMOPT_ROUND_MODE(1) : MEMOPT_ROUND_MODE(0);
#undef MEMOPT_ROUND_MODE
#undef MEMOPT_ROUND_BITS
}
#endif

#if !defined(MEMOPT_AVX512) /* AVX-512 builds round in round_packed */
/* codes[i] = clamp(zp + sign(v) * (floor(max(|v * inverse| - first, 0) + u) + 1), 0, top): zp
 * where v == 0, and where v is NaN (only groups kept exactly hold NaN; their codes go unused).
 * Nearest rounding (k == NULL) takes u = 1/2. Stochastic rounding takes u = (k[i] + 1/2) / 2^16
 * in 16-bit fixed point: floor(q + u) = (floor(q * 2^16 + 1/2) + k[i]) >> 16, which rounds q to
 * 2^-17 (a bias below 2^-17 of a step). q is capped at 1024, where codes clamp anyway, to keep
 * the integer conversion defined. */
static void round_group(const float *v, const uint16_t *k, int64_t n, float inverse, float first,
                        int32_t zp, int32_t top, uint8_t *codes) {
    int64_t i = 0;
#if defined(MEMOPT_AVX2)
    /* 32 lanes at a time in four vectors of 8, narrowed to bytes by two packs and one permute
     * (gcc's own vectorization of the loop below narrows with long shuffle chains). */
    const __m256 inv = _mm256_set1_ps(inverse), lowest = _mm256_set1_ps(first);
    const __m256 zero = _mm256_setzero_ps(), half = _mm256_set1_ps(0.5f);
    const __m256 cap = _mm256_set1_ps(1024.0f), fixed_one = _mm256_set1_ps(65536.0f);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i zpv = _mm256_set1_epi32(zp), one = _mm256_set1_epi32(1);
    const __m256i topv = _mm256_set1_epi32(top), zero_i = _mm256_setzero_si256();
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (; i + 32 <= n; i += 32) {
        __m256i code[4];
        for (int part = 0; part < 4; part++) {
            const __m256 e = _mm256_loadu_ps(v + i + 8 * part);
            __m256 q = _mm256_sub_ps(_mm256_and_ps(_mm256_mul_ps(e, inv), magnitude), lowest);
            q = _mm256_max_ps(q, zero); /* NaN -> 0 */
            __m256i mag;
            if (k) {
                q = _mm256_min_ps(q, cap);
                const __m256i fixed = _mm256_cvttps_epi32(_mm256_fmadd_ps(q, fixed_one, half));
                const __m256i noise =
                    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(k + i + 8 * part)));
                mag = _mm256_srli_epi32(_mm256_add_epi32(fixed, noise), 16);
            } else {
                mag = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_add_ps(q, half), cap));
            }
            mag = _mm256_add_epi32(mag, one);
            const __m256i pos = _mm256_castps_si256(_mm256_cmp_ps(e, zero, _CMP_GT_OQ));
            const __m256i neg = _mm256_castps_si256(_mm256_cmp_ps(e, zero, _CMP_LT_OQ));
            __m256i c = _mm256_add_epi32(zpv, _mm256_and_si256(pos, mag));
            c = _mm256_sub_epi32(c, _mm256_and_si256(neg, mag));
            code[part] = _mm256_min_epi32(_mm256_max_epi32(c, zero_i), topv);
        }
        const __m256i low = _mm256_packs_epi32(code[0], code[1]);
        const __m256i high = _mm256_packs_epi32(code[2], code[3]);
        const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(low, high), order);
        _mm256_storeu_si256((__m256i *)(codes + i), bytes);
    }
#endif
    for (; i < n; i++) {
        const float e = v[i];
        float q = __builtin_fabsf(e * inverse) - first;
        q = q > 0.0f ? q : 0.0f; /* NaN too */
        int32_t mag;
        if (k) {
            q = q < 1024.0f ? q : 1024.0f;
            mag = ((int32_t)(q * 65536.0f + 0.5f) + (int32_t)k[i]) >> 16;
        } else {
            q += 0.5f;
            mag = (int32_t)(q < 1024.0f ? q : 1024.0f);
        }
        mag += 1;
        int32_t code = e > 0.0f ? zp + mag : e < 0.0f ? zp - mag : zp;
        code = code < 0 ? 0 : code;
        codes[i] = (uint8_t)(code > top ? top : code);
    }
}
#endif

/* Pack n one-byte codes into n / per_byte bytes (n a multiple of per_byte), low bits first. */
static void pack(const uint8_t *codes, int64_t n, int per_byte, uint8_t *out) {
    if (per_byte == 1) {
        memcpy(out, codes, (size_t)n);
    } else if (per_byte == 2) {
        for (int64_t b = 0; b < n / 2; b++)
            out[b] = (uint8_t)(codes[2 * b] | codes[2 * b + 1] << 4);
    } else {
        for (int64_t b = 0; b < n / 4; b++)
            out[b] = (uint8_t)(codes[4 * b] | codes[4 * b + 1] << 2 | codes[4 * b + 2] << 4 |
                               codes[4 * b + 3] << 6);
    }
}

/* A group's elements where the codes are read from: float32 or bfloat16 (bf16). */
typedef struct {
    const void *v;
    int bf16;
    int64_t ahead; /* bytes to the next block's group (read in place), or 0 */
} source_t;

/* Group g's elements and their minimum and maximum: in place where the rounding reads the type
 * (AVX-512: a whole float32 or bfloat16 group of a contiguous x), else as float32 in buf
 * (load_group, or gathered from a strided x). */
static source_t group_source(const void *x, int dtype, const strided_t *layout, cursor_t *at,
                             int64_t numel, int64_t group_size, int64_t g, float *buf, float *mn,
                             float *mx) {
    if (layout != NULL) { /* gathered in index order from `at` on, padded as load_group pads */
        const int64_t start = g * group_size;
        const int64_t count = numel - start < group_size ? numel - start : group_size;
        gather(x, dtype, layout, at, count, buf);
        for (int64_t i = count; i < group_size; i++) buf[i] = buf[count - 1];
#if defined(MEMOPT_AVX512)
        minmax_f32(buf, group_size, mn, mx);
#else
        minmax(buf, group_size, mn, mx);
#endif
        return (source_t){buf, 0, 0};
    }
#if defined(MEMOPT_AVX512)
    const int64_t start = g * group_size, block = block_of(group_size) * group_size;
    if (numel - start >= group_size && dtype == F32) {
        minmax_f32((const float *)x + start, group_size, mn, mx);
        return (source_t){(const float *)x + start, 0, block * (int64_t)sizeof(float)};
    }
    if (numel - start >= group_size && dtype == BF16) {
        minmax_bf16((const uint16_t *)x + start, group_size, mn, mx);
        return (source_t){(const uint16_t *)x + start, 1, block * (int64_t)sizeof(uint16_t)};
    }
    const float *v = load_group(x, dtype, numel, group_size, g, buf);
    minmax_f32(v, group_size, mn, mx);
#else
    const float *v = load_group(x, dtype, numel, group_size, g, buf);
    minmax(v, group_size, mn, mx);
#endif
    return (source_t){v, 0, 0};
}

/* Group g's codes, `bits` wide: packed as they are made with AVX-512, else (bits 8 only) a byte
 * a code. Stochastic rounding with fill_noise's noise of g's seed (hashed in the registers where
 * it can, else through `scratch`, g->n 16-bit integers), else to nearest. */
static void round_codes(group_round_t g, int stochastic, int bits, uint16_t *scratch,
                        uint8_t *out) {
#if defined(MEMOPT_AVX512)
    const int rounding = !stochastic ? NEAREST : g.first_element & 1 ? NOISE_BUFFER : NOISE_HASHED;
    if (rounding == NOISE_BUFFER) fill_noise(g.first_element, g.seed, g.n, scratch);
    g.noise = scratch;
    round_packed(&g, rounding, bits, out);
#else
    (void)bits;
    if (stochastic) fill_noise(g.first_element, g.seed, g.n, scratch);
    round_group((const float *)g.v, stochastic ? scratch : NULL, g.n, g.inverse, g.first, g.zp,
                g.top, out);
#endif
}

/* Whether round_codes packs codes `bits` wide itself: with AVX-512, where every group starts on
 * a byte (group_size a multiple of 8 / bits). */
static int packs_codes(int64_t group_size, int bits) {
#if defined(MEMOPT_AVX512)
    return group_size % (8 / bits) == 0;
#else
    (void)group_size;
    return bits == 8;
#endif
}

/* The parameters of a block's groups, from their minima and maxima, in arrays. */
typedef struct {
    float inverse[MAX_BLOCK], zero_point[MAX_BLOCK];
    uint32_t scale[MAX_BLOCK], flags[MAX_BLOCK];
} block_params_t;

/* group_params of nb groups, one a SIMD lane (group_params is branch-free for this). */
static void block_params(const float *mn, const float *mx, int64_t nb, int bits, float first,
                         int dtype, float dtype_max, block_params_t *out) {
#pragma omp simd
    for (int64_t j = 0; j < nb; j++) {
        const params_t p = group_params(mn[j], mx[j], bits, first, dtype, dtype_max);
        out->inverse[j] = p.inverse;
        out->zero_point[j] = p.zero_point;
        out->scale[j] = p.scale;
        out->flags[j] = p.flags;
    }
}

/* Quantize groups [g0, g1): parameters (codec._group_params) and codes packed into out (the whole
 * tensor's packed bytes), a block of groups at a time while it is in cache (block_of). The range
 * must start on a byte: g0 * group_size a multiple of 8 / bits. Rounding: nearest (stochastic ==
 * 0, u = 1/2) or stochastic with fill_noise's noise. first: the first level in steps
 * (codec.FIRST_LEVEL); dtype_max: the largest finite value of the input type. Writes scale
 * (bfloat16 bits), zero_point and flags per group; returns the number of groups flagged. Scratch:
 * buf, block_of(group_size) * group_size floats; noise, group_size 16-bit integers; codes,
 * group_size + 4 bytes. */
static int64_t quantize_range(const void *x, int dtype, const strided_t *layout, int64_t numel,
                              int64_t group_size,
                              int64_t g0, int64_t g1, int bits, float first, int stochastic,
                              uint64_t seed, float dtype_max, uint8_t *out, uint16_t *scale,
                              uint8_t *zero_point, uint8_t *flags, float *buf, uint16_t *noise,
                              uint8_t *codes) {
    const int per_byte = 8 / bits;
    const int32_t top = (1 << bits) - 1;
    const int packed = packs_codes(group_size, bits);
    int64_t flagged = 0;
    int64_t pending = 0; /* codes of the previous group not yet packed, fewer than per_byte */
    uint8_t *next = out + g0 * group_size / per_byte;
    const int64_t block = block_of(group_size);
    float mn[MAX_BLOCK], mx[MAX_BLOCK];
    block_params_t p;
    /* where a strided x's next group starts: its groups are read in order */
    cursor_t at = layout != NULL ? cursor_at(layout, g0 * group_size) : (cursor_t){.at = 0};
    source_t src[MAX_BLOCK];
    for (int64_t gb = g0; gb < g1; gb += block) {
        const int64_t nb = g1 - gb < block ? g1 - gb : block;
        for (int64_t j = 0; j < nb; j++)
            src[j] = group_source(x, dtype, layout, &at, numel, group_size, gb + j,
                                  buf + j * group_size, &mn[j], &mx[j]);
        block_params(mn, mx, nb, bits, first, dtype, dtype_max, &p);
        for (int64_t j = 0; j < nb; j++) {
            const int64_t g = gb + j;
            scale[g] = (uint16_t)p.scale[j];
            zero_point[g] = (uint8_t)p.zero_point[j];
            flags[g] = (uint8_t)p.flags[j];
            flagged += p.flags[j] != 0;
            /* packed as made: straight into the output (pending stays 0) */
            const group_round_t job = {
                .v = src[j].v, .bf16 = src[j].bf16, .ahead = src[j].ahead, .n = group_size,
                .first_element = (uint64_t)(g * group_size), .seed = seed,
                .inverse = p.inverse[j], .first = first, .zp = (int32_t)p.zero_point[j],
                .top = top};
            round_codes(job, stochastic, packed ? bits : 8, noise,
                        packed ? next : codes + pending);
            if (packed) {
                next += group_size / per_byte;
                continue;
            }
            int64_t have = pending + group_size;
            int64_t whole = have / per_byte * per_byte;
            pack(codes, whole, per_byte, next);
            next += whole / per_byte;
            pending = have - whole;
            memmove(codes, codes + whole, (size_t)pending);
        }
    }
    if (pending) { /* the tensor's last byte; unused lanes are 0, as pack_bits pads */
        memset(codes + pending, 0, (size_t)(per_byte - pending));
        pack(codes, per_byte, per_byte, next);
    }
    return flagged;
}

/* Groups [g0, g1) of part `part` of `parts` contiguous ranges of n_groups groups; every range
 * starts at a multiple of `align` groups. */
static void range_of(int64_t n_groups, int parts, int part, int64_t align, int64_t *g0,
                     int64_t *g1) {
    int64_t per = (n_groups + parts - 1) / parts;
    per = (per + align - 1) / align * align;
    *g0 = part * per < n_groups ? part * per : n_groups;
    *g1 = *g0 + per < n_groups ? *g0 + per : n_groups;
}

/* Split a tensor's groups between threads: below this many groups per thread, one thread. */
#define GROUPS_PER_THREAD 64

static int thread_count(int64_t n_groups, int threads) {
    int64_t most = n_groups / GROUPS_PER_THREAD;
    return most < 1 ? 1 : most < threads ? (int)most : threads;
}

/* Transparent huge pages for the 2 MiB-aligned interior of a fresh output (where it holds one):
 * its first touch then maps 2 MiB a fault instead of 4 KiB, and a fault costs more than writing
 * its page (about 1.5 us in a virtual machine). Only the output's own range is advised; where the
 * kernel's THP setting is "never", nothing changes. */
static void advise_huge_pages(void *out, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)1 << 21, at = (uintptr_t)out;
    const uintptr_t start = (at + huge - 1) & ~(huge - 1), end = (at + bytes) & ~(huge - 1);
    if (end > start) (void)madvise((void *)start, end - start, MADV_HUGEPAGE);
#else
    (void)out;
    (void)bytes;
#endif
}

/* quantize_range over all n_groups groups of x, split between `threads` threads (OpenMP, the
 * runtime torch runs on): x contiguous where ndim is 0, else read in its index order at ndim
 * sizes and strides (no copy made first). Returns the number of groups flagged, or -1 when
 * scratch memory could not be allocated. */
int64_t memopt_quantize_strided(const void *x, int dtype, int ndim, const int64_t *size,
                                const int64_t *stride, int64_t numel, int64_t group_size,
                                int64_t n_groups, int bits, float first, int stochastic,
                                uint64_t seed, float dtype_max, uint8_t *out, uint16_t *scale,
                                uint8_t *zero_point, uint8_t *flags, int threads) {
    strided_t room;
    const strided_t *layout = strided_of(ndim, size, stride, &room);
    const int parts = thread_count(n_groups, threads);
    int64_t flagged = 0;
    int failed = 0;
    advise_huge_pages(out, (size_t)(n_groups * group_size * bits / 8));
#pragma omp parallel for num_threads(parts) schedule(static, 1) reduction(+ : flagged) \
    reduction(| : failed)
    for (int part = 0; part < parts; part++) {
        int64_t g0, g1;
        range_of(n_groups, parts, part, 8 / bits, &g0, &g1);
        if (g0 == g1) continue;
        const int64_t block = block_of(group_size);
        float *buf = malloc((size_t)group_size * (size_t)(block + 1) * sizeof(float));
        uint8_t *codes = malloc((size_t)group_size + 4);
        if (buf && codes)
            flagged += quantize_range(x, dtype, layout, numel, group_size, g0, g1, bits, first,
                                      stochastic, seed, dtype_max, out, scale, zero_point, flags,
                                      buf, (uint16_t *)(buf + block * group_size), codes);
        else
            failed = 1;
        free(buf);
        free(codes);
    }
    return failed ? -1 : flagged;
}

/* memopt_quantize_strided of a contiguous x. */
int64_t memopt_quantize(const void *x, int dtype, int64_t numel, int64_t group_size,
                        int64_t n_groups, int bits, float first, int stochastic, uint64_t seed,
                        float dtype_max, uint8_t *out, uint16_t *scale, uint8_t *zero_point,
                        uint8_t *flags, int threads) {
    return memopt_quantize_strided(x, dtype, 0, NULL, NULL, numel, group_size, n_groups, bits,
                                   first, stochastic, seed, dtype_max, out, scale, zero_point,
                                   flags, threads);
}

/* Pack each group's n codes in planes, as traced._pack_planes does: byte j of the group holds
 * codes j, j + m, j + 2m, ... (m = n / per_byte bytes), lowest bits first. */
static void pack_planes(const uint8_t *codes, int64_t n, int bits, uint8_t *out) {
    const int per_byte = 8 / bits;
    const int64_t m = n / per_byte;
    if (per_byte == 1) {
        memcpy(out, codes, (size_t)n);
        return;
    }
    memcpy(out, codes, (size_t)m);
    for (int lane = 1; lane < per_byte; lane++)
        for (int64_t j = 0; j < m; j++) out[j] |= (uint8_t)(codes[lane * m + j] << (lane * bits));
}

/* What compiled graphs save for x (traced.encode, in one call opaque to inductor, which would
 * otherwise generate and compile the encoder's kernels for every tensor a graph saves): per group
 * the scale and zero point of group_params, except that a group the eager codec keeps exactly (or
 * a constant that is not finite) gets scale 0 and the top code, which decode to NaN
 * (reference.graph_params), and the codes, packed in planes (pack_planes;
 * n_groups * group_size * bits / 8 bytes, the last group padded as load_group pads). Codes of a
 * group decoded as NaN are unspecified. Returns 0, or -1 when scratch memory ran out. */
int memopt_graph_encode(const void *x, int dtype, int64_t numel, int64_t group_size,
                        int64_t n_groups, int bits, float first, int stochastic, uint64_t seed,
                        float dtype_max, uint8_t *out, uint16_t *scale, uint8_t *zero_point,
                        int threads) {
    const int parts = thread_count(n_groups, threads);
    const int32_t top = (1 << bits) - 1;
    const int64_t bytes = group_size * bits / 8, block = block_of(group_size);
    int failed = 0;
#pragma omp parallel for num_threads(parts) schedule(static, 1) reduction(| : failed)
    for (int part = 0; part < parts; part++) {
        int64_t g0, g1;
        range_of(n_groups, parts, part, 1, &g0, &g1);
        if (g0 == g1) continue;
        float *buf = malloc((size_t)group_size * (size_t)(block + 1) * sizeof(float));
        uint8_t *codes = malloc((size_t)group_size);
        if (!buf || !codes) {
            failed = 1;
            g1 = g0;
        }
        uint16_t *noise = buf ? (uint16_t *)(buf + block * group_size) : NULL;
        float mn[MAX_BLOCK], mx[MAX_BLOCK];
        source_t src[MAX_BLOCK];
        for (int64_t gb = g0; gb < g1; gb += block) {
            const int64_t nb = g1 - gb < block ? g1 - gb : block;
            for (int64_t j = 0; j < nb; j++)
                src[j] = group_source(x, dtype, NULL, NULL, numel, group_size, gb + j,
                                      buf + j * group_size, &mn[j], &mx[j]);
            for (int64_t j = 0; j < nb; j++) {
                const int64_t g = gb + j;
                const params_t p = group_params(mn[j], mx[j], bits, first, dtype, dtype_max);
                const int lost =
                    (p.flags & EXACT) || ((p.flags & CONSTANT) && !__builtin_isfinite(mx[j]));
                scale[g] = (uint16_t)(lost ? 0u : p.scale);
                zero_point[g] = (uint8_t)(lost ? top : (int32_t)p.zero_point);
                const group_round_t job = {
                    .v = src[j].v, .bf16 = src[j].bf16, .ahead = src[j].ahead, .n = group_size,
                    .first_element = (uint64_t)(g * group_size), .seed = seed,
                    .inverse = p.inverse, .first = first, .zp = (int32_t)p.zero_point,
                    .top = top};
                round_codes(job, stochastic, 8, noise, codes);
                pack_planes(codes, group_size, bits, out + g * bytes);
            }
        }
        free(buf);
        free(codes);
    }
    return failed ? -1 : 0;
}

/* One-byte codes of elements [first, first + n) from the packed stream. */
static void unpack(const uint8_t *packed, int bits, int64_t first, int64_t n, uint8_t *codes) {
    const int per_byte = 8 / bits;
    const uint8_t *p = packed + first / per_byte;
    if (per_byte == 1) {
        memcpy(codes, p, (size_t)n);
    } else if (first % per_byte == 0 && n % per_byte == 0 && per_byte == 2) {
        for (int64_t b = 0; b < n / 2; b++) {
            codes[2 * b] = p[b] & 15u;
            codes[2 * b + 1] = p[b] >> 4;
        }
    } else if (first % per_byte == 0 && n % per_byte == 0) {
        for (int64_t b = 0; b < n / 4; b++) {
            codes[4 * b] = p[b] & 3u;
            codes[4 * b + 1] = (p[b] >> 2) & 3u;
            codes[4 * b + 2] = (p[b] >> 4) & 3u;
            codes[4 * b + 3] = p[b] >> 6;
        }
    } else {
        const uint32_t mask = (1u << bits) - 1u;
        for (int64_t i = 0; i < n; i++) {
            int64_t e = first + i;
            codes[i] = (uint8_t)((packed[e / per_byte] >> (e % per_byte * bits)) & mask);
        }
    }
}

/* The level of offset o = code - zero_point: (o - sign(o) * pull) * step, pull = 1 - first. */
static inline float level(uint8_t code, float zp, float pull, float step) {
    const float o = (float)code - zp;
    return (o > 0.0f ? o - pull : o < 0.0f ? o + pull : 0.0f) * step;
}

#if defined(MEMOPT_AVX512)
/* 16 levels (float32) in the output type, stored at out (element i of out's dtype). bfloat16 as
 * to_bf16 rounds; float16 by the conversion a C cast makes (to nearest even). */
static inline __attribute__((always_inline)) void store_levels(__m512 levels, const int dtype,
                                                               void *out, int64_t i) {
    if (dtype == F32) {
        _mm512_storeu_ps((float *)out + i, levels);
    } else if (dtype == BF16) {
        const __m512i u = _mm512_castps_si512(levels);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + i),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
    } else {
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + i),
                            _mm512_cvtps_ph(levels, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
}

/* The first n / 16 * 16 levels of an 8-bit group at out (dtype), its codes at p: level()'s
 * operations in 16 lanes. Returns the number of elements written. */
static inline __attribute__((always_inline)) int64_t
levels_8bit(const uint8_t *p, int64_t n, float zp, float pull, float step, const int dtype,
            void *out) {
    const __m512 zpv = _mm512_set1_ps(zp), pullv = _mm512_set1_ps(pull);
    const __m512 stepv = _mm512_set1_ps(step), zero = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + i)));
        const __m512 o = _mm512_sub_ps(_mm512_cvtepi32_ps(c), zpv);
        const __mmask16 pos = _mm512_cmp_ps_mask(o, zero, _CMP_GT_OQ);
        const __mmask16 neg = _mm512_cmp_ps_mask(o, zero, _CMP_LT_OQ);
        __m512 t = _mm512_mask_sub_ps(o, pos, o, pullv); /* o == 0 stays +0 */
        t = _mm512_mask_add_ps(t, neg, o, pullv);
        store_levels(_mm512_mul_ps(t, stepv), dtype, out, i);
    }
    return i;
}

/* The first n / 16 * 16 levels of a 4- or 2-bit group by table: the level of every code, in the
 * output type (one 32-bit lane each, the table repeated to 16 entries), permuted by the codes'
 * bits (a lane's low 4 bits: the code, then for 2 bits the next codes, which the repeats
 * ignore). Returns the number of elements written. */
static inline __attribute__((always_inline)) int64_t
levels_by_table(const uint8_t *p, const int bits, int64_t n, float zp, float pull, float step,
                const int dtype, void *out) {
    uint32_t entries[16];
    for (int c = 0; c < 16; c++) {
        const float f = level((uint8_t)(c & ((1 << bits) - 1)), zp, pull, step);
        if (dtype == F32) {
            memcpy(&entries[c], &f, sizeof f);
        } else if (dtype == BF16) {
            entries[c] = to_bf16(f);
        } else {
            const _Float16 h = (_Float16)f;
            uint16_t hb;
            memcpy(&hb, &h, sizeof hb);
            entries[c] = hb;
        }
    }
    const __m512i table = _mm512_loadu_si512(entries);
    const __m512i shifts =
        _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16, p += 2 * bits) {
        __m512i idx;
        if (bits == 4) { /* bytes 2j, 2j + 1: byte j's low and high nibble in their low bits */
            const __m128i b = _mm_loadl_epi64((const __m128i *)p);
            idx = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, _mm_srli_epi16(b, 4)));
        } else {
            uint32_t w;
            memcpy(&w, p, sizeof w);
            idx = _mm512_srlv_epi32(_mm512_set1_epi32((int)w), shifts);
        }
        const __m512i v = _mm512_permutexvar_epi32(idx, table);
        if (dtype == F32)
            _mm512_storeu_si512((float *)out + i, v);
        else
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), _mm512_cvtepi32_epi16(v));
    }
    return i;
}

/* The levels of a group's first n / 16 * 16 elements in AVX-512 (the group starts on a byte of
 * packed); returns how many were written. */
static int64_t levels_simd(const uint8_t *p, int bits, int64_t n, float zp, float pull,
                           float step, int dtype, void *out) {
#define MEMOPT_LEVELS(DTYPE) \
    (bits == 8   ? levels_8bit(p, n, zp, pull, step, DTYPE, out) \
     : bits == 4 ? levels_by_table(p, 4, n, zp, pull, step, DTYPE, out) \
                 : levels_by_table(p, 2, n, zp, pull, step, DTYPE, out))
    return dtype == F32 ? MEMOPT_LEVELS(F32) : dtype == BF16 ? MEMOPT_LEVELS(BF16)
                                                             : MEMOPT_LEVELS(F16);
#undef MEMOPT_LEVELS
}
#endif

/* The levels (codec._decode) of group g into dst (group_size elements of dtype): scale: bfloat16
 * bits per group; each level is exact in float32 and rounded once to the output type. buf:
 * group_size floats; codes: group_size bytes. */
static inline __attribute__((always_inline)) void
decode_group(const uint8_t *packed, int bits, float first, int64_t group_size,
                         int64_t g, const uint16_t *scale, const uint8_t *zero_point, int dtype,
                         void *dst, float *buf, uint8_t *codes) {
    const float pull = 1.0f - first;
    const uint8_t top = (uint8_t)((1u << bits) - 1);
    /* scale 0 with the top code: a group lost for want of side-table room, decoded as NaN */
    const float step = scale[g] == 0 && zero_point[g] == top ? NAN : from_bf16(scale[g]);
    const float zp = (float)zero_point[g];
    int64_t start = g * group_size, done = 0;
#if defined(MEMOPT_AVX512)
    if (group_size % (8 / bits) == 0) /* the group starts on a byte */
        done = levels_simd(packed + start * bits / 8, bits, group_size, zp, pull, step, dtype, dst);
#endif
    const int64_t n = group_size - done;
    unpack(packed, bits, start + done, n, codes);
    if (dtype == F32) {
        float *o = (float *)dst + done;
        for (int64_t i = 0; i < n; i++) o[i] = level(codes[i], zp, pull, step);
        return;
    }
    for (int64_t i = 0; i < n; i++) buf[i] = level(codes[i], zp, pull, step);
    if (dtype == BF16) {
        uint16_t *o = (uint16_t *)dst + done;
        for (int64_t i = 0; i < n; i++) o[i] = to_bf16(buf[i]);
    } else {
        _Float16 *o = (_Float16 *)dst + done;
        for (int64_t i = 0; i < n; i++) o[i] = (_Float16)buf[i];
    }
}

/* Groups [g0, g1) of a tensor of numel elements into out: straight into place where out is
 * contiguous and the group whole, else through `group` (group_size elements of dtype) and
 * written where its elements lie (the last group's padding dropped). */
static void decode_range(const uint8_t *packed, int bits, float first, int64_t group_size,
                         int64_t g0, int64_t g1, const uint16_t *scale, const uint8_t *zero_point,
                         int dtype, const strided_t *layout, int64_t numel, void *out, float *buf,
                         uint8_t *codes, void *group) {
    const size_t width = dtype == F32 ? sizeof(float) : sizeof(uint16_t);
    cursor_t at = layout != NULL ? cursor_at(layout, g0 * group_size) : (cursor_t){.at = 0};
    for (int64_t g = g0; g < g1; g++) {
        const int64_t start = g * group_size;
        const int64_t count = numel - start < group_size ? numel - start : group_size;
        if (layout == NULL && count == group_size) {
            decode_group(packed, bits, first, group_size, g, scale, zero_point, dtype,
                         (char *)out + (size_t)start * width, buf, codes);
            continue;
        }
        decode_group(packed, bits, first, group_size, g, scale, zero_point, dtype, group, buf,
                     codes);
        if (layout == NULL)
            memcpy((char *)out + (size_t)start * width, group, (size_t)count * width);
        else
            scatter(group, width, layout, &at, count, out);
    }
}

/* decode_range over all n_groups groups, split between `threads` threads, into out: numel
 * elements (at most n_groups * group_size), contiguous where ndim is 0, else at ndim sizes and
 * strides in index order. Returns 0, or -1 when scratch memory could not be allocated. */
int memopt_decode_into(const uint8_t *packed, int bits, float first, int64_t group_size,
                       int64_t n_groups, const uint16_t *scale, const uint8_t *zero_point,
                       int dtype, int64_t numel, int ndim, const int64_t *size,
                       const int64_t *stride, void *out, int threads) {
    strided_t room;
    const strided_t *layout = strided_of(ndim, size, stride, &room);
    const int parts = thread_count(n_groups, threads);
    int failed = 0;
    advise_huge_pages(out, (size_t)numel * (dtype == F32 ? 4u : 2u)); /* a dense block either way */
#pragma omp parallel for num_threads(parts) schedule(static, 1) reduction(| : failed)
    for (int part = 0; part < parts; part++) {
        int64_t g0, g1;
        range_of(n_groups, parts, part, 1, &g0, &g1);
        if (g0 == g1) continue;
        float *buf = malloc((size_t)group_size * sizeof(float));
        uint8_t *codes = malloc((size_t)group_size);
        void *group = malloc((size_t)group_size * sizeof(float));
        if (buf && codes && group)
            decode_range(packed, bits, first, group_size, g0, g1, scale, zero_point, dtype, layout,
                         numel, out, buf, codes, group);
        else
            failed = 1;
        free(buf);
        free(codes);
        free(group);
    }
    return failed ? -1 : 0;
}

/* memopt_decode_into every group's elements, padding included: out holds (n_groups, group_size)
 * contiguous elements. */
int memopt_decode(const uint8_t *packed, int bits, float first, int64_t group_size,
                  int64_t n_groups, const uint16_t *scale, const uint8_t *zero_point, int dtype,
                  void *out, int threads) {
    return memopt_decode_into(packed, bits, first, group_size, n_groups, scale, zero_point, dtype,
                              n_groups * group_size, 0, NULL, NULL, out, threads);
}

/* ------------------------------------------------------------------------------------------------
 * Masks: a tensor holding only +0.0 and one other value (a dropout mask on the CPU: 0 and
 * 1 / (1 - p)) kept exactly, one bit an element. Elements are compared as `width`-byte patterns
 * (4: float32; 2: bfloat16 or float16), so the decode is the input bit for bit: -0.0 or a second
 * value makes a tensor no mask. Element i is bit i % 8 of byte i / 8 (packing.pack_bits' order). */

/* Elements per thread's range: a multiple of 512 (its bytes a multiple of 64). */
#define MASK_RANGE_ALIGN 512
#define MASK_PER_THREAD (1 << 18)

static inline uint32_t pattern_at(const void *x, int width, int64_t i) {
    if (width == 4) {
        uint32_t u;
        memcpy(&u, (const char *)x + 4 * i, sizeof u);
        return u;
    }
    uint16_t h;
    memcpy(&h, (const char *)x + 2 * i, sizeof h);
    return h;
}

static int mask_parts(int64_t n, int threads) {
    const int64_t most = n / MASK_PER_THREAD;
    return most < 1 ? 1 : most < threads ? (int)most : threads;
}

/* Part `part` of `parts` element ranges of n, each starting on a multiple of MASK_RANGE_ALIGN. */
static void mask_range(int64_t n, int parts, int part, int64_t *i0, int64_t *i1) {
    int64_t per = (n + parts - 1) / parts;
    per = (per + MASK_RANGE_ALIGN - 1) / MASK_RANGE_ALIGN * MASK_RANGE_ALIGN;
    *i0 = part * per < n ? part * per : n;
    *i1 = *i0 + per < n ? *i0 + per : n;
}

/* The mask bits of elements [i0, i1) (i0 a multiple of 8) into out; 0 where one of them is
 * neither +0.0 nor `value`. */
static int mask_pack_range(const void *x, int width, int64_t i0, int64_t i1, uint32_t value,
                           uint8_t *out) {
    int64_t i = i0;
#if defined(MEMOPT_AVX512)
    if (width == 4) {
        const __m512i v = _mm512_set1_epi32((int)value), zero = _mm512_setzero_si512();
        for (; i + 16 <= i1; i += 16) {
            const __m512i a = _mm512_loadu_si512((const uint32_t *)x + i);
            const __mmask16 is = _mm512_cmpeq_epi32_mask(a, v);
            if ((__mmask16)(is | _mm512_cmpeq_epi32_mask(a, zero)) != (__mmask16)0xffff) return 0;
            memcpy(out + i / 8, &is, 2);
        }
    } else {
        const __m512i v = _mm512_set1_epi16((short)value), zero = _mm512_setzero_si512();
        for (; i + 32 <= i1; i += 32) {
            const __m512i a = _mm512_loadu_si512((const uint16_t *)x + i);
            const __mmask32 is = _mm512_cmpeq_epi16_mask(a, v);
            if ((__mmask32)(is | _mm512_cmpeq_epi16_mask(a, zero)) != (__mmask32)0xffffffffu)
                return 0;
            memcpy(out + i / 8, &is, 4);
        }
    }
#endif
    for (; i < i1; i += 8) {
        uint8_t byte = 0;
        for (int k = 0; k < 8 && i + k < i1; k++) {
            const uint32_t p = pattern_at(x, width, i + k);
            if (p == value)
                byte |= (uint8_t)(1u << k);
            else if (p != 0)
                return 0;
        }
        out[i / 8] = byte;
    }
    return 1;
}

/* The mask bits of x's n contiguous elements into out ((n + 7) / 8 bytes) and its value's bit
 * pattern into *value (0 for an all-zero x): 1, or 0 where x is no mask (out is then garbage). */
int memopt_mask_pack(const void *x, int width, int64_t n, uint8_t *out, uint32_t *value,
                     int threads) {
    int64_t first = 0;
    while (first < n && pattern_at(x, width, first) == 0) first++;
    const uint32_t v = first < n ? pattern_at(x, width, first) : 0;
    *value = v;
    const int parts = mask_parts(n, threads);
    int mask = 1;
#pragma omp parallel for num_threads(parts) schedule(static, 1) reduction(& : mask)
    for (int part = 0; part < parts; part++) {
        int64_t i0, i1;
        mask_range(n, parts, part, &i0, &i1);
        mask &= mask_pack_range(x, width, i0, i1, v, out);
    }
    return mask;
}

/* Elements [i0, i1) (i0 a multiple of 8) of a mask: `value` where its bit is set, else +0.0. */
static void mask_unpack_range(const uint8_t *bits, int width, int64_t i0, int64_t i1,
                              uint32_t value, void *out) {
    int64_t i = i0;
#if defined(MEMOPT_AVX512)
    if (width == 4) {
        const __m512i v = _mm512_set1_epi32((int)value);
        for (; i + 16 <= i1; i += 16) {
            __mmask16 is;
            memcpy(&is, bits + i / 8, 2);
            _mm512_storeu_si512((uint32_t *)out + i, _mm512_maskz_mov_epi32(is, v));
        }
    } else {
        const __m512i v = _mm512_set1_epi16((short)value);
        for (; i + 32 <= i1; i += 32) {
            __mmask32 is;
            memcpy(&is, bits + i / 8, 4);
            _mm512_storeu_si512((uint16_t *)out + i, _mm512_maskz_mov_epi16(is, v));
        }
    }
#endif
    for (; i < i1; i++) {
        const uint32_t p = (bits[i / 8] >> (i % 8)) & 1u ? value : 0u;
        if (width == 4)
            memcpy((char *)out + 4 * i, &p, 4);
        else {
            const uint16_t h = (uint16_t)p;
            memcpy((char *)out + 2 * i, &h, 2);
        }
    }
}

/* memopt_mask_pack's inverse: n contiguous elements of `width` bytes into out. */
void memopt_mask_unpack(const uint8_t *bits, int width, int64_t n, uint32_t value, void *out,
                        int threads) {
    advise_huge_pages(out, (size_t)n * (size_t)width);
    const int parts = mask_parts(n, threads);
#pragma omp parallel for num_threads(parts) schedule(static, 1)
    for (int part = 0; part < parts; part++) {
        int64_t i0, i1;
        mask_range(n, parts, part, &i0, &i1);
        mask_unpack_range(bits, width, i0, i1, value, out);
    }
}
