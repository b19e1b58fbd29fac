// The fused slot attention of dartree_native::slot_attention (native_attention.cpp): every query row of
// every request of a step against its own slot of the KV cache, in one call, with no GEMM.
//
// For each (request, KV head) a task takes the G query heads of that KV head and the request's rows
// (query q = head h*G + g, row r), and computes, all in float32 whatever the cache's dtype:
//
//   s_j = scale * (q . k_j) + bias[r, j]     for the columns j < L the row sees (bias > -inf)
//   p_j = exp(s_j - max_j s_j),  o = (sum_j p_j v_j) / (sum_j p_j)
//
// Order (every step an IEEE float32 multiply, add, or fmadd below: one fused multiply-add where the
// machine has FMA, the same instruction everywhere; built with -ffp-contract=off so the compiler
// fuses nothing else): q . k_j sums the products of each 16-wide chunk of d in 16 lanes (lane d mod 16,
// chunks ascending, fmadd; for bfloat16 on a CPU with AVX512_BF16 and a head dim that is a multiple of
// 32, the pair dots of dot_bf16 instead: exact products, lane l taking d = 32c + 2l and 32c + 2l + 1),
// then adds the lanes pairwise (l + (l + 8), then + 4, + 2, + 1); sum_j p_j one column after another
// (j ascending, in one float32); sum_j p_j v_j per d with j ascending. Neither sum over columns depends on
// a column's position, only on the order of the columns the row sees: a tree verify whose row sees
// columns with masked siblings between them gives the bits of the same path laid out contiguously (as
// the commit compacts it, and as plain decoding computes it); a sum in lanes by column index did not. exp is a fixed polynomial (Cephes' expf, within ~2 ulp of the true value). The lanes are
// GCC vector types (explicit SIMD; AVX-512, AVX2 or SSE as the machine has), so no loop's result
// depends on whether or how the compiler vectorised it. A row's output depends only on its own query,
// its own mask row and its slot's K/V: it is bitwise the same alone or beside any other rows or
// requests, whichever thread runs it, and masked columns (skipped, or adding exact zeros) change
// nothing. A row that sees no column gets zeros. The head dim must be a multiple of 16.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__) || defined(__FMA__) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace dartree_fused {

constexpr int kLanes = 16;          // accumulator lanes (one AVX-512 register of float32)
constexpr int64_t kRowChunk = 32;   // query rows per pass over a slot (bounds the score buffer)
constexpr int64_t kSerialWork = 1 << 18;  // below this many multiply-adds a call runs on one thread

// One request of the step: its rows [row0, row0 + rows) of the call, its slot, where its K/V rows go
// (start), how many columns it reads (length), its additive mask rows (bias [>= rows, length] float32,
// row r at bias + r * bias_stride; -inf = masked).
struct Request {
  int64_t row0, rows, slot, start, length;
  const float* bias;
  int64_t bias_stride;
};

typedef float Vec __attribute__((vector_size(64)));       // 16 float32 lanes (GCC vector extension)
typedef int32_t IVec __attribute__((vector_size(64)));
typedef uint16_t HVec __attribute__((vector_size(32)));     // 16 bfloat16 / float16 bit patterns
typedef uint32_t UVec __attribute__((vector_size(64)));
typedef float Vec8 __attribute__((vector_size(32)));
typedef float Vec4 __attribute__((vector_size(16)));
typedef float Vec2 __attribute__((vector_size(8)));

inline Vec load(const float* p) { Vec v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }
inline Vec splat(float x) { return Vec{} + x; }

// a * b + c in every lane: one rounding (fused) where the machine has FMA, else two; the same
// instruction for every lane, row and call of a build.
inline Vec fmadd(Vec a, Vec b, Vec c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);
#elif defined(__FMA__)
  typedef float Half8 __attribute__((vector_size(32)));
  const Half8 lo = _mm256_fmadd_ps(__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7),
                                   __builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7),
                                   __builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7));
  const Half8 hi = _mm256_fmadd_ps(__builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15),
                                   __builtin_shufflevector(b, b, 8, 9, 10, 11, 12, 13, 14, 15),
                                   __builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15));
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  return a * b + c;
#endif
}

// 16 elements from the cache's dtype to float32.
inline Vec load16(const float* p) { return load(p); }
inline Vec load16(const c10::BFloat16* p) {
  HVec h;
  std::memcpy(&h, p, sizeof h);
  UVec bits = __builtin_convertvector(h, UVec) << 16;
  Vec v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
inline Vec load16(const c10::Half* p) {
  float f[kLanes];
  for (int l = 0; l < kLanes; ++l) f[l] = static_cast<float>(p[l]);
  return load(f);
}

// The 16 lanes added pairwise: (l, l + 8), then (l, l + 4), (l, l + 2), (0, 1).
inline float lane_sum(Vec a) {
  Vec8 b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  Vec4 c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
  Vec2 d = __builtin_shufflevector(c, c, 0, 1) + __builtin_shufflevector(c, c, 2, 3);
  return d[0] + d[1];
}

// exp(x) for x <= 0, 16 lanes (Cephes' expf: ~2 ulp); below -87.3 it gives ~1e-38, not 0 (callers
// zero masked columns).
inline Vec exp_nonpositive(Vec x) {
  x = x < -87.3f ? splat(-87.3f) : x;
  const Vec t = x * 1.44269504088896341f + 0.5f;
  const Vec tr = __builtin_convertvector(__builtin_convertvector(t, IVec), Vec);  // toward zero
  const Vec fx = tr > t ? tr - 1.0f : tr;                                         // floor
  x = fmadd(fx, splat(-0.693359375f), x);
  x = fmadd(fx, splat(2.12194440e-4f), x);
  Vec y = splat(1.9875691500e-4f);
  y = fmadd(y, x, splat(1.3981999507e-3f));
  y = fmadd(y, x, splat(8.3334519073e-3f));
  y = fmadd(y, x, splat(4.1665795894e-2f));
  y = fmadd(y, x, splat(1.6666665459e-1f));
  y = fmadd(y, x, splat(5.0000001201e-1f));
  y = fmadd(y, x * x, x) + 1.0f;
  const IVec e = (__builtin_convertvector(fx, IVec) + 127) << 23;
  Vec scale;
  std::memcpy(&scale, &e, sizeof scale);
  return y * scale;
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// Strided views of the call's tensors, in elements.
template <typename T>
struct Views {
  const T* q; int64_t q_head, q_row;              // query [1, Hq, R, Dh], last dim contiguous
  const T* k; const T* v; int64_t c_slot, c_head, c_col;  // this layer's cache [S, Hkv, C, Dh]
  T* out;                                          // [1, R, Hq, Dh] contiguous
  int64_t hq, hkv, dh;                             // dh: a multiple of 16
  float scale;
};

// Per-task buffers (reused across a thread's tasks).
template <typename T>
struct Scratch {
  std::vector<float> q, s, kv, acc, total;
  std::vector<T> zero;  // dh zeros: the K of the columns past a block's end
};

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// lane_sum of 16 lane vectors at once (a[c]: column c's lanes), the same additions in the same
// pairs, by shuffles: lane c of the result is lane_sum(a[c]), bitwise.
inline Vec lane_sums16(const Vec* a) {
  Vec b[8], c[4], d[2];
  for (int p = 0; p < 8; ++p)  // lanes 0-7: column 2p's l + (l + 8); lanes 8-15: column 2p + 1's
    b[p] = __builtin_shufflevector(a[2 * p], a[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * p], a[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int q = 0; q < 4; ++q)  // 4 lanes per column: + 4
    c[q] = __builtin_shufflevector(b[2 * q], b[2 * q + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * q], b[2 * q + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int r = 0; r < 2; ++r)  // 2 lanes per column: + 2
    d[r] = __builtin_shufflevector(c[2 * r], c[2 * r + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(c[2 * r], c[2 * r + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// q . k in 16 lanes straight from bfloat16 (AVX512_BF16's dot product of bfloat16 pairs: products
// exact in float32, lane l accumulates d = 32c + 2l + 1, then 32c + 2l, chunks c ascending), where
// the machine has it and dh is a multiple of 32: no conversion of K or q.
template <typename T>
constexpr bool raw_bf16_dot() {
#if defined(__AVX512BF16__)
  return std::is_same<T, c10::BFloat16>::value;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__)
inline Vec dot_bf16(const c10::BFloat16* q, const c10::BFloat16* k, int64_t dh) {
  __m512 x = _mm512_setzero_ps();
  for (int64_t d = 0; d < dh; d += 32)
    x = _mm512_dpbf16_ps(x, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(k + d));
  return x;
}
#else
inline Vec dot_bf16(const c10::BFloat16*, const c10::BFloat16*, int64_t) { return Vec{}; }
#endif

// The 16 columns' lane vectors for query i (row r, head hq_i): from bfloat16 directly, or from the
// float32 copies of q (b.q) and of the block's K (b.kv).
template <typename T>
void block_dots(const Views<T>& w, const T* const* kcols, const T* qraw, const float* q, bool raw, Scratch<T>& b,
                Vec* acc) {
  const int64_t dh = w.dh, nc = dh / kLanes;
  if constexpr (raw_bf16_dot<T>()) {
    if (raw) {
      for (int64_t j = 0; j < kLanes; ++j) acc[j] = dot_bf16(qraw, kcols[j], dh);
      return;
    }
  }
  for (int64_t j = 0; j < kLanes; ++j) {
    const float* k = b.kv.data() + j * dh;
    Vec x = load(q) * load(k);
    for (int64_t c = 1; c < nc; ++c) x = fmadd(load(q + c * kLanes), load(k + c * kLanes), x);
    acc[j] = x;
  }
}

// Scores of the nq queries against columns [0, len), s [nq, len16], -inf where masked or padded; 16
// columns at a time (their K as float32 in b.kv [16, dh], zeros past len).
template <typename T>
void scores(const Views<T>& w, const Request& req, int64_t h, int64_t r0, int64_t r1, int64_t len16, Scratch<T>& b) {
  const int64_t g = w.hq / w.hkv, dh = w.dh, len = req.length, nc = dh / kLanes;
  const T* kbase = w.k + req.slot * w.c_slot + h * w.c_head;
  const bool raw = raw_bf16_dot<T>() && dh % 32 == 0;
  b.zero.assign(dh, T(0.0f));
  std::fill(b.s.begin(), b.s.end(), kNegInf);
  Vec acc[kLanes];
  const T* kcols[kLanes];
  for (int64_t j0 = 0; j0 < len; j0 += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, len - j0);
    for (int64_t j = 0; j < kLanes; ++j) kcols[j] = j < n ? kbase + (j0 + j) * w.c_col : b.zero.data();
    if (!raw)  // K read once per task, as float32
      for (int64_t j = 0; j < kLanes; ++j)
        for (int64_t c = 0; c < nc; ++c) store(b.kv.data() + j * dh + c * kLanes, load16(kcols[j] + c * kLanes));
    for (int64_t r = r0; r < r1; ++r) {
      const float* brow = req.bias + r * req.bias_stride + j0;
      float bias[kLanes];
      bool any = false;
      for (int64_t j = 0; j < kLanes; ++j) {
        bias[j] = j < n ? brow[j] : kNegInf;
        any = any || bias[j] != kNegInf;
      }
      if (!any) continue;
      const Vec bv = load(bias);
      for (int64_t gi = 0; gi < g; ++gi) {
        const int64_t i = (r - r0) * g + gi;
        block_dots(w, kcols, w.q + (h * g + gi) * w.q_head + (req.row0 + r) * w.q_row, b.q.data() + i * dh, raw, b,
                   acc);
        const Vec sv = fmadd(lane_sums16(acc), splat(w.scale), bv);
        store(b.s.data() + i * len16 + j0, bv == kNegInf ? splat(kNegInf) : sv);
      }
    }
  }
}

// Scores to probabilities in place (masked: 0); their sum per query is taken in weighted_values (b.total).
template <typename T>
void probabilities(int64_t nq, int64_t len16, Scratch<T>& b) {
  for (int64_t i = 0; i < nq; ++i) {
    float* s = b.s.data() + i * len16;
    Vec m = splat(kNegInf);
    for (int64_t j = 0; j < len16; j += kLanes) m = m > load(s + j) ? m : load(s + j);
    float mx = kNegInf;
    for (int l = 0; l < kLanes; ++l) mx = std::max(mx, m[l]);
    for (int64_t j = 0; j < len16; j += kLanes) {
      const Vec x = load(s + j);
      store(s + j, x == kNegInf ? Vec{} : exp_nonpositive(x - mx));
    }
    b.total[i] = 0.0f;
  }
}

// a [NC * 16] += p_j v_j and *total += p_j for the block's n columns, j ascending (columns with p_j = 0
// skipped). The scalar sum's one add a column runs beside the vector multiply-adds' chains.
template <int NC>
inline void accumulate(const float* p, int64_t n, const float* v, int64_t dh, float* a, float* total) {
  Vec x[NC];
  float t = *total;
  for (int c = 0; c < NC; ++c) x[c] = load(a + c * kLanes);
  for (int64_t j = 0; j < n; ++j) {
    if (p[j] == 0.0f) continue;
    const Vec pj = splat(p[j]);
    t = t + p[j];
    for (int c = 0; c < NC; ++c) x[c] = fmadd(pj, load(v + j * dh + c * kLanes), x[c]);
  }
  for (int c = 0; c < NC; ++c) store(a + c * kLanes, x[c]);
  *total = t;
}

// b.acc [nq, dh] += sum_j p_j v_j and b.total [nq] += sum_j p_j, j ascending, 16 columns at a time (V
// read once per task).
template <typename T>
void weighted_values(const Views<T>& w, const Request& req, const T* vbase, int64_t nq, int64_t len16, Scratch<T>& b) {
  const int64_t dh = w.dh, nc = dh / kLanes;
  for (int64_t j0 = 0; j0 < req.length; j0 += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, req.length - j0);
    bool loaded = false;
    for (int64_t i = 0; i < nq; ++i) {
      const float* p = b.s.data() + i * len16 + j0;
      float* a = b.acc.data() + i * dh;
      bool any = false;
      for (int64_t j = 0; j < n; ++j) any = any || p[j] != 0.0f;
      if (!any) continue;
      if (!loaded) {
        for (int64_t j = 0; j < n; ++j)
          for (int64_t c = 0; c < nc; ++c)
            store(b.kv.data() + j * dh + c * kLanes, load16(vbase + (j0 + j) * w.c_col + c * kLanes));
        loaded = true;
      }
      float* total = b.total.data() + i;
      switch (nc) {  // the same arithmetic; the accumulators in registers for the usual head dims
        case 2: accumulate<2>(p, n, b.kv.data(), dh, a, total); break;
        case 4: accumulate<4>(p, n, b.kv.data(), dh, a, total); break;
        case 8: accumulate<8>(p, n, b.kv.data(), dh, a, total); break;
        default:
          for (int64_t j = 0; j < n; ++j)
            if (p[j] != 0.0f) *total = *total + p[j];
          for (int64_t c = 0; c < nc; ++c) {
            Vec x = load(a + c * kLanes);
            for (int64_t j = 0; j < n; ++j)
              if (p[j] != 0.0f) x = fmadd(splat(p[j]), load(b.kv.data() + j * dh + c * kLanes), x);
            store(a + c * kLanes, x);
          }
      }
    }
  }
}

// One task: request `req`, KV head h, rows [r0, r1) of the request (query i = (r - r0) * g + gi is
// head h * g + gi, row r).
template <typename T>
void attend_chunk(const Views<T>& w, const Request& req, int64_t h, int64_t r0, int64_t r1, Scratch<T>& b) {
  const int64_t g = w.hq / w.hkv, dh = w.dh, nq = (r1 - r0) * g;
  const int64_t len16 = (req.length + kLanes - 1) / kLanes * kLanes;
  b.q.resize(nq * dh);
  b.s.resize(nq * len16);
  b.kv.resize(kLanes * dh);
  b.acc.assign(nq * dh, 0.0f);
  b.total.resize(nq);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t gi = 0; gi < g; ++gi) {
      const T* src = w.q + (h * g + gi) * w.q_head + (req.row0 + r) * w.q_row;
      float* dst = b.q.data() + ((r - r0) * g + gi) * dh;
      for (int64_t d = 0; d < dh; ++d) dst[d] = to_float(src[d]);
    }
  scores(w, req, h, r0, r1, len16, b);
  probabilities<T>(nq, len16, b);
  weighted_values(w, req, w.v + req.slot * w.c_slot + h * w.c_head, nq, len16, b);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t gi = 0; gi < g; ++gi) {
      const int64_t i = (r - r0) * g + gi;
      const float t = b.total[i];
      const float* a = b.acc.data() + i * dh;
      T* dst = w.out + ((req.row0 + r) * w.hq + h * g + gi) * dh;
      for (int64_t d = 0; d < dh; ++d) dst[d] = static_cast<T>(t > 0.0f ? a[d] / t : 0.0f);
    }
}

// Every request's rows against its slot: tasks (request, KV head, chunk of 32 rows), on several
// threads when the call is large enough. Each output row is written by exactly one task.
template <typename T>
void attend_all(const Views<T>& w, const std::vector<Request>& reqs) {
  struct Task { int64_t req, head, r0, r1; };
  std::vector<Task> tasks;
  int64_t work = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(reqs.size()); ++i) {
    work += reqs[i].rows * reqs[i].length;
    for (int64_t h = 0; h < w.hkv; ++h)
      for (int64_t r = 0; r < reqs[i].rows; r += kRowChunk)
        tasks.push_back({i, h, r, std::min(r + kRowChunk, reqs[i].rows)});
  }
  auto run = [&](int64_t begin, int64_t end) {
    Scratch<T> b;
    for (int64_t t = begin; t < end; ++t) attend_chunk(w, reqs[tasks[t].req], tasks[t].head, tasks[t].r0, tasks[t].r1, b);
  };
  const int64_t n = static_cast<int64_t>(tasks.size());
  if (work * w.hq * w.dh < kSerialWork || at::get_num_threads() < 2) {
    run(0, n);
  } else {
    at::parallel_for(0, n, 1, run);
  }
}

}  // namespace dartree_fused
