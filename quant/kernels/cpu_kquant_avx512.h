/* AVX512-VNNI bodies of cpu_kquant.c (included there when the compiler targets a CPU that has them).
 * Each weight block is expanded to unsigned byte codes once and multiplied with up to MT rows' int8 codes
 * (vpdpbusd: 4 products a 32-bit lane); each lane's integer sum is scaled in float by its weight scale times its
 * 32 activations' scale. Q4K / Q6K lanes hold one sub-block in all four vectors of a block (the layout's order),
 * so a row costs 4 vpdpbusd, one conversion and one multiply-add a block. */
#define MT 16
static const int V254 = 254;  /* x ≈ u·(254·q1 + q2): the two passes' integer sums combine exactly in int32 */
#define v254 _mm512_set1_epi32(V254)

static inline __m512i idx8(int a, int b) {
    return _mm512_set_epi32(b, b, b, b, b, b, b, b, a, a, a, a, a, a, a, a);
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The four code vectors of a 256-block against a row's two activation passes (q1 at xr, q2 at xr + K), combined
 * exactly: lane l holds sum(code * (254·q1 + q2)) over its 16 products. */
static inline __m512i dot_two_pass(__m512i c0, __m512i c1, __m512i c2, __m512i c3, const int8_t* xr, int K) {
    __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c0, _mm512_loadu_si512(xr));
    t = _mm512_dpbusd_epi32(t, c1, _mm512_loadu_si512(xr + 64));
    t = _mm512_dpbusd_epi32(t, c2, _mm512_loadu_si512(xr + 128));
    t = _mm512_dpbusd_epi32(t, c3, _mm512_loadu_si512(xr + 192));
    __m512i r = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c0, _mm512_loadu_si512(xr + K));
    r = _mm512_dpbusd_epi32(r, c1, _mm512_loadu_si512(xr + K + 64));
    r = _mm512_dpbusd_epi32(r, c2, _mm512_loadu_si512(xr + K + 128));
    r = _mm512_dpbusd_epi32(r, c3, _mm512_loadu_si512(xr + K + 192));
    return _mm512_add_epi32(_mm512_mullo_epi32(t, v254), r);
}

static inline __m512 twice8(__m256 v) {  /* [v0..v7, v0..v7] */
    const __m512 w = _mm512_castps256_ps512(v);
    return _mm512_shuffle_f32x4(w, w, 0x44);
}

static inline __attribute__((always_inline)) void
q4k_rows_avx512(const uint8_t* qs, const uint8_t* meta, int n0, int n1, int K, const int8_t* xq, const float* xd,
        const float* xs, int M, float* y, int ldy, const int one) {
    const int nb = K / 256;
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    for (int n = n0; n < n1; n++)
    for (int mt = 0; mt < M; mt += MT) {
        const int mr = one ? 1 : M - mt < MT ? M - mt : MT;  /* one: a constant (vec_rows) */
        __m512 acc[MT];
        __m256 macc[MT];
        for (int m = 0; m < mr; m++) { acc[m] = _mm512_setzero_ps(); macc[m] = _mm256_setzero_ps(); }
        const uint8_t* q = qs + (size_t)n * (K / 2);
        const uint8_t* mt0 = meta + (size_t)n * nb * 20;
        for (int b = 0; b < nb; b++) {
            const uint8_t* bm = mt0 + b * 20;
            const float d = _cvtsh_ss(*(const uint16_t*)bm), dmin = _cvtsh_ss(*(const uint16_t*)(bm + 2));
            const __m512i v0 = _mm512_loadu_si512(q + b * 128), v1 = _mm512_loadu_si512(q + b * 128 + 64);
            const __m512i w0 = _mm512_and_si512(v0, lo4), w1 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), lo4);
            const __m512i w2 = _mm512_and_si512(v1, lo4), w3 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), lo4);
            const __m256 sc = _mm256_mul_ps(_mm256_set1_ps(d),   // d * sc[j], one a 32-weight sub-block
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(bm + 4)))));
            const __m256 mn = _mm256_mul_ps(_mm256_set1_ps(dmin),
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(bm + 12)))));
            for (int m = 0; m < mr; m++) {
                const size_t row = (size_t)(mt + m);
                // lane l: sub-block l % 8 in all four vectors
                const __m512i t = dot_two_pass(w0, w1, w2, w3, xq + row * 2 * K + b * 256, K);
                const __m256 f = _mm256_mul_ps(sc, _mm256_loadu_ps(xd + row * (K / 32) + b * 8));
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), twice8(f), acc[m]);
                macc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + row * (K / 32) + b * 8), mn, macc[m]);
            }
        }
        for (int m = 0; m < mr; m++) y[(size_t)(mt + m) * ldy + n] = _mm512_reduce_add_ps(acc[m]) - hsum256(macc[m]);
    }
}


static inline __attribute__((always_inline)) void
q6k_rows_avx512(const uint8_t* qs, const uint8_t* qh, const uint8_t* meta, int n0, int n1, int K, const int8_t* xq,
        const float* xd, const float* xs, int M, float* y, int ldy, const int one) {
    const int nb = K / 256;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x03);
    const __m512i twice = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    for (int n = n0; n < n1; n++)
    for (int mt = 0; mt < M; mt += MT) {
        const int mr = one ? 1 : M - mt < MT ? M - mt : MT;  /* one: a constant (vec_rows) */
        __m512 acc[MT], oacc[MT];
        for (int m = 0; m < mr; m++) { acc[m] = _mm512_setzero_ps(); oacc[m] = _mm512_setzero_ps(); }
        const uint8_t* pl = qs + (size_t)n * (K / 2);
        const uint8_t* ph = qh + (size_t)n * (K / 4);
        const uint8_t* mt0 = meta + (size_t)n * nb * 18;
        for (int b = 0; b < nb; b++) {
            const uint8_t* bm = mt0 + b * 18;
            const float d = _cvtsh_ss(*(const uint16_t*)bm);
            const __m512i v0 = _mm512_loadu_si512(pl + b * 128), v1 = _mm512_loadu_si512(pl + b * 128 + 64);
            const __m512i h = _mm512_loadu_si512(ph + b * 64);
            const __m512i c0 = _mm512_or_si512(_mm512_and_si512(v0, m4), _mm512_slli_epi16(_mm512_and_si512(h, m2), 4));
            const __m512i c1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v0, 4), m4),
                                               _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 2), m2), 4));
            const __m512i c2 = _mm512_or_si512(_mm512_and_si512(v1, m4),
                                               _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 4), m2), 4));
            const __m512i c3 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v1, 4), m4),
                                               _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 6), m2), 4));
            const __m512 sc = _mm512_mul_ps(_mm512_set1_ps(d),  // d * sc[l], lane l: sub-block l of 16
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(bm + 2)))));
            for (int m = 0; m < mr; m++) {
                const size_t row = (size_t)(mt + m);
                const __m512i t = dot_two_pass(c0, c1, c2, c3, xq + row * 2 * K + b * 256, K);
                const __m512 dx = _mm512_permutexvar_ps(twice, _mm512_castps256_ps512(
                    _mm256_loadu_ps(xd + row * (K / 32) + b * 8)));  // lane l: its 32 activations' scale
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(sc, dx), acc[m]);
                oacc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xs + row * (K / 16) + b * 16), sc, oacc[m]);
            }
        }
        for (int m = 0; m < mr; m++)
            y[(size_t)(mt + m) * ldy + n] = _mm512_reduce_add_ps(acc[m]) - 32.f * _mm512_reduce_add_ps(oacc[m]);
    }
}


static inline __attribute__((always_inline)) void
a_rows_avx512(int bits, const uint8_t* qs, const uint8_t* qh, const uint8_t* meta, int n0, int n1, int K,
        const int8_t* xq, const float* xd, const float* xs, int M, float* y, int ldy, const int one) {
    const int nb = K / 32, nc = K / 128;
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    const __m512i i01 = idx8(0, 1), i23 = idx8(2, 3);
    /* byte masks of the plane's bit t in 128-bit lane t of w0 (t = 0..3) and of w1 (t = 4..7) */
    const __m512i hb0 = _mm512_set_epi32(0x08080808, 0x08080808, 0x08080808, 0x08080808, 0x04040404, 0x04040404,
        0x04040404, 0x04040404, 0x02020202, 0x02020202, 0x02020202, 0x02020202, 0x01010101, 0x01010101, 0x01010101,
        0x01010101);
    const __m512i hb1 = _mm512_slli_epi32(hb0, 4);
    for (int n = n0; n < n1; n++)
    for (int mt = 0; mt < M; mt += MT) {
        const int mr = one ? 1 : M - mt < MT ? M - mt : MT;  /* one: a constant (vec_rows) */
        __m512 acc[MT];
        __m128 oacc[MT];
        for (int m = 0; m < mr; m++) { acc[m] = _mm512_setzero_ps(); oacc[m] = _mm_setzero_ps(); }
        for (int c = 0; c < nc; c++) {
            __m512i w0, w1;
            if (bits != 8) {
                const __m512i v = _mm512_loadu_si512(qs + (size_t)n * (K / 2) + c * 64);
                w0 = _mm512_and_si512(v, lo4);  /* weights 0..63 of the chunk */
                w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);  /* 64..127 */
                if (bits == 5) {  /* bit 4 of weight 16t + j: bit t of the plane's byte j (in 128-bit lane t of w0 / w1) */
                    const __m512i h =
                        _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(qh + (size_t)n * (K / 8) + c * 16)));
                    w0 = _mm512_mask_add_epi8(w0, _mm512_test_epi8_mask(h, hb0), w0, _mm512_set1_epi8(16));
                    w1 = _mm512_mask_add_epi8(w1, _mm512_test_epi8_mask(h, hb1), w1, _mm512_set1_epi8(16));
                }
            } else {
                w0 = _mm512_loadu_si512(qs + (size_t)n * K + c * 128);
                w1 = _mm512_loadu_si512(qs + (size_t)n * K + c * 128 + 64);
            }
            const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(meta + ((size_t)n * nb + c * 4) * 4)));
            const __m128 lo = _mm256_castps256_ps128(dm), hi = _mm256_extractf128_ps(dm, 1);
            const __m128 d4 = _mm_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)), m4 = _mm_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1));
            const __m512 d4w = _mm512_castps128_ps512(d4);
            const __m512 dv0 = _mm512_permutexvar_ps(i01, d4w), dv1 = _mm512_permutexvar_ps(i23, d4w);
            for (int m = 0; m < mr; m++) {
                const size_t row = (size_t)(mt + m);
                const int8_t* xr = xq + row * 2 * K + c * 128;
                const __m128 dx4 = _mm_loadu_ps(xd + row * nb + c * 4);
                const __m512 dx4w = _mm512_castps128_ps512(dx4);
                const __m512i z = _mm512_setzero_si512();
                const __m512i p0 = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_dpbusd_epi32(z, w0, _mm512_loadu_si512(xr)),
                    v254), _mm512_dpbusd_epi32(z, w0, _mm512_loadu_si512(xr + K)));
                const __m512i p1 = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_dpbusd_epi32(z, w1, _mm512_loadu_si512(xr + 64)),
                    v254), _mm512_dpbusd_epi32(z, w1, _mm512_loadu_si512(xr + K + 64)));
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_mul_ps(dv0, _mm512_permutexvar_ps(i01, dx4w)), acc[m]);
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), _mm512_mul_ps(dv1, _mm512_permutexvar_ps(i23, dx4w)), acc[m]);
                oacc[m] = _mm_fmadd_ps(_mm_loadu_ps(xs + row * nb + c * 4), m4, oacc[m]);  // m * d_x * sum(codes)
            }
        }
        for (int m = 0; m < mr; m++) {
            __m128 s = _mm_add_ps(oacc[m], _mm_movehl_ps(oacc[m], oacc[m]));
            s = _mm_add_ss(s, _mm_movehdup_ps(s));
            y[(size_t)(mt + m) * ldy + n] = _mm512_reduce_add_ps(acc[m]) + _mm_cvtss_f32(s);
        }
    }
}

