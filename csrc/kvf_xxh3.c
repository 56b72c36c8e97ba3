/* XXH3-64, seed 0, default 192-byte secret. Implemented from the XXH3 specification (the algorithm
 * description: short-input paths 0 / 1-3 / 4-8 / 9-16 / 17-128 / 129-240 bytes, and the long-input
 * stripe/accumulate/scramble loop with its final merge). Scalar, AVX2 and AVX-512 accumulate/scramble
 * kernels; all produce the same 8 accumulators, the widest one the CPU (and the OS's saved vector state)
 * supports is chosen at run time. One 64-byte stripe is exactly one 512-bit register, so the AVX-512 kernel
 * does per stripe what the AVX2 one does in two halves, with half the instructions.
 *
 * KVF_XXH3_SIMDE (tests only, tests/test_native.py): every kernel is built from SIMDe's portable
 * implementations of the same intrinsics, so the AVX-512 kernel's logic is checked against python-xxhash
 * on a CPU without AVX-512. The extension itself is always built from the real intrinsics. */
#include "kvf_xxh3.h"

#include <string.h>
#if defined(KVF_XXH3_SIMDE)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#define KVF_X86 1
#define KVF_TARGET(isa)
#elif defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVF_X86 1
#define KVF_TARGET(isa) __attribute__((target(isa)))
#endif
#if defined(KVF_XXH3_SIMDE)
#define KVF_SWAP64 _MM_SHUFFLE(1, 0, 3, 2)
#elif defined(KVF_X86)
#define KVF_SWAP64 ((_MM_PERM_ENUM)_MM_SHUFFLE(1, 0, 3, 2))  /* GCC types the AVX-512 shuffle control */
#endif

#define P32_1 0x9E3779B1U
#define P32_2 0x85EBCA77U
#define P32_3 0xC2B2AE3DU
#define P64_1 0x9E3779B185EBCA87ULL
#define P64_2 0xC2B2AE3D27D4EB4FULL
#define P64_3 0x165667B19E3779F9ULL
#define P64_4 0x85EBCA77C2B2AE63ULL
#define P64_5 0x27D4EB2F165667C5ULL
#define PMX_1 0x165667919E3779F9ULL
#define PMX_2 0x9FB21C651E98DF25ULL

#define STRIPE 64
#define SECRET_SIZE 192
#define STRIPES_PER_BLOCK ((SECRET_SIZE - STRIPE) / 8) /* 16 */

/* The default secret, as published with the algorithm. */
static const uint8_t kSecret[SECRET_SIZE] __attribute__((aligned(64))) = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; } /* little-endian hosts */
static inline uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
static inline uint32_t swap32(uint32_t x) { return __builtin_bswap32(x); }
static inline uint64_t swap64(uint64_t x) { return __builtin_bswap64(x); }

static inline uint64_t mul128_fold64(uint64_t a, uint64_t b) {
    __uint128_t p = (__uint128_t)a * b;
    return (uint64_t)p ^ (uint64_t)(p >> 64);
}

static inline uint64_t xxh64_avalanche(uint64_t h) {
    h ^= h >> 33; h *= P64_2; h ^= h >> 29; h *= P64_3; h ^= h >> 32;
    return h;
}

static inline uint64_t xxh3_avalanche(uint64_t h) {
    h ^= h >> 37; h *= PMX_1; h ^= h >> 32;
    return h;
}

static inline uint64_t rrmxmx(uint64_t h, uint64_t len) {
    h ^= rotl64(h, 49) ^ rotl64(h, 24);
    h *= PMX_2;
    h ^= (h >> 35) + len;
    h *= PMX_2;
    return h ^ (h >> 28);
}

static inline uint64_t mix16(const uint8_t *in, const uint8_t *sec) {
    return mul128_fold64(rd64(in) ^ rd64(sec), rd64(in + 8) ^ rd64(sec + 8));
}

static uint64_t hash_0to16(const uint8_t *in, size_t len) {
    const uint8_t *s = kSecret;
    if (len > 8) {
        uint64_t lo = rd64(in) ^ (rd64(s + 24) ^ rd64(s + 32));
        uint64_t hi = rd64(in + len - 8) ^ (rd64(s + 40) ^ rd64(s + 48));
        uint64_t acc = (uint64_t)len + swap64(lo) + hi + mul128_fold64(lo, hi);
        return xxh3_avalanche(acc);
    }
    if (len >= 4) {
        uint32_t a = rd32(in), b = rd32(in + len - 4);
        uint64_t bitflip = rd64(s + 8) ^ rd64(s + 16);  /* seed 0: seed ^= swap32(seed) << 32 is a no-op */
        uint64_t keyed = ((uint64_t)b + ((uint64_t)a << 32)) ^ bitflip;
        return rrmxmx(keyed, len);
    }
    if (len > 0) {
        uint32_t c1 = in[0], c2 = in[len >> 1], c3 = in[len - 1];
        uint32_t combined = (c1 << 16) | (c2 << 24) | c3 | ((uint32_t)len << 8);
        uint64_t bitflip = (uint64_t)(rd32(s) ^ rd32(s + 4));
        return xxh64_avalanche((uint64_t)combined ^ bitflip);
    }
    (void)swap32;
    return xxh64_avalanche(rd64(s + 56) ^ rd64(s + 64));
}

static uint64_t hash_17to128(const uint8_t *in, size_t len) {
    const uint8_t *s = kSecret;
    uint64_t acc = (uint64_t)len * P64_1;
    if (len > 32) {
        if (len > 64) {
            if (len > 96) {
                acc += mix16(in + 48, s + 96);
                acc += mix16(in + len - 64, s + 112);
            }
            acc += mix16(in + 32, s + 64);
            acc += mix16(in + len - 48, s + 80);
        }
        acc += mix16(in + 16, s + 32);
        acc += mix16(in + len - 32, s + 48);
    }
    acc += mix16(in, s);
    acc += mix16(in + len - 16, s + 16);
    return xxh3_avalanche(acc);
}

static uint64_t hash_129to240(const uint8_t *in, size_t len) {
    const uint8_t *s = kSecret;
    uint64_t acc = (uint64_t)len * P64_1;
    size_t rounds = len / 16, i;
    for (i = 0; i < 8; i++) acc += mix16(in + 16 * i, s + 16 * i);
    acc = xxh3_avalanche(acc);
    for (i = 8; i < rounds; i++) acc += mix16(in + 16 * i, s + 16 * (i - 8) + 3);
    acc += mix16(in + len - 16, s + 136 - 17);
    return xxh3_avalanche(acc);
}

/* ---- long inputs: accumulate 64-byte stripes, scramble after each 16-stripe block ---- */

static void accumulate_scalar(uint64_t *acc_out, const uint8_t *in, const uint8_t *sec, size_t n) {
    /* a local copy: stores through acc_out could alias the byte-typed input, which would force reloads */
    uint64_t acc[8];
    memcpy(acc, acc_out, sizeof acc);
    for (size_t k = 0; k < n; k++, in += STRIPE, sec += 8) {
        for (int i = 0; i < 8; i++) {
            uint64_t v = rd64(in + 8 * i);
            uint64_t key = v ^ rd64(sec + 8 * i);
            acc[i ^ 1] += v;
            acc[i] += (uint64_t)(uint32_t)key * (key >> 32);
        }
    }
    memcpy(acc_out, acc, sizeof acc);
}

static void scramble_scalar(uint64_t *acc, const uint8_t *sec) {
    for (int i = 0; i < 8; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= rd64(sec + 8 * i);
        acc[i] = a * P32_1;
    }
}

#ifdef KVF_X86
KVF_TARGET("avx2")
static void accumulate_avx2(uint64_t *acc, const uint8_t *in, const uint8_t *sec, size_t n) {
    __m256i a0 = _mm256_loadu_si256((const __m256i *)acc), a1 = _mm256_loadu_si256((const __m256i *)(acc + 4));
#pragma GCC unroll 8
    for (size_t k = 0; k < n; k++, in += STRIPE, sec += 8) {
        __builtin_prefetch(in + 384);  /* a few stripes ahead: hides L3/DRAM latency on inputs past L2 */
        __m256i d0 = _mm256_loadu_si256((const __m256i *)in), d1 = _mm256_loadu_si256((const __m256i *)(in + 32));
        __m256i k0 = _mm256_xor_si256(d0, _mm256_loadu_si256((const __m256i *)sec));
        __m256i k1 = _mm256_xor_si256(d1, _mm256_loadu_si256((const __m256i *)(sec + 32)));
        /* low 32 bits x high 32 bits of each 64-bit lane */
        __m256i p0 = _mm256_mul_epu32(k0, _mm256_srli_epi64(k0, 32));
        __m256i p1 = _mm256_mul_epu32(k1, _mm256_srli_epi64(k1, 32));
        /* acc[i ^ 1] += data[i]: swap the two 64-bit halves of each 128-bit lane */
        a0 = _mm256_add_epi64(a0, _mm256_add_epi64(p0, _mm256_shuffle_epi32(d0, _MM_SHUFFLE(1, 0, 3, 2))));
        a1 = _mm256_add_epi64(a1, _mm256_add_epi64(p1, _mm256_shuffle_epi32(d1, _MM_SHUFFLE(1, 0, 3, 2))));
    }
    _mm256_storeu_si256((__m256i *)acc, a0);
    _mm256_storeu_si256((__m256i *)(acc + 4), a1);
}

KVF_TARGET("avx2")
static void scramble_avx2(uint64_t *acc, const uint8_t *sec) {
    const __m256i prime = _mm256_set1_epi32((int)P32_1);
    for (int h = 0; h < 2; h++) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(acc + 4 * h));
        a = _mm256_xor_si256(a, _mm256_srli_epi64(a, 47));
        a = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i *)(sec + 32 * h)));
        /* 64-bit x 32-bit constant multiply from two 32x32->64 products */
        __m256i lo = _mm256_mul_epu32(a, prime);
        __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), prime);
        _mm256_storeu_si256((__m256i *)(acc + 4 * h), _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32)));
    }
}

KVF_TARGET("avx512f")
static void accumulate_avx512(uint64_t *acc, const uint8_t *in, const uint8_t *sec, size_t n) {
    __m512i a = _mm512_loadu_si512((const void *)acc);
#pragma GCC unroll 8
    for (size_t k = 0; k < n; k++, in += STRIPE, sec += 8) {
        __builtin_prefetch(in + 384);
        __m512i d = _mm512_loadu_si512((const void *)in);
        __m512i key = _mm512_xor_si512(d, _mm512_loadu_si512((const void *)sec));
        __m512i p = _mm512_mul_epu32(key, _mm512_srli_epi64(key, 32));
        /* acc[i ^ 1] += data[i]: swap the two 64-bit halves of each 128-bit lane */
        a = _mm512_add_epi64(a, _mm512_add_epi64(p, _mm512_shuffle_epi32(d, KVF_SWAP64)));
    }
    _mm512_storeu_si512((void *)acc, a);
}

KVF_TARGET("avx512f")
static void scramble_avx512(uint64_t *acc, const uint8_t *sec) {
    const __m512i prime = _mm512_set1_epi32((int)P32_1);
    __m512i a = _mm512_loadu_si512((const void *)acc);
    a = _mm512_xor_si512(a, _mm512_srli_epi64(a, 47));
    a = _mm512_xor_si512(a, _mm512_loadu_si512((const void *)sec));
    __m512i lo = _mm512_mul_epu32(a, prime);
    __m512i hi = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), prime);
    _mm512_storeu_si512((void *)acc, _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32)));
}
#endif

typedef void (*acc_fn)(uint64_t *, const uint8_t *, const uint8_t *, size_t);
typedef void (*scr_fn)(uint64_t *, const uint8_t *);
static acc_fn g_acc = accumulate_scalar;
static scr_fn g_scr = scramble_scalar;
static int g_path = -2; /* not yet selected */

int kvf_xxh3_have_avx2(void) {
#if defined(KVF_XXH3_SIMDE)
    return 1;  /* emulated */
#elif defined(KVF_X86)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? 1 : 0;
#else
    return 0;
#endif
}

int kvf_xxh3_have_avx512(void) {
#if defined(KVF_XXH3_SIMDE)
    return 1;  /* emulated */
#elif defined(KVF_X86)
    /* GCC's check covers both the CPUID bit and the OS saving the ZMM state (XCR0 opmask/ZMM bits) */
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") ? 1 : 0;
#else
    return 0;
#endif
}

int kvf_xxh3_select(int path) {
    if (path < 0) path = kvf_xxh3_have_avx512() ? 2 : kvf_xxh3_have_avx2();
    if (path == 2 && !kvf_xxh3_have_avx512()) path = kvf_xxh3_have_avx2();
    if (path == 1 && !kvf_xxh3_have_avx2()) path = 0;
#ifdef KVF_X86
    if (path == 2) { g_acc = accumulate_avx512; g_scr = scramble_avx512; g_path = 2; return 2; }
    if (path == 1) { g_acc = accumulate_avx2; g_scr = scramble_avx2; g_path = 1; return 1; }
#endif
    g_acc = accumulate_scalar; g_scr = scramble_scalar; g_path = 0;
    return 0;
}

int kvf_xxh3_path(void) {
    if (g_path == -2) kvf_xxh3_select(-1);
    return g_path;
}

void kvf_xxh3_init(kvf_xxh3_state *s, const void *base, size_t len) {
    static const uint64_t init[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    if (g_path == -2) kvf_xxh3_select(-1);
    memcpy(s->acc, init, sizeof init);
    s->base = (const uint8_t *)base;
    s->len = len;
    s->stripes_done = 0;
    s->stripes_total = len > 240 ? (len - 1) / STRIPE : 0;
}

void kvf_xxh3_update(kvf_xxh3_state *s, size_t avail) {
    if (s->len <= 240) return;  /* short inputs are hashed whole at the end */
    size_t ready = avail / STRIPE;
    if (ready > s->stripes_total) ready = s->stripes_total;
    acc_fn acc = g_acc;
    while (s->stripes_done < ready) {
        size_t in_block = s->stripes_done % STRIPES_PER_BLOCK;
        size_t n = STRIPES_PER_BLOCK - in_block;
        if (n > ready - s->stripes_done) n = ready - s->stripes_done;
        acc(s->acc, s->base + s->stripes_done * STRIPE, kSecret + in_block * 8, n);
        s->stripes_done += n;
        if (s->stripes_done % STRIPES_PER_BLOCK == 0) g_scr(s->acc, kSecret + SECRET_SIZE - STRIPE);
    }
}

uint64_t kvf_xxh3_digest(kvf_xxh3_state *s) {
    size_t len = s->len;
    const uint8_t *in = s->base;
    if (len <= 16) return hash_0to16(in, len);
    if (len <= 128) return hash_17to128(in, len);
    if (len <= 240) return hash_129to240(in, len);
    kvf_xxh3_update(s, len);
    uint64_t acc[8];
    memcpy(acc, s->acc, sizeof acc);
    /* the last stripe, overlapping the previous ones, with the secret offset by SECRET_LASTACC_START (7) */
    g_acc(acc, in + len - STRIPE, kSecret + SECRET_SIZE - STRIPE - 7, 1);
    const uint8_t *ms = kSecret + 11; /* SECRET_MERGEACCS_START */
    uint64_t r = (uint64_t)len * P64_1;
    for (int i = 0; i < 4; i++) r += mul128_fold64(acc[2 * i] ^ rd64(ms + 16 * i), acc[2 * i + 1] ^ rd64(ms + 16 * i + 8));
    return xxh3_avalanche(r);
}

uint64_t kvf_xxh3_64(const void *data, size_t len) {
    kvf_xxh3_state s;
    kvf_xxh3_init(&s, data, len);
    return kvf_xxh3_digest(&s);
}
