// Paged attention for short queries (decodes, and extends of a few tokens) on CPU.
//
// Reads K/V straight from the paged pool ([num_slots, Hkv, D], slot = page * page_size + offset)
// through each sequence's block table: no gather into a padded batch, no padding, float32
// scores and accumulation for every input dtype. A work item is one sequence (and some of its KV
// heads); all its query heads and query tokens share every K/V row it loads, so a row is
// converted to float32 once and used by all of them.
//
// Per layer (engines/attention/base.py LayerAttn): `scale` multiplies q.k; `window` > 0 lets the
// query at position p see keys p - window < t <= p only (transformers' sliding_window_overlay),
// and the loops start at the first key some query of the item sees, so a window also skips the
// loads and dots of everything older (16 decodes at context 4k, H 8, Hkv 2, D 64, fp32, 1 thread:
// 18 ms per call, 2.4 ms with a 512 window); `softcap` > 0 maps scores s -> softcap * tanh(s /
// softcap) before the softmax (Gemma 2), vectorised (soft_cap): the one cost only softcapped layers
// pay (16 decodes at context 4k, fp32, 1 thread, AMD EPYC AVX2: 10.0 -> 12.8 ms; std::tanh's
// scalar loop took 10.8 -> 17.9 ms).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

template <typename T>
inline void load_row(const T* src, float* dst, int64_t D) {
  for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<float>(src[i]);
}

// bf16 -> f32 is a 16-bit shift; written on raw bits so the compiler vectorises it.
template <>
inline void load_row<at::BFloat16>(const at::BFloat16* src, float* dst, int64_t D) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < D; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
}

// The pool is far bigger than the caches (every layer's K/V), and one work item reads one KV
// head's 128-256 B out of every token's row: the hardware prefetcher does not follow that, so
// the loops ask for the row kPrefetch tokens ahead themselves.
constexpr int64_t kPrefetch = 16;
template <typename T>
inline void prefetch_row(const T* p, int64_t D) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(c + b, 0, 3);
}

inline float dot(const float* a, const float* b, int64_t D) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < D; ++i) acc += a[i] * b[i];
  return acc;
}

// exp for x <= 0 (softmax after subtracting the max): 2^(x log2 e) split into 2^n * 2^f with a
// degree-6 polynomial for 2^f, f in [-0.5, 0.5]; relative error ~2e-7. Branch-free so the loop
// around it vectorises (std::exp does not, and was a third of the kernel's time).
inline float exp_nonpos(float x) {
  x = std::max(x, -87.f);
  const float y = x * 1.44269504088896341f;
  const float n = std::nearbyint(y);
  const float f = y - n;
  float p = 1.5353362e-4f;
  p = p * f + 1.3398874e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// x -> cap * tanh(x / cap) (Gemma 2's soft-capping), as 1 - 2 / (e^{2y} + 1) on exp_nonpos: branch-
// free, so its loops vectorise like the softmax's (std::tanh does not). Absolute error ~cap * 2e-7.
inline float soft_cap(float x, float cap) {
  const float y = x / cap, e = exp_nonpos(-2.f * std::fabs(y));
  return std::copysign(cap * (1.f - e) / (1.f + e), y);
}

inline void axpy(float w, const float* x, float* y, int64_t D) {
#pragma omp simd
  for (int64_t i = 0; i < D; ++i) y[i] += w * x[i];
}

#if defined(__AVX512F__)
// Three or more query rows per KV head (q_len * G: GQA decodes, handoff-resume extends): the
// row-by-row dots below spend most of their time in horizontal sums. Here a vector holds 16 query
// rows (q transposed once), 8 keys are in flight per pass over the head dim, the softmax runs
// across the lanes, and P.V keeps 4 rows x 64 dims in registers. Measured per layer call, 2
// threads: cpu-tiny large (GQA 4) extends [1,3,4,3] 208 -> 88 us, decode b4 84 -> 66 us;
// SmolLM2 (GQA 3) decode b32 372 -> 344 us fp32, 397 -> 323 us bf16.

struct Scratch {
  std::vector<float> kf, vf, qt, s;
};

// e^x for x <= 0 (after the max is subtracted), as exp_nonpos, 16 lanes at a time
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(1.5353362e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3398874e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// One sequence, one KV head `hk`: its R = ql * G query rows (row r: query token r / G, query
// head hk * G + r % G) against its keys at positions [t0, L) (t0 > 0: older keys are outside every
// row's window); writes those rows of `out`. D: 64 or 128. Key k of the loops is position t0 + k.
template <typename T, int64_t D>
void blocked_head(const T* qp, int64_t qs0, int64_t qs1, const T* kp, const T* vp, int64_t Hkv, int64_t hk,
                  const int64_t* slots, int64_t t0, int64_t L, int64_t q0, int64_t ql, int64_t G, float scale,
                  int64_t window, float softcap, T* op, int64_t os0, int64_t os1, Scratch& w) {
  const int64_t R = ql * G, prefix = L - ql, NB = (R + 15) / 16;
  slots += t0;
  L -= t0;  // from here on: keys loaded, positions relative to t0
  w.kf.resize(L * D);
  w.vf.resize(L * D);
  for (int64_t t = 0; t < L; ++t) {  // this head's K/V rows in float32, [L, D] each
    if (t + kPrefetch < L) {
      prefetch_row(kp + (slots[t + kPrefetch] * Hkv + hk) * D, D);
      prefetch_row(vp + (slots[t + kPrefetch] * Hkv + hk) * D, D);
    }
    load_row(kp + (slots[t] * Hkv + hk) * D, &w.kf[t * D], D);
    load_row(vp + (slots[t] * Hkv + hk) * D, &w.vf[t * D], D);
  }
  w.qt.assign(NB * D * 16, 0.f);  // [NB, D, 16]: block b, dim d, lane = row % 16 (scaled q)
  for (int64_t r = 0; r < R; ++r) {
    const T* src = qp + (q0 + r / G) * qs0 + (hk * G + r % G) * qs1;
    float* dst = &w.qt[(r / 16) * D * 16 + r % 16];
    for (int64_t d = 0; d < D; ++d) dst[d * 16] = static_cast<float>(src[d]) * scale;
  }
  w.s.resize(L * 16);  // one block's scores, then probabilities: [L, 16]
  const float* kf = w.kf.data();
  const float* vf = w.vf.data();
  float* sb = w.s.data();
  for (int64_t b = 0; b < NB; ++b) {
    const float* qb = &w.qt[b * D * 16];
    alignas(64) int32_t lens[16], firsts[16];  // each lane's row sees keys [firsts, lens): causal, windowed
    for (int64_t l = 0; l < 16; ++l) {
      const int64_t pos = prefix + (b * 16 + l) / G;  // the row's query position
      lens[l] = static_cast<int32_t>(std::min(L + t0, pos + 1) - t0);
      firsts[l] = static_cast<int32_t>(window > 0 ? std::max<int64_t>(0, pos - window + 1 - t0) : 0);
    }
    const __m512i lenv = _mm512_load_si512(lens), firstv = _mm512_load_si512(firsts);
    int64_t t = 0;
    for (; t + 8 <= L; t += 8) {
      __m512 a[8];
      for (int k = 0; k < 8; ++k) a[k] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; ++d) {
        const __m512 qv = _mm512_loadu_ps(qb + d * 16);
        for (int k = 0; k < 8; ++k) a[k] = _mm512_fmadd_ps(_mm512_set1_ps(kf[(t + k) * D + d]), qv, a[k]);
      }
      for (int k = 0; k < 8; ++k) _mm512_storeu_ps(sb + (t + k) * 16, a[k]);
    }
    for (; t < L; ++t) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; ++d) a = _mm512_fmadd_ps(_mm512_set1_ps(kf[t * D + d]), _mm512_loadu_ps(qb + d * 16), a);
      _mm512_storeu_ps(sb + t * 16, a);
    }
    if (softcap > 0.f)
#pragma omp simd
      for (int64_t i = 0; i < L * 16; ++i) sb[i] = soft_cap(sb[i], softcap);
    __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t k = 0; k < L; ++k) {
      const __m512i kv = _mm512_set1_epi32(static_cast<int32_t>(k));
      const __mmask16 ok = _mm512_cmpgt_epi32_mask(lenv, kv) & _mm512_cmple_epi32_mask(firstv, kv);
      m = _mm512_mask_max_ps(m, ok, m, _mm512_loadu_ps(sb + k * 16));
    }
    __m512 sum = _mm512_setzero_ps();
    for (int64_t k = 0; k < L; ++k) {
      const __m512i kv = _mm512_set1_epi32(static_cast<int32_t>(k));
      const __mmask16 ok = _mm512_cmpgt_epi32_mask(lenv, kv) & _mm512_cmple_epi32_mask(firstv, kv);
      const __m512 p = _mm512_maskz_mov_ps(ok, exp512(_mm512_sub_ps(_mm512_loadu_ps(sb + k * 16), m)));
      sum = _mm512_add_ps(sum, p);
      _mm512_storeu_ps(sb + k * 16, p);
    }
    alignas(64) float inv[16];
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), sum));
    const int64_t rows = std::min<int64_t>(16, R - b * 16);
    for (int64_t l0 = 0; l0 < rows; l0 += 4) {  // 4 rows x 64 dims of P.V in 16 registers
      const int64_t nr = std::min<int64_t>(4, rows - l0);
      for (int64_t dc = 0; dc < D; dc += 64) {
        __m512 acc[4][4];
        for (int i = 0; i < 4; ++i)
          for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_setzero_ps();
        for (int64_t k = 0; k < L; ++k) {
          const float* vr = vf + k * D + dc;
          const __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16), v2 = _mm512_loadu_ps(vr + 32),
                       v3 = _mm512_loadu_ps(vr + 48);
          for (int i = 0; i < 4; ++i) {
            const __m512 p = _mm512_set1_ps(sb[k * 16 + l0 + i]);
            acc[i][0] = _mm512_fmadd_ps(p, v0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(p, v1, acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(p, v2, acc[i][2]);
            acc[i][3] = _mm512_fmadd_ps(p, v3, acc[i][3]);
          }
        }
        for (int64_t i = 0; i < nr; ++i) {
          const int64_t r = b * 16 + l0 + i;
          alignas(64) float o[64];
          const __m512 sc = _mm512_set1_ps(inv[l0 + i]);
          for (int c = 0; c < 4; ++c) _mm512_store_ps(o + 16 * c, _mm512_mul_ps(acc[i][c], sc));
          T* dst = op + (q0 + r / G) * os0 + (hk * G + r % G) * os1 + dc;
          for (int64_t j = 0; j < 64; ++j) dst[j] = static_cast<T>(o[j]);
        }
      }
    }
  }
}
#endif

// DC: the head dim as a compile-time constant (64, 128), so the per-row loops unroll into a few
// full-width vector ops; 0 = any head dim, read at run time.
template <typename T, int64_t DC>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& seqs, int64_t page_size, double scale,
         int64_t window, double softcap, at::Tensor& out) {
  const int64_t H = q.size(1), D = DC ? DC : q.size(2), Hkv = k_cache.size(1), G = H / Hkv;
  const int64_t n = seqs.size(0), max_pages = block_tables.size(1);
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* btp = block_tables.data_ptr<int64_t>();
  const int64_t* sp = seqs.data_ptr<int64_t>();  // [n, 4]: block-table row, q_start, q_len, kv_len
  const float fscale = static_cast<float>(scale), fcap = static_cast<float>(softcap);

  // A work item is one sequence and `hpi` of its KV heads. With every head in one item, a token's
  // K (or V) row for the item is one contiguous [hpi, D] run of the pool, and the pages stream
  // in whole; items of one head each read 1/Hkv of every row, which the prefetchers follow badly
  // (measured 1.3x slower at batch 32). Single heads only when there are too few sequences to
  // keep every thread busy (batch 1).
  const int64_t threads = at::get_num_threads();
  const int64_t hpi = n >= 2 * threads ? Hkv : 1;
  const int64_t per_seq = Hkv / hpi, num_items = n * per_seq, W = hpi * D;  // W: floats per row run
  // Items are handed out one at a time from a shared counter: at::parallel_for's static split
  // gave one thread all the long sequences (the runner orders decodes longest first) and made
  // the kernel 2x slower than its balanced cost; longest-first + dynamic is the LPT schedule.
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, num_items), 1, [&](int64_t, int64_t) {
    std::vector<float> qf, sc, acc, row(W), inv;
    std::vector<int64_t> slots;
#if defined(__AVX512F__)
    Scratch scratch;
#endif
    for (int64_t item; (item = next.fetch_add(1, std::memory_order_relaxed)) < num_items;) {
      const int64_t s = item / per_seq, h0 = (item % per_seq) * hpi;  // KV heads [h0, h0 + hpi)
      const int64_t* bt = btp + sp[4 * s] * max_pages;
      const int64_t q0 = sp[4 * s + 1], ql = sp[4 * s + 2], L = sp[4 * s + 3], prefix = L - ql;
      // Query token i (position prefix + i) sees keys [first(i), prefix + i], first(i) =
      // max(0, prefix + i - window + 1) with a window; no key before t0 = first(0) is read.
      const int64_t t0 = window > 0 ? std::max<int64_t>(0, prefix - window + 1) : 0;
      // Slots of the sequence's tokens from t0 on, walked page by page (no division per token).
      slots.resize(L);
      for (int64_t t = t0, p = t0 / page_size, o = t0 % page_size; t < L; ++p, o = 0)
        for (const int64_t base = bt[p] * page_size; o < page_size && t < L; ++o, ++t) slots[t] = base + o;
      // row r = (i * hpi + j) * G + g: query token i, query head (h0 + j) * G + g, and its K/V
      // are floats [j * D, (j + 1) * D) of a row run; RI rows per query token.
#if defined(__AVX512F__)
      if constexpr (DC == 64 || DC == 128) {
        // one or two rows keep the dot path: with two (GQA-2 decodes: cpu-tiny's small model) the
        // 16-lane blocks are 1/8 full; the dot path measured faster (1 thread, context 200-230:
        // batch 5 59 -> 49-52 us, batch 16 202 -> 171-181 us)
        if (ql * G >= 3) {
          for (int64_t j = 0; j < hpi; ++j)
            blocked_head<T, DC>(qp, qs0, qs1, kp, vp, Hkv, h0 + j, slots.data(), t0, L, q0, ql, G, fscale, window,
                                fcap, op, os0, os1, scratch);
          continue;
        }
      }
#endif
      const int64_t RI = hpi * G, R = ql * RI;
      qf.resize(R * D);
      sc.resize(R * L);
      acc.assign(R * D, 0.f);
      inv.resize(R);
      for (int64_t i = 0; i < ql; ++i)
        for (int64_t c = 0; c < RI; ++c) {
          float* dst = &qf[(i * RI + c) * D];
          load_row(qp + (q0 + i) * qs0 + (h0 * G + c) * qs1, dst, D);
          for (int64_t j = 0; j < D; ++j) dst[j] *= fscale;
        }
      // Scores: token t is visible to query token i when first(i) <= t <= prefix + i. Each K row is
      // converted to float32 once for all the rows that see it. (A transposed [D][16] tile, to
      // trade the horizontal sums for plain FMAs, measured 1.4x slower: the transposing stores
      // cost more than the sums.)
      // rows that see key t: tokens max(0, t - prefix) .. (t - prefix + window - 1 with a window)
      const auto rows_end = [&](int64_t t) { return window > 0 ? std::min(ql, t - prefix + window) * RI : R; };
      for (int64_t t = t0; t < L; ++t) {
        if (t + kPrefetch < L) prefetch_row(kp + (slots[t + kPrefetch] * Hkv + h0) * D, W);
        load_row(kp + (slots[t] * Hkv + h0) * D, row.data(), W);
        for (int64_t r = std::max<int64_t>(0, t - prefix) * RI, r1 = rows_end(t); r < r1; ++r)
          sc[r * L + t] = dot(&qf[r * D], &row[(r / G) % hpi * D], D);
      }
      for (int64_t r = 0; r < R; ++r) {
        float* x = &sc[r * L];
        const int64_t len = prefix + r / RI + 1, first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
        if (fcap > 0.f)
#pragma omp simd
          for (int64_t t = first; t < len; ++t) x[t] = soft_cap(x[t], fcap);
        float m = -std::numeric_limits<float>::infinity(), sum = 0.f;
        for (int64_t t = first; t < len; ++t) m = std::max(m, x[t]);
#pragma omp simd reduction(+ : sum)
        for (int64_t t = first; t < len; ++t) sum += (x[t] = exp_nonpos(x[t] - m));
        inv[r] = 1.f / sum;
      }
      for (int64_t t = t0; t < L; ++t) {
        if (t + kPrefetch < L) prefetch_row(vp + (slots[t + kPrefetch] * Hkv + h0) * D, W);
        load_row(vp + (slots[t] * Hkv + h0) * D, row.data(), W);
        for (int64_t r = std::max<int64_t>(0, t - prefix) * RI, r1 = rows_end(t); r < r1; ++r)
          axpy(sc[r * L + t], &row[(r / G) % hpi * D], &acc[r * D], D);
      }
      for (int64_t r = 0; r < R; ++r) {
        T* dst = op + (q0 + r / RI) * os0 + (h0 * G + r % RI) * os1;
        for (int64_t j = 0; j < D; ++j) dst[j] = static_cast<T>(acc[r * D + j] * inv[r]);
      }
    }
  });
}

// q [T, H, D] (rows may be strided, D contiguous), caches [num_slots, Hkv, D] contiguous,
// block_tables [B, max_pages] int64, seqs [n, 4] int64, out [T, H, D] (D contiguous): writes the
// rows of the n listed sequences and leaves every other row untouched. window: 0 = every key;
// softcap: 0 = none.
void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seqs, int64_t page_size,
                     double scale, at::Tensor out, int64_t window, double softcap) {
  TORCH_CHECK(q.device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && out.dim() == 3, "paged_attention: q/cache/out must be 3-D");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "paged_attention: head dim must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_attention: caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type(),
              "paged_attention: q, caches and out must share a dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "paged_attention: heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seqs.scalar_type() == at::kLong &&
                  block_tables.is_contiguous() && seqs.is_contiguous() && seqs.size(1) == 4,
              "paged_attention: block_tables/seqs must be contiguous int64, seqs [n, 4]");
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged_attention: window and softcap must be >= 0");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    if (q.size(2) == 64)
      run<scalar_t, 64>(q, k_cache, v_cache, block_tables, seqs, page_size, scale, window, softcap, out);
    else if (q.size(2) == 128)
      run<scalar_t, 128>(q, k_cache, v_cache, block_tables, seqs, page_size, scale, window, softcap, out);
    else
      run<scalar_t, 0>(q, k_cache, v_cache, block_tables, seqs, page_size, scale, window, softcap, out);
  });
}

}  // namespace

TORCH_LIBRARY(aiorouter_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seqs, "
        "int page_size, float scale, Tensor(a!) out, int window=0, float softcap=0.) -> ()");
}

TORCH_LIBRARY_IMPL(aiorouter_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
