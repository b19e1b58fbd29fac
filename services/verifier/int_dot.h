// Integer-dot CPU linears for the q4 format (services/int_dot.py): Q4_1 int4 weights and int8 lm_head
// rows against activations quantized to int8 per block of 32, multiplied by AVX-512 VNNI (vpdpbusd) where
// the compiler targets it, else by a scalar loop with the same arithmetic.
//
// Why: torch's weight-only int4 / int8 CPU kernels turn every weight into a float before a float
// multiply-add; on the 2-core AVX-512 EPYC a one-row q4 step read its int4 linears at ~14 GB/s and the
// int8 lm_head at ~12 GB/s of the ~40 GB/s the cores can read (benchmarks/results/2026-12-07-int-dot).
// llama.cpp multiplies Q4_1 blocks by activations quantized to 8 bits (its Q8_1) with integer dot
// products; these kernels do the same.
//
// Arithmetic (every row alone, fixed order, no fused multiply-add; services/int_dot.py holds the torch
// reference that gives the same bits):
//   activations: per row r, block g of 32: a = max |x|, dx = a / 127, xq = round_half_even(x / dx)
//     clamped to [-127, 127] (0 where a == 0), sxq = sum xq, dxs = dx * float(sxq).
//   int4 (w = d q + m, q in 0..15): isum = sum q xq (int32); acc = (acc + (float(isum) * d) * dx) + m * dxs,
//     g ascending from acc = 0; y = acc rounded to the output dtype.
//   int8 rows (w = s q): isum = sum q xq; acc = acc + float(isum) * dx, g ascending; y = acc * s.
// Layouts (services/int_dot.py packs them): int4 qw uint8 [N/16, K/8, 16, 4], byte b of lane l in
// octet j = q[16t+l, 8j+b] | q[16t+l, 8j+4+b] << 4; dm fp16 [N/16, K/32, 2, 16] (d, then m);
// int8 qw uint8 [N/16, K/4, 16, 4] = q[16t+l, 4j+b] + 128 (vpdpbusd multiplies unsigned by signed).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define DARTREE_INT_DOT_VNNI 1
#else
#define DARTREE_INT_DOT_VNNI 0
#endif

namespace int_dot {

constexpr int64_t kBlock = 32;  // activation / Q4_1 block
constexpr int64_t kLanes = 16;  // output columns per tile
#ifndef DARTREE_INT_DOT_PREFETCH
#define DARTREE_INT_DOT_PREFETCH 512
#endif
constexpr int64_t kPrefetch = DARTREE_INT_DOT_PREFETCH;  // bytes of weights fetched ahead of the loads

// Quantized activations of M rows, in this thread's scratch (no allocation per call once grown): xq [M, K],
// dx / dxs / sxq [M, K / 32].
struct QuantRows {
  const int8_t* xq;
  const float* dx;
  const float* dxs;
  const int32_t* sxq;
};

template <typename T>
inline QuantRows quantize_rows(const T* src, int64_t M, int64_t K) {
  thread_local std::vector<int8_t> xq_buf;
  thread_local std::vector<float> dx_buf, dxs_buf;
  thread_local std::vector<int32_t> sxq_buf;
  const int64_t G = K / kBlock;
  if (static_cast<int64_t>(xq_buf.size()) < M * K) xq_buf.resize(M * K);
  if (static_cast<int64_t>(dx_buf.size()) < M * G) {
    dx_buf.resize(M * G);
    dxs_buf.resize(M * G);
    sxq_buf.resize(M * G);
  }
  int8_t* xq = xq_buf.data();
  float* dx = dx_buf.data();
  float* dxs = dxs_buf.data();
  int32_t* sxq = sxq_buf.data();
  for (int64_t i = 0; i < M * G; ++i) {
    float v[kBlock];
    for (int64_t k = 0; k < kBlock; ++k) v[k] = static_cast<float>(src[i * kBlock + k]);
    float a = 0.f;
    for (int64_t k = 0; k < kBlock; ++k) a = std::fmax(a, std::fabs(v[k]));
    const float d = a / 127.f;
    int32_t s = 0;
    for (int64_t k = 0; k < kBlock; ++k) {
      float r = a == 0.f ? 0.f : std::nearbyint(v[k] / d);  // round half to even (default rounding mode)
      r = std::fmin(127.f, std::fmax(-127.f, r));
      xq[i * kBlock + k] = static_cast<int8_t>(r);
      s += static_cast<int32_t>(r);
    }
    dx[i] = d;
    sxq[i] = s;
    dxs[i] = d * static_cast<float>(s);
  }
  return {xq, dx, dxs, sxq};
}

template <typename T>
inline void store_lanes(T* out, const float* acc) {
  for (int64_t l = 0; l < kLanes; ++l) out[l] = static_cast<T>(acc[l]);
}

// ---------------------------------------------------------------- int4 (Q4_1) tiles
#if DARTREE_INT_DOT_VNNI
template <int R>
inline void q4_tile(const uint8_t* qw, const c10::Half* dm, const int8_t* xq, const float* dx, const float* dxs,
                    int64_t K, int64_t G, float (*out)[kLanes]) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i ia[R];
    for (int r = 0; r < R; ++r) ia[r] = _mm512_setzero_si512();
    for (int64_t j = 0; j < 4; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(qw + (g * 4 + j) * 64 + kPrefetch), _MM_HINT_T0);
      const __m512i w = _mm512_loadu_si512(qw + (g * 4 + j) * 64);
      const __m512i lo = _mm512_and_si512(w, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xq + r * K + g * kBlock + j * 8;
        int32_t x0, x1;
        std::memcpy(&x0, xr, 4);
        std::memcpy(&x1, xr + 4, 4);
        ia[r] = _mm512_dpbusd_epi32(ia[r], lo, _mm512_set1_epi32(x0));
        ia[r] = _mm512_dpbusd_epi32(ia[r], hi, _mm512_set1_epi32(x1));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + g * 32)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + g * 32 + 16)));
    for (int r = 0; r < R; ++r) {
      const __m512 t1 = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(ia[r]), d), _mm512_set1_ps(dx[r * G + g]));
      const __m512 t3 = _mm512_mul_ps(m, _mm512_set1_ps(dxs[r * G + g]));
      acc[r] = _mm512_add_ps(_mm512_add_ps(acc[r], t1), t3);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out[r], acc[r]);
}
#else
template <int R>
inline void q4_tile(const uint8_t* qw, const c10::Half* dm, const int8_t* xq, const float* dx, const float* dxs,
                    int64_t K, int64_t G, float (*out)[kLanes]) {
  for (int r = 0; r < R; ++r) {
    for (int64_t l = 0; l < kLanes; ++l) {
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        int32_t isum = 0;
        for (int64_t j = 0; j < 4; ++j) {
          const uint8_t* lane = qw + (g * 4 + j) * 64 + l * 4;
          const int8_t* xr = xq + r * K + g * kBlock + j * 8;
          for (int b = 0; b < 4; ++b) isum += (lane[b] & 15) * xr[b] + (lane[b] >> 4) * xr[4 + b];
        }
        const float d = static_cast<float>(dm[g * 32 + l]), m = static_cast<float>(dm[g * 32 + 16 + l]);
        const float t1 = (static_cast<float>(isum) * d) * dx[r * G + g];
        const float t3 = m * dxs[r * G + g];
        acc = (acc + t1) + t3;
      }
      out[r][l] = acc;
    }
  }
}
#endif

// ---------------------------------------------------------------- int8 row tiles
#if DARTREE_INT_DOT_VNNI
template <int R>
inline void q8_tile(const uint8_t* qw, const int8_t* xq, const float* dx, const int32_t* sxq, int64_t K, int64_t G,
                    float (*out)[kLanes]) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i ia[R];
    for (int r = 0; r < R; ++r) ia[r] = _mm512_setzero_si512();
    for (int64_t j = 0; j < 8; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(qw + (g * 8 + j) * 64 + kPrefetch), _MM_HINT_T0);
      const __m512i w = _mm512_loadu_si512(qw + (g * 8 + j) * 64);
      for (int r = 0; r < R; ++r) {
        int32_t x0;
        std::memcpy(&x0, xq + r * K + g * kBlock + j * 4, 4);
        ia[r] = _mm512_dpbusd_epi32(ia[r], w, _mm512_set1_epi32(x0));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512i isum = _mm512_sub_epi32(ia[r], _mm512_set1_epi32(128 * sxq[r * G + g]));
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(dx[r * G + g])));
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out[r], acc[r]);
}
#else
template <int R>
inline void q8_tile(const uint8_t* qw, const int8_t* xq, const float* dx, const int32_t* sxq, int64_t K, int64_t G,
                    float (*out)[kLanes]) {
  for (int r = 0; r < R; ++r) {
    for (int64_t l = 0; l < kLanes; ++l) {
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        int32_t raw = 0;
        for (int64_t j = 0; j < 8; ++j) {
          const uint8_t* lane = qw + (g * 8 + j) * 64 + l * 4;
          const int8_t* xr = xq + r * K + g * kBlock + j * 4;
          for (int b = 0; b < 4; ++b) raw += lane[b] * xr[b];
        }
        acc = acc + static_cast<float>(raw - 128 * sxq[r * G + g]) * dx[r * G + g];
      }
      out[r][l] = acc;
    }
  }
}
#endif

// One tile's rows in blocks of up to 4 (the row count changes no row's arithmetic).
template <typename Tile>
inline void rows_in_blocks(int64_t M, Tile&& tile) {
  int64_t r = 0;
  for (; r + 4 <= M; r += 4) tile(std::integral_constant<int, 4>{}, r);
  switch (M - r) {
    case 3: tile(std::integral_constant<int, 3>{}, r); break;
    case 2: tile(std::integral_constant<int, 2>{}, r); break;
    case 1: tile(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

// Every 16-column tile of y [M, N] (the tiles spread over torch's threads), its rows in blocks of up to
// 4: tile(R, t, r, out) puts rows r .. r + R - 1 of tile t in out[0 .. R - 1] (float32), stored in T.
template <typename T, typename Tile>
void for_tiles(T* y, int64_t M, int64_t N, Tile&& tile) {
  at::parallel_for(0, N / kLanes, 1, [&](int64_t t0, int64_t t1) {
    float out[4][kLanes];
    for (int64_t t = t0; t < t1; ++t) {
      rows_in_blocks(M, [&](auto R, int64_t r) {
        tile(R, t, r, out);
        for (int i = 0; i < decltype(R)::value; ++i) store_lanes(y + (r + i) * N + t * kLanes, out[i]);
      });
    }
  });
}

inline void check_rows(const at::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && K % kBlock == 0, op, ": x must be [M, ", K, "] with K % 32 == 0, got ",
              x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, op,
              ": x must be bfloat16 or float32, got ", x.scalar_type());
}

// y [M, N] in x's dtype: x [M, K] checked and quantized (quantize_rows), then run(rows, y's data) per dtype.
template <typename Run>
at::Tensor multiply(const at::Tensor& x, int64_t N, int64_t K, const char* op, Run&& run) {
  check_rows(x, K, op);
  const int64_t M = x.size(0);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.scalar_type() == at::kBFloat16)
    run(quantize_rows(xc.const_data_ptr<c10::BFloat16>(), M, K), y.data_ptr<c10::BFloat16>());
  else run(quantize_rows(xc.const_data_ptr<float>(), M, K), y.data_ptr<float>());
  return y;
}

// y [M, N] in x's dtype = x [M, K] times the Q4_1 weight packed as qw uint8 [N/16, K/8, 16, 4], dm fp16
// [N/16, K/32, 2, 16].
inline at::Tensor q4_mm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& dm) {
  TORCH_CHECK(qw.dim() == 4 && qw.scalar_type() == at::kByte && qw.is_contiguous() && dm.dim() == 4 &&
                  dm.scalar_type() == at::kHalf && dm.is_contiguous(),
              "dartree_native::q4_mm: qw must be contiguous uint8 [N/16, K/8, 16, 4] and dm fp16 [N/16, K/32, 2, 16]");
  const int64_t N = qw.size(0) * kLanes, K = qw.size(1) * 8, G = K / kBlock;
  const uint8_t* w = qw.const_data_ptr<uint8_t>();
  const c10::Half* s = dm.const_data_ptr<c10::Half>();
  return multiply(x, N, K, "dartree_native::q4_mm", [&](const QuantRows& q, auto* y) {
    for_tiles(y, x.size(0), N, [&](auto R, int64_t t, int64_t r, float (*out)[kLanes]) {
      q4_tile<decltype(R)::value>(w + t * (K / 8) * 64, s + t * G * 32, q.xq + r * K, q.dx + r * G, q.dxs + r * G,
                                  K, G, out);
    });
  });
}

// y [M, N] in x's dtype = x [M, K] times the int8 rows packed as qw uint8 [N/16, K/4, 16, 4] (q + 128) with
// one bfloat16 scale per row, scale [N].
inline at::Tensor q8_mm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scale) {
  TORCH_CHECK(qw.dim() == 4 && qw.scalar_type() == at::kByte && qw.is_contiguous() && scale.dim() == 1 &&
                  scale.scalar_type() == at::kBFloat16 && scale.size(0) == qw.size(0) * kLanes,
              "dartree_native::q8_mm: qw must be contiguous uint8 [N/16, K/4, 16, 4] and scale bfloat16 [N]");
  const int64_t N = qw.size(0) * kLanes, K = qw.size(1) * 4, G = K / kBlock;
  const uint8_t* w = qw.const_data_ptr<uint8_t>();
  const at::Tensor sc = scale.contiguous();
  const c10::BFloat16* s = sc.const_data_ptr<c10::BFloat16>();
  return multiply(x, N, K, "dartree_native::q8_mm", [&](const QuantRows& q, auto* y) {
    for_tiles(y, x.size(0), N, [&](auto R, int64_t t, int64_t r, float (*out)[kLanes]) {
      q8_tile<decltype(R)::value>(w + t * (K / 4) * 64, q.xq + r * K, q.dx + r * G, q.sxq + r * G, K, G, out);
      for (int i = 0; i < decltype(R)::value; ++i)
        for (int64_t l = 0; l < kLanes; ++l) out[i][l] = out[i][l] * static_cast<float>(s[t * kLanes + l]);
    });
  });
}

// Which instructions the kernels run: "avx512_vnni" or "scalar".
inline std::string isa() { return DARTREE_INT_DOT_VNNI ? "avx512_vnni" : "scalar"; }

}  // namespace int_dot
