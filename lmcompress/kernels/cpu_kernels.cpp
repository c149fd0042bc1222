// CPU kernels for the compressed runtimes at few tokens: packed N:M weights (the layout of
// lmcompress/kernels/reference.py) read directly instead of unpacked to a dense weight on every
// call, the int8 linear in one pass, and both products of a low-rank layer in one call.
//
// Built once per machine by lmcompress/kernels/cpu_kernels.py (c++ -O3 -march=native -fopenmp)
// and called through ctypes; every function takes contiguous row-major buffers.
//
//   lmc_nm_matmul_float  y (T, out) = x (T, in) @ W^T + bias, x and y fp32 or bf16, values fp32,
//                        bf16 or fp16, accumulated in fp32. For few tokens (decoding): each
//                        output row reads its packed weights once for up to TILE tokens.
//   lmc_nm_matmul_int8   acc (T, out) int32 = x_q (T, in) int8 @ W^T, W int8: exact integers,
//                        equal to torch._int_mm of the unpacked codes.
//   lmc_int8_linear      y = rescale(Q(x) @ W^T) + bias for dense or packed int8 codes,
//                        bit-identical to the torch computation of the int8 layers.
//   lmc_int8_quantize    per-token activation codes and scales, and lmc_int8_rescale the int32
//                        products' rescale and bias, each in one pass (many tokens: the
//                        product between them is torch._int_mm).
//   lmc_lowrank_float    y = (x A^T) B^T + bias.
//   lmc_nm_unpack        the dense (out, in) weight, any 1, 2 or 4-byte element (prefill).
//   lmc_int4_linear,     weight-only int4 / int3 (packed nibbles, per-group scales and zeros):
//   lmc_int4_dequant     the decode linear and the prefill dequantization (their section below).
//
// 2:4 on AVX-512 takes 32 inputs at a time: their 16 kept values, their 16 2-bit positions
// (4 bytes) turned into lane indices 0..31, and one two-register permute of x per token
// (vpermt2ps) feeding one fused multiply-add; int8 codes take 64 inputs at a time in 16-bit
// lanes (vpermt2w, then vpdpwssd; needs AVX-512 BW). Dense rows take 16 float or 32 int8
// weights a step. A CPU with AVX2 but not AVX-512 (AMD Zen 2 and 3, Intel before Ice Lake)
// runs AVX2 loops instead, half as wide (LMC_NM_AVX2, LMC_INT4_AVX2; lmc_nm_simd() and
// lmc_int4_vector() say 2). Every other N:M, and a CPU with neither, runs the scalar loop,
// which also finishes what the vector loops leave.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
// The int4 loops for CPUs with AVX2 but not AVX-512 BW/VL (tiled decode, dequantization, 2:4)
#if defined(__AVX2__) && !(defined(__AVX512BW__) && defined(__AVX512VL__))
#define LMC_INT4_AVX2 1
#endif

enum Kind { F32 = 0, BF16 = 1, F16 = 2 };
static const int TILE = 4;  // tokens per pass over a row's packed weights

static inline float bf16_to_f32(uint16_t v) {
  uint32_t u = (uint32_t)v << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(man & 1024)) {
        man <<= 1;
        exp--;
      }
      u = sign | (exp << 23) | ((man & 1023) << 13);
    }
  } else if (exp == 31) {
    u = sign | (255u << 23) | (man << 13);
  } else {
    u = sign | ((exp - 15 + 127) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline float load_value(const void* values, int kind, int64_t i) {
  if (kind == F32) return ((const float*)values)[i];
  if (kind == BF16) return bf16_to_f32(((const uint16_t*)values)[i]);
  return f16_to_f32(((const uint16_t*)values)[i]);
}

static inline void store_value(void* y, int kind, int64_t i, float v) {
  if (kind == F32) ((float*)y)[i] = v;
  else ((uint16_t*)y)[i] = f32_to_bf16(v);  // callers pass fp32 or bf16 outputs
}

// Position (0..m-1) of kept value j of a row inside its group.
static inline int position(const uint8_t* row_idx, int64_t j, int bits) {
  int64_t bit = j * bits;
  return (row_idx[bit >> 3] >> (bit & 7)) & ((1 << bits) - 1);
}

#ifdef __AVX512F__
// Lane i of 16 kept 2:4 values (8 groups, 32 inputs): the input it multiplies, 0..31.
static inline __m512i positions_24(const uint8_t* four_bytes) {
  const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i group = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
  uint32_t word;
  memcpy(&word, four_bytes, 4);
  __m512i pos = _mm512_srlv_epi32(_mm512_set1_epi32((int)word), shifts);
  return _mm512_add_epi32(group, _mm512_and_si512(pos, _mm512_set1_epi32(3)));
}

static inline __m512 load16(const void* values, int kind, int64_t i) {
  if (kind == F32) return _mm512_loadu_ps((const float*)values + i);
  __m256i half = _mm256_loadu_si256((const __m256i*)((const uint16_t*)values + i));
  if (kind == BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
  return _mm512_cvtph_ps(half);
}

// 2:4, tokens x[0..T) of one row: returns how many kept values it consumed. T is a template
// argument so that the accumulators stay in registers (the loops over t unroll).
// U independent accumulators a token (blocks b, b + 1, ... in turn): at one or two tokens a
// single chain of multiply-adds, one a block, waited on each add's latency.
template <int T>
static int64_t row_24_float(const float* x, int64_t in, const void* values, int kind,
                            const uint8_t* row_idx, float* acc) {
  constexpr int U = T == 1 ? 4 : T == 2 ? 2 : 1;
  __m512 sum[T][U];
  for (int t = 0; t < T; t++)
    for (int u = 0; u < U; u++) sum[t][u] = _mm512_setzero_ps();
  const int64_t blocks = in / 32;
  for (int64_t b0 = 0; b0 < blocks; b0 += U) {
    for (int u = 0; u < U && b0 + u < blocks; u++) {  // the last step may hold fewer than U blocks
      const int64_t b = b0 + u;
      __m512i pos = positions_24(row_idx + 4 * b);
      __m512 v = load16(values, kind, 16 * b);
      for (int t = 0; t < T; t++) {
        const float* xb = x + t * in + 32 * b;
        __m512 xg = _mm512_permutex2var_ps(_mm512_loadu_ps(xb), pos, _mm512_loadu_ps(xb + 16));
        sum[t][u] = _mm512_fmadd_ps(v, xg, sum[t][u]);
      }
    }
  }
  for (int t = 0; t < T; t++) {
    for (int u = 1; u < U; u++) sum[t][0] = _mm512_add_ps(sum[t][0], sum[t][u]);
    acc[t] += _mm512_reduce_add_ps(sum[t][0]);
  }
  return 16 * blocks;
}

#ifdef __AVX512BW__
// sum + the products of a and b's 16-bit lanes, added in pairs into 32-bit lanes (exact).
static inline __m512i madd16(__m512i sum, __m512i a, __m512i b) {
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(sum, a, b);
#else
  return _mm512_add_epi32(sum, _mm512_madd_epi16(a, b));
#endif
}

// int8 2:4 with 16-bit lanes: 32 kept values (64 inputs) a step, one vpermt2w of x (widened to
// int16) and one multiply-add of pairs into int32 (vpdpwssd with VNNI, else vpmaddwd + add):
// exact, |a product| <= 2^14.
template <int T>
static int64_t row_24_int8_bw(const int16_t* x, int64_t in, const int8_t* values,
                              const uint8_t* row_idx, int32_t* acc) {
  __m512i sum[T];
  for (int t = 0; t < T; t++) sum[t] = _mm512_setzero_si512();
  const __m512i upper = _mm512_set1_epi32(32);
  int64_t blocks = in / 64;
  for (int64_t b = 0; b < blocks; b++) {
    __m256i lo = _mm512_cvtepi32_epi16(positions_24(row_idx + 8 * b));
    __m256i hi = _mm512_cvtepi32_epi16(_mm512_add_epi32(positions_24(row_idx + 8 * b + 4), upper));
    __m512i pos = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(values + 32 * b)));
    for (int t = 0; t < T; t++) {
      const int16_t* xb = x + t * in + 64 * b;
      __m512i xg = _mm512_permutex2var_epi16(_mm512_loadu_si512(xb), pos, _mm512_loadu_si512(xb + 32));
      sum[t] = madd16(sum[t], v, xg);
    }
  }
  for (int t = 0; t < T; t++) acc[t] += _mm512_reduce_add_epi32(sum[t]);
  return 32 * blocks;
}
// Dense int8 row: 32 codes a step widened to 16-bit lanes, one multiply-add of pairs per token.
template <int T>
static int64_t row_dense_int8(const int16_t* x, int64_t in, const int8_t* row, int32_t* acc) {
  __m512i sum[T];
  for (int t = 0; t < T; t++) sum[t] = _mm512_setzero_si512();
  int64_t blocks = in / 32;
  for (int64_t b = 0; b < blocks; b++) {
    __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(row + 32 * b)));
    for (int t = 0; t < T; t++) {
      __m512i xv = _mm512_loadu_si512(x + t * in + 32 * b);
      sum[t] = madd16(sum[t], v, xv);
    }
  }
  for (int t = 0; t < T; t++) acc[t] += _mm512_reduce_add_epi32(sum[t]);
  return 32 * blocks;
}
#endif

// Dense float row: 16 weights a step (fp32, or bf16/fp16 widened), one FMA per token.
template <int T>
static int64_t row_dense_float(const float* x, int64_t in, const void* row, int kind, float* acc) {
  __m512 sum[T];
  for (int t = 0; t < T; t++) sum[t] = _mm512_setzero_ps();
  int64_t blocks = in / 16;
  for (int64_t b = 0; b < blocks; b++) {
    __m512 v = load16(row, kind, 16 * b);
    for (int t = 0; t < T; t++)
      sum[t] = _mm512_fmadd_ps(v, _mm512_loadu_ps(x + t * in + 16 * b), sum[t]);
  }
  for (int t = 0; t < T; t++) acc[t] += _mm512_reduce_add_ps(sum[t]);
  return 16 * blocks;
}

#if defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
#define LMC_BYTE_LANES 1
// int8 in byte lanes: the activations as unsigned bytes xu = x_q + 128, one vpdpbusd adds 4
// products a 32-bit lane (64 a step), and 128 * sum(w) (one vpdpbusd of 0x80 bytes with the
// same weights, shared by the tokens) is subtracted at the end: exact integers.

// Dense rows: 64 codes a step.
template <int T>
static int64_t row_dense_int8_bytes(const uint8_t* xu, int64_t in, const int8_t* row,
                                    int32_t* acc) {
  __m512i sum[T], wsum = _mm512_setzero_si512();
  for (int t = 0; t < T; t++) sum[t] = _mm512_setzero_si512();
  const __m512i x80 = _mm512_set1_epi8((char)0x80);
  int64_t blocks = in / 64;
  for (int64_t b = 0; b < blocks; b++) {
    __m512i w = _mm512_loadu_si512(row + 64 * b);
    wsum = _mm512_dpbusd_epi32(wsum, x80, w);
    for (int t = 0; t < T; t++)
      sum[t] = _mm512_dpbusd_epi32(sum[t], _mm512_loadu_si512(xu + t * in + 64 * b), w);
  }
  int32_t correction = _mm512_reduce_add_epi32(wsum);
  for (int t = 0; t < T; t++) acc[t] += _mm512_reduce_add_epi32(sum[t]) - correction;
  return 64 * blocks;
}

// 2:4 rows: 64 kept values (128 inputs) a step. Kept value j's input, 4 * (j / 2) + its 2-bit
// code, comes from the step's 16 code bytes by one multishift (each byte takes the 8 bits at
// offset 2j of the code word it sits over); one vpermt2b gathers those activation bytes from
// two registers. A last half step (64 inputs, 32 kept values) runs with the upper half masked.
template <int T>
static int64_t row_24_int8_bytes(const uint8_t* xu, int64_t in, const int8_t* values,
                                 const uint8_t* row_idx, int32_t* acc) {
  __m512i sum[T], wsum = _mm512_setzero_si512();
  for (int t = 0; t < T; t++) sum[t] = _mm512_setzero_si512();
  const __m512i x80 = _mm512_set1_epi8((char)0x80), three = _mm512_set1_epi8(3);
  alignas(64) uint8_t base_bytes[64], shift_bytes[64];
  for (int j = 0; j < 64; j++) {
    base_bytes[j] = (uint8_t)(4 * (j / 2));
    shift_bytes[j] = (uint8_t)((2 * j) % 64);
  }
  const __m512i base = _mm512_load_si512(base_bytes), shifts = _mm512_load_si512(shift_bytes);
  const __m512i halves = _mm512_set_epi64(1, 1, 1, 1, 0, 0, 0, 0);  // code word 0, then 1
  int64_t steps = in / 128, half = (in % 128) >= 64;
  for (int64_t b = 0; b < steps + half; b++) {
    bool last_half = b == steps;
    __m128i codes = last_half ? _mm_loadl_epi64((const __m128i*)(row_idx + 16 * b))
                              : _mm_loadu_si128((const __m128i*)(row_idx + 16 * b));
    __m512i words = _mm512_permutexvar_epi64(halves, _mm512_castsi128_si512(codes));
    __m512i lane = _mm512_add_epi8(base, _mm512_and_si512(_mm512_multishift_epi64_epi8(shifts, words), three));
    __m512i w = last_half ? _mm512_maskz_loadu_epi8(0xffffffffull, values + 64 * b)
                          : _mm512_loadu_si512(values + 64 * b);
    wsum = _mm512_dpbusd_epi32(wsum, x80, w);
    for (int t = 0; t < T; t++) {
      const uint8_t* xb = xu + t * in + 128 * b;
      __m512i lo = _mm512_loadu_si512(xb);
      __m512i hi = last_half ? _mm512_setzero_si512() : _mm512_loadu_si512(xb + 64);
      sum[t] = _mm512_dpbusd_epi32(sum[t], _mm512_permutex2var_epi8(lo, lane, hi), w);
    }
  }
  int32_t correction = _mm512_reduce_add_epi32(wsum);
  for (int t = 0; t < T; t++) acc[t] += _mm512_reduce_add_epi32(sum[t]) - correction;
  return 64 * steps + 32 * half;
}
#endif

#endif

#ifdef __AVX2__
// vpshufb indices of 2:4 kept activations: a position byte (kept values i = 0..3 of two groups
// of 4 inputs, 2 bits each) gives kept i's int16 activation, input c = 4 (i / 2) + p_i of 8
// (bytes 2c, 2c + 1 of 16), at bytes 2i, 2i + 1 (lo) or 8 + 2i, 9 + 2i (hi); 0x80 zeroes the rest.
struct Shuffle24 {
  uint8_t lo[256][16], hi[256][16];
  Shuffle24() {
    for (int v = 0; v < 256; v++) {
      for (int b = 0; b < 16; b++) lo[v][b] = hi[v][b] = 0x80;
      for (int i = 0; i < 4; i++) {
        int c = 4 * (i / 2) + ((v >> (2 * i)) & 3);
        lo[v][2 * i] = hi[v][8 + 2 * i] = (uint8_t)(2 * c);
        lo[v][2 * i + 1] = hi[v][9 + 2 * i] = (uint8_t)(2 * c + 1);
      }
    }
  }
};
static const Shuffle24 SHUFFLE24;

static inline int32_t hsum_epi32_256(__m256i v) {  // modulo 2^32
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// Shuffle24's indices for a 32-input 2:4 step's 4 position bytes p: lo of bytes 0 | 2 (ia), hi
// of bytes 1 | 3 (ib), each 128-bit lane's.
static inline void shuffle_24(const uint8_t* p, __m256i* ia, __m256i* ib) {
  *ia = _mm256_set_m128i(_mm_loadu_si128((const __m128i*)SHUFFLE24.lo[p[2]]),
                         _mm_loadu_si128((const __m128i*)SHUFFLE24.lo[p[0]]));
  *ib = _mm256_set_m128i(_mm_loadu_si128((const __m128i*)SHUFFLE24.hi[p[3]]),
                         _mm_loadu_si128((const __m128i*)SHUFFLE24.hi[p[1]]));
}

// The 16 kept int16 activations of a 32-input step xb, in kept order: the 8-input quarters put
// as 0, 2 | 1, 3 in the two 128-bit lanes (vperm2i128), gathered by two vpshufb.
static inline __m256i gather_24(const int16_t* xb, __m256i ia, __m256i ib) {
  __m256i l01 = _mm256_loadu_si256((const __m256i*)xb), l23 = _mm256_loadu_si256((const __m256i*)(xb + 16));
  return _mm256_or_si256(_mm256_shuffle_epi8(_mm256_permute2x128_si256(l01, l23, 0x20), ia),
                         _mm256_shuffle_epi8(_mm256_permute2x128_si256(l01, l23, 0x31), ib));
}

#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define LMC_NM_AVX2 1
// The few-token loops with AVX2 (no AVX-512: e.g. AMD Zen 2 and 3, Intel before Ice Lake), 8
// float or 16 int16 lanes: the same products as the AVX-512 loops above, half as wide. Float
// rows sum in another order than the plain loop (float rounding); int8 rows are exact.

static inline __m256 load8(const void* values, int kind, int64_t i) {
  if (kind == F32) return _mm256_loadu_ps((const float*)values + i);
  __m128i half = _mm_loadu_si128((const __m128i*)((const uint16_t*)values + i));
  if (kind == BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
  return _mm256_cvtph_ps(half);
}

static inline float hsum_ps_256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// 2:4, 16 inputs (8 kept values, 16 position bits) a step: lane i's input within its 8-input
// half (kept 0-3 read inputs 0-7, kept 4-7 inputs 8-15), one vpermps of each half, a blend.
template <int T>
static int64_t row_24_float_avx2(const float* x, int64_t in, const void* values, int kind,
                                 const uint8_t* row_idx, float* acc) {
  constexpr int U = T == 1 ? 4 : T == 2 ? 2 : 1;
  const __m256i shifts = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
  const __m256i group = _mm256_setr_epi32(0, 0, 4, 4, 0, 0, 4, 4), three = _mm256_set1_epi32(3);
  __m256 sum[T][U];
  for (int t = 0; t < T; t++)
    for (int u = 0; u < U; u++) sum[t][u] = _mm256_setzero_ps();
  const int64_t blocks = in / 16;
  for (int64_t b0 = 0; b0 < blocks; b0 += U) {
    for (int u = 0; u < U && b0 + u < blocks; u++) {  // (as row_24_float: fewer at the end)
      const int64_t b = b0 + u;
      uint16_t bits16;
      memcpy(&bits16, row_idx + 2 * b, 2);
      __m256i pos = _mm256_add_epi32(group, _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(bits16), shifts), three));
      __m256 v = load8(values, kind, 8 * b);
      for (int t = 0; t < T; t++) {
        const float* xb = x + t * in + 16 * b;
        __m256 xg = _mm256_blend_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(xb), pos),
                                    _mm256_permutevar8x32_ps(_mm256_loadu_ps(xb + 8), pos), 0xF0);
        sum[t][u] = _mm256_fmadd_ps(v, xg, sum[t][u]);
      }
    }
  }
  for (int t = 0; t < T; t++) {
    for (int u = 1; u < U; u++) sum[t][0] = _mm256_add_ps(sum[t][0], sum[t][u]);
    acc[t] += hsum_ps_256(sum[t][0]);
  }
  return 8 * blocks;
}

// Dense float row: 8 weights a step, one FMA per token (two accumulators at one token).
template <int T>
static int64_t row_dense_float_avx2(const float* x, int64_t in, const void* row, int kind,
                                    float* acc) {
  constexpr int U = T == 1 ? 2 : 1;
  __m256 sum[T][U];
  for (int t = 0; t < T; t++)
    for (int u = 0; u < U; u++) sum[t][u] = _mm256_setzero_ps();
  const int64_t blocks = in / 8;
  for (int64_t b0 = 0; b0 < blocks; b0 += U) {
    for (int u = 0; u < U && b0 + u < blocks; u++) {  // (fewer than U at the end)
      __m256 v = load8(row, kind, 8 * (b0 + u));
      for (int t = 0; t < T; t++)
        sum[t][u] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + t * in + 8 * (b0 + u)), sum[t][u]);
    }
  }
  for (int t = 0; t < T; t++) {
    for (int u = 1; u < U; u++) sum[t][0] = _mm256_add_ps(sum[t][0], sum[t][u]);
    acc[t] += hsum_ps_256(sum[t][0]);
  }
  return 8 * blocks;
}

// Four dense float rows (o .. o + 3, consecutive in `rows`, `in` apart) for one token: each 8
// activations loaded once for the four rows' FMAs, eight accumulators in flight where one row
// has two, the next four rows prefetched. Each row's sum is row_dense_float_avx2<1>'s, bit for
// bit (the same two accumulators, blocks of 8 alternating, the odd last block in the first).
// bf16 weights, one token, 2-core AMD EPYC (Zen 3), against the row loop and torch's bf16
// F.linear, interleaved, ad hoc (µs): 8192 x 2048 1892 / 2650 / 3002, 2048 x 8192 1911 / 2789 /
// 2920, 1536 x 576 99 / 103 / 159; SmolLM2's head, 49152 x 576 streamed from memory, about
// even with the row loop (5657 / 5324 / 6043: the bandwidth, not the loop, is the limit there).
// Used by the low-rank factors at one token. Tried for the plain bf16 linears of a loaded
// export at decode (the bf16 head, the expanded runtime) and taken out again: in a model each
// layer's weight comes from memory, where torch's loop is about as fast, and the Python of the
// call cost more than the loop saved (the expanded rows decoded at 0.80x dense bf16 lean
// against 0.95x before; benchmarks/results/speed_avx2_lean/stack_dec07b, docs/speed.md).
static int64_t rows4_dense_float_avx2(const float* x, int64_t in, const void* rows, int kind,
                                      float* acc) {
  __m256 sum[4][2];
  for (int r = 0; r < 4; r++) sum[r][0] = sum[r][1] = _mm256_setzero_ps();
  const int64_t blocks = in / 8, elem = kind == F32 ? 4 : 2;
  const char* base = (const char*)rows;
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    if (((8 * b * elem) & 63) == 0)  // a cache line of each of the next four rows per line read
      for (int r = 0; r < 4; r++) _mm_prefetch(base + ((4 + r) * in + 8 * b) * elem, _MM_HINT_T0);
    const __m256 x0 = _mm256_loadu_ps(x + 8 * b), x1 = _mm256_loadu_ps(x + 8 * b + 8);
    for (int r = 0; r < 4; r++) {
      sum[r][0] = _mm256_fmadd_ps(load8(rows, kind, r * in + 8 * b), x0, sum[r][0]);
      sum[r][1] = _mm256_fmadd_ps(load8(rows, kind, r * in + 8 * b + 8), x1, sum[r][1]);
    }
  }
  if (b < blocks) {  // an odd last block: the first accumulator's, as in the row loop
    const __m256 last = _mm256_loadu_ps(x + 8 * b);
    for (int r = 0; r < 4; r++)
      sum[r][0] = _mm256_fmadd_ps(load8(rows, kind, r * in + 8 * b), last, sum[r][0]);
  }
  for (int r = 0; r < 4; r++) acc[r] += hsum_ps_256(_mm256_add_ps(sum[r][0], sum[r][1]));
  return 8 * blocks;
}

// Dense int8 row: 16 codes a step widened to 16-bit lanes, one vpmaddwd per token (exact).
template <int T>
static int64_t row_dense_int8_avx2(const int16_t* x, int64_t in, const int8_t* row, int32_t* acc) {
  __m256i sum[T];
  for (int t = 0; t < T; t++) sum[t] = _mm256_setzero_si256();
  const int64_t blocks = in / 16;
  for (int64_t b = 0; b < blocks; b++) {
    __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(row + 16 * b)));
    for (int t = 0; t < T; t++)
      sum[t] = _mm256_add_epi32(sum[t], _mm256_madd_epi16(v, _mm256_loadu_si256((const __m256i*)(x + t * in + 16 * b))));
  }
  for (int t = 0; t < T; t++) acc[t] += hsum_epi32_256(sum[t]);
  return 16 * blocks;
}

// Four dense int8 rows (o .. o + 3, consecutive in `rows`) for one token: each 16 activations
// loaded once for the four rows' vpmaddwd (exact: the same sums as row_dense_int8_avx2<1>), and
// the next four rows prefetched a cache line at a time. Streaming 1B-shape weights from memory
// on a 2-core AMD EPYC (Zen 3), interleaved against the row-at-a-time loop, ad hoc: +45% on
// 2048 x 8192, 0-20% on 8192 x 2048 and 2048 x 2048; nothing on rows shorter than
// INT8_ROWS4_MIN_IN (SmolLM2's 576 and 1536), which keep the row loop.
static const int64_t INT8_ROWS4_MIN_IN = 2048;
static int64_t rows4_dense_int8_avx2(const int16_t* x, int64_t in, const int8_t* rows,
                                     int32_t* acc) {
  __m256i sum[4];
  for (int r = 0; r < 4; r++) sum[r] = _mm256_setzero_si256();
  const int64_t blocks = in / 16;
  for (int64_t b = 0; b < blocks; b++) {
    const __m256i xv = _mm256_loadu_si256((const __m256i*)(x + 16 * b));
    if ((b & 3) == 0)
      for (int r = 0; r < 4; r++)
        _mm_prefetch((const char*)(rows + (4 + r) * in + 16 * b), _MM_HINT_T0);
    for (int r = 0; r < 4; r++) {
      __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(rows + r * in + 16 * b)));
      sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(v, xv));
    }
  }
  for (int r = 0; r < 4; r++) acc[r] += hsum_epi32_256(sum[r]);
  return 16 * blocks;
}

// int8 2:4: 32 inputs (16 kept codes, 4 position bytes) a step; the activations gathered into
// kept order (gather_24); one vpmaddwd per token (exact).
template <int T>
static int64_t row_24_int8_avx2(const int16_t* x, int64_t in, const int8_t* values,
                                const uint8_t* row_idx, int32_t* acc) {
  __m256i sum[T];
  for (int t = 0; t < T; t++) sum[t] = _mm256_setzero_si256();
  const int64_t blocks = in / 32;
  for (int64_t b = 0; b < blocks; b++) {
    __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(values + 16 * b)));
    __m256i ia, ib;
    shuffle_24(row_idx + 4 * b, &ia, &ib);
    for (int t = 0; t < T; t++)
      sum[t] = _mm256_add_epi32(sum[t], _mm256_madd_epi16(v, gather_24(x + t * in + 32 * b, ia, ib)));
  }
  for (int t = 0; t < T; t++) acc[t] += hsum_epi32_256(sum[t]);
  return 16 * blocks;
}
#endif

// 1: the AVX-512 2:4 loops were compiled in; 2: the AVX2 ones (a CPU without AVX-512); 0: none
extern "C" int lmc_nm_simd(void) {
#if defined(__AVX512F__)
  return 1;
#elif defined(LMC_NM_AVX2)
  return 2;
#else
  return 0;
#endif
}

// acc[0..tn) += the products of tn fp32 tokens xt (tokens, in) with float row o of W: packed
// N:M values and positions, or (idx null) a dense row of `in` values.
static void row_float(const float* xt, int64_t tn, int64_t in, const void* values, int v_kind,
                      const uint8_t* idx, int64_t idx_stride, int n, int m, int bits, int64_t o,
                      float* acc) {
  int elem = v_kind == F32 ? 4 : 2;
  if (!idx) {
    const char* row = (const char*)values + o * in * elem;
    int64_t done = 0;
#ifdef __AVX512F__
    if (tn == 4) done = row_dense_float<4>(xt, in, row, v_kind, acc);
    else if (tn == 3) done = row_dense_float<3>(xt, in, row, v_kind, acc);
    else if (tn == 2) done = row_dense_float<2>(xt, in, row, v_kind, acc);
    else done = row_dense_float<1>(xt, in, row, v_kind, acc);
#elif defined(LMC_NM_AVX2)
    if (tn == 4) done = row_dense_float_avx2<4>(xt, in, row, v_kind, acc);
    else if (tn == 3) done = row_dense_float_avx2<3>(xt, in, row, v_kind, acc);
    else if (tn == 2) done = row_dense_float_avx2<2>(xt, in, row, v_kind, acc);
    else done = row_dense_float_avx2<1>(xt, in, row, v_kind, acc);
#endif
    for (int64_t i = done; i < in; i++) {
      float v = load_value(row, v_kind, i);
      for (int64_t t = 0; t < tn; t++) acc[t] += v * xt[t * in + i];
    }
    return;
  }
  int64_t kept = in / m * n;
  const uint8_t* row_idx = idx + o * idx_stride;
  const char* row_values = (const char*)values + o * kept * elem;
  int64_t done = 0;
#ifdef __AVX512F__
  if (n == 2 && m == 4) {
    if (tn == 4) done = row_24_float<4>(xt, in, row_values, v_kind, row_idx, acc);
    else if (tn == 3) done = row_24_float<3>(xt, in, row_values, v_kind, row_idx, acc);
    else if (tn == 2) done = row_24_float<2>(xt, in, row_values, v_kind, row_idx, acc);
    else done = row_24_float<1>(xt, in, row_values, v_kind, row_idx, acc);
  }
#elif defined(LMC_NM_AVX2)
  if (n == 2 && m == 4) {
    if (tn == 4) done = row_24_float_avx2<4>(xt, in, row_values, v_kind, row_idx, acc);
    else if (tn == 3) done = row_24_float_avx2<3>(xt, in, row_values, v_kind, row_idx, acc);
    else if (tn == 2) done = row_24_float_avx2<2>(xt, in, row_values, v_kind, row_idx, acc);
    else done = row_24_float_avx2<1>(xt, in, row_values, v_kind, row_idx, acc);
  }
#endif
  for (int64_t g = done / n, j = done; j < kept; g++) {  // done is a whole number of groups
    for (int k = 0; k < n; k++, j++) {
      int pos = position(row_idx, j, bits);
      if (pos >= m) continue;  // never stored by pack_nm; loaders refuse it (memory safety)
      float v = load_value(row_values, v_kind, j);
      for (int64_t t = 0; t < tn; t++) acc[t] += v * xt[t * in + g * m + pos];
    }
  }
}

#if defined(LMC_NM_AVX2)  // rows4_dense_float_avx2 exists only there (every build compiles it
                          // or not: tests/kernels/test_kernel_targets.py)
// y (1, out) = x (1, in) @ W^T + bias for dense float rows W, four rows a pass
// (rows4_dense_float_avx2; the last out % 4 rows by row_float): row_float's sums bit for bit.
static void matmul_float_dense_t1(const float* x, int64_t in, const void* values, int v_kind,
                                  int64_t out, const void* bias, int b_kind, void* y, int y_kind,
                                  int threads) {
  const int64_t elem = v_kind == F32 ? 4 : 2, quads = out / 4;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t q = 0; q < quads + (out % 4 != 0); q++) {
    float acc[4] = {0, 0, 0, 0};
    const int64_t o = 4 * q, rows = q < quads ? 4 : out % 4;
    if (rows == 4) {
      const char* block = (const char*)values + o * in * elem;
      int64_t done = rows4_dense_float_avx2(x, in, block, v_kind, acc);
      for (int r = 0; r < 4; r++)  // as row_float's tail
        for (int64_t i = done; i < in; i++) {
          float v = load_value(block + r * in * elem, v_kind, i);
          acc[r] += v * x[i];
        }
    } else {
      for (int64_t r = 0; r < rows; r++)
        row_float(x, 1, in, values, v_kind, nullptr, 0, 0, 0, 0, o + r, acc + r);
    }
    for (int64_t r = 0; r < rows; r++) {
      float b = bias ? load_value(bias, b_kind, o + r) : 0.0f;
      store_value(y, y_kind, o + r, acc[r] + b);
    }
  }
}
#endif

// y (T, out) = x (T, in, fp32) @ W^T + bias for W as row_float reads it; y fp32 or bf16.
static void matmul_float(const float* x, int64_t T, int64_t in, const void* values, int v_kind,
                         const uint8_t* idx, int64_t idx_stride, int64_t out, int n, int m,
                         int bits, const void* bias, int b_kind, void* y, int y_kind, int threads) {
#if defined(LMC_NM_AVX2)
  if (!idx && T == 1) {
    matmul_float_dense_t1(x, in, values, v_kind, out, bias, b_kind, y, y_kind, threads);
    return;
  }
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t o = 0; o < out; o++) {
    for (int64_t t0 = 0; t0 < T; t0 += TILE) {
      int64_t tn = T - t0 < TILE ? T - t0 : TILE;
      float acc[TILE] = {0};
      row_float(x + t0 * in, tn, in, values, v_kind, idx, idx_stride, n, m, bits, o, acc);
      float b = bias ? load_value(bias, b_kind, o) : 0.0f;
      for (int64_t t = 0; t < tn; t++) store_value(y, y_kind, (t0 + t) * out + o, acc[t] + b);
    }
  }
}

static float* widened(const void* x_in, int x_kind, int64_t count) {  // every row reads all of x
  if (x_kind == F32) return (float*)x_in;
  float* x = (float*)malloc(sizeof(float) * count);
  for (int64_t i = 0; i < count; i++) x[i] = load_value(x_in, x_kind, i);
  return x;
}

extern "C" void lmc_nm_matmul_float(const void* x_in, int x_kind, int64_t T, int64_t in,
                                    const void* values, int v_kind, const uint8_t* idx,
                                    int64_t idx_stride, int64_t out, int n, int m, int bits,
                                    const void* bias, int b_kind, void* y, int y_kind,
                                    int threads) {
  float* x = widened(x_in, x_kind, T * in);
  matmul_float(x, T, in, values, v_kind, idx, idx_stride, out, n, m, bits, bias, b_kind, y, y_kind,
               threads);
  if (x != x_in) free(x);
}

// Low rank, y (T, out) = (x A^T) B^T + bias with A (rank, in) and B (out, rank) dense rows of
// one float kind: the intermediate (T, rank) is rounded to y's kind between the two products,
// as two torch linears in that dtype round it.
extern "C" void lmc_lowrank_float(const void* x_in, int x_kind, int64_t T, int64_t in,
                                  const void* A, const void* B, int w_kind, int64_t rank,
                                  int64_t out, const void* bias, int b_kind, void* y, int y_kind,
                                  int threads) {
  float* x = widened(x_in, x_kind, T * in);
  float* h = (float*)malloc(sizeof(float) * T * rank);
  matmul_float(x, T, in, A, w_kind, 0, 0, rank, 1, 1, 0, 0, 0, h, F32, threads);
  if (y_kind == BF16)
    for (int64_t i = 0; i < T * rank; i++) h[i] = bf16_to_f32(f32_to_bf16(h[i]));
  matmul_float(h, T, rank, B, w_kind, 0, 0, out, 1, 1, 0, bias, b_kind, y, y_kind, threads);
  free(h);
  if (x != x_in) free(x);
}

// The activation codes as unsigned bytes, x_q + 128, where the byte-lane loops are compiled in
// (else null).
static uint8_t* unsigned_codes(const int16_t* x, int64_t count) {
#ifdef LMC_BYTE_LANES
  uint8_t* xu = (uint8_t*)malloc(count);
  for (int64_t i = 0; i < count; i++) xu[i] = (uint8_t)(x[i] + 128);
  return xu;
#else
  (void)x;
  (void)count;
  return 0;
#endif
}

// acc[0..tn) += the int32 products of tn tokens of int16 codes xt (tokens, in) with packed int8
// row o (idx null: dense codes, a row of `in`).
static void row_int8(const int16_t* xt, const uint8_t* xu, int64_t tn, int64_t in,
                     const int8_t* values, const uint8_t* idx, int64_t idx_stride, int n, int m,
                     int bits, int64_t o, int32_t* acc) {
  if (!idx) {
    const int8_t* row = values + o * in;
    int64_t done = 0;
#ifdef LMC_BYTE_LANES
    if (tn == 4) done = row_dense_int8_bytes<4>(xu, in, row, acc);
    else if (tn == 3) done = row_dense_int8_bytes<3>(xu, in, row, acc);
    else if (tn == 2) done = row_dense_int8_bytes<2>(xu, in, row, acc);
    else done = row_dense_int8_bytes<1>(xu, in, row, acc);
#elif defined(__AVX512BW__)
    if (tn == 4) done = row_dense_int8<4>(xt, in, row, acc);
    else if (tn == 3) done = row_dense_int8<3>(xt, in, row, acc);
    else if (tn == 2) done = row_dense_int8<2>(xt, in, row, acc);
    else done = row_dense_int8<1>(xt, in, row, acc);
#elif defined(LMC_NM_AVX2)
    if (tn == 4) done = row_dense_int8_avx2<4>(xt, in, row, acc);
    else if (tn == 3) done = row_dense_int8_avx2<3>(xt, in, row, acc);
    else if (tn == 2) done = row_dense_int8_avx2<2>(xt, in, row, acc);
    else done = row_dense_int8_avx2<1>(xt, in, row, acc);
#endif
    for (int64_t i = done; i < in; i++)
      for (int64_t t = 0; t < tn; t++) acc[t] += (int32_t)row[i] * (int32_t)xt[t * in + i];
    return;
  }
  int64_t kept = in / m * n;
  const uint8_t* row_idx = idx + o * idx_stride;
  const int8_t* row_values = values + o * kept;
  int64_t done = 0;
#ifdef LMC_BYTE_LANES
  if (n == 2 && m == 4) {
    if (tn == 4) done = row_24_int8_bytes<4>(xu, in, row_values, row_idx, acc);
    else if (tn == 3) done = row_24_int8_bytes<3>(xu, in, row_values, row_idx, acc);
    else if (tn == 2) done = row_24_int8_bytes<2>(xu, in, row_values, row_idx, acc);
    else done = row_24_int8_bytes<1>(xu, in, row_values, row_idx, acc);
  }
#elif defined(__AVX512BW__)
  if (n == 2 && m == 4) {
    if (tn == 4) done = row_24_int8_bw<4>(xt, in, row_values, row_idx, acc);
    else if (tn == 3) done = row_24_int8_bw<3>(xt, in, row_values, row_idx, acc);
    else if (tn == 2) done = row_24_int8_bw<2>(xt, in, row_values, row_idx, acc);
    else done = row_24_int8_bw<1>(xt, in, row_values, row_idx, acc);
  }
#elif defined(LMC_NM_AVX2)
  if (n == 2 && m == 4) {
    if (tn == 4) done = row_24_int8_avx2<4>(xt, in, row_values, row_idx, acc);
    else if (tn == 3) done = row_24_int8_avx2<3>(xt, in, row_values, row_idx, acc);
    else if (tn == 2) done = row_24_int8_avx2<2>(xt, in, row_values, row_idx, acc);
    else done = row_24_int8_avx2<1>(xt, in, row_values, row_idx, acc);
  }
#endif
  for (int64_t g = done / n, j = done; j < kept; g++) {
    for (int k = 0; k < n; k++, j++) {
      int pos = position(row_idx, j, bits);
      if (pos >= m) continue;  // never stored by pack_nm; loaders refuse it (memory safety)
      int32_t v = row_values[j];
      for (int64_t t = 0; t < tn; t++) acc[t] += v * (int32_t)xt[t * in + g * m + pos];
    }
  }
}

extern "C" void lmc_nm_matmul_int8(const int8_t* x_q, int64_t T, int64_t in, const int8_t* values,
                                   const uint8_t* idx, int64_t idx_stride, int64_t out, int n,
                                   int m, int bits, int32_t* acc_out, int threads) {
  int16_t* x = (int16_t*)malloc(sizeof(int16_t) * T * in);  // widened once, for vpermt2w
  for (int64_t i = 0; i < T * in; i++) x[i] = x_q[i];
  uint8_t* xu = unsigned_codes(x, T * in);
  // blocks of tokens (many tokens: a prefill where torch's int8 GEMM is slow), so that every row
  // reads a block's codes from cache, not all of them from memory
  const int64_t block = 64;
  for (int64_t b0 = 0; b0 < T; b0 += block) {
    const int64_t b1 = T - b0 < block ? T : b0 + block;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < out; o++) {
      for (int64_t t0 = b0; t0 < b1; t0 += TILE) {
        int64_t tn = b1 - t0 < TILE ? b1 - t0 : TILE;
        int32_t acc[TILE] = {0};
        row_int8(x + t0 * in, xu ? xu + t0 * in : 0, tn, in, values, idx, idx_stride, n, m,
                 bits, o, acc);
        for (int64_t t = 0; t < tn; t++) acc_out[(t0 + t) * out + o] = acc[t];
      }
    }
  }
  free(xu);
  free(x);
}

// Activation codes of row t of x (in values) into q, and their scale: the per-token absmax /
// 127 floored at 1e-12, or *static_scale; x / scale rounded half to even, clamped to
// [-128, 127] (quant.per_token_scale and quant.quantize, as torch computes them).
template <typename Q>
static float quantize_row(const void* x_in, int x_kind, int64_t t, int64_t in,
                          const float* static_scale, Q* q) {
  float s;
  const float* xf = (const float*)x_in + t * in;  // read where x_kind == F32 (AVX-512)
  (void)xf;
  int64_t vec = 0;
#ifdef __AVX512F__
  if (x_kind == F32) vec = in / 16 * 16;
#endif
  if (static_scale) {
    s = *static_scale;
  } else {
    float hi = -INFINITY, lo = INFINITY;
#ifdef __AVX512F__
    if (vec) {
      __m512 vhi = _mm512_set1_ps(-INFINITY), vlo = _mm512_set1_ps(INFINITY);
      for (int64_t i = 0; i < vec; i += 16) {
        __m512 v = _mm512_loadu_ps(xf + i);
        vhi = _mm512_max_ps(vhi, v);
        vlo = _mm512_min_ps(vlo, v);
      }
      hi = _mm512_reduce_max_ps(vhi);
      lo = _mm512_reduce_min_ps(vlo);
    }
#endif
    for (int64_t i = vec; i < in; i++) {
      float v = load_value(x_in, x_kind, t * in + i);
      hi = v > hi ? v : hi;
      lo = v < lo ? v : lo;
    }
    float absmax = hi > -lo ? hi : -lo;
    s = absmax / 127.0f;
    if (s < 1e-12f) s = 1e-12f;
  }
#ifdef __AVX512F__
  if (vec) {
    const __m512 vs = _mm512_set1_ps(s), qmin = _mm512_set1_ps(-128.0f), qmax = _mm512_set1_ps(127.0f);
    for (int64_t i = 0; i < vec; i += 16) {
      __m512 c = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(xf + i), vs),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      __m512i ci = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(c, qmin), qmax));
      if (sizeof(Q) == 1) _mm_storeu_si128((__m128i*)(q + i), _mm512_cvtsepi32_epi8(ci));
      else _mm256_storeu_si256((__m256i*)(q + i), _mm512_cvtsepi32_epi16(ci));
    }
  }
#endif
  for (int64_t i = vec; i < in; i++) {
    float c = nearbyintf(load_value(x_in, x_kind, t * in + i) / s);
    q[i] = (Q)(c < -128.0f ? -128.0f : (c > 127.0f ? 127.0f : c));
  }
  return s;
}

// The float half of an int8 linear for output o of token t: acc * x_scale, then * w_scale, or
// fma(acc * x_scale, w_scale, bias) (int8_ops.rescale: torch.mul, then mul_ or addcmul).
static inline float rescaled(int32_t acc, float x_scale, const float* w_scale, const void* bias,
                             int b_kind, int64_t o) {
  float v = (float)acc * x_scale;
  return bias ? fmaf(v, w_scale[o], load_value(bias, b_kind, o)) : v * w_scale[o];
}

// The whole int8 linear for a few tokens, in one pass: y (T, out) = rescale(Q(x) @ W^T) + bias,
// computed exactly as lmcompress.compressor.formats.int8.int8_forward computes it in torch, so
// the output is bit-identical. W: dense int8 codes (out, in) when idx is null, else packed N:M
// codes. w_scale (out,) fp32.
extern "C" void lmc_int8_linear(const void* x_in, int x_kind, int64_t T, int64_t in,
                                const float* static_scale, const int8_t* values,
                                const uint8_t* idx, int64_t idx_stride, int n, int m, int bits,
                                int64_t out, const float* w_scale, const void* bias, int b_kind,
                                void* y, int y_kind, int threads) {
  int16_t* xq = (int16_t*)malloc(sizeof(int16_t) * T * in);
  float* xs = (float*)malloc(sizeof(float) * T);
  for (int64_t t = 0; t < T; t++) xs[t] = quantize_row(x_in, x_kind, t, in, static_scale, xq + t * in);
  uint8_t* xu = unsigned_codes(xq, T * in);
#if defined(LMC_NM_AVX2) && !defined(LMC_BYTE_LANES)
  if (T == 1 && !idx && out % 4 == 0 && in >= INT8_ROWS4_MIN_IN) {  // four rows a pass
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < out; o += 4) {
      int32_t acc[4] = {0, 0, 0, 0};
      const int64_t done = rows4_dense_int8_avx2(xq, in, values + o * in, acc);
      for (int r = 0; r < 4; r++) {
        for (int64_t i = done; i < in; i++)
          acc[r] += (int32_t)values[(o + r) * in + i] * (int32_t)xq[i];
        store_value(y, y_kind, o + r, rescaled(acc[r], xs[0], w_scale, bias, b_kind, o + r));
      }
    }
    free(xu);
    free(xs);
    free(xq);
    return;
  }
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t o = 0; o < out; o++) {
    for (int64_t t0 = 0; t0 < T; t0 += TILE) {
      int64_t tn = T - t0 < TILE ? T - t0 : TILE;
      int32_t acc[TILE] = {0};
      row_int8(xq + t0 * in, xu ? xu + t0 * in : 0, tn, in, values, idx, idx_stride, n, m, bits,
               o, acc);
      for (int64_t t = 0; t < tn; t++)
        store_value(y, y_kind, (t0 + t) * out + o,
                    rescaled(acc[t], xs[t0 + t], w_scale, bias, b_kind, o));
    }
  }
  free(xu);
  free(xs);
  free(xq);
}

// For many tokens (the integer product is then torch._int_mm): the activation codes (T, in) and
// scales (T,) in one pass, and the rescale in one pass.
extern "C" void lmc_int8_quantize(const void* x_in, int x_kind, int64_t T, int64_t in,
                                  const float* static_scale, int8_t* q, float* scales,
                                  int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < T; t++)
    scales[t] = quantize_row(x_in, x_kind, t, in, static_scale, q + t * in);
}

// y row t starts at y + t * y_stride (elements): a block of an output's columns.
extern "C" void lmc_int8_rescale(const int32_t* acc, int64_t T, int64_t out, const float* x_scale,
                                 int per_token, const float* w_scale, const void* bias,
                                 int b_kind, void* y, int64_t y_stride, int y_kind, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < T; t++) {
    float xs = x_scale[per_token ? t : 0];
    int64_t done = 0;
#ifdef __AVX512F__
    if (y_kind == F32 && (!bias || b_kind != F16)) {  // fp32 outputs, fp32 or bf16 bias
      const __m512 vx = _mm512_set1_ps(xs);
      float* yt = (float*)y + t * y_stride;
      for (done = 0; done + 16 <= out; done += 16) {
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(acc + t * out + done)), vx);
        __m512 ws = _mm512_loadu_ps(w_scale + done);
        v = bias ? _mm512_fmadd_ps(v, ws, load16(bias, b_kind, done)) : _mm512_mul_ps(v, ws);
        _mm512_storeu_ps(yt + done, v);
      }
    }
#endif
    for (int64_t o = done; o < out; o++)
      store_value(y, y_kind, t * y_stride + o,
                  rescaled(acc[t * out + o], xs, w_scale, bias, b_kind, o));
  }
}

#ifdef __AVX512F__
// The 32-bit mask of the inputs a 2:4 block keeps: bit g*4+p for each position p of group g.
// One byte of codes holds two groups, so one table lookup a byte.
struct Mask24 {
  uint8_t of_byte[256];
  Mask24() {
    for (int v = 0; v < 256; v++) {
      int lo = (1 << (v & 3)) | (1 << ((v >> 2) & 3));
      int hi = (1 << ((v >> 4) & 3)) | (1 << ((v >> 6) & 3));
      of_byte[v] = (uint8_t)(lo | hi << 4);
    }
  }
};
static const Mask24 MASK24;

static inline uint32_t mask_24(const uint8_t* four_bytes) {
  return (uint32_t)MASK24.of_byte[four_bytes[0]] | (uint32_t)MASK24.of_byte[four_bytes[1]] << 8 |
         (uint32_t)MASK24.of_byte[four_bytes[2]] << 16 | (uint32_t)MASK24.of_byte[four_bytes[3]] << 24;
}

// 2:4 rows by masked expand-loads: the kept values are sorted within their group, so they are
// the set bits of the block's mask in order. Returns the kept values consumed (whole blocks).
// A group whose two positions repeat (never stored by pack_nm) sets one bit: fewer values are
// read, never more, and the next block starts at its own offset.
static int64_t unpack_24(const void* values, int elem, const uint8_t* row_idx, int64_t in,
                         void* dense) {
  int64_t blocks = in / 32;
  if (elem == 4) {
    for (int64_t b = 0; b < blocks; b++) {
      uint32_t mask = mask_24(row_idx + 4 * b);
      const float* src = (const float*)values + 16 * b;
      float* dst = (float*)dense + 32 * b;
      _mm512_storeu_ps(dst, _mm512_maskz_expandloadu_ps((__mmask16)mask, src));
      _mm512_storeu_ps(dst + 16, _mm512_maskz_expandloadu_ps(
                                      (__mmask16)(mask >> 16), src + _mm_popcnt_u32(mask & 0xffff)));
    }
    return 16 * blocks;
  }
#ifdef __AVX512VBMI2__
  if (elem == 2) {
    for (int64_t b = 0; b < blocks; b++)
      _mm512_storeu_si512((uint16_t*)dense + 32 * b,
                          _mm512_maskz_expandloadu_epi16(mask_24(row_idx + 4 * b),
                                                         (const uint16_t*)values + 16 * b));
    return 16 * blocks;
  }
  if (elem == 1) {
    for (int64_t b = 0; b < blocks; b++)
      _mm256_storeu_si256((__m256i*)((uint8_t*)dense + 32 * b),
                          _mm256_maskz_expandloadu_epi8(mask_24(row_idx + 4 * b),
                                                        (const uint8_t*)values + 16 * b));
    return 16 * blocks;
  }
#endif
  return 0;
}
#endif

template <typename T>
static void unpack_rows(const T* values, const uint8_t* idx, int64_t idx_stride, int64_t out,
                        int64_t in, int n, int m, int bits, T* dense, int threads) {
  int64_t kept = in / m * n;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t o = 0; o < out; o++) {
    const uint8_t* row_idx = idx + o * idx_stride;
    const T* src = values + o * kept;
    T* dst = dense + o * in;
    int64_t done = 0;
#ifdef __AVX512F__
    if (n == 2 && m == 4) done = unpack_24(src, sizeof(T), row_idx, in, dst);
#endif
    memset(dst + done / n * m, 0, (in - done / n * m) * sizeof(T));
    for (int64_t g = done / n, j = done; j < kept; g++) {
      for (int k = 0; k < n; k++, j++) {
        int pos = position(row_idx, j, bits);
        if (pos < m) dst[g * m + pos] = src[j];  // pos >= m: never stored by pack_nm (loaders
      }                                          // refuse it); skipped for memory safety
    }
  }
}

extern "C" void lmc_nm_unpack(const void* values, int elem, const uint8_t* idx,
                              int64_t idx_stride, int64_t out, int64_t in, int n, int m, int bits,
                              void* dense, int threads) {
  if (elem == 1)
    unpack_rows((const uint8_t*)values, idx, idx_stride, out, in, n, m, bits, (uint8_t*)dense, threads);
  else if (elem == 2)
    unpack_rows((const uint16_t*)values, idx, idx_stride, out, in, n, m, bits, (uint16_t*)dense, threads);
  else
    unpack_rows((const uint32_t*)values, idx, idx_stride, out, in, n, m, bits, (uint32_t*)dense, threads);
}

// The first index byte (row, byte) of the first `bytes` bytes of each row whose value `valid`
// (256 entries, 1 = the byte's codes are whole groups in ascending order below m) rejects:
// returns 1 and writes where[0..1], or 0. One pass over the index bytes (load-time check).
extern "C" int lmc_nm_first_bad_byte(const uint8_t* idx, int64_t rows, int64_t stride,
                                     int64_t bytes, const uint8_t* valid, int64_t* where) {
  for (int64_t r = 0; r < rows; r++) {
    const uint8_t* row = idx + r * stride;
    uint8_t all = 1;
    for (int64_t b = 0; b < bytes; b++) all &= valid[row[b]];
    if (all) continue;
    for (int64_t b = 0; b < bytes; b++) {
      if (!valid[row[b]]) {
        where[0] = r;
        where[1] = b;
        return 1;
      }
    }
  }
  return 0;
}

// 1 when none of `count` values (kind F32, BF16 or F16) is a NaN or an infinity (all exponent
// bits set), else 0: integer tests of the exponent, in parallel (a load-time check).
extern "C" int lmc_all_finite(const void* values, int kind, int64_t count, int threads) {
  int bad = 0;
  if (kind == F32) {
    const uint32_t* v = (const uint32_t*)values;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(| : bad)
    for (int64_t i = 0; i < count; i++) bad |= (v[i] & 0x7f800000u) == 0x7f800000u;
  } else {
    const uint16_t* v = (const uint16_t*)values;
    const uint16_t exponent = kind == BF16 ? 0x7f80 : 0x7c00;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(| : bad)
    for (int64_t i = 0; i < count; i++) bad |= (v[i] & exponent) == exponent;
  }
  return !bad;
}

// ---- MaskLLM's soft N:M mask, fused (training) -------------------------------------------
//
//   lmc_soft_mask_forward   out (G, m) = W ⊙ mask, mask = softmax((κ·logits + g) / τ) @ C, or
//                           (hard) the candidate at argmax(κ·logits + g); mask entries below
//                           floor are 0 (no subnormal weights). W may be NULL: out = mask.
//   lmc_soft_mask_backward  grad_logits (G, C) = κ/τ · p ⊙ (dp − <p, dp>), dp = (grad ⊙ W) @ Cᵀ,
//                           p the same softmax, its noise regenerated (nothing kept between).
//
// G groups of m weights, C candidates (rows of cand, 0/1). The Gumbel noise g of value i = g·C+c
// is either pool[offset + i mod size] (a doubled pool of `size` values: the GumbelPool) or,
// with pool NULL, a counter-based draw: u = (top 23 bits of splitmix64(seed + i·φ) + 0.5) / 2^23,
// g = −log(−log u), the same in forward and backward and in gumbel.counter_gumbel.

static inline uint64_t lmc_splitmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// (bits + 0.5) / 2^23 is exact in float32 and strictly inside (0, 1)
static inline float lmc_counter_noise(uint64_t seed, int64_t i) {
  uint64_t bits = lmc_splitmix64(seed + (uint64_t)i * 0x9e3779b97f4a7c15ULL) >> 41;
  float u = ((float)bits + 0.5f) * (1.0f / 8388608.0f);
  return -logf(-logf(u));
}

static const int LMC_MAX_CANDIDATES = 256;

// p (C,) = softmax((κ·l + g) / τ) of group g; returns the argmax candidate
static inline int lmc_group_softmax(const float* l, int C, float kappa, float tau,
                                    const float* pool, int64_t size, int64_t offset,
                                    uint64_t seed, int64_t first, float* p) {
  int best = 0;
  float top = -INFINITY;
  // the pool's window: one division a group, then the index wraps by subtraction
  int64_t at = pool ? offset + first % size : 0, end = offset + size;
  for (int c = 0; c < C; c++) {
    float noise;
    if (pool) {
      noise = pool[at++];
      if (at == end) at = offset;
    } else {
      noise = lmc_counter_noise(seed, first + c);
    }
    p[c] = (kappa * l[c] + noise) / tau;
    if (p[c] > top) top = p[c], best = c;
  }
  float sum = 0.0f;
  for (int c = 0; c < C; c++) sum += (p[c] = expf(p[c] - top));
  float inv = 1.0f / sum;
  for (int c = 0; c < C; c++) p[c] *= inv;
  return best;
}

extern "C" void lmc_soft_mask_forward(const float* logits, const float* cand, int64_t G, int C,
                                      int m, float kappa, float tau, const float* pool,
                                      int64_t size, int64_t offset, uint64_t seed, int hard,
                                      float floor_, const float* W, float* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t g = 0; g < G; g++) {
    float p[LMC_MAX_CANDIDATES];
    int best = lmc_group_softmax(logits + g * C, C, kappa, tau, pool, size, offset, seed,
                                 g * C, p);
    for (int j = 0; j < m; j++) {
      float v;
      if (hard) {
        v = cand[best * m + j];
      } else {
        v = 0.0f;
        for (int c = 0; c < C; c++) v += p[c] * cand[c * m + j];
        if (v < floor_) v = 0.0f;
      }
      out[g * m + j] = W ? W[g * m + j] * v : v;
    }
  }
}

extern "C" void lmc_soft_mask_backward(const float* logits, const float* cand, int64_t G, int C,
                                       int m, float kappa, float tau, const float* pool,
                                       int64_t size, int64_t offset, uint64_t seed,
                                       const float* grad, const float* W, float* grad_logits,
                                       int threads) {
  const float scale = kappa / tau;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t g = 0; g < G; g++) {
    float p[LMC_MAX_CANDIDATES], dm[64];
    lmc_group_softmax(logits + g * C, C, kappa, tau, pool, size, offset, seed, g * C, p);
    for (int j = 0; j < m; j++) dm[j] = W ? grad[g * m + j] * W[g * m + j] : grad[g * m + j];
    float dot = 0.0f, dp[LMC_MAX_CANDIDATES];
    for (int c = 0; c < C; c++) {
      float s = 0.0f;
      for (int j = 0; j < m; j++) s += dm[j] * cand[c * m + j];
      dp[c] = s;
      dot += p[c] * s;
    }
    for (int c = 0; c < C; c++) grad_logits[g * C + c] = scale * p[c] * (dp[c] - dot);
  }
}

// out (G,) uint8 = the first index of each row's largest of C logits (torch.argmax's choice;
// NaN rows give their first NaN, as torch does)
extern "C" void lmc_group_argmax(const float* logits, int64_t G, int C, uint8_t* out,
                                 int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t g = 0; g < G; g++) {
    const float* l = logits + g * C;
    int best = 0;
    for (int c = 1; c < C && l[best] == l[best]; c++)
      if (l[c] > l[best] || l[c] != l[c]) best = c;
    out[g] = (uint8_t)best;
  }
}

// ---- weight-only int4 / int3 (packed nibbles) ---------------------------------------------
//
//   lmc_int4_linear   y (T, out) = x (T, in) @ W^T + bias, W = (q - z) * s per group of G input
//                     columns (lmcompress/kernels/int4_reference.py), for a few tokens: the packed
//                     codes are read directly. Each token's activations are quantized per group
//                     to int16 (absmax / 32767, half to even), the group's products
//                     D = sum (q - z) * x16 are exact integers (vpdpwssd, or vpmaddwd + add, on
//                     16-bit lanes; a plain loop without AVX-512), and the float part is fixed:
//                     acc = acc + ((float)D * s) * x_scale, group after group, then + bias. So
//                     every path (vector, scalar) equals int4_reference.decode_linear bit for bit.
//                     Dense codes: 2 codes a byte, low nibble the even column; the even and odd
//                     columns' activations are stored apart, so one byte load widened to 16 bits
//                     gives both (& 15, >> 4) and D = sum q x - z * sum x. Packed 2:4 (idx not
//                     null): kept codes packed the same way, positions as pack_nm's; 64 inputs a
//                     step gathered with vpermt2w as the int8 2:4 loop does, D = sum (q - z) x.
//   lmc_int4_dequant  rows [row0, row0 + rows) of W into fp32 or bf16 (prefill: blocks of rows
//                     that stay in cache for the BLAS matmul). (q - z) * s is one rounded product,
//                     as in the reference.

static const float INT4_ACT_QMAX = 32767.0f;
// The compilers may fuse a product and a later sum into one FMA (GCC's default
// -ffp-contract=fast for C++): an empty asm that "changes" the value keeps it rounded.
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#define LMC_OPAQUE(v) __asm__("" : "+x"(v))
#define LMC_OPAQUE_V(v) __asm__("" : "+v"(v))
#elif (defined(__GNUC__) || defined(__clang__)) && defined(__aarch64__)
#define LMC_OPAQUE(v) __asm__("" : "+w"(v))
#else
#define LMC_OPAQUE(v) \
  do {                \
    volatile float lmc_v = (v); \
    (v) = lmc_v;      \
  } while (0)
#endif
static const int INT4_FLUSH_STEPS = 256;  // int32 lanes: < 256 * 4 * 15 * 32768 < 2^31

struct Int4Acts {  // the quantized activations of T tokens
  int16_t* xq;     // (T, in)
  int16_t* xe;     // (T, half): even columns
  int16_t* xo;     // (T, half): odd columns (0 past the end)
  float* scale;    // (T, groups)
  int64_t* sum;    // (T, groups): sum of the group's codes
  int32_t* sum32;  // the same, as int32 (exact for G <= 65536)
  int64_t half;
};

static void int4_quantize_group(const float* x, int64_t len, float s, int16_t* q) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 vs = _mm512_set1_ps(s), lo = _mm512_set1_ps(-32768.0f), hi = _mm512_set1_ps(32767.0f);
  for (; i + 16 <= len; i += 16) {
    __m512 c = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), vs),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    c = _mm512_min_ps(_mm512_max_ps(c, lo), hi);
    _mm256_storeu_si256((__m256i*)(q + i), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(c)));
  }
#endif
  for (; i < len; i++) {
    float c = nearbyintf(x[i] / s);
    q[i] = (int16_t)(c < -32768.0f ? -32768.0f : (c > 32767.0f ? 32767.0f : c));
  }
}

// One group's activations x (len) to int16 codes q at the scale absmax / 32767 (floored at 1e-12;
// written to *scale): int4_reference.quantize_activations. Returns the codes' sum.
static int64_t int4_quantize_absmax(const float* x, int64_t len, int16_t* q, float* scale) {
  float hi = -INFINITY, lo = INFINITY;
  for (int64_t i = 0; i < len; i++) {
    hi = x[i] > hi ? x[i] : hi;
    lo = x[i] < lo ? x[i] : lo;
  }
  float absmax = hi > -lo ? hi : -lo;
  float s = absmax / INT4_ACT_QMAX;
  if (s < 1e-12f) s = 1e-12f;
  int4_quantize_group(x, len, s, q);
  int64_t total = 0;
  for (int64_t i = 0; i < len; i++) total += q[i];
  *scale = s;
  return total;
}

static Int4Acts int4_prepare(const void* x_in, int x_kind, int64_t T, int64_t in, int64_t groups,
                             int64_t G) {
  Int4Acts a;
  a.half = (in + 1) / 2;
  a.xq = (int16_t*)malloc(sizeof(int16_t) * T * in);
  a.xe = (int16_t*)malloc(sizeof(int16_t) * T * a.half);
  a.xo = (int16_t*)malloc(sizeof(int16_t) * T * a.half);
  a.scale = (float*)malloc(sizeof(float) * T * groups);
  a.sum = (int64_t*)malloc(sizeof(int64_t) * T * groups);
  a.sum32 = (int32_t*)malloc(sizeof(int32_t) * T * groups);
  float* x = (float*)malloc(sizeof(float) * in);
  for (int64_t t = 0; t < T; t++) {
    for (int64_t i = 0; i < in; i++) x[i] = load_value(x_in, x_kind, t * in + i);
    for (int64_t g = 0; g < groups; g++) {
      int64_t total = int4_quantize_absmax(x + g * G, G, a.xq + t * in + g * G,
                                           &a.scale[t * groups + g]);
      a.sum[t * groups + g] = total;
      a.sum32[t * groups + g] = (int32_t)total;
    }
    for (int64_t j = 0; j < a.half; j++) {
      a.xe[t * a.half + j] = a.xq[t * in + 2 * j];
      a.xo[t * a.half + j] = 2 * j + 1 < in ? a.xq[t * in + 2 * j + 1] : 0;
    }
  }
  free(x);
  return a;
}

static void int4_free(Int4Acts* a) {
  free(a->xq);
  free(a->xe);
  free(a->xo);
  free(a->scale);
  free(a->sum);
  free(a->sum32);
}

#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define LMC_INT4_VECTOR 1
static inline int64_t reduce_epi32_to_64(__m512i v) {
  __m512i lo = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(v));
  __m512i hi = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(v, 1));
  return _mm512_reduce_add_epi64(_mm512_add_epi64(lo, hi));
}

// sum[t] += sum over bytes [0, nbytes) of (c & 15) * xe[t] + (c >> 4) * xo[t]: 32 bytes (64
// inputs) a step, the last step masked.
template <int TN>
static void int4_bytes_vector(const uint8_t* row, const int16_t* xe, const int16_t* xo,
                              int64_t stride, int64_t nbytes, int64_t* sum) {
  __m512i acc[TN];
  for (int t = 0; t < TN; t++) acc[t] = _mm512_setzero_si512();
  const __m512i low4 = _mm512_set1_epi16(15);
  int steps = 0;
  for (int64_t b = 0; b < nbytes; b += 32) {
    int64_t k = nbytes - b;
    __mmask32 mk = k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << k) - 1);
    __m512i v = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(mk, row + b));
    __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_srli_epi16(v, 4);
    for (int t = 0; t < TN; t++) {
      acc[t] = madd16(acc[t], lo, _mm512_maskz_loadu_epi16(mk, xe + t * stride + b));
      acc[t] = madd16(acc[t], hi, _mm512_maskz_loadu_epi16(mk, xo + t * stride + b));
    }
    if (++steps == INT4_FLUSH_STEPS) {
      for (int t = 0; t < TN; t++) {
        sum[t] += reduce_epi32_to_64(acc[t]);
        acc[t] = _mm512_setzero_si512();
      }
      steps = 0;
    }
  }
  for (int t = 0; t < TN; t++) sum[t] += reduce_epi32_to_64(acc[t]);
}

// 2:4 kept codes of one group: 64 inputs (32 kept, 16 code bytes, 8 position bytes) a step;
// returns the kept values consumed. sum[t] += sum (q - z) * x[t] at the kept positions.
template <int TN>
static int64_t int4_24_vector(const uint8_t* codes, const uint8_t* row_idx, const int16_t* x,
                              int64_t stride, int64_t cols, int z, int64_t* sum) {
  __m512i acc[TN];
  for (int t = 0; t < TN; t++) acc[t] = _mm512_setzero_si512();
  const __m512i upper = _mm512_set1_epi32(32), low4 = _mm512_set1_epi32(15);
  const __m512i zv = _mm512_set1_epi16((short)z);
  int64_t steps = cols / 64;
  for (int64_t b = 0; b < steps; b++) {
    __m256i plo = _mm512_cvtepi32_epi16(positions_24(row_idx + 8 * b));
    __m256i phi = _mm512_cvtepi32_epi16(_mm512_add_epi32(positions_24(row_idx + 8 * b + 4), upper));
    __m512i pos = _mm512_inserti64x4(_mm512_castsi256_si512(plo), phi, 1);
    __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(codes + 16 * b)));
    __m512i q = _mm512_or_si512(_mm512_and_si512(c, low4), _mm512_slli_epi32(_mm512_srli_epi32(c, 4), 16));
    q = _mm512_sub_epi16(q, zv);
    for (int t = 0; t < TN; t++) {
      const int16_t* xb = x + t * stride + 64 * b;
      __m512i xg = _mm512_permutex2var_epi16(_mm512_loadu_si512(xb), pos, _mm512_loadu_si512(xb + 32));
      acc[t] = madd16(acc[t], q, xg);
    }
    if ((b + 1) % INT4_FLUSH_STEPS == 0) {
      for (int t = 0; t < TN; t++) {
        sum[t] += reduce_epi32_to_64(acc[t]);
        acc[t] = _mm512_setzero_si512();
      }
    }
  }
  for (int t = 0; t < TN; t++) sum[t] += reduce_epi32_to_64(acc[t]);
  return 32 * steps;
}
#endif

// 1: the AVX-512 int4 loops were compiled in; 2: the AVX2 ones (a CPU without AVX-512); 0: none
extern "C" int lmc_int4_vector(void) {
#if defined(LMC_INT4_VECTOR)
  return 1;
#elif defined(LMC_INT4_AVX2)
  return 2;
#else
  return 0;
#endif
}

static inline int int4_code(const uint8_t* codes, int64_t j) {
  return (codes[j >> 1] >> ((j & 1) * 4)) & 15;
}

// D[t] for group g of dense row `row` (tokens t0 .. t0 + TN): exact integers.
template <int TN>
static void int4_group_dense(const Int4Acts& a, int64_t t0, int64_t in, int64_t groups, int64_t G,
                             const uint8_t* row, int z, int64_t g, int vector, int64_t* D) {
  int64_t sum[TN] = {0};
  if (G % 2 == 0 || groups == 1) {  // the group is whole bytes
    int64_t b0 = g * G / 2, b1 = g == groups - 1 ? a.half : (g + 1) * G / 2;
    const int16_t* xe = a.xe + t0 * a.half + b0;
    const int16_t* xo = a.xo + t0 * a.half + b0;
#ifdef LMC_INT4_VECTOR
    if (vector) {
      int4_bytes_vector<TN>(row + b0, xe, xo, a.half, b1 - b0, sum);
    } else
#endif
    {
      for (int64_t b = 0; b < b1 - b0; b++) {
        int32_t lo = row[b0 + b] & 15, hi = row[b0 + b] >> 4;
        for (int t = 0; t < TN; t++) sum[t] += lo * xe[t * a.half + b] + hi * xo[t * a.half + b];
      }
    }
  } else {
    for (int64_t i = g * G; i < (g + 1) * G; i++) {
      int32_t q = int4_code(row, i);
      for (int t = 0; t < TN; t++) sum[t] += q * a.xq[(t0 + t) * in + i];
    }
  }
  for (int t = 0; t < TN; t++) D[t] = sum[t] - (int64_t)z * a.sum[(t0 + t) * groups + g];
  (void)vector;
}

#ifdef LMC_INT4_AVX2
// 2:4 kept codes of one group with AVX2, 32 inputs (16 kept, 8 code bytes, 4 position bytes) a
// step: the codes widened to 16-bit lanes less z; the activations gathered into kept order
// (gather_24); one vpmaddwd. sum[t] += sum (q - z) * x[t] (exact: |D| < 2^31 for G <= 4096).
// Returns the kept values consumed.
template <int TN>
static int64_t int4_24_avx2(const uint8_t* codes, const uint8_t* row_idx, const int16_t* x,
                            int64_t stride, int64_t cols, int z, int64_t* sum) {
  __m256i acc[TN];
  for (int t = 0; t < TN; t++) acc[t] = _mm256_setzero_si256();
  const __m128i low4 = _mm_set1_epi8(15);
  const __m256i zv = _mm256_set1_epi16((short)z);
  const int64_t steps = cols / 32;
  for (int64_t b = 0; b < steps; b++) {
    __m128i v = _mm_loadl_epi64((const __m128i*)(codes + 8 * b));
    __m128i kept = _mm_unpacklo_epi8(_mm_and_si128(v, low4), _mm_and_si128(_mm_srli_epi16(v, 4), low4));
    __m256i w = _mm256_sub_epi16(_mm256_cvtepu8_epi16(kept), zv);
    __m256i ia, ib;
    shuffle_24(row_idx + 4 * b, &ia, &ib);
    for (int t = 0; t < TN; t++)
      acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(w, gather_24(x + t * stride + 32 * b, ia, ib)));
  }
  for (int t = 0; t < TN; t++) sum[t] += hsum_epi32_256(acc[t]);
  return 16 * steps;
}
#endif

// The same for packed N:M kept codes (groups over the original columns; G a multiple of m).
template <int TN>
static void int4_group_nm(const Int4Acts& a, int64_t t0, int64_t in, int64_t groups, int64_t G,
                          const uint8_t* codes, const uint8_t* row_idx, int n, int m, int bits,
                          int z, int64_t g, int vector, int64_t* D) {
  int64_t sum[TN] = {0};
  int64_t c0 = g * G, j0 = c0 / m * n, j1 = (c0 + G) / m * n, done = 0;
#ifdef LMC_INT4_VECTOR
  if (vector && n == 2 && m == 4 && c0 % 8 == 0)
    done = int4_24_vector<TN>(codes + j0 / 2, row_idx + j0 / 4, a.xq + t0 * in + c0, in, G, z, sum);
#endif
#ifdef LMC_INT4_AVX2
  if (vector && n == 2 && m == 4 && G % 32 == 0 && G <= 4096)
    done = int4_24_avx2<TN>(codes + j0 / 2, row_idx + j0 / 4, a.xq + t0 * in + c0, in, G, z, sum);
#endif
  (void)vector;
  for (int64_t j = j0 + done; j < j1; j++) {
    int pos = position(row_idx, j, bits);
    if (pos >= m) continue;  // never stored by pack_nm; loaders refuse it (memory safety)
    int32_t q = int4_code(codes, j) - z;
    int64_t col = j / n * m + pos;
    for (int t = 0; t < TN; t++) sum[t] += q * a.xq[(t0 + t) * in + col];
  }
  for (int t = 0; t < TN; t++) D[t] = sum[t];
}

// The float part (int4_reference.decode_linear): p_g = ((float)D_g * s_g) * x_scale_g goes
// into partial g % 16; the 16 partials are then added in a fixed tree (i + 8, i + 4, i + 2,
// i + 1), so that 16 groups at a time can run in vector lanes.
static inline void int4_add_partial(float* part, int64_t g, int64_t D, float s, float xs) {
  float p = (float)D * s;
  p = p * xs;
  LMC_OPAQUE(p);  // rounded here: never contracted with the sum into an FMA
  part[g & 15] = part[g & 15] + p;
}

static inline float int4_tree(const float* part) {
  float s8[8], s4[4];
  for (int i = 0; i < 8; i++) s8[i] = part[i] + part[i + 8];
  for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
  float a = s4[0] + s4[2], b = s4[1] + s4[3];
  return a + b;
}

#ifdef LMC_INT4_VECTOR
// r[i] = the sum of the 16 lanes of v[i] (modulo 2^32): a transposing tree of adds.
static inline __m512i int4_sum16(const __m512i* v) {
  __m512i u[4];
  for (int q = 0; q < 4; q++) {
    const __m512i* w = v + 4 * q;
    __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(w[0], w[1]), _mm512_unpackhi_epi32(w[0], w[1]));
    __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(w[2], w[3]), _mm512_unpackhi_epi32(w[2], w[3]));
    u[q] = _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
  }  // u[q], 128-bit lane j: the lane-j sums of v[4q .. 4q + 3]
  __m512i w0 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], 0x88), _mm512_shuffle_i32x4(u[0], u[1], 0xDD));
  __m512i w1 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2], u[3], 0x88), _mm512_shuffle_i32x4(u[2], u[3], 0xDD));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(w0, w1, 0x88), _mm512_shuffle_i32x4(w0, w1, 0xDD));
}

// R dense rows (sharing each activation load), 16 groups at a time, for G a multiple of 64 up
// to 4096 or G = 32 (every D fits in int32, so its lanes may wrap): each group's products in
// one vector, the 16 groups' sums by one transposing tree, and the float part in 16 lanes.
template <int TN, int R>
static void int4_rows_fast(const Int4Acts& a, int64_t t0, int64_t groups, int64_t G,
                           const uint8_t* const* row, const float* const* srow,
                           const uint8_t* const* zrow, float* part /* R * TN * 16 */) {
  __m512 vpart[R][TN];
  for (int r = 0; r < R; r++)
    for (int t = 0; t < TN; t++) vpart[r][t] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi16(15);
  __m512i vec[R][TN][16];
  const int16_t* xe[TN];
  const int16_t* xo[TN];
  for (int t = 0; t < TN; t++) {
    xe[t] = a.xe + (t0 + t) * a.half;
    xo[t] = a.xo + (t0 + t) * a.half;
  }
  const bool pairs = G == 32;  // one 32-byte step holds two groups
  const int64_t group_bytes = G / 2;
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    int64_t gn = groups - g0 < 16 ? groups - g0 : 16;
    __mmask16 gm = (__mmask16)((1u << gn) - 1);
    for (int64_t gi = 0; gi < gn; gi += pairs ? 2 : 1) {
      __m512i acc[R][TN], acc2[R][TN];  // even and odd columns: independent chains
      for (int r = 0; r < R; r++)
        for (int t = 0; t < TN; t++) acc[r][t] = acc2[r][t] = _mm512_setzero_si512();
      const int64_t b0 = (g0 + gi) * group_bytes;
      const int64_t nb = pairs ? (gn - gi >= 2 ? 32 : 16) : group_bytes;
      if (nb == 16) {  // a last single group of 32 columns: half a step, masked loads
        const __mmask32 mk = (__mmask32)0xffffu;
        for (int r = 0; r < R; r++) {
          __m512i v = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(mk, row[r] + b0));
          __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_srli_epi16(v, 4);
          for (int t = 0; t < TN; t++) {
            acc[r][t] = madd16(acc[r][t], lo, _mm512_maskz_loadu_epi16(mk, xe[t] + b0));
            acc2[r][t] = madd16(acc2[r][t], hi, _mm512_maskz_loadu_epi16(mk, xo[t] + b0));
          }
        }
      }
      for (int64_t b = b0; b + 32 <= b0 + nb; b += 32) {  // plain loads (no mask uops)
        __m512i lo[R], hi[R];
        for (int r = 0; r < R; r++) {
          __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(row[r] + b)));
          lo[r] = _mm512_and_si512(v, low4);
          hi[r] = _mm512_srli_epi16(v, 4);
        }
        for (int t = 0; t < TN; t++) {
          __m512i e = _mm512_loadu_si512(xe[t] + b), o = _mm512_loadu_si512(xo[t] + b);
          for (int r = 0; r < R; r++) {
            acc[r][t] = madd16(acc[r][t], lo[r], e);
            acc2[r][t] = madd16(acc2[r][t], hi[r], o);
          }
        }
      }
      for (int r = 0; r < R; r++) {
        for (int t = 0; t < TN; t++) {
          __m512i sum = _mm512_add_epi32(acc[r][t], acc2[r][t]);
          if (pairs) {
            vec[r][t][gi] = _mm512_maskz_mov_epi32(0x00ff, sum);
            vec[r][t][gi + 1] = _mm512_maskz_mov_epi32(0xff00, sum);
          } else {
            vec[r][t][gi] = sum;
          }
        }
      }
    }
    for (int64_t gi = gn + (pairs && gn % 2); gi < 16; gi++)
      for (int r = 0; r < R; r++)
        for (int t = 0; t < TN; t++) vec[r][t][gi] = _mm512_setzero_si512();
    for (int r = 0; r < R; r++) {
      __m512 s = _mm512_maskz_loadu_ps(gm, srow[r] + g0);
      __m512i z = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(gm, zrow[r] + g0));
      for (int t = 0; t < TN; t++) {
        __m512i sx = _mm512_maskz_loadu_epi32(gm, a.sum32 + (t0 + t) * groups + g0);
        __m512i D = _mm512_sub_epi32(int4_sum16(vec[r][t]), _mm512_mullo_epi32(z, sx));
        __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(D), s);
        p = _mm512_mul_ps(p, _mm512_maskz_loadu_ps(gm, a.scale + (t0 + t) * groups + g0));
        LMC_OPAQUE_V(p);  // rounded here: never contracted with the sum into an FMA
        vpart[r][t] = _mm512_add_ps(vpart[r][t], p);
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int t = 0; t < TN; t++) _mm512_storeu_ps(part + 16 * (r * TN + t), vpart[r][t]);
}

#ifdef __AVX512VBMI2__
#define LMC_INT4_NM_FAST 1
// A packed 2:4 row, 16 groups at a time, for G a multiple of 64 up to 4096: each 64-input step
// widens its 32 kept codes to 16-bit lanes, subtracts z, and expands them (vpexpandw, the keep
// mask from the positions) into the 64 inputs' lanes, zeros where pruned: then the dense
// step's multiply-adds with the contiguous activations. D = sum (q - z) x, exact in int32.
template <int TN>
static void int4_row_nm_fast(const Int4Acts& a, int64_t t0, int64_t in, int64_t groups,
                             int64_t G, const uint8_t* codes, const uint8_t* row_idx,
                             const float* srow, const uint8_t* zrow, float* part) {
  __m512 vpart[TN];
  for (int t = 0; t < TN; t++) vpart[t] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi32(15);
  __m512i vec[TN][16];
  const int16_t* x[TN];
  for (int t = 0; t < TN; t++) x[t] = a.xq + (t0 + t) * in;
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    int64_t gn = groups - g0 < 16 ? groups - g0 : 16;
    __mmask16 gm = (__mmask16)((1u << gn) - 1);
    for (int64_t gi = 0; gi < gn; gi++) {
      __m512i acc[TN], acc2[TN];
      for (int t = 0; t < TN; t++) acc[t] = acc2[t] = _mm512_setzero_si512();
      const __m512i zv = _mm512_set1_epi16((short)zrow[g0 + gi]);
      for (int64_t c = (g0 + gi) * G; c < (g0 + gi + 1) * G; c += 64) {  // c: first input
        int64_t j = c / 2;  // first kept value
        __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(codes + j / 2)));
        __m512i q = _mm512_or_si512(_mm512_and_si512(b, low4), _mm512_slli_epi32(_mm512_srli_epi32(b, 4), 16));
        q = _mm512_sub_epi16(q, zv);
        __m512i w0 = _mm512_maskz_expand_epi16(mask_24(row_idx + j / 4), q);
        __m512i w1 = _mm512_maskz_expand_epi16(mask_24(row_idx + j / 4 + 4), _mm512_shuffle_i64x2(q, q, 0xEE));
        for (int t = 0; t < TN; t++) {
          acc[t] = madd16(acc[t], w0, _mm512_loadu_si512(x[t] + c));
          acc2[t] = madd16(acc2[t], w1, _mm512_loadu_si512(x[t] + c + 32));
        }
      }
      for (int t = 0; t < TN; t++) vec[t][gi] = _mm512_add_epi32(acc[t], acc2[t]);
    }
    for (int64_t gi = gn; gi < 16; gi++)
      for (int t = 0; t < TN; t++) vec[t][gi] = _mm512_setzero_si512();
    __m512 s = _mm512_maskz_loadu_ps(gm, srow + g0);
    for (int t = 0; t < TN; t++) {
      __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(int4_sum16(vec[t])), s);
      p = _mm512_mul_ps(p, _mm512_maskz_loadu_ps(gm, a.scale + (t0 + t) * groups + g0));
      LMC_OPAQUE_V(p);  // rounded here: never contracted with the sum into an FMA
      vpart[t] = _mm512_add_ps(vpart[t], p);
    }
  }
  for (int t = 0; t < TN; t++) _mm512_storeu_ps(part + 16 * t, vpart[t]);
}
#endif

// Rows o .. o + R - 1 (R = 1 or 2) for tokens t0 .. t0 + tn: acc[r * TILE + t].
template <int R>
static void int4_rows_fast_tn(const Int4Acts& a, int64_t t0, int64_t tn, int64_t groups,
                              int64_t G, const uint8_t* codes, int64_t code_stride,
                              const float* scales, const uint8_t* zeros, int64_t o, float* acc) {
  const uint8_t* row[R];
  const float* srow[R];
  const uint8_t* zrow[R];
  for (int r = 0; r < R; r++) {
    row[r] = codes + (o + r) * code_stride;
    srow[r] = scales + (o + r) * groups;
    zrow[r] = zeros + (o + r) * groups;
  }
  float part[R * TILE * 16];
  if (tn == 4) int4_rows_fast<4, R>(a, t0, groups, G, row, srow, zrow, part);
  else if (tn == 3) int4_rows_fast<3, R>(a, t0, groups, G, row, srow, zrow, part);
  else if (tn == 2) int4_rows_fast<2, R>(a, t0, groups, G, row, srow, zrow, part);
  else int4_rows_fast<1, R>(a, t0, groups, G, row, srow, zrow, part);
  for (int r = 0; r < R; r++)
    for (int64_t t = 0; t < tn; t++) acc[r * TILE + t] = int4_tree(part + 16 * (r * tn + t));
}
#endif

template <int TN>
static void int4_row(const Int4Acts& a, int64_t t0, int64_t in, const uint8_t* codes,
                     int64_t code_stride, const float* scales, const uint8_t* zeros,
                     int64_t groups, int64_t G, const uint8_t* idx, int64_t idx_stride, int n,
                     int m, int bits, int64_t o, int vector, float* acc) {
  const uint8_t* row = codes + o * code_stride;
  float part[TN * 16] = {0};
#ifdef LMC_INT4_NM_FAST
  if (vector && idx && n == 2 && m == 4 && G % 64 == 0 && G <= 4096) {
    int4_row_nm_fast<TN>(a, t0, in, groups, G, row, idx + o * idx_stride, scales + o * groups,
                         zeros + o * groups, part);
    for (int t = 0; t < TN; t++) acc[t] = int4_tree(part + 16 * t);
    return;
  }
#endif
  for (int64_t g = 0; g < groups; g++) {
    int64_t D[TN];
    int z = zeros[o * groups + g];
    if (idx)
      int4_group_nm<TN>(a, t0, in, groups, G, row, idx + o * idx_stride, n, m, bits, z, g, vector, D);
    else
      int4_group_dense<TN>(a, t0, in, groups, G, row, z, g, vector, D);
    float s = scales[o * groups + g];
    for (int t = 0; t < TN; t++)
      int4_add_partial(part + 16 * t, g, D[t], s, a.scale[(t0 + t) * groups + g]);
  }
  for (int t = 0; t < TN; t++) acc[t] = int4_tree(part + 16 * t);
}

extern "C" void lmc_int4_linear(const void* x_in, int x_kind, int64_t T, int64_t in,
                                const uint8_t* codes, int64_t code_stride, const float* scales,
                                const uint8_t* zeros, int64_t groups, int64_t G,
                                const uint8_t* idx, int64_t idx_stride, int n, int m, int bits,
                                int64_t out, const void* bias, int b_kind, void* y, int y_kind,
                                int vector, int threads) {
  Int4Acts a = int4_prepare(x_in, x_kind, T, in, groups, G);
#ifdef LMC_INT4_VECTOR
  if (vector && !idx && (G == 32 || (G % 64 == 0 && G <= 4096))) {  // two rows at a time
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t pair = 0; pair < (out + 1) / 2; pair++) {
      int64_t o = 2 * pair;
      for (int64_t t0 = 0; t0 < T; t0 += TILE) {
        int64_t tn = T - t0 < TILE ? T - t0 : TILE;
        float acc[2 * TILE];
        int R = o + 1 < out ? 2 : 1;
        if (R == 2) int4_rows_fast_tn<2>(a, t0, tn, groups, G, codes, code_stride, scales, zeros, o, acc);
        else int4_rows_fast_tn<1>(a, t0, tn, groups, G, codes, code_stride, scales, zeros, o, acc);
        for (int r = 0; r < R; r++) {
          for (int64_t t = 0; t < tn; t++) {
            float v = acc[r * TILE + t];
            if (bias) v = v + load_value(bias, b_kind, o + r);
            store_value(y, y_kind, (t0 + t) * out + o + r, v);
          }
        }
      }
    }
    int4_free(&a);
    return;
  }
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t o = 0; o < out; o++) {
    for (int64_t t0 = 0; t0 < T; t0 += TILE) {
      int64_t tn = T - t0 < TILE ? T - t0 : TILE;
      float acc[TILE] = {0};
      if (tn == 4)
        int4_row<4>(a, t0, in, codes, code_stride, scales, zeros, groups, G, idx, idx_stride, n, m, bits, o, vector, acc);
      else if (tn == 3)
        int4_row<3>(a, t0, in, codes, code_stride, scales, zeros, groups, G, idx, idx_stride, n, m, bits, o, vector, acc);
      else if (tn == 2)
        int4_row<2>(a, t0, in, codes, code_stride, scales, zeros, groups, G, idx, idx_stride, n, m, bits, o, vector, acc);
      else
        int4_row<1>(a, t0, in, codes, code_stride, scales, zeros, groups, G, idx, idx_stride, n, m, bits, o, vector, acc);
      for (int64_t t = 0; t < tn; t++) {
        float v = acc[t];
        if (bias) v = v + load_value(bias, b_kind, o);
        store_value(y, y_kind, (t0 + t) * out + o, v);
      }
    }
  }
  int4_free(&a);
}

#ifdef LMC_INT4_VECTOR
// (q - z) * s of a group's nbytes (a multiple of 16) packed bytes into fp32 or bf16: the 16
// possible values are computed once a group (the same product, and for bf16 the same rounding
// to nearest even as f32_to_bf16: the values are finite), then looked up by code (vpermw /
// vpermps), 64 columns a step, the codes put in column order by byte unpacks.
// The 16 values (q - z) * s of a group, fp32, and rounded to bf16 (in 16-bit lanes).
static inline void int4_tables(int z, float s, __m512* table, __m512i* table16) {
  *table = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_sub_epi32(
          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(z))),
      _mm512_set1_ps(s));
  __m512i u = _mm512_castps_si512(*table);
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                           _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
  *table16 = _mm512_castsi256_si512(_mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}

static void int4_dequant_group(const uint8_t* row, int64_t nbytes, int z, float s, void* out,
                               bool f32) {
  __m512 table;
  __m512i table16;
  int4_tables(z, s, &table, &table16);
  const __m256i low4 = _mm256_set1_epi8(15);
  int64_t b = 0;
  for (; b + 32 <= nbytes; b += 32) {
    __m256i v = _mm256_loadu_si256((const __m256i*)(row + b));
    __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    __m256i a = _mm256_unpacklo_epi8(lo, hi), c = _mm256_unpackhi_epi8(lo, hi);
    __m256i cols[2] = {_mm256_permute2x128_si256(a, c, 0x20), _mm256_permute2x128_si256(a, c, 0x31)};
    for (int k = 0; k < 2; k++) {  // 32 columns each, in order
      if (f32) {
        float* dst = (float*)out + 2 * b + 32 * k;
        _mm512_storeu_ps(dst, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(cols[k])), table));
        _mm512_storeu_ps(dst + 16, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(cols[k], 1)), table));
      } else {
        _mm512_storeu_si512((uint16_t*)out + 2 * b + 32 * k,
                            _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(cols[k]), table16));
      }
    }
  }
  if (b < nbytes) {  // 16 bytes left: 32 columns
    __m128i v = _mm_loadu_si128((const __m128i*)(row + b));
    const __m128i low4x = _mm_set1_epi8(15);
    __m128i lo = _mm_and_si128(v, low4x), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4x);
    __m256i cols = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
    if (f32) {
      float* dst = (float*)out + 2 * b;
      _mm512_storeu_ps(dst, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(cols)), table));
      _mm512_storeu_ps(dst + 16, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(cols, 1)), table));
    } else {
      _mm512_storeu_si512((uint16_t*)out + 2 * b, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(cols), table16));
    }
  }
}
#endif

#ifdef LMC_INT4_NM_FAST
// A packed 2:4 group of G (a multiple of 64) inputs starting at input c0: the kept values
// looked up by code, then expanded by the keep mask into the inputs' lanes (zeros where pruned).
static void int4_dequant_24_group(const uint8_t* codes, const uint8_t* row_idx, int64_t c0,
                                  int64_t G, int z, float s, void* out, bool f32) {
  __m512 table;
  __m512i table16;
  int4_tables(z, s, &table, &table16);
  const __m128i low4 = _mm_set1_epi8(15);
  for (int64_t c = c0; c < c0 + G; c += 64) {
    int64_t j = c / 2;
    __m128i v = _mm_loadu_si128((const __m128i*)(codes + j / 2));
    __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
    __m128i k0 = _mm_unpacklo_epi8(lo, hi), k1 = _mm_unpackhi_epi8(lo, hi);  // kept order
    uint32_t m0 = mask_24(row_idx + j / 4), m1 = mask_24(row_idx + j / 4 + 4);
    if (f32) {
      alignas(64) float vals[32];
      _mm512_store_ps(vals, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(k0), table));
      _mm512_store_ps(vals + 16, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(k1), table));
      float* dst = (float*)out + c;
      const float* src = vals;
      uint32_t masks[2] = {m0, m1};
      for (int h = 0; h < 4; h++) {
        __mmask16 mk = (__mmask16)(masks[h / 2] >> (16 * (h % 2)));
        _mm512_storeu_ps(dst + 16 * h, _mm512_maskz_expandloadu_ps(mk, src));
        src += _mm_popcnt_u32(mk);
      }
    } else {
      __m512i vals = _mm512_permutexvar_epi16(
          _mm512_cvtepu8_epi16(_mm256_set_m128i(k1, k0)), table16);
      uint16_t* dst = (uint16_t*)out + c;
      _mm512_storeu_si512(dst, _mm512_maskz_expand_epi16(m0, vals));
      _mm512_storeu_si512(dst + 32, _mm512_maskz_expand_epi16(m1, _mm512_shuffle_i64x2(vals, vals, 0xEE)));
    }
  }
}
#endif

#ifdef LMC_INT4_AVX2
// 8 codes (uint8 lanes of c) to (q - z) * s, fp32 (one rounded product, as the reference).
static inline __m256 int4_values8(__m128i c, __m256i z, __m256 s) {
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(c), z)), s);
}

// Rounded to bf16 as f32_to_bf16 (finite values): 8 fp32 lanes to their upper 16 bits.
static inline __m256i int4_bf16_bits(__m256 v) {
  __m256i u = _mm256_castps_si256(v);
  u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                           _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
  return _mm256_srli_epi32(u, 16);
}

// int4_dequant_group with AVX2: 16 bytes (32 columns) a step, the codes put in column order by
// byte unpacks, each 8 widened, shifted by z, converted and scaled (bf16: rounded, packed).
static void int4_dequant_group_avx2(const uint8_t* row, int64_t nbytes, int z, float s, void* out,
                                    bool f32) {
  const __m256i zv = _mm256_set1_epi32(z);
  const __m256 sv = _mm256_set1_ps(s);
  const __m128i low4 = _mm_set1_epi8(15);
  for (int64_t b = 0; b + 16 <= nbytes; b += 16) {
    __m128i v = _mm_loadu_si128((const __m128i*)(row + b));
    __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
    __m128i cols[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)};  // 16 columns each
    for (int k = 0; k < 2; k++) {
      __m256 a = int4_values8(cols[k], zv, sv), c = int4_values8(_mm_srli_si128(cols[k], 8), zv, sv);
      if (f32) {
        float* dst = (float*)out + 2 * b + 16 * k;
        _mm256_storeu_ps(dst, a);
        _mm256_storeu_ps(dst + 8, c);
      } else {  // packus interleaves 128-bit lanes: put them back in order
        __m256i packed = _mm256_packus_epi32(int4_bf16_bits(a), int4_bf16_bits(c));
        _mm256_storeu_si256((__m256i*)((uint16_t*)out + 2 * b + 16 * k),
                            _mm256_permute4x64_epi64(packed, 0xD8));
      }
    }
  }
}
#endif

// One dense row's codes (out of groups groups of G) into fp32 wf or bf16 wb (the other null).
static void int4_dequant_dense_row(const uint8_t* row, const float* srow, const uint8_t* zrow,
                                   int64_t groups, int64_t G, float* wf, uint16_t* wb) {
  for (int64_t g = 0; g < groups; g++) {
    float s = srow[g];
    int z = zrow[g];
#ifdef LMC_INT4_VECTOR
    if (G % 32 == 0) {  // 32 columns (16 bytes) a step
      int4_dequant_group(row + g * G / 2, G / 2, z, s, wf ? (void*)(wf + g * G) : (void*)(wb + g * G), wf != 0);
      continue;
    }
#endif
#ifdef LMC_INT4_AVX2
    if (G % 32 == 0) {
      int4_dequant_group_avx2(row + g * G / 2, G / 2, z, s, wf ? (void*)(wf + g * G) : (void*)(wb + g * G), wf != 0);
      continue;
    }
#endif
    if (wf) {
      for (int64_t i = g * G; i < (g + 1) * G; i++) wf[i] = (float)(int4_code(row, i) - z) * s;
    } else {
      for (int64_t i = g * G; i < (g + 1) * G; i++) wb[i] = f32_to_bf16((float)(int4_code(row, i) - z) * s);
    }
  }
}

extern "C" void lmc_int4_dequant(const uint8_t* codes, int64_t code_stride, const float* scales,
                                 const uint8_t* zeros, int64_t groups, int64_t G,
                                 const uint8_t* idx, int64_t idx_stride, int n, int m, int bits,
                                 int64_t row0, int64_t rows, int64_t in, void* W, int w_kind,
                                 int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; r++) {
    int64_t o = row0 + r;
    const uint8_t* row = codes + o * code_stride;
    float* wf = w_kind == F32 ? (float*)W + r * in : 0;
    uint16_t* wb = w_kind == F32 ? 0 : (uint16_t*)W + r * in;
#ifdef LMC_INT4_NM_FAST
    if (idx && n == 2 && m == 4 && G % 64 == 0) {
      for (int64_t g = 0; g < groups; g++)
        int4_dequant_24_group(row, idx + o * idx_stride, g * G, G, zeros[o * groups + g],
                              scales[o * groups + g], wf ? (void*)wf : (void*)wb, wf != 0);
      continue;
    }
#endif
    if (idx) {
      if (wf) memset(wf, 0, sizeof(float) * in);
      else memset(wb, 0, sizeof(uint16_t) * in);
      const uint8_t* row_idx = idx + o * idx_stride;
      int64_t kept = in / m * n;
      for (int64_t j = 0; j < kept; j++) {
        int pos = position(row_idx, j, bits);
        if (pos >= m) continue;
        int64_t col = j / n * m + pos, g = col / G;
        float v = (float)(int4_code(row, j) - zeros[o * groups + g]) * scales[o * groups + g];
        if (wf) wf[col] = v;
        else wb[col] = f32_to_bf16(v);
      }
      continue;
    }
    int4_dequant_dense_row(row, scales + o * groups, zeros + o * groups, groups, G, wf, wb);
  }
}

// ---------------------------------------------------------------------------------------------
// Weight-only int4 decode on the tiled layout (lmcompress/kernels/int4_tiles.py):
//
//   lmc_int4_linear_tiled  y (T, out) = the int4 linear of x (T, in), T up to a few tokens,
//                          equal to lmc_int4_linear (and int4_reference.decode_linear) bit for
//                          bit; the codes in tiles of 16 rows, the grid (scales16, zeros16)
//                          tiled the same way, (blocks, groups, 16).
//   lmc_int4_dequant_tiled the prefill dequantization of rows of tiled codes (block by block).
//   lmc_int4_untile_rows   rows [row0, row0 + rows) of the tiled codes back in the stored
//                          layout (where the dequantization runs in torch).
//
// Tiles: the stored row layout read as 32-bit words (8 codes: column c + i in bits 4i .. 4i+3,
// little-endian) and transposed by blocks of 16 rows: word k of rows 16b .. 16b + 15 are the 16
// consecutive words tiles[(b * K + k) * 16 + l], K = in / 8 (rows past `out` are zero words).
// One 64-byte load is then 8 columns of 16 rows, one output row a vector lane: the masks
// 0x000F000F after shifts of 0, 4, 8, 12 give the 16-bit code pairs (c + j, c + j + 4), and
// one multiply-add of pairs (vpdpwssd) against the broadcast activation pair (x[c + j],
// x[c + j + 4]) adds 32 products: no horizontal sums (the row layout needs one per group and
// row), four independent accumulators. With VNNI the masks 0x0F0F0F0F (after a shift of 0 or
// 4) give the codes as bytes instead, and vpdpbusd multiplies them by the activations' signed
// high and unsigned low bytes (x = 256 (x >> 8) + (x & 255)): 4 products a lane, one shift a
// chunk. A group's integer sums D (exact: the same D as the row kernel) then take the same
// float steps in 16 row lanes, into the partial g % 16 and the same tree (int4_add_partial,
// int4_tree): bit-identical outputs.

#ifndef LMC_TILE_PREFETCH
#define LMC_TILE_PREFETCH 1024  // words (4 KiB) ahead: codes stream from memory at decode
#endif

struct Int4PairActs {  // the quantized activations of T tokens
  int32_t* pairs;      // (T, in / 2) words: the int16 pairs (x[c + j], x[c + j + 4])
  int32_t* bytes;      // (T, in / 2) words, 4 per 8 columns: the high bytes (x >> 8, signed) of
                       // columns c, c+2, c+4, c+6, their low bytes (x & 255), the same of c+1..c+7
  float* scale;        // (T, groups)
  int32_t* sum32;      // (T, groups): sum of the group's codes (int32: exact for G <= 65536)
};

// Per-thread scratch that grows to the largest call (no allocation per call): slots 0-2 the
// calling thread's activations, 3 its row of floats, or a dequantizing worker's row of codes.
static float* lmc_scratch(size_t bytes, int which) {
  static thread_local void* buffers[4] = {0, 0, 0, 0};
  static thread_local size_t sizes[4] = {0, 0, 0, 0};
  if (sizes[which] < bytes) {
    free(buffers[which]);
    buffers[which] = malloc(bytes);
    sizes[which] = bytes;
  }
  return (float*)buffers[which];
}

static void load_row_float(const void* x_in, int x_kind, int64_t offset, int64_t n, float* x) {
  if (x_kind == F32) {
    memcpy(x, (const float*)x_in + offset, sizeof(float) * n);
  } else if (x_kind == BF16) {
    const uint16_t* v = (const uint16_t*)x_in + offset;
    for (int64_t i = 0; i < n; i++) {
      uint32_t u = (uint32_t)v[i] << 16;
      memcpy(x + i, &u, 4);
    }
  } else {
    for (int64_t i = 0; i < n; i++) x[i] = load_value(x_in, x_kind, offset + i);
  }
}

// The same codes, scales and sums as int4_prepare (int4_reference.quantize_activations).
static Int4PairActs int4_prepare_pairs(const void* x_in, int x_kind, int64_t T, int64_t in,
                                       int64_t groups, int64_t G) {
  Int4PairActs a;
  a.pairs = (int32_t*)lmc_scratch(sizeof(int32_t) * T * in, 0);
  a.bytes = a.pairs + T * (in / 2);
  a.scale = lmc_scratch(sizeof(float) * T * groups, 1);
  a.sum32 = (int32_t*)lmc_scratch(sizeof(int32_t) * T * groups, 2);
  float* x = lmc_scratch(sizeof(float) * in + sizeof(int16_t) * in, 3);
  int16_t* q = (int16_t*)(x + in);
  for (int64_t t = 0; t < T; t++) {
    load_row_float(x_in, x_kind, t * in, in, x);
    for (int64_t g = 0; g < groups; g++)
      a.sum32[t * groups + g] =
          (int32_t)int4_quantize_absmax(x + g * G, G, q + g * G, &a.scale[t * groups + g]);
    uint16_t* p = (uint16_t*)(a.pairs + t * (in / 2));
    uint8_t* b = (uint8_t*)(a.bytes + t * (in / 2));
    for (int64_t c = 0; c < in; c += 8) {
      for (int j = 0; j < 4; j++) {
        p[c + 2 * j] = (uint16_t)q[c + j];
        p[c + 2 * j + 1] = (uint16_t)q[c + j + 4];
      }
      for (int odd = 0; odd < 2; odd++)
        for (int j = 0; j < 4; j++) {
          int16_t v = q[c + 2 * j + odd];
          b[2 * c + 8 * odd + j] = (uint8_t)(v >> 8);  // arithmetic shift: signed high byte
          b[2 * c + 8 * odd + 4 + j] = (uint8_t)(v & 255);  // v = 256 (v >> 8) + (v & 255)
        }
    }
  }
  return a;
}

#ifdef __AVX2__
// The float steps of int4_add_partial for 8 row lanes: p = ((float)D * s) * xs into part[g & 15].
static inline void int4_add_partial8(__m256* part, int64_t g, __m256i D, __m256 s, float xs) {
  __m256 pr = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(D), s), _mm256_set1_ps(xs));
  LMC_OPAQUE_V(pr);  // rounded here: never contracted with the sum into an FMA
  part[g & 15] = _mm256_add_ps(part[g & 15], pr);
}

// int4_tree lane by lane: the 16 partials of 8 rows, summed, into dst.
static inline void int4_tree8(const __m256* part, float* dst) {
  __m256 s8[8], s4[4];
  for (int i = 0; i < 8; i++) s8[i] = _mm256_add_ps(part[i], part[i + 8]);
  for (int i = 0; i < 4; i++) s4[i] = _mm256_add_ps(s8[i], s8[i + 4]);
  _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_add_ps(s4[0], s4[2]), _mm256_add_ps(s4[1], s4[3])));
}
#endif

#ifdef LMC_INT4_AVX2
// The tiled loop with AVX2 (no AVX-512: e.g. AMD Zen 2 and 3, Intel before Ice Lake), 8 rows a
// vector: each tile line's two 32-byte halves (rows 0-7, rows 8-15) in turn, a group at a time
// (the group's lines stay in L1 for the second half). The codes as 16-bit pairs (masks
// 0x000F000F after shifts of 0, 4, 8, 12) times the broadcast activation pairs by vpmaddwd,
// then the AVX-512 loop's integer D and float steps in 8 lanes: the same bits.
template <int TN>
static void int4_tile_block_avx2(const Int4PairActs& a, int64_t t0, int64_t in, int64_t groups,
                                 int64_t G, const uint32_t* tb, const float* s16,
                                 const uint8_t* z16, float* out) {
  const int64_t kg = G / 8;
  const __m256i M = _mm256_set1_epi32(0x000F000F);
  __m256 part[2][TN][16];
  for (int h = 0; h < 2; h++)
    for (int t = 0; t < TN; t++)
      for (int i = 0; i < 16; i++) part[h][t][i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    for (int h = 0; h < 2; h++) {
      __m256i acc[TN][2];
      for (int t = 0; t < TN; t++) acc[t][0] = acc[t][1] = _mm256_setzero_si256();
      for (int64_t k = g * kg; k < (g + 1) * kg; k++) {
        if (h == 0) _mm_prefetch((const char*)(tb + k * 16 + LMC_TILE_PREFETCH), _MM_HINT_T0);
        __m256i v = _mm256_loadu_si256((const __m256i*)(tb + k * 16 + 8 * h));
        __m256i p0 = _mm256_and_si256(v, M), p1 = _mm256_and_si256(_mm256_srli_epi32(v, 4), M);
        __m256i p2 = _mm256_and_si256(_mm256_srli_epi32(v, 8), M);
        __m256i p3 = _mm256_and_si256(_mm256_srli_epi32(v, 12), M);
        for (int t = 0; t < TN; t++) {
          const int32_t* x = a.pairs + (t0 + t) * (in / 2) + 4 * k;
          __m256i e = _mm256_add_epi32(_mm256_madd_epi16(p0, _mm256_set1_epi32(x[0])),
                                       _mm256_madd_epi16(p2, _mm256_set1_epi32(x[2])));
          __m256i o = _mm256_add_epi32(_mm256_madd_epi16(p1, _mm256_set1_epi32(x[1])),
                                       _mm256_madd_epi16(p3, _mm256_set1_epi32(x[3])));
          acc[t][0] = _mm256_add_epi32(acc[t][0], e);
          acc[t][1] = _mm256_add_epi32(acc[t][1], o);
        }
      }
      const __m256 s = _mm256_loadu_ps(s16 + 16 * g + 8 * h);
      const __m256i z = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(z16 + 16 * g + 8 * h)));
      for (int t = 0; t < TN; t++) {
        __m256i sum = _mm256_add_epi32(acc[t][0], acc[t][1]);  // exact modulo 2^32, as D is
        __m256i sx = _mm256_set1_epi32(a.sum32[(t0 + t) * groups + g]);
        __m256i D = _mm256_sub_epi32(sum, _mm256_mullo_epi32(z, sx));
        int4_add_partial8(part[h][t], g, D, s, a.scale[(t0 + t) * groups + g]);
      }
    }
  }
  for (int h = 0; h < 2; h++)
    for (int t = 0; t < TN; t++) int4_tree8(part[h][t], out + 16 * t + 8 * h);
}
#endif

// One block of 16 rows for tokens t0 .. t0 + TN: out[t * 16 + l] = row 16b + l's sum before
// the bias. s16, z16: the block's scales and zero points, (groups, 16) (int4_tiles.tile_grid).
template <int TN>
static void int4_tile_block(const Int4PairActs& a, int64_t t0, int64_t in, int64_t groups,
                            int64_t G, const uint32_t* tb, const float* s16, const uint8_t* z16,
                            int vector, float* out) {
  const int64_t kg = G / 8;
#ifdef LMC_INT4_VECTOR
  if (vector) {
    const __m512i M = _mm512_set1_epi32(0x000F000F);
    __m512 part[TN][16];
    for (int t = 0; t < TN; t++)
      for (int i = 0; i < 16; i++) part[t][i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
      __m512i acc[TN][4];
      for (int t = 0; t < TN; t++)
        for (int j = 0; j < 4; j++) acc[t][j] = _mm512_setzero_si512();
      for (int64_t k = g * kg; k < (g + 1) * kg; k++) {
        _mm_prefetch((const char*)(tb + k * 16 + LMC_TILE_PREFETCH), _MM_HINT_T0);
        __m512i v = _mm512_loadu_si512(tb + k * 16);
#ifdef __AVX512VNNI__
        // bytes: codes of c, c+2, c+4, c+6 (lo) and c+1 .. c+7 (hi) in each lane's 4 bytes;
        // vpdpbusd multiplies unsigned by signed bytes, 4 products a lane: codes by the
        // activations' signed high bytes, the unsigned low bytes by codes (0..15 as signed)
        const __m512i M8 = _mm512_set1_epi32(0x0F0F0F0F);
        __m512i lo = _mm512_and_si512(v, M8), hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), M8);
        for (int t = 0; t < TN; t++) {
          const int32_t* x = a.bytes + (t0 + t) * (in / 2) + 4 * k;
          acc[t][0] = _mm512_dpbusd_epi32(acc[t][0], lo, _mm512_set1_epi32(x[0]));
          acc[t][1] = _mm512_dpbusd_epi32(acc[t][1], _mm512_set1_epi32(x[1]), lo);
          acc[t][2] = _mm512_dpbusd_epi32(acc[t][2], hi, _mm512_set1_epi32(x[2]));
          acc[t][3] = _mm512_dpbusd_epi32(acc[t][3], _mm512_set1_epi32(x[3]), hi);
        }
#else
        __m512i p[4] = {_mm512_and_si512(v, M), _mm512_and_si512(_mm512_srli_epi32(v, 4), M),
                        _mm512_and_si512(_mm512_srli_epi32(v, 8), M),
                        _mm512_and_si512(_mm512_srli_epi32(v, 12), M)};
        for (int t = 0; t < TN; t++) {
          const int32_t* x = a.pairs + (t0 + t) * (in / 2) + 4 * k;
          for (int j = 0; j < 4; j++) acc[t][j] = madd16(acc[t][j], p[j], _mm512_set1_epi32(x[j]));
        }
#endif
      }
      const __m512 s = _mm512_loadu_ps(s16 + 16 * g);
      const __m512i z = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(z16 + 16 * g)));
      for (int t = 0; t < TN; t++) {
#ifdef __AVX512VNNI__
        __m512i sum = _mm512_add_epi32(
            _mm512_slli_epi32(_mm512_add_epi32(acc[t][0], acc[t][2]), 8),
            _mm512_add_epi32(acc[t][1], acc[t][3]));  // exact modulo 2^32, as D is
#else
        __m512i sum = _mm512_add_epi32(_mm512_add_epi32(acc[t][0], acc[t][1]),
                                       _mm512_add_epi32(acc[t][2], acc[t][3]));
#endif
        __m512i sx = _mm512_set1_epi32(a.sum32[(t0 + t) * groups + g]);
        __m512i D = _mm512_sub_epi32(sum, _mm512_mullo_epi32(z, sx));
        __m512 pr = _mm512_mul_ps(_mm512_cvtepi32_ps(D), s);
        pr = _mm512_mul_ps(pr, _mm512_set1_ps(a.scale[(t0 + t) * groups + g]));
        LMC_OPAQUE_V(pr);  // rounded here: never contracted with the sum into an FMA
        part[t][g & 15] = _mm512_add_ps(part[t][g & 15], pr);
      }
    }
    for (int t = 0; t < TN; t++) {  // int4_tree, lane by lane
      __m512 s8[8], s4[4];
      for (int i = 0; i < 8; i++) s8[i] = _mm512_add_ps(part[t][i], part[t][i + 8]);
      for (int i = 0; i < 4; i++) s4[i] = _mm512_add_ps(s8[i], s8[i + 4]);
      _mm512_storeu_ps(out + 16 * t, _mm512_add_ps(_mm512_add_ps(s4[0], s4[2]),
                                                   _mm512_add_ps(s4[1], s4[3])));
    }
    return;
  }
#endif
#ifdef LMC_INT4_AVX2
  if (vector) {
    int4_tile_block_avx2<TN>(a, t0, in, groups, G, tb, s16, z16, out);
    return;
  }
#endif
  (void)vector;
  for (int l = 0; l < 16; l++) {
    float part[TN][16];
    memset(part, 0, sizeof(part));
    for (int64_t g = 0; g < groups; g++) {
      int64_t sum[TN] = {0};
      for (int64_t k = g * kg; k < (g + 1) * kg; k++) {
        uint32_t w = tb[k * 16 + l];
        for (int t = 0; t < TN; t++) {
          const int16_t* x = (const int16_t*)(a.pairs + (t0 + t) * (in / 2) + 4 * k);
          for (int j = 0; j < 4; j++)
            sum[t] += (int64_t)((w >> (4 * j)) & 15) * x[2 * j] +
                      (int64_t)((w >> (4 * j + 16)) & 15) * x[2 * j + 1];
        }
      }
      for (int t = 0; t < TN; t++) {
        int64_t D = sum[t] - (int64_t)z16[16 * g + l] * a.sum32[(t0 + t) * groups + g];
        int4_add_partial(part[t], g, D, s16[16 * g + l], a.scale[(t0 + t) * groups + g]);
      }
    }
    for (int t = 0; t < TN; t++) out[16 * t + l] = int4_tree(part[t]);
  }
}

extern "C" void lmc_int4_linear_tiled(const void* x_in, int x_kind, int64_t T, int64_t in,
                                      const uint32_t* tiles, const float* scales16,
                                      const uint8_t* zeros16, int64_t groups, int64_t G,
                                      int64_t out, const void* bias, int b_kind, void* y,
                                      int y_kind, int vector, int threads) {
  Int4PairActs a = int4_prepare_pairs(x_in, x_kind, T, in, groups, G);
  const int64_t blocks = (out + 15) / 16, K = in / 8;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; b++) {
    const uint32_t* tb = tiles + b * K * 16;
    const float* s16 = scales16 + b * groups * 16;
    const uint8_t* z16 = zeros16 + b * groups * 16;
    for (int64_t t0 = 0; t0 < T; t0 += TILE) {
      int64_t tn = T - t0 < TILE ? T - t0 : TILE;
      float acc[TILE * 16];
      if (tn == 4) int4_tile_block<4>(a, t0, in, groups, G, tb, s16, z16, vector, acc);
      else if (tn == 3) int4_tile_block<3>(a, t0, in, groups, G, tb, s16, z16, vector, acc);
      else if (tn == 2) int4_tile_block<2>(a, t0, in, groups, G, tb, s16, z16, vector, acc);
      else int4_tile_block<1>(a, t0, in, groups, G, tb, s16, z16, vector, acc);
      for (int l = 0; l < 16 && b * 16 + l < out; l++)
        for (int64_t t = 0; t < tn; t++) {
          float v = acc[16 * t + l];
          if (bias) v = v + load_value(bias, b_kind, b * 16 + l);
          store_value(y, y_kind, (t0 + t) * out + b * 16 + l, v);
        }
    }
  }
}

// lmc_int4_dequant of rows [row0, row0 + rows) of tiled codes and grid (scales16, zeros16:
// (blocks, groups, 16)), by blocks of 16 rows: a block's words and grid untiled into a
// per-thread buffer of its 16 rows (each tile line read once), then the stored layout's loops.
extern "C" void lmc_int4_dequant_tiled(const uint32_t* tiles, const float* scales16,
                                       const uint8_t* zeros16, int64_t groups, int64_t G,
                                       int64_t row0, int64_t rows, int64_t in, void* W,
                                       int w_kind, int threads) {
  const int64_t K = in / 8, first = row0 / 16, last = (row0 + rows + 15) / 16;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = first; b < last; b++) {
    // (16, K) code words, then one row's scales and zero points
    uint32_t* block = (uint32_t*)lmc_scratch((4 * 16 * K + 5 * groups), 3);
    float* srow = (float*)(block + 16 * K);
    uint8_t* zrow = (uint8_t*)(srow + groups);
    const uint32_t* tb = tiles + b * K * 16;
    for (int64_t k = 0; k < K; k++)
      for (int l = 0; l < 16; l++) block[l * K + k] = tb[k * 16 + l];
    for (int l = 0; l < 16; l++) {
      int64_t o = b * 16 + l, r = o - row0;
      if (r < 0 || r >= rows) continue;
      for (int64_t g = 0; g < groups; g++) {
        srow[g] = scales16[(b * groups + g) * 16 + l];
        zrow[g] = zeros16[(b * groups + g) * 16 + l];
      }
      float* wf = w_kind == F32 ? (float*)W + r * in : 0;
      uint16_t* wb = w_kind == F32 ? 0 : (uint16_t*)W + r * in;
      int4_dequant_dense_row((const uint8_t*)(block + l * K), srow, zrow, groups, G, wf, wb);
    }
  }
}

extern "C" void lmc_int4_untile_rows(const uint32_t* tiles, int64_t in, int64_t row0,
                                     int64_t rows, uint8_t* codes, int threads) {
  const int64_t K = in / 8;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; r++) {
    int64_t o = row0 + r, b = o / 16, l = o % 16;
    uint32_t* dst = (uint32_t*)(codes + r * (in / 2));
    for (int64_t k = 0; k < K; k++) dst[k] = tiles[(b * K + k) * 16 + l];
  }
}

// ---------------------------------------------------------------------------------------------
// Weight-only int4 decode of packed 2:4 codes on a tiled layout (lmcompress/kernels/int4_tiles24.py):
//
//   lmc_int4_linear_tiled24   y (T, out) = the nm_packed_int4 linear (n = 2, m = 4) of x (T, in),
//                             equal to lmc_int4_linear and int4_reference.decode_linear bit for bit.
//   lmc_int4_dequant_tiled24  the prefill dequantization of rows [row0, row0 + rows).
//
// Tiles: blocks of 16 rows; for each 16 input columns (4 groups of 4) and row, one 32-bit word of
// the 8 kept codes (group i's first kept code in bits 4i .. 4i+3, its second in bits 16 + 4i ..)
// and one 16-bit word of the 4 patterns (group i's in bits 4i .. 4i+3: 0..5, the pair of kept
// positions (0,1) (0,2) (0,3) (1,2) (1,3) (2,3)); word k of rows 16b .. 16b+15 are 16
// consecutive words. 3 bits a weight, as the stored layout. The grid is int4_tiles' (scales16,
// zeros16: a group's 16 rows together). Each token's quantized activations (the same int16 codes
// as lmc_int4_linear) become a table of the 6 pairs (x[a], x[b]) of every group of 4 inputs, 8
// int32 a group. With AVX2, 8 rows a vector (each block's two halves in turn, a group at a time):
// the masks 0x000F000F after shifts of 0, 4, 8, 12 give each row's two kept codes of a group
// (less the row's zero point) as 16-bit pairs, one vpermd picks each row's pair of activations
// from the group's table by its pattern, one vpmaddwd adds the two products: one multiply-add
// per group of 4 inputs, where the dense tiled loop needs two, and no horizontal sum. The group
// sums D = sum (q - z) x (exact integers: |D| < 2^31 for G <= 4096) then take the row kernel's
// float steps (int4_add_partial, int4_tree) in the row lanes: the same bits.

static const int8_t T24_PAIR[6][2] = {{0, 1}, {0, 2}, {0, 3}, {1, 2}, {1, 3}, {2, 3}};

struct Int4PairTable {  // the quantized activations of T tokens
  int32_t* pairs;       // (T, in / 4, 8): lane p the int16 pair (x[4c + a], x[4c + b]) of pattern p
  float* scale;         // (T, groups)
};

static Int4PairTable int4_prepare_table(const void* x_in, int x_kind, int64_t T, int64_t in,
                                        int64_t groups, int64_t G) {
  Int4PairTable a;
  a.pairs = (int32_t*)lmc_scratch(sizeof(int32_t) * T * 2 * in, 0);
  a.scale = lmc_scratch(sizeof(float) * T * groups, 1);
  float* x = lmc_scratch(sizeof(float) * in + sizeof(int16_t) * in, 3);
  int16_t* q = (int16_t*)(x + in);
  for (int64_t t = 0; t < T; t++) {
    load_row_float(x_in, x_kind, t * in, in, x);
    for (int64_t g = 0; g < groups; g++)
      int4_quantize_absmax(x + g * G, G, q + g * G, &a.scale[t * groups + g]);
    uint32_t* p = (uint32_t*)(a.pairs + t * 2 * in);
    for (int64_t c = 0; c < in / 4; c++) {
      for (int k = 0; k < 6; k++)
        p[8 * c + k] = (uint32_t)(uint16_t)q[4 * c + T24_PAIR[k][0]] |
                       ((uint32_t)(uint16_t)q[4 * c + T24_PAIR[k][1]] << 16);
      p[8 * c + 6] = p[8 * c + 7] = 0;
    }
  }
  return a;
}

#ifdef __AVX2__
template <int TN>
static void int4_t24_block_avx2(const Int4PairTable& a, int64_t t0, int64_t in, int64_t groups,
                                int64_t G, const uint32_t* tb, const uint16_t* pb,
                                const float* s16, const uint8_t* z16, float* res) {
  const int64_t kg = G / 16;
  const __m256i M = _mm256_set1_epi32(0x000F000F);
  __m256 part[2][TN][16];
  for (int h = 0; h < 2; h++)
    for (int t = 0; t < TN; t++)
      for (int i = 0; i < 16; i++) part[h][t][i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    for (int h = 0; h < 2; h++) {
      const __m256i z = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(z16 + 16 * g + 8 * h)));
      const __m256i zz = _mm256_or_si256(z, _mm256_slli_epi32(z, 16));  // z in both halves
      __m256i acc[TN][2];
      for (int t = 0; t < TN; t++) acc[t][0] = acc[t][1] = _mm256_setzero_si256();
      for (int64_t k = g * kg; k < (g + 1) * kg; k++) {
        if (h == 0) _mm_prefetch((const char*)(tb + k * 16 + LMC_TILE_PREFETCH), _MM_HINT_T0);
        __m256i v = _mm256_loadu_si256((const __m256i*)(tb + k * 16 + 8 * h));
        __m256i p0 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(pb + k * 16 + 8 * h)));
        __m256i w0 = _mm256_sub_epi16(_mm256_and_si256(v, M), zz);
        __m256i w1 = _mm256_sub_epi16(_mm256_and_si256(_mm256_srli_epi32(v, 4), M), zz);
        __m256i w2 = _mm256_sub_epi16(_mm256_and_si256(_mm256_srli_epi32(v, 8), M), zz);
        __m256i w3 = _mm256_sub_epi16(_mm256_srli_epi16(v, 12), zz);  // no mask: 16-bit shifts
        __m256i p1 = _mm256_srli_epi32(p0, 4), p2 = _mm256_srli_epi32(p0, 8);
        __m256i p3 = _mm256_srli_epi32(p0, 12);  // vpermd reads the low 3 bits of each lane
        for (int t = 0; t < TN; t++) {
          const __m256i* P = (const __m256i*)(a.pairs + (t0 + t) * 2 * in + 32 * k);
          __m256i e = _mm256_add_epi32(
              _mm256_madd_epi16(w0, _mm256_permutevar8x32_epi32(_mm256_loadu_si256(P), p0)),
              _mm256_madd_epi16(w1, _mm256_permutevar8x32_epi32(_mm256_loadu_si256(P + 1), p1)));
          __m256i o = _mm256_add_epi32(
              _mm256_madd_epi16(w2, _mm256_permutevar8x32_epi32(_mm256_loadu_si256(P + 2), p2)),
              _mm256_madd_epi16(w3, _mm256_permutevar8x32_epi32(_mm256_loadu_si256(P + 3), p3)));
          acc[t][0] = _mm256_add_epi32(acc[t][0], e);
          acc[t][1] = _mm256_add_epi32(acc[t][1], o);
        }
      }
      const __m256 s = _mm256_loadu_ps(s16 + 16 * g + 8 * h);
      for (int t = 0; t < TN; t++) {
        __m256i D = _mm256_add_epi32(acc[t][0], acc[t][1]);
        int4_add_partial8(part[h][t], g, D, s, a.scale[(t0 + t) * groups + g]);
      }
    }
  }
  for (int h = 0; h < 2; h++)
    for (int t = 0; t < TN; t++) int4_tree8(part[h][t], res + 16 * t + 8 * h);
}
#endif

#ifdef __AVX2__
static void int4_t24_block_avx2_one(const Int4PairTable& a, int64_t t0, int64_t in, int64_t groups,
                                    int64_t G, const uint32_t* tb, const uint16_t* pb,
                                    const float* s16, const uint8_t* z16, float* res) {
  const int64_t kg = G / 16;
  const __m256i M = _mm256_set1_epi32(0x000F000F);
  __m256 part[2][16];
  for (int h = 0; h < 2; h++)
    for (int i = 0; i < 16; i++) part[h][i] = _mm256_setzero_ps();
  const int32_t* pairs = a.pairs + t0 * 2 * in;
  for (int64_t g = 0; g < groups; g++) {
    __m256i zz[2], acc[2];
    for (int h = 0; h < 2; h++) {
      __m256i z = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(z16 + 16 * g + 8 * h)));
      zz[h] = _mm256_or_si256(z, _mm256_slli_epi32(z, 16));
      acc[h] = _mm256_setzero_si256();
    }
    for (int64_t k = g * kg; k < (g + 1) * kg; k++) {
      _mm_prefetch((const char*)(tb + k * 16 + LMC_TILE_PREFETCH), _MM_HINT_T0);
      const __m256i* P = (const __m256i*)(pairs + 32 * k);
      __m256i v[2], p[2];
      for (int h = 0; h < 2; h++) {
        v[h] = _mm256_loadu_si256((const __m256i*)(tb + k * 16 + 8 * h));
        p[h] = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(pb + k * 16 + 8 * h)));
      }
      for (int i = 0; i < 4; i++) {
        __m256i table = _mm256_loadu_si256(P + i);
        for (int h = 0; h < 2; h++) {
          __m256i w = i == 3 ? _mm256_srli_epi16(v[h], 12)
                             : _mm256_and_si256(_mm256_srli_epi32(v[h], 4 * i), M);
          __m256i x = _mm256_permutevar8x32_epi32(table, _mm256_srli_epi32(p[h], 4 * i));
          acc[h] = _mm256_add_epi32(acc[h], _mm256_madd_epi16(_mm256_sub_epi16(w, zz[h]), x));
        }
      }
    }
    for (int h = 0; h < 2; h++)
      int4_add_partial8(part[h], g, acc[h], _mm256_loadu_ps(s16 + 16 * g + 8 * h), a.scale[t0 * groups + g]);
  }
  for (int h = 0; h < 2; h++) int4_tree8(part[h], res + 8 * h);
}
#endif

// One block of 16 rows for tokens t0 .. t0 + TN: res[t * 16 + l] = row 16b + l's sum before the
// bias. s16, z16: the block's scales and zero points, (groups, 16).
template <int TN>
static void int4_t24_block(const Int4PairTable& a, int64_t t0, int64_t in, int64_t groups,
                           int64_t G, const uint32_t* tb, const uint16_t* pb, const float* s16,
                           const uint8_t* z16, int vector, float* res) {
#ifdef __AVX2__
  if (vector && TN == 1) {
    int4_t24_block_avx2_one(a, t0, in, groups, G, tb, pb, s16, z16, res);
    return;
  }
  if (vector) {
    int4_t24_block_avx2<TN>(a, t0, in, groups, G, tb, pb, s16, z16, res);
    return;
  }
#endif
  (void)vector;
  const int64_t kg = G / 16;
  for (int l = 0; l < 16; l++) {
    float part[TN][16];
    memset(part, 0, sizeof(part));
    for (int64_t g = 0; g < groups; g++) {
      int32_t z = z16[16 * g + l];
      int64_t D[TN] = {0};
      for (int64_t k = g * kg; k < (g + 1) * kg; k++) {
        uint32_t w = tb[k * 16 + l];
        uint16_t p = pb[k * 16 + l];
        for (int i = 0; i < 4; i++) {
          int pat = (p >> (4 * i)) & 7;  // as vpermd: the low 3 bits
          int32_t q0 = (int32_t)((w >> (4 * i)) & 15) - z;
          int32_t q1 = (int32_t)((w >> (16 + 4 * i)) & 15) - z;
          for (int t = 0; t < TN; t++) {
            const int16_t* pair = (const int16_t*)(a.pairs + (t0 + t) * 2 * in + 8 * (4 * k + i) + pat);
            D[t] += q0 * pair[0] + q1 * pair[1];
          }
        }
      }
      for (int t = 0; t < TN; t++) int4_add_partial(part[t], g, D[t], s16[16 * g + l], a.scale[(t0 + t) * groups + g]);
    }
    for (int t = 0; t < TN; t++) res[16 * t + l] = int4_tree(part[t]);
  }
}

extern "C" void lmc_int4_linear_tiled24(const void* x_in, int x_kind, int64_t T, int64_t in,
                                        const uint32_t* tiles, const uint16_t* patterns,
                                        const float* scales16, const uint8_t* zeros16,
                                        int64_t groups, int64_t G, int64_t out, const void* bias,
                                        int b_kind, void* y, int y_kind, int vector, int threads) {
  Int4PairTable a = int4_prepare_table(x_in, x_kind, T, in, groups, G);
  const int64_t blocks = (out + 15) / 16, K = in / 16;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; b++) {
    const uint32_t* tb = tiles + b * K * 16;
    const uint16_t* pb = patterns + b * K * 16;
    const float* s16 = scales16 + b * groups * 16;
    const uint8_t* z16 = zeros16 + b * groups * 16;
    for (int64_t t0 = 0; t0 < T; t0 += TILE) {
      int64_t tn = T - t0 < TILE ? T - t0 : TILE;
      float res[TILE * 16];
      if (tn == 4) int4_t24_block<4>(a, t0, in, groups, G, tb, pb, s16, z16, vector, res);
      else if (tn == 3) int4_t24_block<3>(a, t0, in, groups, G, tb, pb, s16, z16, vector, res);
      else if (tn == 2) int4_t24_block<2>(a, t0, in, groups, G, tb, pb, s16, z16, vector, res);
      else int4_t24_block<1>(a, t0, in, groups, G, tb, pb, s16, z16, vector, res);
      for (int l = 0; l < 16 && b * 16 + l < out; l++)
        for (int64_t t = 0; t < tn; t++) {
          float v = res[16 * t + l];
          if (bias) v = v + load_value(bias, b_kind, b * 16 + l);
          store_value(y, y_kind, (t0 + t) * out + b * 16 + l, v);
        }
    }
  }
}

// Rows [row0, row0 + rows) of the tiled 2:4 codes as fp32 or bf16 (W: (rows, in)), each value
// (q - z) * s rounded once, as lmc_int4_dequant; the pruned positions 0.
extern "C" void lmc_int4_dequant_tiled24(const uint32_t* tiles, const uint16_t* patterns,
                                         const float* scales16, const uint8_t* zeros16,
                                         int64_t groups, int64_t G, int64_t row0, int64_t rows,
                                         int64_t in, void* W, int w_kind, int threads) {
  const int64_t K = in / 16;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; r++) {
    int64_t o = row0 + r, b = o / 16, l = o % 16;
    float* wf = w_kind == F32 ? (float*)W + r * in : 0;
    uint16_t* wb = w_kind == F32 ? 0 : (uint16_t*)W + r * in;
    if (wf) memset(wf, 0, sizeof(float) * in);
    else memset(wb, 0, sizeof(uint16_t) * in);
    for (int64_t k = 0; k < K; k++) {
      uint32_t w = tiles[(b * K + k) * 16 + l];
      uint16_t p = patterns[(b * K + k) * 16 + l];
      int64_t g = 16 * k / G;
      float s = scales16[(b * groups + g) * 16 + l];
      int32_t z = zeros16[(b * groups + g) * 16 + l];
      for (int i = 0; i < 4; i++) {
        int pat = (p >> (4 * i)) & 7;
        if (pat > 5) continue;  // never tiled (int4_tiles24.tile); memory safety
        for (int j = 0; j < 2; j++) {
          int64_t col = 16 * k + 4 * i + T24_PAIR[pat][j];
          float v = (float)((int32_t)((w >> (16 * j + 4 * i)) & 15) - z) * s;
          if (wf) wf[col] = v;
          else wb[col] = f32_to_bf16(v);
        }
      }
    }
  }
}

// ---- 2:4 float decode on tiles of 16 rows (lmcompress/kernels/nm24_tiles.py) --------------
//
//   lmc_nm24_tiled_float  y (T, out) = x (T, in) @ W^T + bias for a packed 2:4 weight held as
//                         tiles, for a few tokens; x, y fp32 or bf16, values fp32, bf16 or fp16.
//
// The row kernel above (row_24_float*) decodes every 2-bit position into a lane index and
// permutes x across the vector for each 8 (AVX2) or 16 kept values of one row, then sums the
// row's lanes: on an AVX2 EPYC it ran at ~40 % of the memory bandwidth on 1B-shape layers. On
// tiles one output row is a vector lane instead: for 16 rows, group g (inputs 4g .. 4g + 3)
// holds the 16 first kept values, then the 16 second ones (values[(g * 2 + j) * 16 + l]), and
// the positions are the stored rows' 32-bit words (8 groups each: bits 4k, 4k + 1 the first
// position of group k, 4k + 2, 4k + 3 the second) transposed by 16 rows. A group then costs
// one broadcast of its 4 inputs to every 128-bit lane, an in-lane permute (vpermilps, which
// reads the low 2 bits of each lane's word: the position) for each kept value, and one FMA
// each: no position decoding beyond two shifts, no horizontal sums.
//
// Every path (AVX-512, AVX2, scalar) computes lane l in one order: acc_j = fma(v_j, x, acc_j)
// over the groups in turn for j = 0, 1 (from 0), then acc_0 + acc_1, then + bias: the paths
// and any number of tokens give the same bits (to the reference: float rounding).

static void nm24_tile_scalar(const float* x, int64_t tn, int64_t in, const void* vt, int kind,
                             const uint32_t* pt, float* out) {
  const int64_t G = in / 4;
  for (int64_t t = 0; t < tn; t++) {
    for (int l = 0; l < 16; l++) {
      float acc0 = 0.0f, acc1 = 0.0f;
      for (int64_t g = 0; g < G; g++) {
        uint32_t p = pt[(g / 8) * 16 + l] >> (4 * (g % 8));
        const float* xg = x + t * in + 4 * g;
        acc0 = fmaf(load_value(vt, kind, (2 * g) * 16 + l), xg[p & 3], acc0);
        acc1 = fmaf(load_value(vt, kind, (2 * g + 1) * 16 + l), xg[(p >> 2) & 3], acc1);
      }
      out[t * 16 + l] = acc0 + acc1;
    }
  }
}

#if defined(__AVX512F__)
template <int TN>
static void nm24_tile_vector(const float* x, int64_t in, const void* vt, int kind,
                             const uint32_t* pt, float* out) {
  const int64_t G = in / 4;
  __m512 acc[TN][2];
  for (int t = 0; t < TN; t++) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
  for (int64_t gg = 0; gg < G / 8; gg++) {
    __m512i p = _mm512_loadu_si512(pt + gg * 16);
    for (int k = 0; k < 8; k++) {
      const int64_t g = 8 * gg + k;
      const __m512i p1 = _mm512_srli_epi32(p, 2);
      const __m512 v0 = load16(vt, kind, (2 * g) * 16), v1 = load16(vt, kind, (2 * g + 1) * 16);
      for (int t = 0; t < TN; t++) {
        const __m512 x4 = _mm512_broadcast_f32x4(_mm_loadu_ps(x + t * in + 4 * g));
        acc[t][0] = _mm512_fmadd_ps(v0, _mm512_permutevar_ps(x4, p), acc[t][0]);
        acc[t][1] = _mm512_fmadd_ps(v1, _mm512_permutevar_ps(x4, p1), acc[t][1]);
      }
      p = _mm512_srli_epi32(p, 4);
    }
  }
  for (int t = 0; t < TN; t++) _mm512_storeu_ps(out + 16 * t, _mm512_add_ps(acc[t][0], acc[t][1]));
}
#define LMC_NM24_TILES 1  // as lmc_nm_simd(): 1 AVX-512, 2 AVX2
#elif defined(LMC_NM_AVX2)
// AVX2: rows 0-7 and 8-15 of the tile in two vectors. At one or two tokens both halves run in
// one pass (four chains of FMAs in flight); at more, one half a pass (registers).
template <int TN, int H0, int HN>
static void nm24_tile_halves(const float* x, int64_t in, const void* vt, int kind,
                             const uint32_t* pt, float* out) {
  const int64_t G = in / 4;
  __m256 acc[TN][HN][2];
  for (int t = 0; t < TN; t++)
    for (int h = 0; h < HN; h++) acc[t][h][0] = acc[t][h][1] = _mm256_setzero_ps();
  for (int64_t gg = 0; gg < G / 8; gg++) {
    __m256i p[HN];
    for (int h = 0; h < HN; h++) p[h] = _mm256_loadu_si256((const __m256i*)(pt + gg * 16 + 8 * (H0 + h)));
    for (int k = 0; k < 8; k++) {
      const int64_t g = 8 * gg + k;
      for (int h = 0; h < HN; h++) {
        const __m256i p1 = _mm256_srli_epi32(p[h], 2);
        const __m256 v0 = load8(vt, kind, (2 * g) * 16 + 8 * (H0 + h));
        const __m256 v1 = load8(vt, kind, (2 * g + 1) * 16 + 8 * (H0 + h));
        for (int t = 0; t < TN; t++) {
          const __m256 x4 = _mm256_broadcast_ps((const __m128*)(x + t * in + 4 * g));
          acc[t][h][0] = _mm256_fmadd_ps(v0, _mm256_permutevar_ps(x4, p[h]), acc[t][h][0]);
          acc[t][h][1] = _mm256_fmadd_ps(v1, _mm256_permutevar_ps(x4, p1), acc[t][h][1]);
        }
        p[h] = _mm256_srli_epi32(p[h], 4);
      }
    }
  }
  for (int t = 0; t < TN; t++)
    for (int h = 0; h < HN; h++)
      _mm256_storeu_ps(out + 16 * t + 8 * (H0 + h), _mm256_add_ps(acc[t][h][0], acc[t][h][1]));
}

template <int TN>
static void nm24_tile_vector(const float* x, int64_t in, const void* vt, int kind,
                             const uint32_t* pt, float* out) {
  if (TN <= 2) {
    nm24_tile_halves<TN, 0, 2>(x, in, vt, kind, pt, out);
  } else {
    nm24_tile_halves<TN, 0, 1>(x, in, vt, kind, pt, out);
    nm24_tile_halves<TN, 1, 1>(x, in, vt, kind, pt, out);
  }
}
#define LMC_NM24_TILES 2
#endif

extern "C" void lmc_nm24_tiled_float(const void* x_in, int x_kind, int64_t T, int64_t in,
                                     const void* values, int v_kind, const uint32_t* positions,
                                     int64_t out, const void* bias, int b_kind, void* y,
                                     int y_kind, int vector, int threads) {
  float* x = widened(x_in, x_kind, T * in);
  const int64_t blocks = out / 16, elem = v_kind == F32 ? 4 : 2;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; b++) {
    const char* vt = (const char*)values + b * (in / 2) * 16 * elem;
    const uint32_t* pt = positions + b * (in / 32) * 16;
    for (int64_t t0 = 0; t0 < T; t0 += TILE) {
      const int64_t tn = T - t0 < TILE ? T - t0 : TILE;
      float acc[TILE * 16];
      const float* xt = x + t0 * in;
#ifdef LMC_NM24_TILES
      if (vector) {
        if (tn == 4) nm24_tile_vector<4>(xt, in, vt, v_kind, pt, acc);
        else if (tn == 3) nm24_tile_vector<3>(xt, in, vt, v_kind, pt, acc);
        else if (tn == 2) nm24_tile_vector<2>(xt, in, vt, v_kind, pt, acc);
        else nm24_tile_vector<1>(xt, in, vt, v_kind, pt, acc);
      } else {
        nm24_tile_scalar(xt, tn, in, vt, v_kind, pt, acc);
      }
#else
      (void)vector;
      nm24_tile_scalar(xt, tn, in, vt, v_kind, pt, acc);
#endif
      for (int64_t t = 0; t < tn; t++)
        for (int l = 0; l < 16; l++) {
          const float b_l = bias ? load_value(bias, b_kind, 16 * b + l) : 0.0f;
          store_value(y, y_kind, (t0 + t) * out + 16 * b + l, acc[t * 16 + l] + b_l);
        }
    }
  }
  if (x != x_in) free(x);
}

// ---- the lean decode step's helpers (lmcompress/kernels/lean_step.py) ------------------------
//
// One token of a Llama-family decoder, between the layers' own linears, in a few calls instead
// of transformers' ~50 small ops a layer. Each rounds to the model dtype (`kind`: fp32 or bf16)
// where transformers' eager code does, and computes in fp32 between:
//
//   lmc_lean_rmsnorm  rows of D: x = x + add (rounded; in place, the residual stream) where add
//                     is given, then y = w * (x * rsqrt(mean(x^2) + eps)), the normalised value
//                     rounded before the product (LlamaRMSNorm). The mean in double.
//   lmc_lean_rope     q (heads_q, hd) and k (heads_k, hd) in place: x cos + rotate_half(x) sin,
//                     each product rounded, then their sum (apply_rotary_pos_emb): bit-identical
//                     to transformers' for one token.
//   lmc_lean_attend   out (H, hd) = softmax(q K^T scale) V for one query over L cached keys,
//                     query head h reading key/value head h / (H / KVH) (GQA); K, V strided
//                     (head, position, dim), fp32 or bf16; scores, softmax and sums in fp32.
//   lmc_lean_silu_mul y = silu(g) u, silu rounded before the product (LlamaMLP's act_fn * up).

static inline float lean_round(float v, int kind) {
  return kind == BF16 ? bf16_to_f32(f32_to_bf16(v)) : v;
}

extern "C" void lmc_lean_rmsnorm(void* x, const void* add, int kind, int64_t rows, int64_t D,
                                 const void* w, int w_kind, float eps, void* y) {
  for (int64_t r = 0; r < rows; r++) {
    double sq = 0.0;
    for (int64_t i = 0; i < D; i++) {
      float v = load_value(x, kind, r * D + i);
      if (add) {
        v = v + load_value(add, kind, r * D + i);
        store_value(x, kind, r * D + i, v);
        v = lean_round(v, kind);
      }
      sq += (double)v * v;
    }
    const float inv = 1.0f / sqrtf((float)(sq / (double)D) + eps);
    for (int64_t i = 0; i < D; i++) {
      float h = lean_round(load_value(x, kind, r * D + i) * inv, kind);
      float p = load_value(w, w_kind, i) * h;
      LMC_OPAQUE(p);
      store_value(y, kind, r * D + i, p);
    }
  }
}

static void lean_rope_heads(void* x, int kind, int64_t heads, int64_t hd, const float* c,
                            const float* s) {
  const int64_t half = hd / 2;
  float row[1024];
  for (int64_t h = 0; h < heads; h++) {
    for (int64_t i = 0; i < hd; i++) row[i] = load_value(x, kind, h * hd + i);
    for (int64_t i = 0; i < hd; i++) {
      const float rot = i < half ? -row[i + half] : row[i - half];
      float a = lean_round(row[i] * c[i], kind), b = lean_round(rot * s[i], kind);
      LMC_OPAQUE(a);
      LMC_OPAQUE(b);
      store_value(x, kind, h * hd + i, a + b);
    }
  }
}

extern "C" void lmc_lean_rope(void* q, int64_t heads_q, void* k, int64_t heads_k, int kind,
                              int64_t hd, const void* cos_in, const void* sin_in) {
  float c[1024], s[1024];  // hd <= 1024 (lean_step.applies)
  for (int64_t i = 0; i < hd; i++) {
    c[i] = load_value(cos_in, kind, i);
    s[i] = load_value(sin_in, kind, i);
  }
  lean_rope_heads(q, kind, heads_q, hd, c, s);
  lean_rope_heads(k, kind, heads_k, hd, c, s);
}

// One head's row of K or V (hd values of kind T) as fp32.
template <typename T>
static inline void lean_widen(const T* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; i++) {
    if (sizeof(T) == 4) {
      dst[i] = (float)src[i];
    } else {
      uint32_t u = (uint32_t)src[i] << 16;
      memcpy(dst + i, &u, 4);
    }
  }
}

// sum_d a[d] * b[d] over 8 partial sums (vectorised by the compiler), then their sum
static inline float lean_dot(const float* a, const float* b, int64_t n) {
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; l++) part[l] += a[i + l] * b[i + l];
  float total = 0.0f;
  for (int l = 0; l < 8; l++) total += part[l];
  for (; i < n; i++) total += a[i] * b[i];
  return total;
}

template <typename T>
static void lean_attend_head(const float* qh, const T* K, const T* V, int64_t L, int64_t hd,
                             int64_t pos_stride, float scale, float* buf, float* acc) {
  float *row = buf, *p = buf + hd;
  float top = -INFINITY;
  for (int64_t j = 0; j < L; j++) {
    lean_widen(K + j * pos_stride, hd, row);
    p[j] = lean_dot(qh, row, hd) * scale;
    top = p[j] > top ? p[j] : top;
  }
  float total = 0.0f;
  for (int64_t j = 0; j < L; j++) {
    p[j] = expf(p[j] - top);
    total += p[j];
  }
  for (int64_t i = 0; i < hd; i++) acc[i] = 0.0f;
  for (int64_t j = 0; j < L; j++) {
    lean_widen(V + j * pos_stride, hd, row);
    for (int64_t i = 0; i < hd; i++) acc[i] += p[j] * row[i];
  }
  for (int64_t i = 0; i < hd; i++) acc[i] = acc[i] / total;
}

extern "C" void lmc_lean_attend(const void* q, int kind, int64_t H, int64_t KVH, int64_t hd,
                                const void* K, const void* V, int cache_kind, int64_t L,
                                int64_t head_stride, int64_t pos_stride, float scale, void* out,
                                int threads) {
  const int64_t group = H / KVH;
#pragma omp parallel for num_threads(threads) schedule(static) if (H * L * hd > (1 << 18))
  for (int64_t h = 0; h < H; h++) {
    float* buf = (float*)malloc(sizeof(float) * (3 * hd + L));
    float *qh = buf, *acc = buf + hd;
    for (int64_t i = 0; i < hd; i++) qh[i] = load_value(q, kind, h * hd + i);
    const int64_t base = (h / group) * head_stride;
    if (cache_kind == F32)
      lean_attend_head(qh, (const float*)K + base, (const float*)V + base, L, hd, pos_stride, scale,
                       acc + hd, acc);
    else
      lean_attend_head(qh, (const uint16_t*)K + base, (const uint16_t*)V + base, L, hd, pos_stride,
                       scale, acc + hd, acc);
    for (int64_t i = 0; i < hd; i++) store_value(out, kind, h * hd + i, acc[i]);
    free(buf);
  }
}

extern "C" void lmc_lean_silu_mul(const void* g, const void* u, int kind, int64_t n, void* y) {
  for (int64_t i = 0; i < n; i++) {
    const float a = load_value(g, kind, i);
    const float act = lean_round(a / (1.0f + expf(-a)), kind);
    float p = act * load_value(u, kind, i);
    LMC_OPAQUE(p);
    store_value(y, kind, i, p);
  }
}

// The lean step's decoder block of tiled int4 layers in two calls (lmcompress/compressor/formats/
// int4_lean.py): the same kernels, in the same order, on the same tensors as the lean step's
// separate calls (bit for bit). `desc`: int64 words,
//   [0] input norm weight, [1] post-attention norm weight, [2] their kind, [3] D (hidden),
//   [4] H, [5] KVH, [6] hd, [7] I (MLP width), then 4 linears (q|k|v, o, gate|up, down) of 10
//   words each: tiles, 2:4 patterns (0: dense int4 tiles; else lmc_int4_linear_tiled24's),
//   scales16, zeros16, bias (0: none), bias kind, in, out, groups, G.
//   lmc_lean_int4_pre   x += add (where given), h = norm(x), qkv = [q|k|v](h), rope on q and k.
//   lmc_lean_int4_post  a = attend(q, K, V), x += o(a), h = norm(x), down = down(silu(g) u) for
//                       [g|u] = gate_up(h): `down` the block's last residual update.

static void lean_int4_linear(const int64_t* l, const void* x, int kind, void* y, int threads) {
  if (l[1])
    lmc_int4_linear_tiled24(x, kind, 1, l[6], (const uint32_t*)l[0], (const uint16_t*)l[1],
                            (const float*)l[2], (const uint8_t*)l[3], l[8], l[9], l[7],
                            (const void*)l[4], (int)l[5], y, kind, 1, threads);
  else
    lmc_int4_linear_tiled(x, kind, 1, l[6], (const uint32_t*)l[0], (const float*)l[2],
                          (const uint8_t*)l[3], l[8], l[9], l[7], (const void*)l[4], (int)l[5], y,
                          kind, 1, threads);
}

extern "C" void lmc_lean_int4_pre(const int64_t* desc, void* x, const void* add, int kind,
                                  float eps, const void* cos_in, const void* sin_in, void* qkv,
                                  int threads) {
  const int64_t D = desc[3], hd = desc[6], elem = kind == F32 ? 4 : 2;
  void* h = malloc(D * elem);
  lmc_lean_rmsnorm(x, add, kind, 1, D, (const void*)desc[0], (int)desc[2], eps, h);
  lean_int4_linear(desc + 8, h, kind, qkv, threads);
  lmc_lean_rope(qkv, desc[4], (char*)qkv + desc[4] * hd * elem, desc[5], kind, hd, cos_in, sin_in);
  free(h);
}

extern "C" void lmc_lean_int4_post(const int64_t* desc, void* x, const void* qkv, const void* K,
                                   const void* V, int cache_kind, int64_t L, int64_t head_stride,
                                   int64_t pos_stride, float scale, int kind, float eps,
                                   void* down, int threads) {
  const int64_t D = desc[3], H = desc[4], hd = desc[6], I = desc[7], elem = kind == F32 ? 4 : 2;
  char* buf = (char*)malloc((H * hd + 2 * D + 3 * I) * elem);
  char *a = buf, *o = a + H * hd * elem, *h = o + D * elem, *gu = h + D * elem;
  char* act = gu + 2 * I * elem;
  lmc_lean_attend(qkv, kind, H, desc[5], hd, K, V, cache_kind, L, head_stride, pos_stride, scale,
                  a, threads);
  lean_int4_linear(desc + 18, a, kind, o, threads);
  lmc_lean_rmsnorm(x, o, kind, 1, D, (const void*)desc[1], (int)desc[2], eps, h);
  lean_int4_linear(desc + 28, h, kind, gu, threads);
  lmc_lean_silu_mul(gu, gu + I * elem, kind, I, act);
  lean_int4_linear(desc + 38, act, kind, down, threads);
  free(buf);
}

// Every decoder block of a model in one call (int4_lean.run_stack): for each block in turn,
// lmc_lean_int4_pre, the token's k and v written at position L of the block's KV buffers
// (lmcompress/compressor/lean_cache.py: the cache's keys and values are views of them), then
// lmc_lean_int4_post over L + 1 positions: the same calls, bit for bit, as block by block.
// `table`: n rows of 9 words: block descriptor, K buffer, V buffer, the buffers' kind,
// head stride, position stride (elements), then three floats' bits (input norm eps,
// post-attention norm eps, attention scale). `down` (hidden): the last block's MLP output, the
// residual update that the final norm adds. The buffers hold the model's dtype (`kind`).
extern "C" void lmc_lean_int4_stack(const int64_t* table, int64_t n, int64_t L, void* x, int kind,
                                    const void* cos_in, const void* sin_in, void* down,
                                    int threads) {
  const int64_t elem = kind == F32 ? 4 : 2;
  int64_t widest = 0;
  for (int64_t b = 0; b < n; b++) {
    const int64_t* d = (const int64_t*)table[b * 9];
    const int64_t width = (d[4] + 2 * d[5]) * d[6];
    widest = width > widest ? width : widest;
  }
  char* qkv = (char*)malloc(widest * elem);
  for (int64_t b = 0; b < n; b++) {
    const int64_t* row = table + b * 9;
    const int64_t* d = (const int64_t*)row[0];
    const int64_t H = d[4], KVH = d[5], hd = d[6];
    float eps_in, eps_post, scale;
    uint32_t bits[3] = {(uint32_t)row[6], (uint32_t)row[7], (uint32_t)row[8]};
    memcpy(&eps_in, bits, 4);
    memcpy(&eps_post, bits + 1, 4);
    memcpy(&scale, bits + 2, 4);
    lmc_lean_int4_pre(d, x, b == 0 ? nullptr : down, kind, eps_in, cos_in, sin_in, qkv, threads);
    char* cache[2] = {(char*)row[1], (char*)row[2]};
    for (int which = 0; which < 2; which++)
      for (int64_t h = 0; h < KVH; h++)
        memcpy(cache[which] + (h * row[4] + L * row[5]) * elem,
               qkv + ((H + which * KVH + h) * hd) * elem, hd * elem);
    lmc_lean_int4_post(d, x, qkv, cache[0], cache[1], (int)row[3], L + 1, row[4], row[5], scale,
                       kind, eps_post, down, threads);
  }
  free(qkv);
}
