/* AVX2 bodies of cpu_kquant.c (included where the compiler targets AVX2 + FMA + F16C but not AVX512-VNNI: AMD
 * Zen 1-3, Intel before Ice Lake and its client cores since Alder Lake). The layouts and the integers are
 * cpu_kquant_avx512.h's, in 256-bit halves: a 32-bit lane of a 32-position vector is the same sub-block as the
 * 512-bit lane it came from (Q4K: lane l is sub-block l in every vector; Q6K: sub-block l in the vectors of
 * positions 64v..64v + 31, 8 + l in 64v + 32..64v + 63).
 * Four products into a 32-bit lane are vpmaddubsw (u8 code × s8 activation pairs into int16) then vpmaddwd (int16
 * pairs into int32, by 254 for the first pass and by 1 for the second: 254·q1 + q2 exactly). int16 pair sums are
 * added before vpmaddwd only where they cannot saturate (|q1|, |q2| ≤ 127): Q4K codes < 16, eight vectors
 * (≤ 8·2·15·127 = 30,480); Q6K codes < 64, two (≤ 32,004). A8 (a scale every 32 weights, codes up to 255) takes the
 * activations as int16 (254·q1 + q2 ≤ 32,385, made once a call) against codes widened to int16 once a chunk: two
 * vpmaddwd a 32-block a row (docs/perf.md session 36: 16-21% faster than int8 pairs with A8's sign fix); A4 / A5 (codes
 * < 32) go through vpmaddubsw, each pass apart (a45_rows_avx2).
 * Every row's result is one fixed sequence of operations, whatever the call's rows or threads. */
#define MT 16

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline __m256i ld32(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }

/* int16 pair sums of 32 unsigned codes against 32 signed activations */
static inline __m256i pairs(__m256i c, const int8_t* x) { return _mm256_maddubs_epi16(c, ld32(x)); }

/* the two passes' int16 sums (q1 at x, q2 at x + K) combined into int32 lanes: 254·s1 + s2 */
static inline __m256i combine(__m256i s1, __m256i s2) {
    return _mm256_add_epi32(_mm256_madd_epi16(s1, _mm256_set1_epi16(254)), _mm256_madd_epi16(s2, _mm256_set1_epi16(1)));
}

static inline __attribute__((always_inline)) void
q4k_rows_avx2(const uint8_t* qs, const uint8_t* meta, int n0, int n1, int K, const int8_t* xq, const float* xd,
        const float* xs, int M, float* y, int ldy, const int one) {
    const int nb = K / 256;
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    for (int n = n0; n < n1; n++)
    for (int mt = 0; mt < M; mt += MT) {
        const int mr = one ? 1 : M - mt < MT ? M - mt : MT;  /* one: a constant (vec_rows) */
        __m256 acc[MT], macc[MT];
        for (int m = 0; m < mr; m++) { acc[m] = _mm256_setzero_ps(); macc[m] = _mm256_setzero_ps(); }
        const uint8_t* q = qs + (size_t)n * (K / 2);
        const uint8_t* mt0 = meta + (size_t)n * nb * 20;
        for (int b = 0; b < nb; b++) {
            const uint8_t* bm = mt0 + b * 20;
            const float d = _cvtsh_ss(*(const uint16_t*)bm), dmin = _cvtsh_ss(*(const uint16_t*)(bm + 2));
            const uint8_t* qb = q + b * 128;
            const __m256i a0 = ld32(qb), a1 = ld32(qb + 32), a2 = ld32(qb + 64), a3 = ld32(qb + 96);
            __m256i c[8];  /* c[i]: the codes of positions 32i..32i + 31 */
            c[0] = _mm256_and_si256(a0, lo4); c[1] = _mm256_and_si256(a1, lo4);
            c[2] = _mm256_and_si256(_mm256_srli_epi16(a0, 4), lo4); c[3] = _mm256_and_si256(_mm256_srli_epi16(a1, 4), lo4);
            c[4] = _mm256_and_si256(a2, lo4); c[5] = _mm256_and_si256(a3, lo4);
            c[6] = _mm256_and_si256(_mm256_srli_epi16(a2, 4), lo4); c[7] = _mm256_and_si256(_mm256_srli_epi16(a3, 4), lo4);
            const __m256 sc = _mm256_mul_ps(_mm256_set1_ps(d),   // d * sc[j], one a 32-weight sub-block
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(bm + 4)))));
            const __m256 mn = _mm256_mul_ps(_mm256_set1_ps(dmin),
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(bm + 12)))));
            for (int m = 0; m < mr; m++) {
                const size_t row = (size_t)(mt + m);
                const int8_t* xr = xq + row * 2 * K + b * 256;
                __m256i s1 = pairs(c[0], xr), s2 = pairs(c[0], xr + K);
                for (int i = 1; i < 8; i++) {  /* lane l: sub-block l in all eight */
                    s1 = _mm256_add_epi16(s1, pairs(c[i], xr + 32 * i));
                    s2 = _mm256_add_epi16(s2, pairs(c[i], xr + K + 32 * i));
                }
                const __m256 f = _mm256_mul_ps(sc, _mm256_loadu_ps(xd + row * (K / 32) + b * 8));
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(combine(s1, s2)), f, acc[m]);
                macc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + row * (K / 32) + b * 8), mn, macc[m]);
            }
        }
        for (int m = 0; m < mr; m++) y[(size_t)(mt + m) * ldy + n] = hsum8(acc[m]) - hsum8(macc[m]);
    }
}


static inline __attribute__((always_inline)) void
q6k_rows_avx2(const uint8_t* qs, const uint8_t* qh, const uint8_t* meta, int n0, int n1, int K, const int8_t* xq,
        const float* xd, const float* xs, int M, float* y, int ldy, const int one) {
    const int nb = K / 256;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
    const __m256i lo_units = _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0), hi_units = _mm256_set_epi32(7, 7, 6, 6, 5, 5, 4, 4);
    for (int n = n0; n < n1; n++)
    for (int mt = 0; mt < M; mt += MT) {
        const int mr = one ? 1 : M - mt < MT ? M - mt : MT;  /* one: a constant (vec_rows) */
        __m256 acc[MT], oacc[MT];
        for (int m = 0; m < mr; m++) { acc[m] = _mm256_setzero_ps(); oacc[m] = _mm256_setzero_ps(); }
        const uint8_t* pl = qs + (size_t)n * (K / 2);
        const uint8_t* ph = qh + (size_t)n * (K / 4);
        const uint8_t* mt0 = meta + (size_t)n * nb * 18;
        for (int b = 0; b < nb; b++) {
            const uint8_t* bm = mt0 + b * 18;
            const float d = _cvtsh_ss(*(const uint16_t*)bm);
            __m256i c[8];  /* c[i]: the codes of positions 32i..32i + 31 (i even: sub-blocks 0-7, odd: 8-15) */
            for (int half = 0; half < 2; half++) {
                const __m256i lo = ld32(pl + b * 128 + 32 * half), hi = ld32(pl + b * 128 + 64 + 32 * half);
                const __m256i h = ld32(ph + b * 64 + 32 * half);
                c[half] = _mm256_or_si256(_mm256_and_si256(lo, m4), _mm256_slli_epi16(_mm256_and_si256(h, m2), 4));
                c[2 + half] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo, 4), m4),
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m2), 4));
                c[4 + half] = _mm256_or_si256(_mm256_and_si256(hi, m4),
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m2), 4));
                c[6 + half] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(hi, 4), m4),
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m2), 4));
            }
            const __m128i sc8 = _mm_loadu_si128((const __m128i*)(bm + 2));  /* int8 sc[16] */
            const __m256 sa = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)));
            const __m256 sb = _mm256_mul_ps(_mm256_set1_ps(d),
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8))));
            for (int m = 0; m < mr; m++) {
                const size_t row = (size_t)(mt + m);
                const int8_t* xr = xq + row * 2 * K + b * 256;
                __m256i t[2];
                for (int half = 0; half < 2; half++) {  /* two vectors' pair sums at a time (codes < 64) */
                    const int o = 32 * half;
                    const __m256i p1 = combine(_mm256_add_epi16(pairs(c[half], xr + o), pairs(c[2 + half], xr + 64 + o)),
                                               _mm256_add_epi16(pairs(c[half], xr + K + o),
                                                                pairs(c[2 + half], xr + K + 64 + o)));
                    const __m256i p2 = combine(_mm256_add_epi16(pairs(c[4 + half], xr + 128 + o),
                                                                pairs(c[6 + half], xr + 192 + o)),
                                               _mm256_add_epi16(pairs(c[4 + half], xr + K + 128 + o),
                                                                pairs(c[6 + half], xr + K + 192 + o)));
                    t[half] = _mm256_add_epi32(p1, p2);
                }
                const __m256 dx = _mm256_loadu_ps(xd + row * (K / 32) + b * 8);  /* lane l: its 32 activations' unit */
                const __m256 fa = _mm256_mul_ps(sa, _mm256_permutevar8x32_ps(dx, lo_units));
                const __m256 fb = _mm256_mul_ps(sb, _mm256_permutevar8x32_ps(dx, hi_units));
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[0]), fa, acc[m]);
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[1]), fb, acc[m]);
                const float* sums = xs + row * (K / 16) + b * 16;
                oacc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(sums), sa, oacc[m]);
                oacc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(sums + 8), sb, oacc[m]);
            }
        }
        for (int m = 0; m < mr; m++) y[(size_t)(mt + m) * ldy + n] = hsum8(acc[m]) - 32.f * hsum8(oacc[m]);
    }
}


static inline __attribute__((always_inline)) void
a8_rows_avx2(const uint8_t* qs, const uint8_t* meta, int n0, int n1, int K, const int8_t* xq, const float* xd,
        const float* xs, int M, float* y, int ldy, const int one) {
    /* The activations of a tile of rows as int16 once a call (254·q1 + q2 ≤ 32,385 fits), the codes widened to int16
     * once a chunk: a 32-block a row is then two vpmaddwd (no sign trick, no second pass) */
    const int nb = K / 32, nc = K / 128;
    int16_t local[8192];  /* a decode row's activations (K ≤ 8192): no allocation a call (a call is 16 output rows) */
    const size_t need = (size_t)(M < MT ? M : MT) * K;
    int16_t* x16 = need <= 8192 ? local : (int16_t*)malloc(sizeof(int16_t) * need);
    if (!x16) { a_rows_scalar(8, qs, NULL, meta, n0, n1, K, xq, xd, xs, M, y, ldy); return; }
    for (int mt = 0; mt < M; mt += MT) {
        const int mr = one ? 1 : M - mt < MT ? M - mt : MT;  /* one: a constant (vec_rows) */
        for (int m = 0; m < mr; m++) {
            const int8_t* q1 = xq + (size_t)(mt + m) * 2 * K;
            int16_t* o = x16 + (size_t)m * K;
            for (int k = 0; k < K; k += 16) {
                const __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(q1 + k)));
                const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(q1 + K + k)));
                _mm256_storeu_si256((__m256i*)(o + k), _mm256_add_epi16(_mm256_mullo_epi16(a, _mm256_set1_epi16(254)), b));
            }
        }
        for (int n = n0; n < n1; n++) {
            __m256 acc[MT];
            __m128 oacc[MT];
            for (int m = 0; m < mr; m++) { acc[m] = _mm256_setzero_ps(); oacc[m] = _mm_setzero_ps(); }
            for (int c = 0; c < nc; c++) {
                __m256i w[8];  /* w[2s], w[2s + 1]: block s's 32 codes as int16 */
                __m128i b8[4];
                for (int s = 0; s < 4; s++) {
                    b8[s] = _mm_loadu_si128((const __m128i*)(qs + (size_t)n * K + c * 128 + 32 * s));
                    w[2 * s + 1] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(qs + (size_t)n * K + c * 128 + 32 * s + 16)));
                }
                for (int s = 0; s < 4; s++) w[2 * s] = _mm256_cvtepu8_epi16(b8[s]);
                const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(meta + ((size_t)n * nb + c * 4) * 4)));
                const __m128 lo = _mm256_castps256_ps128(dm), hi = _mm256_extractf128_ps(dm, 1);
                const __m128 d4 = _mm_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)), m4 = _mm_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1));
                for (int m = 0; m < mr; m++) {
                    const size_t row = (size_t)(mt + m);
                    const int16_t* xr = x16 + (size_t)m * K + c * 128;
                    float f[4];
                    _mm_storeu_ps(f, _mm_mul_ps(d4, _mm_loadu_ps(xd + row * nb + c * 4)));
                    for (int s = 0; s < 4; s++) {
                        const __m256i t = _mm256_add_epi32(_mm256_madd_epi16(w[2 * s], ld32(xr + 32 * s)),
                                                           _mm256_madd_epi16(w[2 * s + 1], ld32(xr + 32 * s + 16)));
                        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(f[s]), acc[m]);
                    }
                    oacc[m] = _mm_fmadd_ps(_mm_loadu_ps(xs + row * nb + c * 4), m4, oacc[m]);  // m * d_x * sum(codes)
                }
            }
            for (int m = 0; m < mr; m++) {
                __m128 s = _mm_add_ps(oacc[m], _mm_movehl_ps(oacc[m], oacc[m]));
                s = _mm_add_ss(s, _mm_movehdup_ps(s));
                y[(size_t)(mt + m) * ldy + n] = hsum8(acc[m]) + _mm_cvtss_f32(s);
            }
        }
    }
    if (x16 != local) free(x16);
}


/* A4 / A5 (codes < 32): vpmaddubsw of a 32-block's codes against each activation pass (pair sums ≤ 2·31·127, no
 * saturation), combined by vpmaddwd with 254 / 1; no widening (for one row it was 30% slower, docs/perf.md session 37).
 * A5's bit 4 of chunk position 16t + j is bit t of the chunk plane's byte j: broadcast to both 128-bit halves, the bit of
 * block s's half moved to bit 4 by one variable shift (t = 2s in the low half, 2s + 1 in the high one). */
/* chunk c of row n: q[s] block s's 32 codes, d4 / m4 the four blocks' d / m */
static inline void a45_chunk(int bits, const uint8_t* qs, const uint8_t* qh, const uint8_t* meta, int n, int K, int c,
                             __m256i q[4], __m128* d4, __m128* m4) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F), b4 = _mm256_set1_epi8(16);
    const uint8_t* qc = qs + (size_t)n * (K / 2) + c * 64;
    const __m256i v0 = ld32(qc), v1 = ld32(qc + 32);
    q[0] = _mm256_and_si256(v0, lo4); q[1] = _mm256_and_si256(v1, lo4);
    q[2] = _mm256_and_si256(_mm256_srli_epi16(v0, 4), lo4); q[3] = _mm256_and_si256(_mm256_srli_epi16(v1, 4), lo4);
    if (bits == 5) {
        const __m256i h = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(qh + (size_t)n * (K / 8) + c * 16)));
        q[0] = _mm256_or_si256(q[0], _mm256_and_si256(_mm256_sllv_epi32(h, _mm256_setr_epi32(4, 4, 4, 4, 3, 3, 3, 3)), b4));
        q[1] = _mm256_or_si256(q[1], _mm256_and_si256(_mm256_sllv_epi32(h, _mm256_setr_epi32(2, 2, 2, 2, 1, 1, 1, 1)), b4));
        q[2] = _mm256_or_si256(q[2], _mm256_and_si256(_mm256_srlv_epi32(h, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)), b4));
        q[3] = _mm256_or_si256(q[3], _mm256_and_si256(_mm256_srlv_epi32(h, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3)), b4));
    }
    const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(meta + ((size_t)n * (K / 32) + c * 4) * 4)));
    const __m128 lo = _mm256_castps256_ps128(dm), hi = _mm256_extractf128_ps(dm, 1);
    *d4 = _mm_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)); *m4 = _mm_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1));
}

/* one row's products with chunk c's four blocks added into acc / oacc (the same operations however many rows) */
static inline void a45_row(const __m256i q[4], __m128 d4, __m128 m4, const int8_t* xq, const float* xd, const float* xs,
                           int K, size_t row, int c, __m256* acc, __m128* oacc) {
    const int nb = K / 32;
    const int8_t* x1 = xq + row * 2 * K + c * 128;
    float f[4];
    _mm_storeu_ps(f, _mm_mul_ps(d4, _mm_loadu_ps(xd + row * nb + c * 4)));
    for (int s = 0; s < 4; s++) {
        const __m256i t = _mm256_add_epi32(_mm256_madd_epi16(pairs(q[s], x1 + 32 * s), _mm256_set1_epi16(254)),
                                           _mm256_madd_epi16(pairs(q[s], x1 + K + 32 * s), _mm256_set1_epi16(1)));
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(f[s]), *acc);
    }
    *oacc = _mm_fmadd_ps(_mm_loadu_ps(xs + row * nb + c * 4), m4, *oacc);  // m * d_x * sum(codes)
}

static inline float a45_out(__m256 acc, __m128 oacc) {
    __m128 s = _mm_add_ps(oacc, _mm_movehl_ps(oacc, oacc));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return hsum8(acc) + _mm_cvtss_f32(s);
}

static inline __attribute__((always_inline)) void
a45_rows_avx2(int bits, const uint8_t* qs, const uint8_t* qh, const uint8_t* meta, int n0, int n1, int K,
        const int8_t* xq, const float* xd, const float* xs, int M, float* y, int ldy, const int one) {
    __m256i q[4];
    __m128 d4, m4;
    for (int n = n0; n < n1; n++)
    for (int mt = 0; mt < M; mt += MT) {
        const int mr = one ? 1 : M - mt < MT ? M - mt : MT;  /* one: a constant (vec_rows) */
        __m256 acc[MT];
        __m128 oacc[MT];
        for (int m = 0; m < mr; m++) { acc[m] = _mm256_setzero_ps(); oacc[m] = _mm_setzero_ps(); }
        for (int c = 0; c < K / 128; c++) {
            a45_chunk(bits, qs, qh, meta, n, K, c, q, &d4, &m4);
            for (int m = 0; m < mr; m++) a45_row(q, d4, m4, xq, xd, xs, K, (size_t)(mt + m), c, &acc[m], &oacc[m]);
        }
        for (int m = 0; m < mr; m++) y[(size_t)(mt + m) * ldy + n] = a45_out(acc[m], oacc[m]);
    }
}

static inline __attribute__((always_inline)) void
a_rows_avx2(int bits, const uint8_t* qs, const uint8_t* qh, const uint8_t* meta, int n0, int n1, int K,
        const int8_t* xq, const float* xd, const float* xs, int M, float* y, int ldy, const int one) {
    if (bits == 8) a8_rows_avx2(qs, meta, n0, n1, K, xq, xd, xs, M, y, ldy, one);
    else a45_rows_avx2(bits, qs, qh, meta, n0, n1, K, xq, xd, xs, M, y, ldy, one);
}
