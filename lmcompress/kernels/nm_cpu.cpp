// CPU kernels for packed N:M weights (the layout of lmcompress/kernels/reference.py): they read
// the packed form directly instead of unpacking it to a dense weight on every call.
//
// Built once per machine by lmcompress/kernels/nm_cpu.py (c++ -O3 -march=native -fopenmp) and
// called through ctypes; every function takes contiguous row-major buffers.
//
//   lmc_nm_matmul_float  y (T, out) = x (T, in) @ W^T + bias, x and y fp32 or bf16, values fp32,
//                        bf16 or fp16, accumulated in fp32. For few tokens (decoding): each
//                        output row reads its packed weights once for up to TILE tokens.
//   lmc_nm_matmul_int8   acc (T, out) int32 = x_q (T, in) int8 @ W^T, W int8: exact integers,
//                        equal to torch._int_mm of the unpacked codes.
//   lmc_nm_unpack        the dense (out, in) weight, any 1, 2 or 4-byte element (prefill).
//
// 2:4 on AVX-512 takes 32 inputs at a time: their 16 kept values, their 16 2-bit positions
// (4 bytes) turned into lane indices 0..31, and one two-register permute of x per token
// (vpermt2ps) feeding one fused multiply-add; int8 codes take 64 inputs at a time in 16-bit
// lanes (vpermt2w, then vpdpwssd; needs AVX-512 BW). Every other N:M, and 2:4 without
// AVX-512, runs the scalar loop, which also finishes what the vector loop leaves.

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
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
template <int T>
static int64_t row_24_float(const float* x, int64_t in, const void* values, int kind,
                            const uint8_t* row_idx, float* acc) {
  __m512 sum[T];
  for (int64_t t = 0; t < T; t++) sum[t] = _mm512_setzero_ps();
  int64_t blocks = in / 32;
  for (int64_t b = 0; b < blocks; b++) {
    __m512i pos = positions_24(row_idx + 4 * b);
    __m512 v = load16(values, kind, 16 * b);
    for (int64_t t = 0; t < T; t++) {
      const float* xb = x + t * in + 32 * b;
      __m512 xg = _mm512_permutex2var_ps(_mm512_loadu_ps(xb), pos, _mm512_loadu_ps(xb + 16));
      sum[t] = _mm512_fmadd_ps(v, xg, sum[t]);
    }
  }
  for (int64_t t = 0; t < T; t++) acc[t] += _mm512_reduce_add_ps(sum[t]);
  return 16 * blocks;
}

#ifdef __AVX512BW__
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
#ifdef __AVX512VNNI__
      sum[t] = _mm512_dpwssd_epi32(sum[t], v, xg);
#else
      sum[t] = _mm512_add_epi32(sum[t], _mm512_madd_epi16(v, xg));
#endif
    }
  }
  for (int t = 0; t < T; t++) acc[t] += _mm512_reduce_add_epi32(sum[t]);
  return 32 * blocks;
}
#endif

#endif

extern "C" int lmc_nm_simd(void) {  // 1: the AVX-512 2:4 loops were compiled in
#ifdef __AVX512F__
  return 1;
#else
  return 0;
#endif
}

extern "C" void lmc_nm_matmul_float(const void* x_in, int x_kind, int64_t T, int64_t in,
                                    const void* values, int v_kind, const uint8_t* idx,
                                    int64_t idx_stride, int64_t out, int n, int m, int bits,
                                    const void* bias, int b_kind, void* y, int y_kind,
                                    int threads) {
  int64_t kept = in / m * n;
  float* x = (float*)x_in;
  if (x_kind != F32) {  // widen once: every row reads all of x
    x = (float*)malloc(sizeof(float) * T * in);
    for (int64_t i = 0; i < T * in; i++) x[i] = load_value(x_in, x_kind, i);
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t o = 0; o < out; o++) {
    const uint8_t* row_idx = idx + o * idx_stride;
    const char* row_values = (const char*)values + o * kept * (v_kind == F32 ? 4 : 2);
    for (int64_t t0 = 0; t0 < T; t0 += TILE) {
      int64_t tn = T - t0 < TILE ? T - t0 : TILE;
      const float* xt = x + t0 * in;
      float acc[TILE] = {0};
      int64_t done = 0;
#ifdef __AVX512F__
      if (n == 2 && m == 4) {
        if (tn == 4) done = row_24_float<4>(xt, in, row_values, v_kind, row_idx, acc);
        else if (tn == 3) done = row_24_float<3>(xt, in, row_values, v_kind, row_idx, acc);
        else if (tn == 2) done = row_24_float<2>(xt, in, row_values, v_kind, row_idx, acc);
        else done = row_24_float<1>(xt, in, row_values, v_kind, row_idx, acc);
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
      float b = bias ? load_value(bias, b_kind, o) : 0.0f;
      for (int64_t t = 0; t < tn; t++) {
        int64_t at = (t0 + t) * out + o;
        if (y_kind == F32) ((float*)y)[at] = acc[t] + b;
        else ((uint16_t*)y)[at] = f32_to_bf16(acc[t] + b);
      }
    }
  }
  if (x != x_in) free(x);
}

extern "C" void lmc_nm_matmul_int8(const int8_t* x_q, int64_t T, int64_t in, const int8_t* values,
                                   const uint8_t* idx, int64_t idx_stride, int64_t out, int n,
                                   int m, int bits, int32_t* acc_out, int threads) {
  int64_t kept = in / m * n;
  int16_t* x = (int16_t*)malloc(sizeof(int16_t) * T * in);  // widened once, for vpermt2w
  for (int64_t i = 0; i < T * in; i++) x[i] = x_q[i];
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t o = 0; o < out; o++) {
    const uint8_t* row_idx = idx + o * idx_stride;
    const int8_t* row_values = values + o * kept;
    for (int64_t t0 = 0; t0 < T; t0 += TILE) {
      int64_t tn = T - t0 < TILE ? T - t0 : TILE;
      const int16_t* xt = x + t0 * in;
      int32_t acc[TILE] = {0};
      int64_t done = 0;
#ifdef __AVX512BW__
      if (n == 2 && m == 4) {
        if (tn == 4) done = row_24_int8_bw<4>(xt, in, row_values, row_idx, acc);
        else if (tn == 3) done = row_24_int8_bw<3>(xt, in, row_values, row_idx, acc);
        else if (tn == 2) done = row_24_int8_bw<2>(xt, in, row_values, row_idx, acc);
        else done = row_24_int8_bw<1>(xt, in, row_values, row_idx, acc);
      }
#endif
      for (int64_t g = done / n, j = done; j < kept; g++) {
        for (int k = 0; k < n; k++, j++) {
          int pos = position(row_idx, j, bits);
          if (pos >= m) continue;
          int32_t v = row_values[j];
          for (int64_t t = 0; t < tn; t++) acc[t] += v * (int32_t)xt[t * in + g * m + pos];
        }
      }
      for (int64_t t = 0; t < tn; t++) acc_out[(t0 + t) * out + o] = acc[t];
    }
  }
  free(x);
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
