// Weight-only int4 linear on CPU with AMX: y [T, N] = x [T, K] @ w^T, where w is stored as 4-bit
// codes q with a bf16 scale d and zero z per group of inputs, w = (q - 8) d + z (torch's tinygemm
// convention; GGUF Q4_1's grid, engines/quant_formats.py).
//
// Why: torch's `_weight_int4pack_mm_for_cpu` decodes each weight group again for every 4 rows, so
// at 16 rows it costs as much as the fp32 GEMM it replaces, and an AVX512-BF16 `vdpbf16ps` kernel
// measured no better (40 ms for a SmolLM2 step's decoder linears at 16 rows, 1 thread; the
// instruction issues every other cycle). oneDNN's bf16 GEMM on AMX took 15 ms but reads 2 bytes
// per weight. Here each weight is decoded once per call (per 96 rows), into one AMX B tile of
// 16 outputs x 32 inputs, and meets up to six 16-row A tiles in `tdpbf16ps`: a step reads 0.5
// byte of code and 0.25 byte of scales per weight (d and z are held for each of the 2 lanes).
//
// Decoding: 16 bytes of codes -> 32 bf16 weights, one B tile row (16 outputs x 2 inputs, the VNNI
// pairs `tdpbf16ps` takes). w is formed in fp32 as fma(q, d, z - 8 d), which equals (q - 8) d + z
// rounded once (both are one rounding of the same exact value, z - 8 d being exact for bf16 d and
// z), then rounded to bf16 (nearest-even); x is rounded to bf16 likewise; products accumulate in
// fp32. That is what a bf16 copy of the same de-quantized weights computes in oneDNN, up to the
// order of the fp32 sums.
//
// Packed layout (made by engines/quant_formats.pack_int4_bf16dot, which documents it):
//   codes  [N/16, K/2, 16] uint8: byte i of (block b, input pair p) holds, in its low nibble,
//          q[16 b + i/2, 2 p + i%2] and, in its high nibble, q[16 b + 8 + i/2, 2 p + i%2];
//   scales [N/16, K/g, 4, 16] bf16: for lane i, d and z of outputs 16 b + i/2 and 16 b + 8 + i/2.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AIOROUTER_INT4_AMX 1
#endif

namespace {

#ifdef AIOROUTER_INT4_AMX

// Linux hands out AMX tile state per process on request (arch_prctl); oneDNN asks too.
bool amx_permitted() {
  static bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

constexpr int kRowTiles = 6;          // C tiles 0-5: up to 96 rows per pass over the weights

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void load_tile_config() {  // every tile 16 rows of 64 bytes; per thread, and oneDNN sets its own
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
}

struct alignas(64) WTile {  // 1 KB, 64-byte aligned: one decoded B tile (16 input pairs x 16 outputs x 2 bf16)
  uint16_t v[16 * 32];
};

inline __m512 bf16x16_to_f32(const uint16_t* p) {  // 16 bf16 -> 16 fp32 (exact: a shift)
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

// The B tile of one block (16 outputs) for inputs [32 kt, 32 kt + 32): 16 rows of 64 bytes.
inline void decode_tile(const uint8_t* codes, const uint16_t* scales, int64_t kt, int64_t pairs_per_group,
                        uint16_t* tile) {
  const int64_t g = (kt * 16) / pairs_per_group;  // a tile lies within one group (group_size >= 32)
  const uint16_t* s = scales + g * 64;
  const __m512 eight = _mm512_set1_ps(8.f);
  const __m512 d_lo = bf16x16_to_f32(s), d_hi = bf16x16_to_f32(s + 16);
  const __m512 z_lo = _mm512_fnmadd_ps(eight, d_lo, bf16x16_to_f32(s + 32));  // z - 8 d, exact
  const __m512 z_hi = _mm512_fnmadd_ps(eight, d_hi, bf16x16_to_f32(s + 48));
  const __m512i low4 = _mm512_set1_epi32(0xF);
  const uint8_t* c = codes + kt * 16 * 16;
#pragma GCC unroll 4
  for (int p = 0; p < 16; ++p) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + p * 16)));
    const __m512 w_lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low4)), d_lo, z_lo);
    const __m512 w_hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), d_hi, z_hi);
    // elements 0-15 from w_lo (lanes 0-7: outputs 0-7, inputs 2p and 2p+1), 16-31 from w_hi
    _mm512_store_si512(tile + p * 32, (__m512i)_mm512_cvtne2ps_pbh(w_hi, w_lo));
  }
}

// One block of 16 outputs for `tiles` row tiles of 16 (x padded to whole tiles): out rows
// [16 * tiles] x 16 columns, row stride ldo floats.
// The tile intrinsics are asm whose tile operands must be literal numbers (they are pasted into
// the instruction): hence macros, not constants.
#define AIOROUTER_TILE_A 6  // one A tile: 16 rows x 32 inputs of x
#define AIOROUTER_TILE_B 7  // one B tile: 32 inputs x 16 outputs of w (VNNI pairs)
#define AIOROUTER_FOR_TILES(M) \
  if constexpr (Tiles > 0) { M(0) } \
  if constexpr (Tiles > 1) { M(1) } \
  if constexpr (Tiles > 2) { M(2) } \
  if constexpr (Tiles > 3) { M(3) } \
  if constexpr (Tiles > 4) { M(4) } \
  if constexpr (Tiles > 5) { M(5) }

// One block of 16 outputs for `Tiles` row tiles of 16 (x padded to whole tiles), accumulated in
// C tiles 0..Tiles-1 over all K: out rows [16 Tiles] x 16 columns, row stride ldo floats. Each
// B tile is decoded just before the dot products that use it (into `tile`, 1 KB, from L1):
// decoding a block's whole K first and reading it back measured 11.0 against 8.5 ms per
// SmolLM2 step's decoder linears at 16 rows.
template <int Tiles>
inline void block(const uint8_t* codes, const uint16_t* scales, const uint16_t* x, int64_t K, int64_t pairs_per_group,
                  float* out, int64_t ldo, uint16_t* tile) {
  static_assert(Tiles >= 1 && Tiles <= kRowTiles, "row tiles");
  const int64_t ktiles = K / 32, ldx = K * 2;  // bytes per row of x
#define AIOROUTER_ZERO(i) _tile_zero(i);
  AIOROUTER_FOR_TILES(AIOROUTER_ZERO)
  for (int64_t kt = 0; kt < ktiles; ++kt) {
    decode_tile(codes, scales, kt, pairs_per_group, tile);
    asm volatile("" ::: "memory");  // tileloadd's asm names no memory: the decoded stores come first
    _tile_loadd(AIOROUTER_TILE_B, tile, 64);
#define AIOROUTER_DOT(i)                                                     \
  _tile_loadd(AIOROUTER_TILE_A, x + (i * 16) * K + kt * 32, ldx);            \
  _tile_dpbf16ps(i, AIOROUTER_TILE_A, AIOROUTER_TILE_B);
    AIOROUTER_FOR_TILES(AIOROUTER_DOT)
  }
#define AIOROUTER_STORE(i) _tile_stored(i, out + (i * 16) * ldo, ldo * 4);
  AIOROUTER_FOR_TILES(AIOROUTER_STORE)
#undef AIOROUTER_ZERO
#undef AIOROUTER_DOT
#undef AIOROUTER_STORE
}

using BlockFn = void (*)(const uint8_t*, const uint16_t*, const uint16_t*, int64_t, int64_t, float*, int64_t, uint16_t*);
constexpr BlockFn kBlocks[kRowTiles] = {&block<1>, &block<2>, &block<3>, &block<4>, &block<5>, &block<6>};

// x [T, K] fp32 -> y [Tpad, K] bf16 (nearest-even, as torch's .to(bfloat16)), rows past T zero
void to_bf16_padded(const float* x, uint16_t* y, int64_t T, int64_t K, int64_t Tpad) {
  const int64_t n = T * K;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
  for (; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, x + i, 4);
    y[i] = static_cast<uint16_t>((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
  }
  std::memset(y + n, 0, (Tpad - T) * K * 2);
}

#endif  // AIOROUTER_INT4_AMX

bool int4_linear_available() {
#ifdef AIOROUTER_INT4_AMX
  return amx_permitted();
#else
  return false;
#endif
}

// x [T, K] fp32 or bf16 (contiguous), codes [N/16, K/2, 16] uint8, scales [N/16, K/g, 4, 16] bf16
// -> [T, N] fp32
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t group_size) {
  TORCH_CHECK(int4_linear_available(), "int4_linear: this build or CPU has no AMX-BF16 (see int4_linear_available)");
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu() && scales.device().is_cpu(), "int4_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "int4_linear: x must be contiguous [T, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "int4_linear: x must be fp32 or bf16");
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == 16 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "int4_linear: codes must be contiguous [N/16, K/2, 16] uint8, got ", codes.sizes());
  const int64_t T = x.size(0), K = x.size(1), NB = codes.size(0);
  TORCH_CHECK(codes.size(1) * 2 == K, "int4_linear: codes are for K = ", codes.size(1) * 2, ", x has K = ", K);
  TORCH_CHECK(group_size >= 32 && group_size % 32 == 0 && K % group_size == 0, "int4_linear: K = ", K,
              " must be a multiple of group_size ", group_size, ", itself a multiple of 32");
  const int64_t G = K / group_size;
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() && scales.dim() == 4 &&
                  scales.size(0) == NB && scales.size(1) == G && scales.size(2) == 4 && scales.size(3) == 16,
              "int4_linear: scales must be contiguous [", NB, ", ", G, ", 4, 16] bf16, got ", scales.sizes());
  at::Tensor out = at::empty({T, NB * 16}, x.options().dtype(at::kFloat));
#ifdef AIOROUTER_INT4_AMX
  if (T == 0) return out;
  const int64_t Tpad = (T + 15) / 16 * 16, N = NB * 16, half_k = K / 2, pairs = group_size / 2;
  // x as bf16 in whole 16-row tiles; 64-byte aligned rows are not needed (tileloadd takes any stride)
  std::vector<WTile> xbuf((Tpad * K + 511) / 512);  // 64-byte aligned rows of bf16 (C++17 aligns them)
  uint16_t* xb = xbuf.data()->v;
  if (x.scalar_type() == at::kFloat) {
    to_bf16_padded(x.data_ptr<float>(), xb, T, K, Tpad);
  } else {
    std::memcpy(xb, x.data_ptr<at::BFloat16>(), T * K * 2);
    std::memset(xb + T * K, 0, (Tpad - T) * K * 2);
  }
  // the C tiles store whole 16-row tiles: into out where T fills them, else into a padded copy
  at::Tensor full = Tpad == T ? out : at::empty({Tpad, N}, out.options());
  const auto* cp = codes.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  float* op = full.data_ptr<float>();
  // chunks of >= 2^18 multiply-adds: a parallel region costs a few microseconds, a block of a
  // decode step's linear (16 outputs x K = 576, one tile of rows) about one
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / (16 * K * std::min<int64_t>(Tpad, 16 * kRowTiles)));
  at::parallel_for(0, NB, grain, [&](int64_t b0, int64_t b1) {
    load_tile_config();
    WTile tile;
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* c = cp + b * half_k * 16;
      const uint16_t* s = sp + b * G * 64;
      for (int64_t r = 0; r < Tpad; r += 16 * kRowTiles) {
        const int64_t tiles = std::min<int64_t>(kRowTiles, (Tpad - r) / 16);
        kBlocks[tiles - 1](c, s, xb + r * K, K, pairs, op + r * N + b * 16, N, tile.v);
      }
    }
    _tile_release();
  });
  if (Tpad != T) out.copy_(full.narrow(0, 0, T));
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aiorouter_cpu, m) {
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scales, int group_size) -> Tensor");
  m.def("int4_linear_available() -> bool", &int4_linear_available);  // no tensors: a catch-all kernel
}

TORCH_LIBRARY_IMPL(aiorouter_cpu, CPU, m) { m.impl("int4_linear", &int4_linear); }
