/* GGUF block matrices multiplied on the CPU as stored: int8 activations, integer dot products (AVX512-VNNI),
 * one pass over the weight bytes for all of a call's rows. Layouts (repacked once at load by quant.kquant_pack):
 *
 *   Q4K  qs [N, K/2]: per 256 weights 128 bytes holding 256 codes in the kernel's order (position p = 64v + 4l + j:
 *        vector v, 32-bit lane l, byte j; nibbles: byte i < 64 holds positions i (low) and 64 + i (high), byte 64 + i
 *        positions 128 + i and 192 + i). Position p is weight (l % 8)·32 + (2v + l / 8)·4 + j: every lane of every
 *        vector belongs to sub-block l % 8, so the four vectors' integer products add before one float scaling.
 *        meta [N, K/256, 20]: fp16 d, fp16 dmin, u8 sc[8], u8 mn[8] (one per 32). w = d*sc*q - dmin*mn (Q4_K's).
 *   Q6K  qs as Q4K (the low 4 bits) in the order position p = 64v + 4l + j ↔ weight 16l + 4v + j (lane l: sub-block
 *        l of 16); qh [N, K/4]: byte i of a block's 64 holds bits 4-5 of position 64v + i at bits 2v..2v+1.
 *        meta [N, K/256, 18]: fp16 d, int8 sc[16]. w = d*sc*(q - 32) (Q6_K's values).
 *   A4   qs [N, K/2]: per 128 weights 64 bytes; byte i holds w[i] (low) and w[64+i] (high). meta [N, K/32, 2]:
 *        fp16 d, fp16 m. w = d*q + m (Q4_0, Q4_1).
 *   A8   qs [N, K] u8 codes. meta as A4 (Q8_0 with q + 128).
 *   A5   qs as A4 (each code's low 4 bits); qh [N, K/8]: per 128 weights 16 bytes, bit t of byte j = bit 4 of weight
 *        16t + j (a plane a vector shift expands). meta as A4 (Q5_0 with q + 16, Q5_1): 6 bits a weight where A8 took 9.
 *
 * Activations (kq_quantize): per 32 consecutive values two int8 codes, x ≈ u·(254·q1 + q2) (see kq_quantize; one
 * scale per 256 as llama.cpp's K-quant products lost the first token of a Qwen2.5 prompt, KL 5.6 there), the codes in
 * the order of the weights they meet (order 1: Q4K's, 2: Q6K's, 0: natural), and per 32 (order 2: per 16) values u
 * times their combined codes' sum, as float. Padded
 * columns are zeros. A row's result does not depend on M or on the thread count: every output is one fixed
 * sequence of operations. */
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <stdlib.h>
/* the vector body: 1 AVX512-VNNI (cpu_kquant_avx512.h), 2 AVX2 + FMA + F16C (cpu_kquant_avx2.h), 0 none (the portable
 * loops; KQ_SCALAR forces them) */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__) && !defined(KQ_SCALAR)
#define KQ_VECTOR 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(KQ_SCALAR)
#define KQ_VECTOR 2
#include <immintrin.h>
#else
#define KQ_VECTOR 0
#endif

int kq_vector(void) { return KQ_VECTOR; }

static float fp16_to_float(const uint8_t* p) {
    uint16_t h; memcpy(&h, p, 2);
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else { float f = ldexpf((float)man, -24); memcpy(&bits, &f, 4); bits |= sign; }
    } else if (exp == 31) bits = sign | 0x7F800000u | (man << 13);
    else bits = sign | ((exp + 112) << 23) | (man << 13);
    float f; memcpy(&f, &bits, 4); return f;
}

/* The natural index (within a 256-block) of the weight at kernel position p, for order 1 (Q4K) and 2 (Q6K). */
static int natural(int order, int p) {
    const int v = p >> 6, l = (p >> 2) & 15, j = p & 3;
    return order == 1 ? (l & 7) * 32 + (2 * v + (l >> 3)) * 4 + j : l * 16 + v * 4 + j;
}

int kq_natural(int order, int p) { return natural(order, p); }

/* x float32 [M, K] -> xq int8 [M, 2, Kp]: per row the codes q1 then the residual's q2 (order: 0 natural, 1 Q4K,
 * 2 Q6K), xd float32 [M, Kp/32]: the unit u of each 32 values, x ≈ u·(254·q1 + q2); xs float32 [M, Kp/S] (S = 16 for
 * order 2, else 32): u times the sum of (254·q1 + q2) over each S values. q1 = round(x / (127u·... )) as follows:
 * d = amax / 127, q1 = round(x / d), q2 = round((x − q1·d) / u) with u = d / 254, so |q2| ≤ 127 and every value is
 * within u / 2 = amax / 64,516 of x: ~16 bits against the block's largest (one int8 pass would be 8: its KL was 5x
 * bfloat16's and flipped SmolLM2's greedy answers at near-ties; docs/quality.md session 31). */
void kq_quantize(const float* x, int M, int K, int Kp, int order, int8_t* xq, float* xd, float* xs, int nthreads) {
    const int S = order == 2 ? 16 : 32, C = order ? 256 : 128;  /* C: values a task (one block of the order) */
    const int tasks = Kp / C;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (M * Kp >= 4096)
    for (int t = 0; t < M * tasks; t++) {
        const int m = t / tasks, c0 = (t % tasks) * C;
        const float* v = x + (size_t)m * K;
        int8_t nat1[256], nat2[256];
        int comb[256];
        for (int b = 0; b < C / 32; b++) {
            float amax = 0.f;
            const int k0 = c0 + b * 32;
            for (int i = 0; i < 32; i++) { float a = k0 + i < K ? fabsf(v[k0 + i]) : 0.f; amax = a > amax ? a : amax; }
            const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f, u = d / 254.f, iu = u > 0.f ? 1.f / u : 0.f;
            xd[(size_t)m * (Kp / 32) + k0 / 32] = u;
            for (int i = 0; i < 32; i++) {
                const float xi = k0 + i < K ? v[k0 + i] : 0.f;
                const float q1 = rintf(xi * id);
                float q2 = rintf((xi - q1 * d) * iu);
                q2 = q2 > 127.f ? 127.f : q2 < -127.f ? -127.f : q2;
                nat1[b * 32 + i] = (int8_t)q1; nat2[b * 32 + i] = (int8_t)q2;
                comb[b * 32 + i] = 254 * (int)q1 + (int)q2;
            }
        }
        for (int j = 0; j < C / S; j++) {
            int sum = 0;
            for (int i = j * S; i < j * S + S; i++) sum += comb[i];
            xs[(size_t)m * (Kp / S) + c0 / S + j] = (float)sum * xd[(size_t)m * (Kp / 32) + (c0 + j * S) / 32];
        }
        int8_t* q1 = xq + (size_t)m * 2 * Kp + c0;
        int8_t* q2 = q1 + Kp;
        if (order == 0) { memcpy(q1, nat1, (size_t)C); memcpy(q2, nat2, (size_t)C); }
        else for (int p = 0; p < 256; p++) { const int n = natural(order, p); q1[p] = nat1[n]; q2[p] = nat2[n]; }
    }
}

/* The code of weight i (0..255) of a Q4K / Q6K block, and of weight i (0..127) of an A4 chunk. */
static int nib256(const uint8_t* qs, int i) {
    int j = i >> 6, r = i & 63;
    uint8_t byte = qs[(j >> 1) * 64 + r];
    return (j & 1) ? byte >> 4 : byte & 15;
}

/* ---------------------------------------------------------------- scalar (reference for the vector code) */
static void q4k_rows_scalar(const uint8_t* qs, const uint8_t* meta, int n0, int n1, int K, const int8_t* xq,
                            const float* xd, const float* xs, int M, float* y, int ldy) {
    const int nb = K / 256;
    for (int n = n0; n < n1; n++) for (int m = 0; m < M; m++) {
        float acc = 0.f, mins = 0.f;
        for (int b = 0; b < nb; b++) {
            const uint8_t* bm = meta + ((size_t)n * nb + b) * 20;
            const uint8_t* q = qs + (size_t)n * (K / 2) + b * 128;
            const int8_t* x = xq + (size_t)m * 2 * K + b * 256;  /* q1; q2 at x + K */
            const float d = fp16_to_float(bm), dmin = fp16_to_float(bm + 2);
            int dot[8] = {0};
            for (int p = 0; p < 256; p++) dot[natural(1, p) / 32] += nib256(q, p) * (254 * x[p] + x[K + p]);
            for (int s = 0; s < 8; s++) {
                acc += (float)dot[s] * (d * bm[4 + s] * xd[(size_t)m * (K / 32) + b * 8 + s]);
                mins += xs[(size_t)m * (K / 32) + b * 8 + s] * (dmin * bm[12 + s]);
            }
        }
        y[(size_t)m * ldy + n] = acc - mins;
    }
}

static void q6k_rows_scalar(const uint8_t* qs, const uint8_t* qh, const uint8_t* meta, int n0, int n1, int K,
                            const int8_t* xq, const float* xd, const float* xs, int M, float* y, int ldy) {
    const int nb = K / 256;
    for (int n = n0; n < n1; n++) for (int m = 0; m < M; m++) {
        float acc = 0.f, off = 0.f;
        for (int b = 0; b < nb; b++) {
            const uint8_t* bm = meta + ((size_t)n * nb + b) * 18;
            const uint8_t* l = qs + (size_t)n * (K / 2) + b * 128;
            const uint8_t* h = qh + (size_t)n * (K / 4) + b * 64;
            const int8_t* x = xq + (size_t)m * 2 * K + b * 256;
            const float d = fp16_to_float(bm);
            int dot[16] = {0};
            for (int p = 0; p < 256; p++)
                dot[natural(2, p) / 16] += (nib256(l, p) | (((h[p & 63] >> (2 * (p >> 6))) & 3) << 4))
                                           * (254 * x[p] + x[K + p]);
            for (int s = 0; s < 16; s++) {
                const float f = d * (int8_t)bm[2 + s];
                acc += (float)dot[s] * (f * xd[(size_t)m * (K / 32) + b * 8 + s / 2]);
                off += xs[(size_t)m * (K / 16) + b * 16 + s] * f;
            }
        }
        y[(size_t)m * ldy + n] = acc - 32.f * off;
    }
}

/* The code of weight k of row n of an A4 (bits 4), A5 (5) or A8 (8) matrix */
static inline int a_code(int bits, const uint8_t* qs, const uint8_t* qh, int n, int K, int k) {
    if (bits == 8) return qs[(size_t)n * K + k];
    const int c = k & 127;
    const uint8_t byte = qs[(size_t)n * (K / 2) + (k >> 7) * 64 + (c & 63)];
    const int low = c < 64 ? byte & 15 : byte >> 4;
    return bits == 4 ? low : low | ((qh[(size_t)n * (K / 8) + (k >> 7) * 16 + (c & 15)] >> (c >> 4)) & 1) << 4;
}

static void a_rows_scalar(int bits, const uint8_t* qs, const uint8_t* qh, const uint8_t* meta, int n0, int n1, int K,
                          const int8_t* xq, const float* xd, const float* xs, int M, float* y, int ldy) {
    int nb = K / 32;
    for (int n = n0; n < n1; n++) for (int m = 0; m < M; m++) {
        float acc = 0.f, off = 0.f;
        for (int b = 0; b < nb; b++) {
            const uint8_t* bm = meta + ((size_t)n * nb + b) * 4;
            const int8_t* x = xq + (size_t)m * 2 * K + b * 32;
            int dot = 0;
            for (int i = 0; i < 32; i++) dot += a_code(bits, qs, qh, n, K, b * 32 + i) * (254 * x[i] + x[K + i]);
            acc += (float)dot * (fp16_to_float(bm) * xd[(size_t)m * nb + b]);
            off += xs[(size_t)m * nb + b] * fp16_to_float(bm + 2);
        }
        y[(size_t)m * ldy + n] = acc + off;
    }
}

#if KQ_VECTOR == 1
#include "cpu_kquant_avx512.h"
#define q4k_rows_vec q4k_rows_avx512
#define q6k_rows_vec q6k_rows_avx512
#define a_rows_vec a_rows_avx512
#elif KQ_VECTOR == 2
#include "cpu_kquant_avx2.h"
#define q4k_rows_vec q4k_rows_avx2
#define q6k_rows_vec q6k_rows_avx2
#define a_rows_vec a_rows_avx2
#endif

#define A_BITS(fmt) ((fmt) == 2 ? 4 : (fmt) == 3 ? 8 : 5)  /* an A format's code width */

#if KQ_VECTOR
/* The vector body of a format. Each body is inlined here twice, `one` a constant: 1 for a one-row call (a decode
 * step), whose sums then stay in registers (a tile's accumulator arrays, indexed by a variable row count, live in
 * memory: a load and a store around every FMA), 0 for a tile of rows. The same operations a row either way. */
static inline __attribute__((always_inline)) void vec_rows(int fmt, const uint8_t* qs, const uint8_t* qh,
        const uint8_t* meta, int n0, int n1, int K, const int8_t* xq, const float* xd, const float* xs, int M,
        float* y, int ldy, const int one) {
    if (fmt == 0) q4k_rows_vec(qs, meta, n0, n1, K, xq, xd, xs, M, y, ldy, one);
    else if (fmt == 1) q6k_rows_vec(qs, qh, meta, n0, n1, K, xq, xd, xs, M, y, ldy, one);
    else a_rows_vec(A_BITS(fmt), qs, qh, meta, n0, n1, K, xq, xd, xs, M, y, ldy, one);
}
#endif

/* y[m, n] for n in [0, N) (row stride ldy) = sum_k w[n, k] * x[m, k]; fmt 0 Q4K, 1 Q6K, 2 A4, 3 A8, 4 A5; K: padded
 * width */
static void rows(int fmt, const uint8_t* qs, const uint8_t* qh, const uint8_t* meta, int n0, int n1, int K,
                 const int8_t* xq, const float* xd, const float* xs, int M, float* y, int ldy, int scalar) {
#if KQ_VECTOR
    if (!scalar) {
        if (M == 1) vec_rows(fmt, qs, qh, meta, n0, n1, K, xq, xd, xs, M, y, ldy, 1);
        else vec_rows(fmt, qs, qh, meta, n0, n1, K, xq, xd, xs, M, y, ldy, 0);
        return;
    }
#endif
    if (fmt == 0) q4k_rows_scalar(qs, meta, n0, n1, K, xq, xd, xs, M, y, ldy);
    else if (fmt == 1) q6k_rows_scalar(qs, qh, meta, n0, n1, K, xq, xd, xs, M, y, ldy);
    else a_rows_scalar(A_BITS(fmt), qs, qh, meta, n0, n1, K, xq, xd, xs, M, y, ldy);
}

#define CHUNK 16  /* output rows a task */

/* y[m, n] for n in [0, N) (row stride ldy) = sum_k w[n, k] * x[m, k] (fmt as rows'); K: padded width */
void kq_matmul(int fmt, const uint8_t* qs, const uint8_t* qh, const uint8_t* meta, int N, int K, const int8_t* xq,
               const float* xd, const float* xs, int M, float* y, int ldy, int nthreads, int scalar) {
    const int nchunks = (N + CHUNK - 1) / CHUNK;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int c = 0; c < nchunks; c++) {
        const int n0 = c * CHUNK, n1 = n0 + CHUNK < N ? n0 + CHUNK : N;
        rows(fmt, qs, qh, meta, n0, n1, K, xq, xd, xs, M, y, ldy, scalar);
    }
}

/* A whole layer in one call: x float32 [M, K] → y float32 [M, sum of ns], the parts (each its own format, padded
 * width kps[i] and ns[i] output rows) side by side; the activations quantized once per order the parts need, and
 * every part's row chunks in one parallel loop (one fork and join a layer). 0 on success, -1 out of memory. */
static int linear_run(int nparts, const int* fmts, const uint8_t* const* qs, const uint8_t* const* qh,
                      const uint8_t* const* meta, const int* ns, const int* kps, int K, const float* x, int M,
                      float* y, int nthreads, int scalar) {
    int8_t* xq[3] = {0}; float* xd[3] = {0}; float* xs[3] = {0};
    int kp_of[3] = {0}, ldy = 0, nchunks = 0, failed = 0;
    for (int i = 0; i < nparts; i++) {
        const int order = fmts[i] == 0 ? 1 : fmts[i] == 1 ? 2 : 0;
        ldy += ns[i];
        nchunks += (ns[i] + CHUNK - 1) / CHUNK;
        if (xq[order]) continue;
        kp_of[order] = kps[i];
        xq[order] = (int8_t*)malloc((size_t)M * 2 * kps[i]);
        xd[order] = (float*)malloc(sizeof(float) * (size_t)M * (kps[i] / 32));
        xs[order] = (float*)malloc(sizeof(float) * (size_t)M * (kps[i] / 16));
        if (!xq[order] || !xd[order] || !xs[order]) { failed = 1; break; }
        kq_quantize(x, M, K, kps[i], order, xq[order], xd[order], xs[order], nthreads);
    }
    if (!failed) {
        #pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int c = 0; c < nchunks; c++) {
            int i = 0, col = 0, left = c;  /* the part and row chunk of task c */
            while (left >= (ns[i] + CHUNK - 1) / CHUNK) { left -= (ns[i] + CHUNK - 1) / CHUNK; col += ns[i]; i++; }
            const int order = fmts[i] == 0 ? 1 : fmts[i] == 1 ? 2 : 0;
            const int n0 = left * CHUNK, n1 = n0 + CHUNK < ns[i] ? n0 + CHUNK : ns[i];
            rows(fmts[i], qs[i], qh[i], meta[i], n0, n1, kp_of[order], xq[order], xd[order], xs[order], M, y + col,
                 ldy, scalar);
        }
    }
    for (int o = 0; o < 3; o++) { free(xq[o]); free(xd[o]); free(xs[o]); }
    return failed ? -1 : 0;
}

int kq_linear(int nparts, const int* fmts, const uint8_t* const* qs, const uint8_t* const* qh,
              const uint8_t* const* meta, const int* ns, const int* kps, int K, const float* x, int M, float* y,
              int nthreads) {
    return linear_run(nparts, fmts, qs, qh, meta, ns, kps, K, x, M, y, nthreads, 0);
}

#include "cpu_kquant_step.h"

/* Rows n0..n1 of the matrix as bfloat16 [n1 - n0, K] (round to nearest even), for prompt chunks' GEMMs, Q4K / Q6K
 * columns in the kernel's positions (quant.kquant_pack.NATURAL: the caller permutes its input to match). */
static short NAT1[256], NAT2[256];  /* natural() of each position, filled when the library loads */

__attribute__((constructor)) static void kq_init(void) {
    for (int p = 0; p < 256; p++) { NAT1[p] = (short)natural(1, p); NAT2[p] = (short)natural(2, p); }
}

static void dequant_row(int fmt, const uint8_t* qs, const uint8_t* qh, const uint8_t* meta, int n, int K,
                        int natural_order, float* w) {
    /* Q4K / Q6K: natural_order 0 writes the kernel's positions (a prompt chunk's GEMM takes its input permuted
     * the same way), 1 the weights' own order (references, a head's recomputed rows). */
    if (fmt == 0 || fmt == 1) {
        const int nb = K / 256;
        for (int b = 0; b < nb; b++) {
            const uint8_t* q = qs + (size_t)n * (K / 2) + b * 128;
            uint8_t pos[256];  /* codes by kernel position */
            float A[256], C[256], out[256];
            for (int i = 0; i < 64; i++) {
                pos[i] = q[i] & 15; pos[64 + i] = q[i] >> 4;
                pos[128 + i] = q[64 + i] & 15; pos[192 + i] = q[64 + i] >> 4;
            }
            if (fmt == 0) {
                const uint8_t* bm = meta + ((size_t)n * nb + b) * 20;
                const float d = fp16_to_float(bm), dmin = fp16_to_float(bm + 2);
                for (int l = 0; l < 64; l++) {  /* the 4 positions of lane l % 16 of vector l / 16: sub-block l % 8 */
                    const float a = d * bm[4 + (l & 7)], c = dmin * bm[12 + (l & 7)];
                    for (int j = 0; j < 4; j++) { A[4 * l + j] = a; C[4 * l + j] = c; }
                }
            } else {
                const uint8_t* h = qh + (size_t)n * (K / 4) + b * 64;
                for (int i = 0; i < 64; i++) {
                    pos[i] |= (h[i] & 3) << 4; pos[64 + i] |= ((h[i] >> 2) & 3) << 4;
                    pos[128 + i] |= ((h[i] >> 4) & 3) << 4; pos[192 + i] |= ((h[i] >> 6) & 3) << 4;
                }
                const uint8_t* bm = meta + ((size_t)n * nb + b) * 18;
                const float d = fp16_to_float(bm);
                for (int l = 0; l < 64; l++) {  /* lane l % 16: sub-block l % 16 */
                    const float a = d * (int8_t)bm[2 + (l & 15)];
                    for (int j = 0; j < 4; j++) { A[4 * l + j] = a; C[4 * l + j] = 32.f * a; }
                }
            }
            for (int p = 0; p < 256; p++) out[p] = A[p] * pos[p] - C[p];
            float* o = w + b * 256;
            if (natural_order) {
                const short* nat = fmt == 0 ? NAT1 : NAT2;
                for (int p = 0; p < 256; p++) o[nat[p]] = out[p];
            } else memcpy(o, out, sizeof(out));
        }
        return;
    }
    for (int c = 0; c < K / 128; c++) {
        uint8_t codes[128];
        for (int i = 0; i < 128; i++) codes[i] = (uint8_t)a_code(A_BITS(fmt), qs, qh, n, K, c * 128 + i);
        for (int s = 0; s < 4; s++) {
            const uint8_t* bm = meta + ((size_t)n * (K / 32) + c * 4 + s) * 4;
            const float d = fp16_to_float(bm), m = fp16_to_float(bm + 2);
            float* o = w + c * 128 + s * 32;
            for (int i = 0; i < 32; i++) o[i] = d * codes[s * 32 + i] + m;
        }
    }
}

void kq_dequant_bf16(int fmt, const uint8_t* qs, const uint8_t* qh, const uint8_t* meta, int n0, int n1, int K,
                     uint16_t* out, int nthreads) {
    #pragma omp parallel num_threads(nthreads)
    {
        float* w = (float*)malloc(sizeof(float) * (size_t)K);
        #pragma omp for schedule(static)
        for (int n = n0; n < n1; n++) {
            dequant_row(fmt, qs, qh, meta, n, K, 0, w);
            uint16_t* o = out + (size_t)(n - n0) * K;
            const uint32_t* bits = (const uint32_t*)w;
            for (int k = 0; k < K; k++) o[k] = (uint16_t)((bits[k] + 0x7FFFu + ((bits[k] >> 16) & 1u)) >> 16);
        }
        free(w);
    }
}

/* Rows idx[0..count) of the matrix as float32 [count, K] (the stored values exactly: a head's top candidates). */
void kq_dequant_rows(int fmt, const uint8_t* qs, const uint8_t* qh, const uint8_t* meta, const int64_t* idx,
                     int count, int K, float* out) {
    for (int i = 0; i < count; i++) dequant_row(fmt, qs, qh, meta, (int)idx[i], K, 1, out + (size_t)i * K);
}

/* A head's candidates for the largest logit, per row m of logits [M, V]: with the bound err_v = norms[v]·a[m] + b,
 * floor = max_v(logits − err) (the true maximum is at least this) and every v with logits[v] + err_v ≥ floor
 * written to idx [M, cap] (in order), their count to count[m] (more than cap: counted, not written). One pass
 * over V for the floor and one for the candidates (engine.runtime.narrow_head.recompute_near_top's selection). */
void kq_near_top(const float* logits, const float* norms, const float* a, float b, int M, int V, int cap,
                 int64_t* idx, int64_t* count) {
    for (int m = 0; m < M; m++) {  /* in 16 lanes, so both passes vectorize (a float max needs no order) */
        const float* l = logits + (size_t)m * V;
        const float am = a[m];
        float lane[16];
        for (int j = 0; j < 16; j++) lane[j] = -INFINITY;
        int v = 0;
        for (; v + 16 <= V; v += 16)
            for (int j = 0; j < 16; j++) {
                const float lo = l[v + j] - (norms[v + j] * am + b);
                lane[j] = lo > lane[j] ? lo : lane[j];
            }
        for (; v < V; v++) { const float lo = l[v] - (norms[v] * am + b); lane[0] = lo > lane[0] ? lo : lane[0]; }
        float floor = lane[0];
        for (int j = 1; j < 16; j++) floor = lane[j] > floor ? lane[j] : floor;
        int64_t c = 0;
        for (int v0 = 0; v0 < V; v0 += 16) {
            const int n = v0 + 16 <= V ? 16 : V - v0;
            int any = 0;
            for (int j = 0; j < n; j++) any |= l[v0 + j] + (norms[v0 + j] * am + b) >= floor;
            if (!any) continue;
            for (int j = 0; j < n; j++)
                if (l[v0 + j] + (norms[v0 + j] * am + b) >= floor) {
                    if (c < cap) idx[(size_t)m * cap + c] = v0 + j;
                    c++;
                }
        }
        count[m] = c;
    }
}
